"""Disaggregated serving on Triton: the `context` and `generation` models and their parameters.

TensorRT-LLM's names: a `context` model runs prefill only (the prompt's KV and the first token),
a `generation` model runs decode only, continuing from the KV the context model hands over; a
router (TensorRT-LLM's `disaggregated_serving_bls`; here the client-facing `ensemble` model)
sends each request to one, then the other, with `request_type` = `context_only` /
`generation_only` and the handover in `context_phase_params`. The phases themselves are
config.runtime.Phase.

Each phase model has its own scheduling parameters in its own config.pbtxt. A parameter that
belongs to the other phase is refused when the model loads, naming it: a decode batch limit on the
context model would silently do nothing.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Iterable

from trtforge.config.runtime import Phase
from trtforge.config.scheduler import SchedulerConfig
from trtforge.model_repo.params import scheduler_parameter_names

ROUTER = "router"
"""`emit-repo --only router`: the third model of a disaggregated repository."""
ROUTER_ROLE = "disaggregated_serving_bls"

# Parameters of the phase models beyond the engine model's: RuntimeConfig fields (the phase, and
# the context model's KV handoff) and where the model's process runs.
PHASE = "phase"
HANDOFF_TIMEOUT = "handoff_timeout_s"
KV_CONNECTOR = "kv_connector"
KV_ADVERTISE_HOST = "kv_advertise_host"
KV_AUTH_KEY_FILE = "kv_auth_key_file"
KV_PEERS = "kv_peers"
KV_TLS_FILES = ("kv_tls_cert_file", "kv_tls_key_file", "kv_tls_ca_file")
"""TLS of the tcp KV connector (both phases: the context server's certificate, the generation
server's CA; config/runtime.py)."""
CPUS = "cpus"
CPU_THREADS = "cpu_threads"
# Parameters of the router model.
ROLE = "role"
CONTEXT_MODEL = "context_model"
GENERATION_MODEL = "generation_model"
CONTEXT_URLS = "context_urls"
GENERATION_URLS = "generation_urls"

# Inputs and outputs the phase models take beyond the `ensemble` interface (TensorRT-LLM's names).
REQUEST_TYPE = "request_type"
CONTEXT_PHASE_PARAMS = "context_phase_params"


class RequestType(str, enum.Enum):
    """`request_type` of a request to a phase model: which phase it asks for."""

    CONTEXT_ONLY = "context_only"
    GENERATION_ONLY = "generation_only"

    def __str__(self) -> str:
        return self.value

    @classmethod
    def of(cls, phase: Phase) -> RequestType:
        return cls.CONTEXT_ONLY if phase == Phase.CONTEXT else cls.GENERATION_ONLY


CONTEXT_SCHEDULER_FIELDS = ("max_num_tokens", "prefill_max_tokens", "prefill_chunk_size",
                            "prefill_max_seqs", "prefill_order", "enable_prefix_caching",
                            "max_queue_size", "max_queued_tokens")
"""Prefill: token budget, chunk size, sequences per iteration, admission order, prefix cache,
queue bounds."""
GENERATION_SCHEDULER_FIELDS = ("max_batch_size", "max_num_tokens", "policy", "kv_watermark",
                               "max_queue_size")
"""Decode: batch limit, token budget, eviction policy, watermark, queue bound."""

PHASE_DOCS = {
    CPUS: "CPU cores this model's process runs on, e.g. 0 or 0-3 or 0,2 (empty: all); how the "
          "context and generation models of one CPU host keep from competing.",
    CPU_THREADS: "Threads of the engine's kernels (empty: one per core in `cpus`, else torch's "
                 "default).",
    CONTEXT_URLS: "Router: gRPC addresses HOST:PORT of context servers, comma-separated (empty: "
                  "the `context` model of this server). Least-loaded first.",
    GENERATION_URLS: "Router: gRPC addresses of generation servers, comma-separated (empty: the "
                     "`generation` model of this server). Least-loaded first.",
}
"""Docs of the phase models' own parameters (the RuntimeConfig ones are documented there)."""

_OWN = {Phase.CONTEXT: set(CONTEXT_SCHEDULER_FIELDS) | {HANDOFF_TIMEOUT, KV_CONNECTOR, KV_ADVERTISE_HOST,
                                                       KV_AUTH_KEY_FILE, *KV_TLS_FILES},
        Phase.GENERATION: set(GENERATION_SCHEDULER_FIELDS) | {KV_AUTH_KEY_FILE, KV_PEERS, *KV_TLS_FILES}}
_SCHEDULER_FIELDS = {f.name for f in dataclasses.fields(SchedulerConfig)}


def scheduler_fields(phase: Phase) -> tuple[str, ...]:
    """The SchedulerConfig fields a model of `phase` takes as parameters."""
    if phase == Phase.CONTEXT:
        return CONTEXT_SCHEDULER_FIELDS
    if phase == Phase.GENERATION:
        return GENERATION_SCHEDULER_FIELDS
    return tuple(scheduler_parameter_names())


def refuse_other_phase(phase: Phase, names: Iterable[str]) -> None:
    """ValueError naming the first parameter that belongs to the other phase (a co-located model,
    phase both, takes every one)."""
    if phase not in _OWN:
        return
    other = Phase.GENERATION if phase == Phase.CONTEXT else Phase.CONTEXT
    for name in names:
        if name in _OWN[other] and name not in _OWN[phase]:
            raise ValueError(
                f"parameter {name!r} belongs to the {other} model, not the {phase} model "
                f"({'decode' if other == Phase.GENERATION else 'prefill'} scheduling); move it to "
                f"{other}/config.pbtxt. The {phase} model takes: "
                f"{', '.join(sorted(_OWN[phase]))}")
        if name in _SCHEDULER_FIELDS and name not in _OWN[phase]:
            raise ValueError(f"parameter {name!r} is not a {phase}-phase parameter; the {phase} "
                             f"model takes: {', '.join(sorted(_OWN[phase]))}")


def parse_cpus(text: str) -> set[int]:
    """'0', '0-3', '0,2,5-6' → a set of core ids (ValueError naming the parameter)."""
    cores: set[int] = set()
    try:
        for part in filter(None, (p.strip() for p in text.split(","))):
            lo, _, hi = part.partition("-")
            cores.update(range(int(lo), int(hi or lo) + 1))
    except ValueError:
        raise ValueError(f"parameter {CPUS}={text!r} is invalid: write cores like 0, 0-3 or 0,2") from None
    return cores
