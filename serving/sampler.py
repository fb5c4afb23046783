"""Choose the next token of every sequence in a batch from its last-position logits.

Pipeline per row (the order matters and follows vLLM/HF):

    raw logits ─┬─▶ log_softmax ──────────────────────────────▶ logprobs (raw model distribution)
                └─▶ grammar ▶ bad words ▶ min_tokens ▶ repetition ▶ presence/frequency
                       ├─ temperature == 0 ─▶ argmax
                       └─ ÷ temperature ▶ top-k ▶ top-p ▶ min-p ▶ softmax ▶ draw with own generator

A batch where every row is plain greedy (no penalties, masks) is one ``argmax`` call.

Structured output: a row whose request has a grammar (``SamplingState.grammar``, compiled by the
engine at admission) first gets the grammar's token bitmask (serving/structured_output.py): the
tokens it forbids next are -inf before anything else looks at the logits, as in vLLM. Rows without
one pay nothing, and a batch without any does no mask work at all. The sampler only reads the
matcher; the engine advances it with the chosen token.

One request never fails the batch: a row whose parameters the batched pipeline cannot take (a
token id outside the vocabulary, a NaN temperature: what admission refuses, checked again here
once per request in case a caller bypassed it) or whose logits leave nothing to sample (every
token masked) gets an error in ``SamplerOutput.errors`` instead of a token, and the other rows are
sampled as if it were not there. Should the batch still raise, every row is sampled alone and
only the rows that raise fail.

Random rows use the *exponential race*: ``argmax(p / E)`` with ``E ~ Exp(1)`` i.i.d. picks token
i with probability p_i (the Gumbel-max trick in another guise). Each row draws its ``E`` from its
request's own ``torch.Generator``, always V numbers per step, so a seeded request samples the same
tokens whatever else is in the batch and however the batch is ordered.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from trtforge.config.sampling import SamplingParams
from trtforge.serving.structured_output import apply_grammar_masks

if TYPE_CHECKING:
    from trtforge.serving.structured_output import RequestGrammar

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

    grammar: RequestGrammar | None = None
    """Structured output: the request's grammar matcher (the engine builds it at admission from
    ``params.guided_decoding_guide_type``; None for an unconstrained request). The sampler masks
    with it; the engine advances it with each token."""

    _generator: torch.Generator | None = field(default=None, init=False, repr=False)
    _checked: tuple[int, str | None] | None = field(default=None, init=False, repr=False)

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

    def row_error(self, vocab_size: int) -> str | None:
        """Why this request cannot be sampled from logits of ``vocab_size`` columns (None: it
        can). Its parameters are checked as admission does (validate, check_vocab), once per
        vocabulary size: the defence for a state built without going through the engine."""
        if self._checked is None or self._checked[0] != vocab_size:
            try:
                self.params.validate().check_vocab(vocab_size)
                error = None
                if self.params.is_guided and self.grammar is None:
                    error = ("structured output needs its grammar compiled: submit the request through "
                             "the engine (LLMEngine.add_request), which builds it at admission")
                elif self.grammar is not None and self.grammar.vocab_size not in (0, vocab_size):
                    error = (f"the request's grammar was compiled for a vocabulary of {self.grammar.vocab_size} "
                             f"tokens; the logits have {vocab_size}")
            except (ValueError, TypeError) as exc:
                error = str(exc)
            self._checked = (vocab_size, error)
        return self._checked[1]

    def extended(self, tokens: list[int]) -> SamplingState:
        """This request as the sampler sees it after `tokens` more outputs: what a speculative
        verification scores each draft position with, so penalties, bad words and min_tokens apply
        as if decoded one by one. Same parameters and seed; no grammar (a guided request does not
        speculate) and no generator of its own (the verifier draws from this state's)."""
        view = SamplingState(params=self.params, prompt_token_ids=self.prompt_token_ids,
                             output_token_ids=self.output_token_ids + list(tokens),
                             eos_token_ids=self.eos_token_ids, seed=self.seed)
        view._checked = self._checked
        return view

    @property
    def min_tokens_pending(self) -> bool:
        """True while fewer than ``min_tokens`` tokens have been generated."""
        return len(self.output_token_ids) < self.params.min_tokens

    @property
    def is_plain_greedy(self) -> bool:
        """Greedy with nothing that changes the logits: eligible for the batched argmax."""
        p = self.params
        return (p.is_greedy and not p.has_penalties and not p.bad_words_ids
                and not self.min_tokens_pending and self.grammar is None)


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

    errors: dict[int, str] = field(default_factory=dict)
    """{row: why it has no token}: rows that failed alone (token id -1, no logprobs); the caller
    fails their requests and keeps the other rows' tokens."""


class Sampler:
    """Stateless: all per-request state lives in :class:`SamplingState`."""

    def sample(self, logits: torch.Tensor, states: list[SamplingState]) -> SamplerOutput:
        """Pick one token per row of ``logits`` [N, V] (float32) for ``states`` [N]; a row that
        cannot be sampled gets an entry in ``errors`` instead (see the module docstring)."""
        if logits.dim() != 2 or logits.shape[0] != len(states):
            raise ValueError(
                f"logits must be [num_seqs, vocab] with one row per state; got shape "
                f"{tuple(logits.shape)} for {len(states)} states."
            )
        errors = {}
        for i, state in enumerate(states):
            error = state.row_error(logits.shape[1])
            if error is not None:
                errors[i] = f"the request's sampling parameters are invalid for this engine: {error}"
        if not errors:
            try:
                return _sample_batch(logits, states)
            except Exception:  # noqa: BLE001 - one row's failure must not fail the others: isolate
                return _merge(len(states), [_sample_alone(logits, states, i) for i in range(len(states))])
        rows = [i for i in range(len(states)) if i not in errors]
        parts: list[tuple[int, SamplerOutput | str]] = list(errors.items())
        if rows:
            sub = logits[torch.tensor(rows, device=logits.device)]
            try:
                out = _sample_batch(sub, [states[i] for i in rows])
                parts += [(i, _row(out, r)) for r, i in enumerate(rows)]
            except Exception:  # noqa: BLE001 - as above: sample each remaining row alone
                parts += [_sample_alone(sub, [states[i] for i in rows], r, i) for r, i in enumerate(rows)]
        return _merge(len(states), parts)


_Check = tuple[list[int], torch.Tensor, str]
"""(rows, a bool per row: was its token possible, why not): read back after the tokens, so that
the checks add no wait for the device."""


def _sample_batch(logits: torch.Tensor, states: list[SamplingState]) -> SamplerOutput:
    """The batched pipeline over rows whose parameters are valid; ``errors`` holds rows left
    with nothing to sample."""
    logits = logits.float()
    raw_logprobs = None
    if any(s.params.logprobs is not None for s in states):
        raw_logprobs = torch.log_softmax(logits, dim=-1)
    checks: list[_Check] = []
    if all(s.is_plain_greedy for s in states):
        token_ids = logits.argmax(dim=-1)  # the fast path: one kernel for the whole batch
    else:
        token_ids = _choose(process_logits(logits, states), states, checks)
    out = _make_output(token_ids, raw_logprobs, states)  # reads the tokens back: the device is done
    for rows, ok, why in checks:
        for i, fine in zip(rows, ok.tolist()):
            # A plain greedy row is not failed here: the fast path, without masks, never checks.
            if not fine and i not in out.errors and not states[i].is_plain_greedy:
                out.errors[i] = why
                out.token_ids[i], out.logprobs[i], out.top_logprobs[i] = -1, None, None
    return out


def _sample_alone(logits: torch.Tensor, states: list[SamplingState], r: int,
                  row: int | None = None) -> tuple[int, SamplerOutput | str]:
    """(row, its one-row output or its error): row ``r`` of ``logits`` sampled by itself."""
    row = r if row is None else row
    try:
        return row, _row(_sample_batch(logits[r:r + 1], [states[r]]), 0)
    except Exception as exc:  # noqa: BLE001 - this row fails, alone
        return row, f"sampling failed: {type(exc).__name__}: {exc}"


def _row(out: SamplerOutput, r: int) -> SamplerOutput | str:
    """Row ``r`` of a batch's output as a one-row output, or its error."""
    if r in out.errors:
        return out.errors[r]
    return SamplerOutput([out.token_ids[r]], [out.logprobs[r]], [out.top_logprobs[r]])


def _merge(n: int, parts: list[tuple[int, SamplerOutput | str]]) -> SamplerOutput:
    """One output of ``n`` rows from (row, one-row output or error) pairs."""
    merged = SamplerOutput([-1] * n, [None] * n, [None] * n)
    for i, part in parts:
        if isinstance(part, str):
            merged.errors[i] = part
        else:
            merged.token_ids[i], merged.logprobs[i] = part.token_ids[0], part.logprobs[0]
            merged.top_logprobs[i] = part.top_logprobs[0]
    return merged


def process_logits(logits: torch.Tensor, states: list[SamplingState]) -> torch.Tensor:
    """A copy of ``logits`` [N, V] with the grammars' masks, bad words, min_tokens and the
    penalties applied: what greedy rows take the argmax of and random rows go on to
    :func:`sampling_probs` with."""
    processed = logits.float().clone()
    apply_grammar_masks(processed, states)  # first: a forbidden token stays -inf whatever follows
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
        last = out[-1] if out else None
        for seq in state.params.bad_words_ids:
            prefix_len = len(seq) - 1
            if prefix_len == 0 or (
                seq[-2] == last and len(out) >= prefix_len and out[len(out) - prefix_len:] == seq[:-1]
            ):
                rows.append(i)
                cols.append(seq[-1])
    _fill(logits, rows, cols)


def _apply_min_tokens(logits: torch.Tensor, states: list[SamplingState]) -> None:
    """Forbid EOS and stop tokens until ``min_tokens`` tokens exist. On a row with a grammar, the
    grammar decides when EOS may come (it allows EOS only once it is complete, and then nothing
    else but what may continue it): only the stop tokens wait."""
    rows, cols = [], []
    vocab = logits.shape[1]
    for i, state in enumerate(states):
        if not state.min_tokens_pending:
            continue
        banned = set(state.params.stop_token_ids)
        # (an EOS id beyond the logits can never be drawn anyway)
        if not state.params.ignore_eos and state.grammar is None:
            banned.update(t for t in state.eos_token_ids if 0 <= t < vocab)
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


_NOTHING_TO_SAMPLE = ("no token can be sampled: every token of the vocabulary is masked (the structured "
                      "output grammar with bad_words_ids, bad_words_ids, or stop_token_ids / EOS while "
                      "min_tokens is pending) or the logits are not finite")


def _choose(logits: torch.Tensor, states: list[SamplingState], checks: list[_Check]) -> torch.Tensor:
    """Argmax for greedy rows, the exponential race for the others. Adds to ``checks`` whether
    each row's chosen token was possible at all (a finite logit, a probability > 0): O(rows)."""
    token_ids = torch.empty(len(states), dtype=torch.long, device=logits.device)
    greedy = [i for i, s in enumerate(states) if s.params.is_greedy]
    rand = [i for i, s in enumerate(states) if not s.params.is_greedy]
    if greedy:
        rows = torch.tensor(greedy, device=logits.device)
        chosen = logits[rows].argmax(dim=-1)
        token_ids[rows] = chosen
        checks.append((greedy, logits[rows, chosen] > _NEG_INF, _NOTHING_TO_SAMPLE))  # NaN: False
    if rand:
        rows = torch.tensor(rand, device=logits.device)
        probs = sampling_probs(logits[rows], [states[i].params for i in rand])
        race = torch.empty_like(probs)
        for r, i in enumerate(rand):
            race[r].exponential_(generator=states[i].generator_for(logits.device))
        # An exact 0 draw would make 0/0 = NaN win the argmax for a masked token.
        race.clamp_(min=torch.finfo(race.dtype).tiny)
        chosen = (probs / race).argmax(dim=-1)
        token_ids[rows] = chosen
        p = probs[torch.arange(len(rand), device=logits.device), chosen]
        checks.append((rand, torch.isfinite(p) & (p > 0), _NOTHING_TO_SAMPLE))
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


def token_logprobs(logits: torch.Tensor, token_ids: list[int], states: list[SamplingState]) -> SamplerOutput:
    """The output for tokens already chosen, one per row of raw ``logits`` [N, V]: their raw-model
    logprobs and top alternatives where ``states`` ask (speculative decoding's committed tokens)."""
    raw = None
    if any(s.params.logprobs is not None for s in states):
        raw = torch.log_softmax(logits.float(), dim=-1)
    return _make_output(torch.tensor(token_ids, dtype=torch.long, device=logits.device), raw, states)


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
