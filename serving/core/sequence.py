"""One request as the scheduler and the KV cache manager see it: token ids and counters, no tensors.

Token layout of a sequence (positions are absolute):

    all_token_ids = prompt_token_ids + output_token_ids
    [0 ........................ num_computed_tokens) [num_computed_tokens .. num_tokens)
     KV already in the cache (computed or reused)     still to compute (a prompt chunk, or the
                                                      last sampled token = one decode step)

Sampling parameters other than `max_tokens` live with the engine; the scheduler needs only
`max_tokens` to know the most KV a request can ever hold.
"""

from __future__ import annotations

import enum
from collections.abc import Hashable
from dataclasses import dataclass, field

SeqId = Hashable
"""A sequence's id: the engine uses the request id, so one id names a request from the client to
the KV cache and back (the scheduler needs only equality and hashing)."""


class SequenceStatus(enum.Enum):
    """Where a sequence is in its life."""

    WAITING = "waiting"
    """Added, never admitted yet (holds no KV blocks)."""
    RUNNING = "running"
    """Admitted: holds KV blocks; being prefilled (maybe in chunks) or decoded."""
    PREEMPTED = "preempted"
    """Evicted to free KV blocks; back in the waiting queue, recomputes prompt + outputs on resume."""
    FINISHED_STOPPED = "finished_stopped"
    """Finished on a stop token / stop word."""
    FINISHED_LENGTH = "finished_length"
    """Finished on max_tokens or max_seq_len."""
    FINISHED_ABORTED = "finished_aborted"
    """Cancelled by the client or the server."""

    @property
    def is_finished(self) -> bool:
        return self in _FINISHED


_FINISHED = frozenset({SequenceStatus.FINISHED_STOPPED, SequenceStatus.FINISHED_LENGTH,
                       SequenceStatus.FINISHED_ABORTED})


@dataclass(eq=False)  # identity semantics: two requests with equal tokens are still two requests
class Sequence:
    """A request's tokens, its KV block table and the counters the scheduler keeps for it."""

    seq_id: SeqId
    """Unique among unfinished sequences; the engine passes the request id."""
    prompt_token_ids: list[int]
    """The prompt (at least one token)."""
    max_tokens: int
    """Most tokens to generate; `Scheduler.add` refuses a request whose prompt + max_tokens
    exceed max_seq_len."""
    output_token_ids: list[int] = field(default_factory=list)
    """Tokens sampled so far, in order."""
    arrival_time: float = 0.0
    """When the request arrived (seconds, engine's clock) — for metrics; FCFS uses add() order."""
    status: SequenceStatus = SequenceStatus.WAITING
    """Life-cycle state, changed only by the scheduler."""
    num_computed_tokens: int = 0
    """Leading tokens of `all_token_ids` whose K/V are in the cache (computed or prefix-cache hits)."""
    block_table: list[int] = field(default_factory=list)
    """Physical KV block ids, in position order; block i holds positions [i*B, (i+1)*B) (the first
    num_freed_blocks entries: FREED_BLOCK, out of the sliding window)."""
    num_cached_prefix_tokens: int = 0
    """Tokens reused from the prefix cache at the latest admission (not recomputed)."""
    num_external_tokens: int = 0
    """Leading tokens whose K/V arrive from outside at admission (a KV handoff from a context
    engine) instead of being computed; 0 once admitted (a preempted sequence recomputes)."""
    external_first_block: int = 0
    """With num_external_tokens: the first block the handoff brings (KVHandle.first_block); the
    blocks before it fell out of the sliding window on the context side and do not come (their
    entries start FREED_BLOCK). 0 once admitted."""
    num_freed_blocks: int = 0
    """Leading block-table entries released because they fell out of the sliding window
    (FREED_BLOCK, kv_cache_manager); the sequence holds len(block_table) - num_freed_blocks blocks."""
    cache_salt: str | None = None
    """Its prefix-cache namespace (SamplingParams.cache_salt): folded into the root key of its
    block chain, so it shares cached blocks only with sequences of the same salt."""

    @property
    def all_token_ids(self) -> list[int]:
        """Prompt followed by the outputs (a new list)."""
        return self.prompt_token_ids + self.output_token_ids

    def token_ids(self, start: int, end: int) -> list[int]:
        """all_token_ids[start:end] (a new list) without building all_token_ids: a decode step
        asks for its one token every iteration."""
        n_prompt = len(self.prompt_token_ids)
        if end <= n_prompt:
            return self.prompt_token_ids[start:end]
        if start >= n_prompt:
            return self.output_token_ids[start - n_prompt:end - n_prompt]
        return self.prompt_token_ids[start:] + self.output_token_ids[:end - n_prompt]

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        """Prompt + output tokens."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        """Tokens whose K/V still have to be computed (1 for a sequence in decode)."""
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

