"""The options of `trtforge dynamo-worker` (imports neither dynamo nor torch: the CLI reads them)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from trtforge.config.runtime import RuntimeConfig


@dataclass
class WorkerOptions:
    """What `trtforge dynamo-worker` takes beyond RuntimeConfig (its flags)."""

    engine_dir: str
    served_model_name: str | None = None
    """The model name clients send (default: the engine directory's name)."""
    namespace: str = "dynamo"
    component: str = "trtforge"
    endpoint: str = "generate"
    discovery_backend: str = "file"
    """file (a folder in $DYN_FILE_KV: one host) | etcd (several hosts) | mem | kubernetes."""
    request_plane: str = "tcp"
    event_plane: str = "zmq"
    """zmq (no broker) | nats."""
    disaggregation_mode: str = "agg"
    """agg (prefill and decode here) | prefill (the prompt and first token; the KV is handed to a
    decode worker through our KV connector) | decode (continues handed-over requests). Sets the
    engine's phase (context / generation); the --kv-* options configure the connector."""
    enable_kv_routing: bool = True
    """Publish KV events and load for the KV-aware router."""
    model_card_dir: str | None = None
    """Where to write the frontend's model card (default: a private temp dir)."""
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
    scheduler: dict[str, Any] = field(default_factory=dict)
    """SchedulerConfig overrides (the --schedule KEY=VALUE flags)."""
