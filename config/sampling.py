"""Per-request sampling parameters.

One dataclass, built once at the edge (CLI, Triton adapter, OpenAI endpoint), validated, and
passed down whole to the sampler, the detokenizer and the stop checker. The defaults describe
greedy decoding of at most 16 tokens, which makes results exactly comparable with HF
``generate(do_sample=False)``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Protocol

_MAX_SEED = (1 << 64) - 1  # Triton's `seed` input is UINT64; torch generators accept the range.


class _Encoder(Protocol):
    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...


@dataclass
class SamplingParams:
    """How to choose each next token and when to stop."""

    temperature: float = 0.0
    """Softmax temperature. 0 means greedy (argmax); values > 0 sample from softmax(logits / t)."""

    top_k: int = 0
    """Keep only the k most likely tokens before sampling. 0 or -1 disables the filter."""

    top_p: float = 1.0
    """Nucleus sampling: keep the smallest set of tokens whose probability sums to >= top_p.
    1.0 disables the filter."""

    min_p: float = 0.0
    """Drop tokens whose probability is below min_p times the most likely token's. 0 disables."""

    seed: int | None = None
    """Seed of this request's own random generator, so a seeded request samples the same tokens
    whatever else shares its batch. None draws a fresh random seed."""

    repetition_penalty: float = 1.0
    """HF/CTRL penalty on tokens already in the prompt or output: positive logits are divided by
    it, negative ones multiplied. 1.0 disables; > 1 discourages repetition."""

    presence_penalty: float = 0.0
    """OpenAI presence penalty: subtracted once from the logit of every token already generated.
    Range [-2, 2]; 0 disables."""

    frequency_penalty: float = 0.0
    """OpenAI frequency penalty: subtracted from a token's logit once per time it was generated.
    Range [-2, 2]; 0 disables."""

    min_tokens: int = 0
    """Generate at least this many tokens before EOS or a stop token/string may end the request."""

    max_tokens: int = 16
    """Generate at most this many tokens (finish reason "length"). A request whose prompt +
    max_tokens exceed the engine's max_seq_len is refused, never shortened."""

    timeout_s: float | None = None
    """Deadline, in seconds from arrival: a request still unfinished then is aborted, waiting or
    running (finish reason "timeout", its KV blocks freed). None: no deadline."""

    stop_token_ids: list[int] = field(default_factory=list)
    """Token ids that end the request (finish reason "stop"), in addition to EOS. The stop
    token itself is not turned into text when it is a special token."""

    stop: list[str] = field(default_factory=list)
    """Stop strings, matched across token boundaries. The output is cut before the match, which
    is not returned unless ``include_stop_str_in_output``."""

    bad_words: list[str] = field(default_factory=list)
    """Words or phrases that must never be generated. Turned into token ids by
    :meth:`resolve_bad_words` (both with and without a leading space)."""

    bad_words_ids: list[list[int]] = field(default_factory=list)
    """Token sequences that must never be generated: filled from ``bad_words`` by
    :meth:`resolve_bad_words`, or given directly (e.g. by a TensorRT-LLM-style client)."""

    ignore_eos: bool = False
    """Keep generating past EOS (benchmarks use this for fixed output lengths)."""

    logprobs: int | None = None
    """None: no logprobs. 0: the log-probability of each chosen token. n > 0: also the n most
    likely tokens with theirs. Values are log_softmax of the model's raw logits (before
    penalties, temperature and filtering), as vLLM returns by default."""

    include_stop_str_in_output: bool = False
    """Return the matched stop string at the end of the output instead of cutting it off."""

    skip_special_tokens: bool = True
    """Leave special tokens (EOS, padding, chat markers) out of the output text."""

    @property
    def is_greedy(self) -> bool:
        """True when the next token is the argmax of the (processed) logits."""
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        """True when any of the repetition/presence/frequency penalties changes the logits."""
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )

    def validate(self) -> "SamplingParams":
        """Raise ValueError naming the first bad field, its value and the accepted range."""
        for name, ok, expected in _RULES:
            value = getattr(self, name)
            try:
                valid = bool(ok(value, self))
            except TypeError:  # e.g. a string where a number belongs
                valid = False
            if valid and isinstance(value, float) and math.isnan(value):
                valid = False
            if not valid:
                expected = expected.format(max_tokens=self.max_tokens, max_seed=_MAX_SEED)
                raise ValueError(
                    f"SamplingParams.{name}={value!r} is invalid: it must be {expected}."
                )
        return self

    def resolve_bad_words(self, tokenizer: _Encoder) -> "SamplingParams":
        """Add the token ids of every ``bad_words`` entry to ``bad_words_ids``.

        A word is encoded both as written and with a leading space, because BPE tokenizers give
        " word" (mid-sentence) and "word" (after a newline) different ids. Idempotent.
        """
        seen = {tuple(seq) for seq in self.bad_words_ids}
        for word in self.bad_words:
            for variant in (word.lstrip(), " " + word.lstrip()):
                ids = tuple(tokenizer.encode(variant, add_special_tokens=False))
                if ids and ids not in seen:
                    seen.add(ids)
                    self.bad_words_ids.append(list(ids))
        return self


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _int_ids(ids: object) -> bool:
    return isinstance(ids, (list, tuple)) and all(_is_int(t) and t >= 0 for t in ids)


