"""The offline benchmark's workload and result records, shared by every system measured.

A workload is a list of requests with random token-id prompts and a fixed number of tokens to
generate each (EOS ignored), so every system produces exactly the same amount of useful output and
output tokens/s compares like with like. Random ids are fine: the weights are random too, and speed
does not depend on either.
"""

from __future__ import annotations

import random
import time
from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class BenchRequest:
    """One request of the workload."""

    prompt_token_ids: list[int]
    """The prompt, as token ids."""
    output_len: int
    """Tokens to generate (exactly: EOS is ignored)."""

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)


def make_workload(num_requests: int, prompt_len: tuple[int, int], output_len: tuple[int, int],
                  vocab_size: int, seed: int = 0, first_token_id: int = 10) -> list[BenchRequest]:
    """Prompt and output lengths uniform in the inclusive ranges; ids avoid the first
    `first_token_id` ids, where tokenizers keep their special tokens (EOS, BOS, padding)."""
    for name, (low, high) in (("prompt_len", prompt_len), ("output_len", output_len)):
        if not 1 <= low <= high:
            raise ValueError(f"{name} range {low}..{high} is invalid: need 1 <= low <= high")
    if vocab_size <= first_token_id:
        raise ValueError(f"vocab_size={vocab_size} leaves no ordinary token ids above {first_token_id}")
    rng = random.Random(seed)
    return [BenchRequest([rng.randrange(first_token_id, vocab_size) for _ in range(rng.randint(*prompt_len))],
                         rng.randint(*output_len))
            for _ in range(num_requests)]


@dataclass
class SystemResult:
    """One system's run over (part of) the workload."""

    name: str
    """Which system: hf_one_at_a_time, hf_static_batch, trtforge_inflight, ..."""
    num_requests: int
    """Requests it ran."""
    elapsed_s: float
    """Wall time of the whole run (model already loaded and warmed up)."""
    useful_output_tokens: int
    """Sum of the requests' own output lengths: what the users asked for."""
    generated_tokens: int
    """Tokens actually computed, padding rows of static batches included."""
    prompt_tokens: int
    """Sum of the prompt lengths."""
    extra: dict[str, Any] = field(default_factory=dict)
    """System-specific measurements (steps, preemptions, KV statistics...)."""

    @property
    def output_tokens_per_s(self) -> float:
        return self.useful_output_tokens / self.elapsed_s if self.elapsed_s > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "output_tokens_per_s": self.output_tokens_per_s}


class Stopwatch:
    """`with Stopwatch() as sw: ...; sw.elapsed` — wall seconds on the performance counter."""

    def __enter__(self) -> "Stopwatch":
        self.start = time.perf_counter()
        self.elapsed = 0.0
        return self

    def __exit__(self, *exc: Any) -> None:
        self.elapsed = time.perf_counter() - self.start
