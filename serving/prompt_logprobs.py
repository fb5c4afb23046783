"""Prompt log-probabilities (vLLM's `prompt_logprobs=K`): the log-probability of every prompt token
after the first given the tokens before it, its rank, and the K most likely tokens there.

    prompt:    t0   t1   t2  ...  t[P-1]
    position:  0    1    2        P-1
    logits at position p predict t[p+1]: rows 0 .. P-2 score t1 .. t[P-1]
    (row P-1 is the one the sampler reads for the first generated token)

A request asking for them gets, in each prefill chunk [start, end), the logits rows of its
positions p in [start, min(end, P - 1)) besides its sampling row (model_inputs.prepare_inputs):
chunk-sized, never the whole prompt's [P, V] at once. `score` turns such rows into entries here,
in float32 (log_softmax of the raw logits, as the sampler's `logprobs`); `PromptLogprobsState`
collects one request's entries chunk by chunk. The scheduler never sees any of it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

TopLogprobs = list[tuple[int, float]]


@dataclass
class PromptLogprob:
    """One prompt token's entry (prompt token i >= 1, scored by the logits at position i - 1)."""

    token_id: int
    """The prompt token."""
    logprob: float
    """Its log-probability given the prompt tokens before it."""
    rank: int
    """1 + the number of tokens strictly more likely than it (vLLM's rank: 1 = the most likely)."""
    top: TopLogprobs = field(default_factory=list)
    """The K most likely (token id, logprob) at this position, most likely first."""


def score(logits: torch.Tensor, targets: list[int], k: int) -> list[PromptLogprob]:
    """Entries of `targets` (one per row of `logits` [n, V], the token each row predicts) with the
    `k` most likely tokens of each row; float32 whatever the logits' dtype."""
    if not targets:
        return []
    lp = torch.log_softmax(logits.float(), dim=-1)
    index = torch.tensor(targets, dtype=torch.int64, device=lp.device).unsqueeze(1)
    chosen = lp.gather(1, index)  # [n, 1]
    ranks = (lp > chosen).sum(dim=1) + 1
    chosen_list, rank_list = chosen.squeeze(1).tolist(), ranks.tolist()
    if k > 0:
        values, ids = lp.topk(min(k, lp.shape[1]), dim=1)
        tops = [list(zip(row_ids, row_values)) for row_ids, row_values in zip(ids.tolist(), values.tolist())]
    else:
        tops = [[] for _ in targets]
    return [PromptLogprob(t, v, r, top) for t, v, r, top in zip(targets, chosen_list, rank_list, tops)]


@dataclass
class PromptLogprobsState:
    """One request's prompt logprobs, collected as its prefill chunks run."""

    prompt_token_ids: list[int]
    k: int
    """Alternatives per position (SamplingParams.prompt_logprobs)."""
    entries: list[PromptLogprob] = field(default_factory=list)
    """Entries of prompt tokens 1 .. len(entries), in order."""
    sent: bool = False
    """The entries went out (on the request's first output)."""

    @property
    def next_position(self) -> int:
        """The first position whose logits row is still needed (a recomputed prefix after a
        preemption is not scored twice)."""
        return len(self.entries)

    @property
    def end_position(self) -> int:
        """One past the last position scored: P - 1 (the last prompt position samples instead)."""
        return len(self.prompt_token_ids) - 1

    @property
    def done(self) -> bool:
        return len(self.entries) >= self.end_position

    def add(self, first_position: int, logits: torch.Tensor) -> None:
        """Score rows [first_position, first_position + len(logits)); they must continue the
        entries so far."""
        if first_position != len(self.entries):
            raise ValueError(f"prompt logprobs: rows start at position {first_position}, but positions "
                             f"0..{len(self.entries) - 1} are all that was scored (a skipped prompt chunk)")
        n = int(logits.shape[0])
        targets = self.prompt_token_ids[first_position + 1:first_position + 1 + n]
        self.entries += score(logits, targets, self.k)

    def take(self) -> list[PromptLogprob] | None:
        """The entries, once (None after they were sent)."""
        if self.sent:
            return None
        self.sent = True
        return self.entries
