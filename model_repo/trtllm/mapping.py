"""Our option names → TensorRT-LLM's: one table, rendered into docs/tensorrt-llm.md.

Every SchedulerConfig field (prefill and decode scheduling) has an entry, so none is dropped
without a word: an option with no counterpart is *reported* (`not_carried_over`) whenever its
value asks for something TensorRT-LLM will not do. `mapping_table_markdown()` is the docs table.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

PARAMETER, CONFIG, ENGINE, NONE = ("tensorrt_llm parameter", "model config", "engine build", "—")


@dataclass(frozen=True)
class Counterpart:
    """Where one trtforge option goes in TensorRT-LLM's Triton models."""

    theirs: str
    """Their name ('' when there is none)."""
    where: str
    """PARAMETER (tensorrt_llm config.pbtxt parameter), CONFIG (a model config field), ENGINE
    (a TensorRT-LLM BuildConfig option, fixed at build time) or NONE."""
    note: str
    neutral: Callable[[Any], Any] | None = None
    """For NONE/ENGINE: the value (from the whole SchedulerConfig, or the engine's build dict for
    ENGINE) that TensorRT-LLM's behaviour already matches; any other value is reported."""


SCHEDULING: dict[str, Counterpart] = {
    "max_num_tokens": Counterpart(
        "max_num_tokens", ENGINE, "TensorRT-LLM's per-iteration token budget is built into the "
        "engine (build-engine --max-num-tokens); the tensorrt_llm model has no run-time parameter",
        lambda build: int(build["max_num_tokens"])),
    "max_batch_size": Counterpart(
        "max_batch_size", ENGINE, "built into the engine (build-engine --max-batch-size); no "
        "run-time parameter", lambda build: int(build["max_batch_size"])),
    "prefill_max_tokens": Counterpart(
        "", NONE, "TensorRT-LLM gives prefill whatever the token budget leaves",
        lambda s: None),
    "prefill_chunk_size": Counterpart(
        "enable_chunked_context", PARAMETER, "true when > 0 (the engine is built with paged "
        "context FMHA for it); TensorRT-LLM sizes the chunks itself (multiples of the KV block "
        "within max_num_tokens), so only on/off carries over"),
    "prefill_max_seqs": Counterpart(
        "", NONE, "no separate limit on sequences prefilled per iteration",
        lambda s: s.max_batch_size),
    "prefill_order": Counterpart(
        "", NONE, "TensorRT-LLM admits requests first come, first served (fcfs)",
        lambda s: "fcfs"),
    "kv_watermark": Counterpart(
        "", NONE, "no free-block reserve at admission", lambda s: 0.0),
    "policy": Counterpart(
        "batch_scheduler_policy", PARAMETER, "same values: max_utilization, guaranteed_no_evict"),
    "enable_prefix_caching": Counterpart("enable_kv_cache_reuse", PARAMETER, "same meaning"),
    "max_queue_size": Counterpart(
        "dynamic_batching.default_queue_policy.max_queue_size", CONFIG, "the backend hands the "
        "tensorrt_llm model's queue limit to the executor; 0 = unbounded in both"),
    "max_queued_tokens": Counterpart(
        "", NONE, "no limit on the prompt tokens waiting", lambda s: 0),
}

OTHER: dict[str, Counterpart] = {
    "kv_cache_memory": Counterpart(
        "max_tokens_in_paged_kv_cache", PARAMETER, "the tokens that much memory holds (whole "
        "blocks, engine.json's bytes per token); the backend takes the smaller of it and "
        "kv_cache_free_gpu_mem_fraction of the free GPU memory"),
    "exclude_input_in_output": Counterpart(
        "exclude_input_in_output", PARAMETER, "the default for requests that do not send it"),
    "device": Counterpart(
        "gpu_device_ids", PARAMETER, "cuda:N → N; cuda or cpu → '' (every visible GPU)"),
    "triton_max_batch_size": Counterpart(
        "max_batch_size", CONFIG, "of every model: the batch dimension a request may carry"),
}

BUILD: dict[str, Counterpart] = {
    "dtype": Counterpart("dtype", ENGINE, "LLM(dtype=...)"),
    "max_batch_size": Counterpart("max_batch_size", ENGINE, "BuildConfig"),
    "max_num_tokens": Counterpart("max_num_tokens", ENGINE, "BuildConfig"),
    "max_seq_len": Counterpart("max_seq_len", ENGINE, "BuildConfig; max_input_len = "
                                                      "max_seq_len - 1"),
    "kv_block_size": Counterpart("tokens_per_block", ENGINE, "plugin_config; a power of 2"),
    "kv_cache_memory": Counterpart("max_tokens_in_paged_kv_cache", PARAMETER,
                                   "as tokens (see above)"),
}


def not_carried_over(scheduling: Any, build: dict) -> list[str]:
    """'name=value: why' for each scheduling option whose value TensorRT-LLM will not honour."""
    out = []
    for name, c in SCHEDULING.items():
        if c.neutral is None:
            continue
        value = getattr(scheduling, name)
        neutral = c.neutral(build if c.where == ENGINE else scheduling)
        if value != neutral:
            why = (f"the engine was built with {c.theirs}={neutral}" if c.where == ENGINE
                   else "no TensorRT-LLM counterpart")
            out.append(f"{name}={value!r}: {why} ({c.note})")
    if scheduling.prefill_chunk_size > 0:
        out.append(f"prefill_chunk_size={scheduling.prefill_chunk_size}: only enable_chunked_context"
                   f"=true carries over; TensorRT-LLM sizes the chunks itself")
    return out


def mapping_table_markdown() -> str:
    """The docs table: every option, its TensorRT-LLM name and where it goes."""
    rows = ["| trtforge | TensorRT-LLM | where | note |", "| --- | --- | --- | --- |"]
    for group, table in (("scheduling", SCHEDULING), ("emit-repo", OTHER), ("build", BUILD)):
        for name, c in table.items():
            rows.append(f"| {group}: `{name}` | {f'`{c.theirs}`' if c.theirs else '—'} | "
                        f"{c.where} | {c.note} |")
    return "\n".join(rows)
