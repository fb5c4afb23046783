"""Disaggregated serving on Triton: the `context` and `generation` models and their parameters.

TensorRT-LLM's names: a `context` model runs prefill only (the prompt's KV and the first token),
a `generation` model runs decode only, continuing from the KV the context model hands over; a
router (TensorRT-LLM's `disaggregated_serving_bls`; here the client-facing `ensemble` model)
sends each request to one, then the other, with `request_type` = `context_only` /
`generation_only` and the handover in `context_phase_params`.

Each phase model has its own scheduling parameters in its own config.pbtxt. A parameter that
belongs to the other phase is refused when the model loads, naming it: a decode batch limit on the
context model would silently do nothing.
"""

from __future__ import annotations

from collections.abc import Iterable

from trtforge.config.scheduler import SchedulerConfig

BOTH, CONTEXT, GENERATION = "both", "context", "generation"
ROUTER_ROLE = "disaggregated_serving_bls"

# Triton parameters of the phase models beyond the scheduler's fields.
PHASE = "phase"
CPUS = "cpus"
CPU_THREADS = "cpu_threads"
HANDOFF_TIMEOUT = "handoff_timeout_s"
# Parameters of the router model.
ROLE = "role"
CONTEXT_MODEL = "context_model"
GENERATION_MODEL = "generation_model"
CONTEXT_URLS = "context_urls"
GENERATION_URLS = "generation_urls"
# The context model's KV connector (servers on different hosts).
KV_CONNECTOR = "kv_connector"
KV_ADVERTISE_HOST = "kv_advertise_host"

# Inputs and outputs the phase models take beyond the `ensemble` interface (TensorRT-LLM's names).
REQUEST_TYPE = "request_type"
CONTEXT_PHASE_PARAMS = "context_phase_params"
CONTEXT_ONLY, GENERATION_ONLY = "context_only", "generation_only"

CONTEXT_SCHEDULER_FIELDS = ("max_num_tokens", "prefill_max_tokens", "prefill_chunk_size",
                            "prefill_max_seqs", "prefill_order", "enable_prefix_caching",
                            "max_queue_size", "max_queued_tokens")
"""Prefill: token budget, chunk size, sequences per iteration, admission order, prefix cache,
queue bounds."""
GENERATION_SCHEDULER_FIELDS = ("max_batch_size", "max_num_tokens", "policy", "kv_watermark",
                               "max_queue_size")
"""Decode: batch limit, token budget, eviction policy, watermark, queue bound."""

PHASE_DOCS = {
    PHASE: "both (prefill and decode here) | context (prefill only, hands the KV over) | "
           "generation (decode only, continues from handed-over KV).",
    CPUS: "CPU cores this model's process runs on, e.g. 0 or 0-3 or 0,2 (empty: all); how the "
          "context and generation models of one CPU host keep from competing.",
    CPU_THREADS: "Threads of the engine's kernels (empty: one per core in `cpus`, else torch's "
                 "default).",
    HANDOFF_TIMEOUT: "Seconds a handed-over prefill's KV waits for the generation model before "
                     "the context model frees it.",
    KV_CONNECTOR: "How the context model hands KV over: shm (generation model on this host) or "
                  "tcp://HOST:PORT (listen there, for generation servers on other hosts; port 0: "
                  "any free port).",
    KV_ADVERTISE_HOST: "Host name or address generation servers reach the tcp connector at "
                       "(default: the listen host, or this host's name when it listens on 0.0.0.0).",
    CONTEXT_URLS: "Router: gRPC addresses HOST:PORT of context servers, comma-separated (empty: "
                  "the `context` model of this server). Least-loaded first.",
    GENERATION_URLS: "Router: gRPC addresses of generation servers, comma-separated (empty: the "
                     "`generation` model of this server). Least-loaded first.",
}

_OWN = {CONTEXT: set(CONTEXT_SCHEDULER_FIELDS) | {HANDOFF_TIMEOUT, KV_CONNECTOR, KV_ADVERTISE_HOST},
        GENERATION: set(GENERATION_SCHEDULER_FIELDS)}


def scheduler_fields(phase: str) -> tuple[str, ...]:
    """The SchedulerConfig fields a model of `phase` takes as parameters."""
    if phase == CONTEXT:
        return CONTEXT_SCHEDULER_FIELDS
    if phase == GENERATION:
        return GENERATION_SCHEDULER_FIELDS
    return tuple(f for f in SchedulerConfig.field_docs() if f not in SchedulerConfig.ENGINE_FIELDS)


def refuse_other_phase(phase: str, names: Iterable[str]) -> None:
    """ValueError naming the first parameter that belongs to the other phase."""
    if phase not in _OWN:
        if phase != BOTH:
            raise ValueError(f"parameter {PHASE}={phase!r} is invalid: must be {BOTH}, {CONTEXT} "
                             f"or {GENERATION}")
        return
    other = GENERATION if phase == CONTEXT else CONTEXT
    for name in names:
        if name in _OWN[other] and name not in _OWN[phase]:
            raise ValueError(
                f"parameter {name!r} belongs to the {other} model, not the {phase} model "
                f"({'decode' if other == GENERATION else 'prefill'} scheduling); move it to "
                f"{other}/config.pbtxt. The {phase} model takes: "
                f"{', '.join(sorted(_OWN[phase]))}")
        if name in SchedulerConfig.field_docs() and name not in _OWN[phase]:
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
