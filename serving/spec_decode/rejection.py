"""Verification of one request's drafts from the target's logits at every verified position.

Row j of `logits` [k + 1, V] is the target's next-token distribution after the committed tokens
plus drafts d_1..d_j (row 0: after the committed tokens alone). Each row is processed as the
sampler would process it one token at a time — penalties, bad words and min_tokens see the drafts
before it as outputs (`SamplingState.extended`) — then:

* greedy: t_j = argmax(row j); accept d_{j+1} while it equals t_j; commit the accepted drafts and
  the first t_j that differs (or t_k after all of them): token for token what one-by-one greedy
  decoding produces.
* sampling (temperature, top-k/top-p/min-p): standard rejection sampling with the proposer's
  distribution a point mass on d (an n-gram proposer is deterministic): accept d with probability
  p_j(d); on a reject draw from the residual (p_j - δ_d)+ normalised, i.e. p_j without d, and
  stop; after k acceptances draw the bonus token from p_k. P(commit t) = p_j(t) for every t, so the
  committed tokens are distributed exactly as without speculation. The uniform draws and the
  residual draw use the request's own generator (its seed).

Logprobs are the target's raw log_softmax at each committed position, as without speculation.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from trtforge.serving.sampler import SamplingState, process_logits, sampling_probs, token_logprobs

_NEG_INF = float("-inf")


@dataclass
class Verified:
    """What one verification commits."""

    token_ids: list[int]
    """The accepted drafts followed by the one token the target chose itself (1..k+1 tokens)."""
    num_accepted: int
    """How many drafts were accepted (len(token_ids) - 1)."""
    logprobs: list[float | None]
    """Raw-model logprob of each committed token (None entries where logprobs are off)."""
    top_logprobs: list[list[tuple[int, float]] | None]


def verify(logits: torch.Tensor, state: SamplingState, drafts: list[int]) -> Verified:
    """Accept a prefix of `drafts` and add one token, from the target's logits [len(drafts) + 1, V].
    Raises ValueError for a request that cannot be sampled (its own failure, not the batch's)."""
    k = len(drafts)
    if logits.dim() != 2 or logits.shape[0] != k + 1:
        raise ValueError(f"verification needs {k + 1} rows of logits for {k} drafts, got {tuple(logits.shape)}")
    error = state.row_error(logits.shape[1])
    if error is not None:
        raise ValueError(f"the request's sampling parameters are invalid for this engine: {error}")
    if state.grammar is not None:
        raise ValueError("a request with a grammar (structured output) cannot be verified speculatively")
    logits = logits.float()
    if state.is_plain_greedy:  # nothing changes the logits: one argmax over all rows
        committed = _accept_greedy(logits.argmax(dim=-1).tolist(), drafts)
    else:
        views = [state.extended(drafts[:j]) for j in range(k + 1)]
        processed = process_logits(logits, views)
        if state.params.is_greedy:
            committed = _accept_greedy(processed.argmax(dim=-1).tolist(), drafts)
            last = len(committed) - 1
            if not processed[last, committed[-1]] > _NEG_INF:
                raise ValueError(_NOTHING)
        else:
            probs = sampling_probs(processed, [state.params] * (k + 1))
            committed = _accept_sampled(probs, drafts, state.generator_for(logits.device))
    n = len(committed)
    if state.params.logprobs is None:
        return Verified(committed, n - 1, [None] * n, [None] * n)
    out = token_logprobs(logits[:n], committed, [state] * n)
    return Verified(committed, n - 1, out.logprobs, out.top_logprobs)


def _accept_greedy(targets: list[int], drafts: list[int]) -> list[int]:
    """Drafts up to the first that differs from the target's choice, then the target's choice."""
    for j, d in enumerate(drafts):
        if targets[j] != d:
            return drafts[:j] + [targets[j]]
    return drafts + [targets[len(drafts)]]


def _accept_sampled(probs: torch.Tensor, drafts: list[int], gen: torch.Generator) -> list[int]:
    device = probs.device
    uniforms = torch.rand(len(drafts), generator=gen, device=device).tolist() if drafts else []
    p_drafts = probs[torch.arange(len(drafts), device=device), torch.tensor(drafts, device=device)].tolist() \
        if drafts else []
    for j, (d, u, p) in enumerate(zip(drafts, uniforms, p_drafts)):
        if u < p:
            continue
        residual = probs[j].clone()
        residual[d] = 0.0  # (p - point mass at d)+
        return drafts[:j] + [_draw(residual, gen)]
    return drafts + [_draw(probs[len(drafts)], gen)]


def _draw(weights: torch.Tensor, gen: torch.Generator) -> int:
    """A token with probability weights / weights.sum() (the sampler's exponential race)."""
    race = torch.empty_like(weights).exponential_(generator=gen).clamp_(min=torch.finfo(weights.dtype).tiny)
    token = int((weights / race).argmax())
    if not (torch.isfinite(weights[token]) and weights[token] > 0):
        raise ValueError(_NOTHING)
    return token


_NOTHING = ("no token can be sampled: every token of the vocabulary is masked (bad_words_ids, or "
            "stop_token_ids / EOS while min_tokens is pending) or the logits are not finite")
