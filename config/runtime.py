"""How an engine *runs*: device, KV memory, CUDA graphs, the disaggregated phase and its KV connector,
speculative decoding.

Apart from what the model is (models/model_config.py), how it was built (builder/build_config.py)
and how its requests are scheduled (scheduler.py). One documented dataclass: the string under each
field is its help text, which the CLI options and the Triton model's config.pbtxt parameters read
(`RuntimeConfig.field_docs()`); every default is written here and nowhere else.
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass
from typing import Any, ClassVar, get_type_hints
from urllib.parse import urlsplit

from trtforge.config.fields import field_docs, parse_bytes, parse_text
from trtforge.config.speculative import NO_SPECULATION, SpeculativeConfig


class Phase(str, enum.Enum):
    """Which part of a request an engine runs (TensorRT-LLM's names for disaggregated serving)."""

    BOTH = "both"
    """Prefill and decode here (co-located)."""
    CONTEXT = "context"
    """Prefill and the first token, then hand the KV over (RequestOutput.kv_handle)."""
    GENERATION = "generation"
    """Decode, continuing from KV a context engine handed over."""

    def __str__(self) -> str:
        return self.value


SHARED_MEMORY_CONNECTOR = "shm"
"""The KV connector of a context and a generation engine on one host."""


def parse_address(address: str) -> tuple[str, int]:
    """'tcp://HOST:PORT' (or 'HOST:PORT') → (host, port); ValueError for anything else."""
    parts = urlsplit(address if "://" in address else f"tcp://{address}")
    if parts.scheme != "tcp" or parts.hostname is None or parts.port is None:
        raise ValueError(f"KV connector address {address!r} is invalid: write tcp://HOST:PORT")
    return parts.hostname, parts.port


LOOPBACK = "127.0.0.1"
"""Where the tcp KV connector listens when its address names no host (tcp://:PORT)."""


def parse_listen_address(address: str) -> tuple[str, int]:
    """A listen address: as parse_address, but 'tcp://:PORT' (no host) listens on loopback only;
    every interface only when written (tcp://0.0.0.0:PORT)."""
    parts = urlsplit(address if "://" in address else f"tcp://{address}")
    if parts.scheme == "tcp" and parts.hostname is None and parts.port is not None \
            and parts.netloc.startswith(":"):
        return LOOPBACK, parts.port
    return parse_address(address)


def parse_peers(text: str) -> list[tuple[str, int | None]]:
    """'hostA, hostB:7000, tcp://10.0.0.3:7001' → [(host, port or None: any port)]."""
    peers = []
    for item in filter(None, (p.strip() for p in text.split(","))):
        parts = urlsplit(item if "://" in item else f"tcp://{item}")
        try:
            port = parts.port
        except ValueError:
            port = -1
        if parts.scheme != "tcp" or not parts.hostname or port == -1 or parts.path:
            raise ValueError(f"kv_peers entry {item!r} is invalid: write HOST or HOST:PORT, "
                             "comma-separated")
        peers.append((parts.hostname.lower(), port))
    return peers


@dataclass(frozen=True)
class RuntimeConfig:
    """Everything about running an engine directory that is not a scheduling choice."""

    device: str = "cpu"
    """Device the engine runs on: cpu | cuda | cuda:N."""
    kv_cache_memory: str | int | None = None
    """Memory for the paged KV cache, e.g. 512MiB or 4GiB (a plain integer is bytes; decides how
    many KV blocks exist). None: the budget recorded in engine.json."""
    cuda_graphs: bool = False
    """Replay decode steps from CUDA graphs captured for batch sizes 1, 2, 4, … up to
    max_batch_size (device cuda only)."""
    verify_checksums: bool = True
    """Check the sha256 of every engine file at load (engine.json records them)."""
    phase: Phase = Phase.BOTH
    """both (prefill and decode here) | context (prefill only, hands the KV over) | generation
    (decode only, continues from handed-over KV)."""
    kv_connector: str = SHARED_MEMORY_CONNECTOR
    """Context phase: how the KV is handed over: shm (generation engine on this host) or
    tcp://HOST:PORT (listen there, for generation servers on other hosts; port 0: any free port;
    tcp://:PORT listens on 127.0.0.1 only, every interface only if written: tcp://0.0.0.0:PORT).
    Plain TCP unless kv_tls_cert_file is set (TLS, docs/scale-out.md)."""
    kv_advertise_host: str | None = None
    """Context phase, tcp connector: the host name or address generation servers reach it at
    (None: the listen host, or this host's name when it listens on 0.0.0.0)."""
    kv_auth_key_file: str | None = None
    """Context and generation phases: file holding the key (32+ random characters, mode 0600)
    that authenticates KV handoffs; both sides need the same one. None: $TRTFORGE_KV_AUTH_KEY,
    else on one host (shm) a per-user key created beside the handoff segments; a tcp connector
    and a generation engine with kv_peers refuse to start without one."""
    kv_tls_cert_file: str | None = None
    """tcp KV connector, TLS: the context server's certificate chain (PEM; TLS is on when set),
    or a generation server's client certificate for mutual TLS."""
    kv_tls_key_file: str | None = None
    """The private key of kv_tls_cert_file (PEM, mode 0600)."""
    kv_tls_ca_file: str | None = None
    """tcp KV connector, TLS: on a generation server, the CA certificates (PEM) the context
    servers' certificates must chain to, each naming the host its handles give (TLS is on when
    set); on a context server, requires every client to present a certificate this CA signed
    (mutual TLS)."""
    kv_peers: str | None = None
    """Generation phase: the context servers whose tcp KV connectors it fetches from, HOST or
    HOST:PORT, comma-separated (None: shared-memory handoffs on this host only; a handle naming
    any other location is refused)."""
    handoff_timeout_s: float = 30.0
    """Context phase: seconds a handed-over prefill's KV waits for the generation side before it
    is freed."""
    speculative_config: SpeculativeConfig | str | None = None
    """Speculative decoding, vLLM's JSON object, e.g. {"method": "ngram", "num_speculative_tokens":
    4, "prompt_lookup_max": 4, "prompt_lookup_min": 2} (docs/speculative-decoding.md; read into a
    SpeculativeConfig). Not given (None, or empty): the engine's default, the config `build-engine
    --speculative-config` recorded in engine.json (none recorded: one token per decode step);
    none (or null): no speculation, whatever engine.json says."""

    CHOICES: ClassVar[dict[str, tuple[str, ...]]] = {"phase": tuple(p.value for p in Phase)}

    def __post_init__(self) -> None:
        if not isinstance(self.phase, Phase):  # a plain string from a CLI flag or a parameter
            if self.phase not in self.CHOICES["phase"]:
                raise ValueError(f"phase={self.phase!r} is invalid: must be one of "
                                 f"{', '.join(self.CHOICES['phase'])}")
            object.__setattr__(self, "phase", Phase(self.phase))
        if self.kv_cache_memory is not None:
            parse_bytes(self.kv_cache_memory)  # ValueError naming a bad size
        if self.kv_connector != SHARED_MEMORY_CONNECTOR:
            parse_listen_address(self.kv_connector)  # ValueError naming a bad address
        if self.kv_peers:
            parse_peers(self.kv_peers)
        spec = self.speculative_config
        if not (isinstance(spec, str) and spec.strip().lower() in (NO_SPECULATION, "null")):
            spec = SpeculativeConfig.parse(spec)  # ValueError naming a bad field
        object.__setattr__(self, "speculative_config", NO_SPECULATION if isinstance(spec, str) else spec)
        if not self.handoff_timeout_s > 0:
            raise ValueError(f"handoff_timeout_s={self.handoff_timeout_s} is invalid: must be > 0")

    @classmethod
    def field_docs(cls) -> dict[str, str]:
        """{field name: its docstring}, for --help texts and Triton config descriptions."""
        return dict(field_docs(cls))

    @classmethod
    def from_text(cls, values: dict[str, str]) -> RuntimeConfig:
        """From option strings (Triton parameters): names checked, values converted by the field's
        type; empty strings keep the default."""
        hints = get_type_hints(cls)
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - names)
        if unknown:
            raise ValueError(f"unknown runtime option(s) {unknown}; known: {', '.join(sorted(names))}")
        typed: dict[str, Any] = {}
        for name, text in values.items():
            if text == "":
                continue
            raw = name in ("phase", "speculative_config")  # read by __post_init__ ("none" is not None there)
            typed[name] = text if raw else parse_text(name, text, hints[name])
        return cls(**typed)

    def speculation(self, engine_default: SpeculativeConfig | dict[str, Any] | str | None = None,
                    ) -> SpeculativeConfig | None:
        """The speculative decoding an engine whose engine.json records `engine_default` runs with:
        speculative_config when given, none for "none", else the engine's default — except in the
        context phase, which never speculates by default (it computes one token)."""
        if self.speculative_config == NO_SPECULATION:
            return None
        if self.speculative_config is not None:
            return self.speculative_config  # type: ignore[return-value]  # parsed in __post_init__
        if self.phase is Phase.CONTEXT:
            return None
        return SpeculativeConfig.parse(engine_default)

    def with_overrides(self, **overrides: Any) -> RuntimeConfig:
        """A validated copy with some fields replaced."""
        return dataclasses.replace(self, **overrides)