def _nonempty_strs(items: object) -> bool:
    # A bare string would iterate as characters: demand a list so stop="###" is caught.
    return isinstance(items, (list, tuple)) and all(isinstance(s, str) and s for s in items)


# (field, predicate(value, params), what is accepted) — checked in this order by validate().
_RULES = [
    ("temperature", lambda v, p: v >= 0.0, ">= 0 (0 = greedy)"),
    ("top_k", lambda v, p: _is_int(v) and v >= -1, "an integer >= 1, or 0/-1 to disable"),
    ("top_p", lambda v, p: 0.0 < v <= 1.0, "in (0, 1] (1 = disabled)"),
    ("min_p", lambda v, p: 0.0 <= v <= 1.0, "in [0, 1] (0 = disabled)"),
    ("seed", lambda v, p: v is None or (_is_int(v) and 0 <= v <= _MAX_SEED),
     "None or an integer in [0, {max_seed}]"),
    ("repetition_penalty", lambda v, p: v > 0.0, "> 0 (1 = disabled)"),
    ("presence_penalty", lambda v, p: -2.0 <= v <= 2.0, "in [-2, 2] (0 = disabled)"),
    ("frequency_penalty", lambda v, p: -2.0 <= v <= 2.0, "in [-2, 2] (0 = disabled)"),
    ("max_tokens", lambda v, p: _is_int(v) and v >= 1, "an integer >= 1"),
    ("timeout_s", lambda v, p: v is None or (not isinstance(v, bool) and 0 < v < math.inf),
     "None (no deadline) or a finite number of seconds > 0"),
    ("min_tokens", lambda v, p: _is_int(v) and 0 <= v <= p.max_tokens,
     "an integer in [0, max_tokens={max_tokens}]"),
    ("logprobs", lambda v, p: v is None or (_is_int(v) and v >= 0),
     "None (off), 0 (chosen token only) or n > 0 (also the top n)"),
    ("stop_token_ids", lambda v, p: _int_ids(v), "a list of non-negative token ids"),
    ("stop", lambda v, p: _nonempty_strs(v), "a list of non-empty strings"),
    ("bad_words", lambda v, p: _nonempty_strs(v), "a list of non-empty strings"),
    ("bad_words_ids",
     lambda v, p: isinstance(v, (list, tuple)) and all(seq and _int_ids(seq) for seq in v),
     "a list of non-empty lists of non-negative token ids"),
]
