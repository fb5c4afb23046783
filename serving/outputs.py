"""What the engine hands back each step, per request."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any


class FinishReason(str, enum.Enum):
    """Why a request finished. A `str` enum: it compares equal to its value ("stop" == STOP) and
    is written as that value (JSON, f-strings), as the API responses spell it."""

    STOP = "stop"
    """EOS, a stop token or a stop string (RequestOutput.stop_reason says which)."""
    LENGTH = "length"
    """max_tokens generated, or the sequence reached max_seq_len."""
    ABORT = "abort"
    """Cancelled (LLMEngine.abort: the client went away or withdrew it)."""
    ERROR = "error"
    """The request failed (RequestOutput.error says why); other requests go on."""
    TIMEOUT = "timeout"
    """Past its deadline (SamplingParams.timeout_s); aborted, its KV freed."""
    HANDOFF = "handoff"
    """Context phase: the prompt and the first token are done; the KV went to a generation
    engine (RequestOutput.kv_handle), which continues the request."""

    def __str__(self) -> str:
        return self.value


@dataclass
class RequestMetrics:
    """Timestamps on the engine's monotonic clock (time.monotonic(), seconds)."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    token_times: list[float] = field(default_factory=list)
    """When each output token was produced."""
    finished_time: float | None = None

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first (vLLM's definition)."""
        if len(self.token_times) < 2:
            return None
        return (self.token_times[-1] - self.token_times[0]) / (len(self.token_times) - 1)


@dataclass
class RequestOutput:
    """One request's progress in one step: what it produced now and everything so far."""

    request_id: str
    new_token_ids: list[int]
    """Tokens produced by this step (usually one; empty for a final abort/error output)."""
    text_delta: str
    """Text completed by this step (may be "" while a character or stop string is pending)."""
    output_token_ids: list[int]
    """All generated tokens so far."""
    text: str
    """All generated text so far (the concatenation of the deltas)."""
    finished: bool
    finish_reason: FinishReason | None
    """Why the request finished (stop | length | abort | error | timeout | handoff); None before."""
    num_prompt_tokens: int
    metrics: RequestMetrics
    logprobs: list[float] | None = None
    """Log-probabilities of new_token_ids (when requested)."""
    top_logprobs: list[list[tuple[int, float]]] | None = None
    cum_logprob: float | None = None
    error: str | None = None
    stop_reason: str | int | None = None
    """The stop string or stop token that finished the request."""
    num_cached_tokens: int = 0
    """Prompt tokens whose KV came from the prefix cache at the request's first scheduling (not
    recomputed; at most num_prompt_tokens - 1, as the last prompt token is always computed). 0
    before it was scheduled, without prefix caching, and in the generation phase (its prompt KV
    was handed over: the context phase's output says how much of it was cached)."""
    num_draft_tokens: int = 0
    """Speculative decoding: draft tokens verified for this request so far (0 without it)."""
    num_accepted_tokens: int = 0
    """Of those, accepted: tokens that cost no target step of their own (acceptance rate =
    num_accepted_tokens / num_draft_tokens)."""
    prompt_logprobs: list[Any] | None = None
    """Prompt logprobs (SamplingParams.prompt_logprobs): on the request's first output only (that
    of its first token, or the context phase's handoff), one PromptLogprob
    (serving/prompt_logprobs.py) per prompt token after the first, in order; None otherwise."""
    kv_handle: Any = None
    """Context phase only (finish_reason handoff): the KVHandle the generation phase continues
    from."""
