"""The handle of one handed-over prefill: where its KV blocks are, and the request state the
generation side needs to continue exactly where the context side stopped."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field


class HandoffError(RuntimeError):
    """A handoff that cannot be completed (expired, its owner gone, no room to stage it)."""


@dataclass
class KVHandle:
    """Plain data (JSON round trip): TensorRT-LLM calls this the context phase parameters."""

    request_id: str
    """The context engine's request id (for messages)."""
    location: str
    """Where the blocks are: the shared-memory segment's path."""
    slot: int
    """The handle's slot in the segment's control table."""
    nonce: int
    """Identifies this handle in its slot (slots are reused; a stale handle never matches)."""
    blocks: list[int]
    """Staging block ids holding positions [0, num_tokens) in order."""
    num_tokens: int
    """Tokens whose K/V are in the blocks (the prompt)."""
    block_size: int
    deadline: float
    """Wall-clock time (time.time()) after which the owner frees the blocks."""
    nbytes: int
    """Bytes of K/V in the blocks."""
    prompt_token_ids: list[int]
    first_token: int
    """The token the context side sampled from the prompt's last position."""
    seed: int
    """The request's sampling seed (drawn by the context side if the client sent none)."""
    generator_state: str | None = None
    """The request's random generator state after the first token (hex), if it drew numbers."""
    cum_logprob: float = 0.0
    """Log-probability of the first token (when logprobs were requested)."""
    export_seconds: float = 0.0
    """Time the context side spent copying the blocks out."""
    extra: dict = field(default_factory=dict)

    def to_json(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str | bytes) -> "KVHandle":
        try:
            data = json.loads(text)
            return cls(**data)
        except (ValueError, TypeError) as exc:
            raise HandoffError(f"malformed context_phase_params: {exc}") from None
