"""Choose the next token of every sequence in a batch from its last-position logits.

Pipeline per row (the order matters and follows vLLM/HF):

    raw logits ─┬─▶ log_softmax ──────────────────────────────▶ logprobs (raw model distribution)
                └─▶ bad words ▶ min_tokens ▶ repetition ▶ presence/frequency
                       ├─ temperature == 0 ─▶ argmax
                       └─ ÷ temperature ▶ top-k ▶ top-p ▶ min-p ▶ softmax ▶ draw with own generator

A batch where every row is plain greedy (no penalties, masks) is one ``argmax`` call.

Random rows use the *exponential race*: ``argmax(p / E)`` with ``E ~ Exp(1)`` i.i.d. picks token
i with probability p_i (the Gumbel-max trick in another guise). Each row draws its ``E`` from its
request's own ``torch.Generator``, always V numbers per step, so a seeded request samples the same
tokens whatever else is in the batch and however the batch is ordered.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import torch

from trtforge.config.sampling import SamplingParams

_NEG_INF = float("-inf")


@dataclass
class SamplingState:
    """Everything the sampler needs to know about one request, kept for its whole life."""

    params: SamplingParams
    """The request's validated sampling parameters (``bad_words_ids`` already resolved)."""

    prompt_token_ids: list[int]
    """Prompt tokens; the repetition penalty applies to them too."""

    output_token_ids: list[int] = field(default_factory=list)
    """Generated tokens so far. The sampler only reads it; the engine appends each new token."""

    eos_token_ids: tuple[int, ...] = ()
    """End-of-sequence ids of the model (HF generation configs may list several)."""

    seed: int | None = None
    """Seed of the request's generator: ``params.seed``, or a random one drawn at creation and
    kept here so a run can be reproduced."""

    _generator: torch.Generator | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.seed is None:
            self.seed = self.params.seed
        if self.seed is None:
            self.seed = random.SystemRandom().getrandbits(63)
        self.eos_token_ids = tuple(self.eos_token_ids)

    def generator_for(self, device: torch.device) -> torch.Generator:
        """The request's generator, created on first use on the device the logits live on."""
        if self._generator is None or self._generator.device != device:
            # A move between devices (rare) restarts the stream; within one device it never does.
            self._generator = torch.Generator(device=device)
            self._generator.manual_seed(self.seed)
        return self._generator

    def generator_state(self) -> str | None:
        """The generator's state (hex) if it has drawn numbers, for a KV handoff; else None."""
        if self._generator is None or self._generator.device.type != "cpu":
            return None  # a CUDA generator restarts from the seed on the other side
        return bytes(self._generator.get_state().tolist()).hex()

    def restore_generator(self, state: str | None) -> None:
        """Continue the random stream of another engine (`generator_state()` there)."""
        if state is None:
            return
        self._generator = torch.Generator(device="cpu")
        self._generator.set_state(torch.tensor(list(bytes.fromhex(state)), dtype=torch.uint8))

    @property
    def min_tokens_pending(self) -> bool:
        """True while fewer than ``min_tokens`` tokens have been generated."""
        return len(self.output_token_ids) < self.params.min_tokens

    @property
    def is_plain_greedy(self) -> bool:
        """Greedy with nothing that changes the logits: eligible for the batched argmax."""
        p = self.params
        return (p.is_greedy and not p.has_penalties and not p.bad_words_ids
                and not self.min_tokens_pending)


@dataclass
class SamplerOutput:
    """One entry per row of the logits, in batch order."""

    token_ids: list[int]
    """The chosen token of each row."""

    logprobs: list[float | None]
    """Raw-model log-probability of the chosen token; None where ``params.logprobs`` is None."""

    top_logprobs: list[list[tuple[int, float]] | None]
    """The ``params.logprobs`` most likely (token id, logprob) pairs, most likely first; [] for
    ``logprobs=0`` and None where logprobs are off."""


