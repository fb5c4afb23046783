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
_FLOAT32_MAX = 3.4028234663852886e38  # the sampler computes in float32: larger values become inf there
_GREEDY_BELOW = 1e-5
"""Temperatures below this are greedy, as in vLLM: logits / 1e-6 can overflow float32 into inf - inf."""

# Bounds on what one request may ask for: each keeps the per-step work of a request (the sampler's
# masks, the stop-string scan on the engine thread) and its memory small, whatever a client sends.
MAX_STOP_STRINGS = 64
"""Most stop strings of one request (OpenAI allows 4, TGI's default is 4; vLLM sets no limit)."""
MAX_STOP_STRING_CHARS = 1024
"""Longest stop string, in characters: also the most text a stream holds back at once."""
MAX_STOP_TOKEN_IDS = 1024
"""Most stop token ids of one request (end_id included)."""
MAX_BAD_WORDS = 256
"""Most `bad_words` entries; each becomes up to two token sequences."""
MAX_BAD_WORD_CHARS = 128
"""Longest `bad_words` entry, in characters."""
MAX_BAD_WORDS_IDS = 512
"""Most `bad_words_ids` sequences given directly; resolving `bad_words` adds up to 2 per entry."""
MAX_BAD_WORD_TOKENS = 1024
"""Longest `bad_words_ids` sequence, in tokens: any bad word resolves within it (a 128-character
word and its leading space are at most 516 byte-level tokens)."""
MAX_LOGPROBS = 20
"""Most alternatives `logprobs` may ask for per token (vLLM's default max_logprobs, OpenAI's
top_logprobs limit)."""
MAX_CACHE_SALT_CHARS = 512
"""Longest `cache_salt`, in characters: room for a tenant's salt and a client's own (it is hashed
once per request, into the prefix cache's root key)."""
GUIDE_TYPES = ("json", "json_schema", "regex", "ebnf_grammar", "structural_tag")
"""Kinds of structured output (TensorRT-LLM's `guided_decoding_guide_type` values): `json` any JSON
object (no guide), `json_schema` a JSON Schema, `regex` a regular expression, `ebnf_grammar` an EBNF
grammar (GBNF style, rule `root`), `structural_tag` xgrammar's structural-tag JSON."""
MAX_GUIDE_CHARS = 64 * 1024
"""Longest `guided_decoding_guide`, in characters: grammars are compiled at admission, on the engine
thread, and cached; the cap bounds that work and the cache's memory whatever a client sends."""


class _Encoder(Protocol):
    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...


