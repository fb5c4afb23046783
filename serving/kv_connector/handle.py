"""The handle of one handed-over prefill: where its KV blocks are, and the request state the
generation side needs to continue exactly where the context side stopped.

It travels through clients (`context_phase_params`), so nothing in it is trusted as it comes:
`from_json` checks every field's type (and bounds the sizes), `mac` authenticates all the other
fields (HMAC-SHA256 with the key the context and generation sides share, auth.py), and `secret`
is what the context side's connector asks before it lets the blocks be taken.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, fields

from trtforge.serving.kv_connector import auth

MAX_HANDLE_BYTES = 8 << 20
"""Longest context_phase_params accepted (a max_seq_len prompt's ids and the generator state)."""
MAX_GENERATOR_STATE_CHARS = 1 << 16


class HandoffError(RuntimeError):
    """A handoff that cannot be completed (expired, its owner gone, no room to stage it)."""


@dataclass
class KVHandle:
    """Plain data (JSON round trip): TensorRT-LLM calls this the context phase parameters."""

    request_id: str
    """The context engine's request id (for messages)."""
    location: str
    """Where the blocks are: the shared-memory segment's path, or tcp://HOST:PORT."""
    slot: int
    """The handle's slot in the segment's control table."""
    nonce: int
    """Identifies this handle in its slot (random, never 0: a free slot holds 0, and a stale
    handle never matches a reused slot)."""
    blocks: list[int]
    """Staging block ids holding positions [first_block * block_size, num_tokens) in order."""
    num_tokens: int
    """Tokens whose K/V the handoff stands for (the prompt)."""
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
    first_block: int = 0
    """The prompt's first block in `blocks`: a sliding-window model's context side frees the blocks
    no later token can see before the handoff (KVCacheManager.free_out_of_window), so only the
    blocks from this one on travel; the generation side's window must never read the others."""
    extra: dict = field(default_factory=dict)
    secret: str = ""
    """This handoff's secret (128 random bits, hex): the connector hands the blocks only to
    whoever names it."""
    mac: str = ""
    """HMAC-SHA256 (hex) of every other field, with the handoff key (auth.py)."""

    def to_json(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))

    def signed_bytes(self) -> bytes:
        """What `mac` authenticates: every other field, canonically encoded."""
        data = asdict(self)
        del data["mac"]
        return json.dumps(data, sort_keys=True, separators=(",", ":")).encode()

    def sign(self, key: bytes) -> KVHandle:
        self.mac = auth.sign(key, self.signed_bytes())
        return self

    def verify(self, key: bytes) -> bool:
        return bool(self.mac) and auth.verify(key, self.signed_bytes(), self.mac)

    @classmethod
    def from_json(cls, text: str | bytes) -> KVHandle:
        """Parse and type-check (HandoffError "malformed context_phase_params: …"); the values'
        ranges and the signature are the generation connector's check_handoff."""
        if len(text) > MAX_HANDLE_BYTES:
            raise HandoffError(f"malformed context_phase_params: {len(text)} bytes (at most "
                               f"{MAX_HANDLE_BYTES})")
        try:
            data = json.loads(text)
            if not isinstance(data, dict):
                raise TypeError("not a JSON object")
            unknown = sorted(set(data) - {f.name for f in fields(cls)})
            if unknown:
                raise TypeError(f"unknown field(s) {unknown[:5]}")
            handle = cls(**data)
            handle._check_types()
            return handle
        except (ValueError, TypeError, RecursionError) as exc:
            raise HandoffError(f"malformed context_phase_params: {exc}") from None

    def _check_types(self) -> None:
        for name in ("request_id", "location", "secret", "mac"):
            if not isinstance(getattr(self, name), str) or len(getattr(self, name)) > 4096:
                raise TypeError(f"{name} must be a string")
        for name in ("slot", "nonce", "num_tokens", "block_size", "nbytes", "first_token", "seed", "first_block"):
            if not _is_int(getattr(self, name)):
                raise TypeError(f"{name} must be an integer")
        for name in ("deadline", "cum_logprob", "export_seconds"):
            value = getattr(self, name)
            if not (_is_int(value) or isinstance(value, float)) or not math.isfinite(value):
                raise TypeError(f"{name} must be a finite number")
        for name in ("blocks", "prompt_token_ids"):
            value = getattr(self, name)
            if not isinstance(value, list) or not all(_is_int(v) for v in value):
                raise TypeError(f"{name} must be a list of integers")
        state = self.generator_state
        if state is not None and (not isinstance(state, str) or len(state) > MAX_GENERATOR_STATE_CHARS):
            raise TypeError("generator_state must be a hex string or null")
        if not isinstance(self.extra, dict):
            raise TypeError("extra must be an object")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