class Sampler:
    """Stateless: all per-request state lives in :class:`SamplingState`."""

    def sample(self, logits: torch.Tensor, states: list[SamplingState]) -> SamplerOutput:
        """Pick one token per row of ``logits`` [N, V] (float32) for ``states`` [N]."""
        if logits.dim() != 2 or logits.shape[0] != len(states):
            raise ValueError(
                f"logits must be [num_seqs, vocab] with one row per state; got shape "
                f"{tuple(logits.shape)} for {len(states)} states."
            )
        logits = logits.float()
        raw_logprobs = None
        if any(s.params.logprobs is not None for s in states):
            raw_logprobs = torch.log_softmax(logits, dim=-1)
        if all(s.is_plain_greedy for s in states):
            token_ids = logits.argmax(dim=-1)  # the fast path: one kernel for the whole batch
        else:
            token_ids = _choose(process_logits(logits, states), states)
        return _make_output(token_ids, raw_logprobs, states)


def process_logits(logits: torch.Tensor, states: list[SamplingState]) -> torch.Tensor:
    """A copy of ``logits`` [N, V] with bad words, min_tokens and the penalties applied: what
    greedy rows take the argmax of and random rows go on to :func:`sampling_probs` with."""
    processed = logits.float().clone()
    _apply_bad_words(processed, states)
    _apply_min_tokens(processed, states)
    _apply_penalties(processed, states)
    return processed


def _apply_bad_words(logits: torch.Tensor, states: list[SamplingState]) -> None:
    """Ban the last token of each bad sequence whose other tokens end the output so far.

    Like vLLM, only generated tokens count as the prefix: a bad phrase that would start in the
    prompt is not the model's doing. Single-token bad words are always banned.
    """
    rows, cols = [], []
    for i, state in enumerate(states):
        out = state.output_token_ids
        for seq in state.params.bad_words_ids:
            prefix_len = len(seq) - 1
            if prefix_len == 0 or (
                len(out) >= prefix_len and out[len(out) - prefix_len:] == seq[:-1]
            ):
                rows.append(i)
                cols.append(seq[-1])
    _fill(logits, rows, cols)


def _apply_min_tokens(logits: torch.Tensor, states: list[SamplingState]) -> None:
    """Forbid EOS and stop tokens until ``min_tokens`` tokens exist."""
    rows, cols = [], []
    for i, state in enumerate(states):
        if not state.min_tokens_pending:
            continue
        banned = set(state.params.stop_token_ids)
        if not state.params.ignore_eos:
            banned.update(state.eos_token_ids)
        rows += [i] * len(banned)
        cols += sorted(banned)
    _fill(logits, rows, cols)


def _fill(logits: torch.Tensor, rows: list[int], cols: list[int]) -> None:
    vocab = logits.shape[1]
    bad = [c for c in cols if not 0 <= c < vocab]
    if bad:
        raise ValueError(
            f"token id {bad[0]} is outside the model's vocabulary of {vocab}; check the request's "
            f"stop_token_ids / bad_words_ids and the tokenizer matching this engine."
        )
    if rows:
        logits[torch.tensor(rows), torch.tensor(cols)] = _NEG_INF


def _apply_penalties(logits: torch.Tensor, states: list[SamplingState]) -> None:
    """Repetition (HF: prompt + output) then presence/frequency (OpenAI: output only).

    Token ids are scattered into [n, V + 1] tensors; column V absorbs the padding of the ragged
    id lists and is dropped.
    """
    idx = [i for i, s in enumerate(states) if s.params.has_penalties]
    if not idx:
        return
    vocab, device = logits.shape[1], logits.device
    seen = _count(([*states[i].prompt_token_ids, *states[i].output_token_ids] for i in idx),
                  vocab, device) > 0
    counts = _count((states[i].output_token_ids for i in idx), vocab, device)
    params = [states[i].params for i in idx]
    rep = torch.tensor([p.repetition_penalty for p in params], device=device).unsqueeze(1)
    freq = torch.tensor([p.frequency_penalty for p in params], device=device).unsqueeze(1)
    pres = torch.tensor([p.presence_penalty for p in params], device=device).unsqueeze(1)
    rows = torch.tensor(idx, device=device)
    sub = logits[rows]
    sub = torch.where(seen, torch.where(sub > 0, sub / rep, sub * rep), sub)
    sub = sub - freq * counts - pres * (counts > 0).float()
    logits[rows] = sub


def _count(id_lists, vocab: int, device: torch.device) -> torch.Tensor:
    lists = [list(ids) for ids in id_lists]
    width = max(1, max(len(ids) for ids in lists))
    padded = torch.full((len(lists), width), vocab, dtype=torch.long)
    for r, ids in enumerate(lists):
        padded[r, : len(ids)] = torch.tensor(ids, dtype=torch.long)
    counts = torch.zeros(len(lists), vocab + 1, device=device)
    counts.scatter_add_(1, padded.to(device), torch.ones(padded.shape, device=device))
    return counts[:, :vocab]