@dataclass
class SamplingParams:
    """How to choose each next token and when to stop."""

    temperature: float = 0.0
    """Softmax temperature. 0 means greedy (argmax); values > 0 sample from softmax(logits / t).
    Values below 1e-5 are greedy too (as in vLLM); it must be finite."""

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
    it, negative ones multiplied. 1.0 disables; > 1 discourages repetition. Range [0.01, 100]."""

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
    token itself is not turned into text when it is a special token. At most 1024 ids, each in the
    engine's vocabulary (:meth:`check_vocab`)."""

    stop: list[str] = field(default_factory=list)
    """Stop strings, matched across token boundaries. The output is cut before the match, which
    is not returned unless ``include_stop_str_in_output``. At most 64, of at most 1024 characters."""

    bad_words: list[str] = field(default_factory=list)
    """Words or phrases that must never be generated. Turned into token ids by
    :meth:`resolve_bad_words` (both with and without a leading space). At most 256, of at most 128
    characters."""

    bad_words_ids: list[list[int]] = field(default_factory=list)
    """Token sequences that must never be generated: filled from ``bad_words`` by
    :meth:`resolve_bad_words`, or given directly (e.g. by a TensorRT-LLM-style client). At most 512
    given (plus those resolved), of 1 to 1024 ids in the engine's vocabulary."""

    ignore_eos: bool = False
    """Keep generating past EOS (benchmarks use this for fixed output lengths)."""

    logprobs: int | None = None
    """None: no logprobs. 0: the log-probability of each chosen token. n > 0: also the n most
    likely tokens with theirs (n <= 20). Values are log_softmax of the model's raw logits (before
    penalties, temperature and filtering), as vLLM returns by default."""

    prompt_logprobs: int | None = None
    """None: no prompt logprobs. K in 0..20 (vLLM's `prompt_logprobs`): for every prompt token
    after the first, its log-probability given the tokens before it, its rank, and the K most
    likely tokens at that position (log_softmax of the raw logits, float32:
    serving/prompt_logprobs.py). Such a request computes its whole prompt: it does not read the
    prefix cache (as vLLM), so its num_cached_tokens is 0."""

    include_stop_str_in_output: bool = False
    """Return the matched stop string at the end of the output instead of cutting it off."""

    skip_special_tokens: bool = True
    """Leave special tokens (EOS, padding, chat markers) out of the output text."""

    cache_salt: str | None = None
    """Prefix-cache namespace (vLLM's field): a request reuses cached prompt blocks only of
    requests with the same salt, so requests with different salts never share a block (nor learn
    from time-to-first-token that the other sent a prefix). None: the namespace of unsalted
    requests. A non-empty string of at most 512 characters."""

    guided_decoding_guide_type: str | None = None
    """Structured output (TensorRT-LLM's name): the kind of constraint every generated token must
    keep, one of json, json_schema, regex, ebnf_grammar, structural_tag; None: unconstrained. The
    engine compiles it at admission (xgrammar) and the sampler masks what the grammar forbids;
    the request ends (finish reason "stop") when the grammar is complete and the model ends it."""

    guided_decoding_guide: str | None = None
    """The constraint's text: the JSON Schema (json_schema), the regular expression (regex), the
    grammar (ebnf_grammar) or the structural tag (structural_tag); none for json. At most 64 KiB."""

    speculative: bool = True
    """Let an engine that speculates (RuntimeConfig.speculative_config, or engine.json's default)
    propose and verify draft tokens for this request; false: one token per step for it (the output
    is the same for greedy requests either way, and equally distributed for sampled ones). The
    Triton input `speculative` and the OpenAI extra body field `speculative` set it."""

    @property
    def is_guided(self) -> bool:
        """True when a grammar constrains the output (structured output)."""
        return self.guided_decoding_guide_type is not None

    @property
    def is_greedy(self) -> bool:
        """True when the next token is the argmax of the (processed) logits."""
        return self.temperature < _GREEDY_BELOW

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
                    f"SamplingParams.{name}={_short_repr(value)} is invalid: it must be {expected}."
                )
        _check_guide(self.guided_decoding_guide_type, self.guided_decoding_guide)
        return self

    def check_vocab(self, vocab_size: int) -> "SamplingParams":
        """Raise ValueError naming the first token id outside the engine's vocabulary
        (0..vocab_size - 1) in ``stop_token_ids`` (a Triton request's ``end_id``) or
        ``bad_words_ids``. The engine calls it at admission, after :meth:`validate`."""
        for t in self.stop_token_ids:
            if not 0 <= t < vocab_size:
                raise ValueError(
                    f"SamplingParams.stop_token_ids contains {t}, outside this model's vocabulary of "
                    f"{vocab_size} tokens: a stop token id (or end_id) must be in 0..{vocab_size - 1}."
                )
        for seq in self.bad_words_ids:
            bad = [t for t in seq if not 0 <= t < vocab_size]
            if bad:
                raise ValueError(
                    f"SamplingParams.bad_words_ids contains {_short_repr(seq)} with token id {bad[0]}, "
                    f"outside this model's vocabulary of {vocab_size} tokens: ids must be in "
                    f"0..{vocab_size - 1}."
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


def _short_repr(value: object, limit: int = 200) -> str:
    """repr() for an error message, cut short for a hostile value (a 1 MB stop string)."""
    text = repr(value)
    if len(text) <= limit:
        return text
    size = f", {len(value)} items" if isinstance(value, (list, tuple)) else ""
    return f"{text[:limit]}... ({len(text)} characters{size})"


def _check_guide(kind: str | None, guide: str | None) -> None:
    """The pair (type, guide) must make sense together: a guide needs its type, and every type but
    json needs a non-empty guide (json takes none, or an empty one, as TensorRT-LLM clients send)."""
    if kind is None:
        if guide is not None:
            raise ValueError(
                f"SamplingParams.guided_decoding_guide={_short_repr(guide, 80)} is given without "
                f"guided_decoding_guide_type: say what it is, one of {', '.join(GUIDE_TYPES)}.")
        return
    if kind == "json":
        if guide:
            raise ValueError(
                "SamplingParams.guided_decoding_guide is set for guided_decoding_guide_type='json' "
                "(any JSON object), which takes no guide: send type 'json_schema' to constrain the "
                "output to that schema, or leave the guide out.")
    elif not guide:
        raise ValueError(
            f"SamplingParams.guided_decoding_guide is missing: guided_decoding_guide_type={kind!r} needs "
            "the constraint's text (the JSON Schema, regular expression, EBNF grammar or structural tag).")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _int_ids(ids: object, most: int) -> bool:
    return (isinstance(ids, (list, tuple)) and len(ids) <= most
            and all(_is_int(t) and t >= 0 for t in ids))


def _nonempty_strs(items: object, most: int, longest: int) -> bool:
    # A bare string would iterate as characters: demand a list so stop="###" is caught.
    return (isinstance(items, (list, tuple)) and len(items) <= most
            and all(isinstance(s, str) and 0 < len(s) <= longest for s in items))


def _bad_words_ids(v: object, p: SamplingParams) -> bool:
    # Checked again after resolve_bad_words (the sampler does): room for what bad_words resolved to.
    return (isinstance(v, (list, tuple)) and len(v) <= MAX_BAD_WORDS_IDS + 2 * len(p.bad_words)
            and all(seq and _int_ids(seq, MAX_BAD_WORD_TOKENS) for seq in v))


def _is_bool(v: object) -> bool:
    return isinstance(v, bool)


# (field, predicate(value, params), what is accepted) — checked in this order by validate().
_RULES = [
    ("temperature", lambda v, p: 0.0 <= v <= _FLOAT32_MAX, "a finite number >= 0 (0 = greedy)"),
    ("top_k", lambda v, p: _is_int(v) and v >= -1, "an integer >= 1, or 0/-1 to disable"),
    ("top_p", lambda v, p: 0.0 < v <= 1.0, "in (0, 1] (1 = disabled)"),
    ("min_p", lambda v, p: 0.0 <= v <= 1.0, "in [0, 1] (0 = disabled)"),
    ("seed", lambda v, p: v is None or (_is_int(v) and 0 <= v <= _MAX_SEED),
     "None or an integer in [0, {max_seed}]"),
    ("repetition_penalty", lambda v, p: 0.01 <= v <= 100.0, "in [0.01, 100] (1 = disabled)"),
    ("presence_penalty", lambda v, p: -2.0 <= v <= 2.0, "in [-2, 2] (0 = disabled)"),
    ("frequency_penalty", lambda v, p: -2.0 <= v <= 2.0, "in [-2, 2] (0 = disabled)"),
    ("max_tokens", lambda v, p: _is_int(v) and v >= 1, "an integer >= 1"),
    ("timeout_s", lambda v, p: v is None or (not isinstance(v, bool) and 0 < v < math.inf),
     "None (no deadline) or a finite number of seconds > 0"),
    ("min_tokens", lambda v, p: _is_int(v) and 0 <= v <= p.max_tokens,
     "an integer in [0, max_tokens={max_tokens}]"),
    ("logprobs", lambda v, p: v is None or (_is_int(v) and 0 <= v <= MAX_LOGPROBS),
     f"None (off), 0 (chosen token only) or n in 1..{MAX_LOGPROBS} (also the top n)"),
    ("prompt_logprobs", lambda v, p: v is None or (_is_int(v) and 0 <= v <= MAX_LOGPROBS),
     f"None (off) or K in 0..{MAX_LOGPROBS} (each prompt token's logprob and the top K)"),
    ("stop_token_ids", lambda v, p: _int_ids(v, MAX_STOP_TOKEN_IDS),
     f"a list of at most {MAX_STOP_TOKEN_IDS} non-negative token ids"),
    ("stop", lambda v, p: _nonempty_strs(v, MAX_STOP_STRINGS, MAX_STOP_STRING_CHARS),
     f"a list of at most {MAX_STOP_STRINGS} non-empty strings of at most {MAX_STOP_STRING_CHARS} "
     "characters each"),
    ("bad_words", lambda v, p: _nonempty_strs(v, MAX_BAD_WORDS, MAX_BAD_WORD_CHARS),
     f"a list of at most {MAX_BAD_WORDS} non-empty strings of at most {MAX_BAD_WORD_CHARS} "
     "characters each"),
    ("bad_words_ids", _bad_words_ids,
     f"a list of at most {MAX_BAD_WORDS_IDS} (plus 2 per bad_words entry) lists of 1 to "
     f"{MAX_BAD_WORD_TOKENS} non-negative token ids"),
    ("ignore_eos", lambda v, p: _is_bool(v), "True or False"),
    ("include_stop_str_in_output", lambda v, p: _is_bool(v), "True or False"),
    ("skip_special_tokens", lambda v, p: _is_bool(v), "True or False"),
    ("guided_decoding_guide_type", lambda v, p: v is None or v in GUIDE_TYPES,
     f"None (unconstrained) or one of {', '.join(GUIDE_TYPES)}"),
    ("guided_decoding_guide", lambda v, p: v is None or (isinstance(v, str) and len(v) <= MAX_GUIDE_CHARS),
     f"None or a string of at most {MAX_GUIDE_CHARS} characters (64 KiB)"),
    ("cache_salt", lambda v, p: v is None or (isinstance(v, str) and 0 < len(v) <= MAX_CACHE_SALT_CHARS),
     f"None or a non-empty string of at most {MAX_CACHE_SALT_CHARS} characters"),
]
