"""How requests are scheduled: the runtime options, separate for prefill and decode.

One dataclass, documented field by field (the string under each field is its help text: the CLI
and the Triton config read it through `SchedulerConfig.field_docs()`). `max_seq_len`, `block_size`
and `num_blocks` describe the engine and the KV memory; the engine fills them in.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, get_type_hints

from trtforge.config.fields import field_docs, parse_text


class ConfigError(ValueError):
    """A scheduling option with a value the scheduler cannot work with."""


@dataclass(frozen=True)
class SchedulerConfig:
    """Per-iteration budgets and admission/preemption policy of the in-flight batching scheduler."""

    max_num_tokens: int = 8192
    """Token budget of one iteration: decode tokens plus prefill tokens batched together. A built
    engine records its build limit (build-engine --max-num-tokens) as its default."""
    max_batch_size: int = 256
    """Most sequences running at once (admitted and holding KV) — the decode batch limit. A built
    engine records its build limit (build-engine --max-batch-size) as its default."""
    prefill_max_tokens: int | None = None
    """Prefill token budget of one iteration (None: whatever max_num_tokens leaves after decodes)."""
    prefill_chunk_size: int = 512
    """Most prompt tokens of one sequence computed in one iteration (0: whole prompt, no chunking).
    A built engine records at most its max_num_tokens."""
    prefill_max_seqs: int = 64
    """Most sequences being prefilled (new or continuing chunks) in one iteration. A built engine
    records at most its max_batch_size."""
    prefill_order: str = "fcfs"
    """Admission order of waiting requests: fcfs (a request that does not fit blocks the ones behind
    it: no overtaking, no starvation) or shortest_first (fewest tokens first; long prompts can wait
    while short ones keep arriving). Preempted requests always resume first."""
    kv_watermark: float = 0.01
    """Fraction of KV blocks kept free when admitting new requests, so running ones can grow without
    being preempted at once (max_utilization only)."""
    policy: str = "max_utilization"
    """max_utilization: admit greedily; when a running sequence needs a block and none is free,
    preempt the newest running one (recomputed later). guaranteed_no_evict: admit a request only if
    its whole KV need (prompt + max_tokens) fits in blocks not promised to running ones; never
    preempts."""
    enable_prefix_caching: bool = True
    """Reuse the KV of full blocks shared with earlier prompts (chained SHA-256 block keys; a hit
    is checked against the block's tokens)."""
    max_queue_size: int = 4096
    """Most requests waiting for their first admission (0: unbounded). A request beyond it is
    refused at once with "server busy, retry later" instead of queueing; preempted requests do
    not count (they resume first). The default, 16 batches of 256, bounds a flood's memory and
    backlog without refusing a benchmark's burst; set it lower for a latency target."""
    max_queued_tokens: int = 4_194_304
    """Most prompt tokens of the requests waiting for their first admission (0: unbounded; else at
    least max_seq_len - 1, the longest prompt). Beyond it a request is refused like above. The
    default (4M tokens, a few hundred MB of token lists) is raised to max_seq_len - 1 for an
    engine whose longest prompt is longer."""
    max_seq_len: int = 4096
    """Most tokens of one sequence, prompt + output (from the engine)."""
    block_size: int = 32
    """Tokens per KV block (from the engine)."""
    num_blocks: int = 4096
    """KV blocks in the pool (from the engine, sized by the KV memory)."""

    CHOICES: ClassVar[dict[str, tuple[str, ...]]] = {
        "prefill_order": ("fcfs", "shortest_first"),
        "policy": ("max_utilization", "guaranteed_no_evict"),
    }
    # Fields that describe the engine and its KV pool, not a scheduling choice (a comment, not a
    # docstring: field_docs() would take it for a field's help text).
    ENGINE_FIELDS: ClassVar[tuple[str, ...]] = ("max_seq_len", "block_size", "num_blocks")

    @classmethod
    def for_engine(cls, build: Mapping[str, Any], scheduling: Mapping[str, Any],
                   num_blocks: int | None = None,
                   overrides: Mapping[str, Any] | None = None) -> SchedulerConfig:
        """The scheduler of an engine, from what engine.json records: its limits (`build`:
        max_seq_len, kv_block_size), the KV pool (`num_blocks`; None: the default, for checking
        values before the pool is known), its scheduling defaults (`scheduling`), then `overrides`.
        Validated: ConfigError names a bad value."""
        engine = {"max_seq_len": int(build["max_seq_len"]), "block_size": int(build["kv_block_size"])}
        if num_blocks is not None:
            engine["num_blocks"] = num_blocks
        overrides = dict(overrides or {})
        cls.refuse_engine_fields(overrides)
        # The engine's own values win over any engine field recorded among the scheduling ones.
        recorded = {k: v for k, v in scheduling.items() if k not in cls.ENGINE_FIELDS}
        if "max_queued_tokens" not in recorded and "max_queued_tokens" not in overrides:
            # The default bound must admit the engine's longest prompt.
            engine["max_queued_tokens"] = max(cls.max_queued_tokens, engine["max_seq_len"] - 1)
        return cls(**engine).with_overrides(**{**recorded, **overrides})

    @classmethod
    def refuse_engine_fields(cls, names: Any) -> None:
        """ConfigError if `names` include fields that describe the engine (ENGINE_FIELDS): overriding
        one would disagree with the compiled engine or the allocated KV pool."""
        given = sorted(set(names) & set(cls.ENGINE_FIELDS))
        if given:
            raise ConfigError(f"{given} describe the engine, not its scheduling: rebuild it "
                              "(build-engine --max-seq-len / --kv-block-size) or give the KV cache "
                              "another amount of memory (kv_cache_memory) to change the number of "
                              "KV blocks")

    @classmethod
    def field_docs(cls) -> dict[str, str]:
        """{field name: its docstring}, for --help texts and Triton config descriptions."""
        return dict(field_docs(cls))

    def with_overrides(self, **overrides: Any) -> SchedulerConfig:
        """A validated copy with some fields replaced; string values (Triton parameters, env vars)
        are converted to the field's type."""
        cfg = dataclasses.replace(self, **_typed(overrides))
        cfg.validate()
        return cfg

    @classmethod
    def coerce(cls, values: dict[str, Any]) -> dict[str, Any]:
        """Check option values before the engine is known (e.g. `build-engine --schedule`): names,
        types (strings converted) and ranges; returns the typed values. Engine fields not given
        take their least constraining legal value, so only the given values are judged; the engine
        validates the whole config again at load."""
        typed = _typed(values)
        cls(**{"max_seq_len": 2, **typed}).validate()
        return typed

    def validate(self) -> None:
        """Raise ConfigError naming the first option that makes scheduling impossible."""
        for name in _KINDS:
            _check_type(name, getattr(self, name), _KINDS[name])
        _at_least("max_num_tokens", self.max_num_tokens, 1)
        _at_least("max_batch_size", self.max_batch_size, 1)
        _at_least("prefill_max_seqs", self.prefill_max_seqs, 1)
        _at_least("block_size", self.block_size, 1)
        _at_least("num_blocks", self.num_blocks, 1)
        _at_least("max_seq_len", self.max_seq_len, 2, "(one prompt token plus one generated token)")
        _at_least("max_queue_size", self.max_queue_size, 0, "(0: unbounded)")
        if self.max_queued_tokens != 0 and self.max_queued_tokens < self.max_seq_len - 1:
            raise ConfigError(f"max_queued_tokens={self.max_queued_tokens} is invalid: must be 0 "
                              f"(unbounded) or >= max_seq_len - 1 = {self.max_seq_len - 1}, so that "
                              "the longest prompt can wait on an empty queue")
        budget = self.max_num_tokens
        if self.prefill_max_tokens is not None and not 1 <= self.prefill_max_tokens <= budget:
            raise ConfigError(f"prefill_max_tokens={self.prefill_max_tokens} is invalid: must be None "
                              f"(use the whole budget) or 1..max_num_tokens ({budget})")
        if not (self.prefill_chunk_size == 0 or 1 <= self.prefill_chunk_size <= budget):
            raise ConfigError(f"prefill_chunk_size={self.prefill_chunk_size} is invalid: must be 0 "
                              f"(no chunking) or 1..max_num_tokens ({budget})")
        for name, allowed in self.CHOICES.items():
            if getattr(self, name) not in allowed:
                raise ConfigError(f"{name}={getattr(self, name)!r} is invalid: must be one of "
                                  f"{', '.join(allowed)}")
        if not 0.0 <= self.kv_watermark <= 0.5:
            raise ConfigError(f"kv_watermark={self.kv_watermark} is invalid: must be in 0..0.5 "
                              "(a fraction of the KV blocks)")
        self._validate_no_chunking()

    def _validate_no_chunking(self) -> None:
        # Without chunking a prompt (or a preempted sequence's recompute, up to max_seq_len - 1
        # tokens) must be computed in one iteration, so both budgets must hold the longest one.
        if self.prefill_chunk_size != 0:
            return
        longest = self.max_seq_len - 1
        for name in ("max_num_tokens", "prefill_max_tokens"):
            value = getattr(self, name)
            if value is not None and value < longest:
                raise ConfigError(
                    f"{name}={value} is too small for prefill_chunk_size=0 (no chunking): a prompt "
                    f"of up to max_seq_len - 1 = {longest} tokens must fit in one iteration; raise "
                    f"{name} to >= {longest} or enable chunking with prefill_chunk_size > 0")


def _at_least(name: str, value: int, low: int, why: str = "") -> None:
    if value < low:
        raise ConfigError(f"{name}={value} is invalid: must be >= {low} {why}".rstrip())


# Field kinds, from the annotations (kept as strings by `from __future__ import annotations`).
_KINDS: dict[str, str] = {f.name: str(f.type) for f in dataclasses.fields(SchedulerConfig)}
_HINTS: dict[str, Any] = get_type_hints(SchedulerConfig)  # the same, evaluated: for parse_text


def _typed(values: dict[str, Any]) -> dict[str, Any]:
    typed = {}
    for key, value in values.items():
        if key not in _KINDS:
            raise ConfigError(f"unknown scheduler option {key!r}; known options: {', '.join(_KINDS)}")
        typed[key] = parse_text(key, value, _HINTS[key], ConfigError) if isinstance(value, str) else value
    return typed


def _check_type(name: str, value: Any, kind: str) -> None:
    if kind.endswith("| None") and value is None:
        return
    base = kind.removesuffix("| None").strip()
    ok = {"int": isinstance(value, int) and not isinstance(value, bool),
          "float": isinstance(value, (int, float)) and not isinstance(value, bool),
          "bool": isinstance(value, bool), "str": isinstance(value, str)}[base]
    if not ok:
        raise ConfigError(f"{name}={value!r} is invalid: must be {kind}, got {type(value).__name__}")