def _choose(logits: torch.Tensor, states: list[SamplingState]) -> torch.Tensor:
    """Argmax for greedy rows, the exponential race for the others."""
    token_ids = torch.empty(len(states), dtype=torch.long, device=logits.device)
    greedy = [i for i, s in enumerate(states) if s.params.is_greedy]
    rand = [i for i, s in enumerate(states) if not s.params.is_greedy]
    if greedy:
        rows = torch.tensor(greedy, device=logits.device)
        token_ids[rows] = logits[rows].argmax(dim=-1)
    if rand:
        rows = torch.tensor(rand, device=logits.device)
        probs = sampling_probs(logits[rows], [states[i].params for i in rand])
        race = torch.empty_like(probs)
        for r, i in enumerate(rand):
            race[r].exponential_(generator=states[i].generator_for(logits.device))
        # An exact 0 draw would make 0/0 = NaN win the argmax for a masked token.
        race.clamp_(min=torch.finfo(race.dtype).tiny)
        token_ids[rows] = (probs / race).argmax(dim=-1)
    return token_ids


def sampling_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """The distribution random rows draw from: temperature, top-k, top-p, min-p (HF warper
    semantics), softmax. ``logits`` [n, V] are processed logits of rows with temperature > 0."""
    device, vocab = logits.device, logits.shape[1]
    temp = torch.tensor([p.temperature for p in params], device=device).unsqueeze(1)
    logits = logits / temp
    top_k = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
    top_p = [p.top_p for p in params]
    if any(k < vocab for k in top_k) or any(p < 1.0 for p in top_p):
        logits = _top_k_top_p(logits, torch.tensor(top_k, device=device),
                              torch.tensor(top_p, device=device))
    probs = logits.softmax(dim=-1)
    min_p = torch.tensor([p.min_p for p in params], device=device).unsqueeze(1)
    if bool((min_p > 0).any()):
        # Drop what is below min_p × the best token's probability, then renormalise.
        probs = probs.masked_fill(probs < min_p * probs.amax(dim=-1, keepdim=True), 0.0)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def _top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Mask tokens outside each row's top-k and nucleus with one ascending sort.

    top_k == V and top_p == 1 leave a row untouched. Ties with the k-th value are kept (as HF's
    ``TopKLogitsWarper``); the most likely token always survives top-p (as ``TopPLogitsWarper``).
    """
    vocab = logits.shape[1]
    sorted_logits, order = logits.sort(dim=-1)  # ascending: the best token is last
    kth_best = sorted_logits.gather(1, (vocab - top_k).unsqueeze(1))
    sorted_logits = sorted_logits.masked_fill(sorted_logits < kth_best, _NEG_INF)
    cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    outside = cumulative <= (1.0 - top_p).unsqueeze(1)
    outside[:, -1] = False
    sorted_logits = sorted_logits.masked_fill(outside, _NEG_INF)
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def _make_output(token_ids: torch.Tensor, raw_logprobs: torch.Tensor | None,
                 states: list[SamplingState]) -> SamplerOutput:
    ids = token_ids.tolist()
    n = len(states)
    if raw_logprobs is None:
        return SamplerOutput(ids, [None] * n, [None] * n)
    chosen = raw_logprobs.gather(1, token_ids.view(-1, 1)).squeeze(1).tolist()
    max_top = max(s.params.logprobs or 0 for s in states)
    top_vals = top_ids = None
    if max_top > 0:
        vals, idx = raw_logprobs.topk(min(max_top, raw_logprobs.shape[1]), dim=-1)
        top_vals, top_ids = vals.tolist(), idx.tolist()
    logprobs: list[float | None] = []
    tops: list[list[tuple[int, float]] | None] = []
    for i, state in enumerate(states):
        want = state.params.logprobs
        if want is None:
            logprobs.append(None)
            tops.append(None)
            continue
        logprobs.append(chosen[i])
        tops.append(list(zip(top_ids[i][:want], top_vals[i][:want])) if want else [])
    return SamplerOutput(ids, logprobs, tops)
