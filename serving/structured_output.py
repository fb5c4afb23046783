"""Structured output: a request's grammar (xgrammar), applied by the sampler as a token bitmask.

    admission ──▶ GrammarCompiler.matcher(params) ── compile (LRU-cached by (type, guide)) ──▶
                  RequestGrammar (one xgrammar GrammarMatcher per request, in its SamplingState)
    each step ──▶ apply_grammar_masks: for the constrained rows only, fill the bitmask of the
                  tokens the grammar allows next and set the others' logits to -inf, before bad
                  words, min_tokens, penalties and the choice (greedy and random rows alike)
    update    ──▶ RequestGrammar.accept(token): the matcher advances; once it has terminated
                  (the grammar is complete and the model chose EOS) the request ends with "stop"

Why these choices:

* Compiled once per distinct (type, guide): the compiled grammar holds the per-token tables for
  the whole vocabulary, which is the expensive part (milliseconds for a small schema and a small
  vocabulary, more for a 150k vocabulary). A bounded LRU (`GRAMMAR_CACHE_SIZE`) keeps repeated
  schemas free and the memory bounded; xgrammar's own cache is off, as it has no entry bound.
* Compiled at admission, in `LLMEngine._admit`: a grammar that cannot compile is a ValueError for
  that request alone (the Triton model answers "bad request", the OpenAI endpoint 400), never a
  failed batch; compiling is never part of a step.
* The matcher is kept through preemption: a preempted request keeps its output tokens (recompute
  rebuilds their KV, it does not sample them again), so the matcher's state stays the state of
  those tokens. A KV handoff's first token is replayed into a fresh matcher (`replay`).
* The grammar decides when EOS is allowed: the matcher's stop tokens are the model's EOS ids, which
  it allows only where the grammar may end, and `min_tokens` does not hold EOS back on a
  constrained row (it would leave nothing to sample once the grammar is complete).
* Rows without a grammar pay nothing: the sampler calls in here only when a row of the batch has
  one, and xgrammar is imported only then.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

import torch

from trtforge.config.sampling import SamplingParams

if TYPE_CHECKING:
    from trtforge.serving.sampler import SamplingState

GRAMMAR_CACHE_SIZE = 128
"""Compiled grammars kept (least recently used dropped first)."""

_XGRAMMAR_LOCATION = re.compile(r"^\[[0-9:]+\] \S+?:\d+: (Check failed: \(.*?\) is false: )?")
"""xgrammar's messages start with a time, its C++ source file and line: not the client's concern."""


def _clean(exc: BaseException) -> str:
    text = str(exc).strip()
    return _XGRAMMAR_LOCATION.sub("", text).strip() or type(exc).__name__


_LENGTH_BOUNDED_CHAR = r'[^\"\\\r\n]'
_JSON_STRING_CHAR = r'[^\0-\x1f\"\\]'


def _strict_json_strings(ebnf: str) -> str:
    """The grammar of a JSON Schema with strings that are JSON: xgrammar 0.2.9 lets a string with
    minLength / maxLength hold raw control characters (its class excludes only the quote, the
    backslash, CR and LF), which no strict JSON parser accepts; its unbounded strings already
    exclude U+0000-U+001F. A no-op once xgrammar emits the right class."""
    return ebnf.replace(_LENGTH_BOUNDED_CHAR, _JSON_STRING_CHAR)


class RequestGrammar:
    """One request's position in its grammar: an xgrammar GrammarMatcher."""

    def __init__(self, matcher: Any, guide_type: str) -> None:
        self.matcher = matcher
        self.guide_type = guide_type
        self.vocab_size: int = 0
        """Columns the bitmask covers (the model's vocabulary, padding included); set by the compiler."""

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the tokens allowed next into row `row` of `bitmask` (int32 [N, ceil(V/32)])."""
        self.matcher.fill_next_token_bitmask(bitmask, row)

    def accept(self, token_id: int) -> None:
        """Advance over the token just sampled; ValueError when the grammar forbids it (the token
        did not come through the mask: this request fails, alone)."""
        if self.matcher.is_terminated():
            raise ValueError(f"token {token_id} came after the {self.guide_type} grammar had ended")
        if not self.matcher.accept_token(int(token_id)):
            raise ValueError(f"token {token_id} is not allowed by the request's {self.guide_type} "
                             "grammar at this point (structured output)")

    def replay(self, token_ids: list[int]) -> None:
        """Advance over tokens generated elsewhere (a KV handoff's first token)."""
        for token_id in token_ids:
            self.accept(token_id)

    @property
    def is_terminated(self) -> bool:
        """The grammar is complete and ended (its stop token accepted): the request is done."""
        return bool(self.matcher.is_terminated())


class GrammarCompiler:
    """Compiles the grammars of one engine's tokenizer; built at the first constrained request."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: tuple[int, ...],
                 cache_size: int = GRAMMAR_CACHE_SIZE, max_threads: int = 1) -> None:
        """`tokenizer`: a transformers tokenizer (a PlainTokenizer's `hf`); `vocab_size`: the
        model's, padding included (the logits' width); `eos_token_ids`: the model's EOS ids, the
        only tokens that may end a grammar."""
        import xgrammar as xgr  # only engines that serve structured output import it

        self._xgr = xgr
        hf = getattr(tokenizer, "hf", tokenizer)  # models.tokenizer.PlainTokenizer wraps one
        eos = [int(t) for t in eos_token_ids if 0 <= int(t) < vocab_size]
        self.info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=vocab_size, stop_token_ids=eos or None)
        self.vocab_size = vocab_size
        self.eos_token_ids = tuple(eos)
        self._compiler = xgr.GrammarCompiler(self.info, max_threads=max_threads, cache_enabled=False)
        self._cache: OrderedDict[tuple[str, str], Any] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    def compile(self, guide_type: str, guide: str | None) -> Any:
        """The CompiledGrammar of (type, guide), from the cache when it was compiled before;
        ValueError saying what is wrong when it cannot be compiled."""
        key = (guide_type, guide or "")
        with self._lock:
            compiled = self._cache.get(key)
            if compiled is not None:
                self._cache.move_to_end(key)
                self.hits += 1
                return compiled
        try:
            compiled = self._compile(guide_type, guide or "")
        except (RuntimeError, ValueError, TypeError) as exc:  # xgrammar raises RuntimeError
            raise ValueError(f"guided_decoding_guide ({guide_type}) cannot be compiled: {_clean(exc)}") from None
        with self._lock:
            self.misses += 1
            self._cache[key] = compiled
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return compiled

    def _compile(self, guide_type: str, guide: str) -> Any:
        c = self._compiler
        if guide_type in ("json", "json_schema"):
            if guide_type == "json":  # any JSON object, as OpenAI's json_object mode
                guide, strict = '{"type": "object"}', False
            else:
                strict = True  # no properties or items beyond the schema's (OpenAI's strict mode)
                try:
                    json.loads(guide)
                except ValueError as exc:
                    raise ValueError(f"the JSON Schema is not JSON ({exc})") from None
            # Compact separators: a random or weak model cannot wander off into whitespace.
            grammar = self._xgr.Grammar.from_json_schema(guide, any_whitespace=False, strict_mode=strict)
            return c.compile_grammar(_strict_json_strings(str(grammar)))
        if guide_type == "regex":
            return c.compile_regex(guide)
        if guide_type == "ebnf_grammar":
            return c.compile_grammar(guide)
        if guide_type == "structural_tag":
            return self._structural_tag(guide)
        raise ValueError(f"unknown guided_decoding_guide_type {guide_type!r}")

    def _structural_tag(self, guide: str) -> Any:
        """xgrammar's structural tag (`{"type": "structural_tag", "format": ...}`), or the older
        form TensorRT-LLM documents (`{"structures": [{"begin", "schema", "end"}], "triggers": [...]}`)."""
        try:
            tag = json.loads(guide)
        except ValueError as exc:
            raise ValueError(f"the structural tag is not JSON ({exc})") from None
        if isinstance(tag, dict) and "structures" in tag and "format" not in tag:
            try:
                items = [self._xgr.StructuralTagItem(begin=s["begin"], schema=json.dumps(s["schema"]), end=s["end"])
                         for s in tag["structures"]]
            except (KeyError, TypeError):
                raise ValueError('each of "structures" needs "begin", "schema" and "end"') from None
            return self._compiler.compile_structural_tag(items, list(tag.get("triggers", [])))
        return self._compiler.compile_structural_tag(guide)

    def matcher(self, params: SamplingParams) -> RequestGrammar:
        """A fresh matcher for a request's (validated) guide."""
        compiled = self.compile(params.guided_decoding_guide_type, params.guided_decoding_guide)
        matcher = self._xgr.GrammarMatcher(
            compiled, override_stop_tokens=list(self.eos_token_ids) or None,
            terminate_without_stop_token=not self.eos_token_ids)
        grammar = RequestGrammar(matcher, params.guided_decoding_guide_type)
        grammar.vocab_size = self.vocab_size
        first, logits = self._xgr.allocate_token_bitmask(1, self.vocab_size), torch.zeros(1, self.vocab_size)
        grammar.fill(first, 0)
        self._xgr.apply_token_bitmask_inplace(logits, first)  # (the bits past the vocabulary do not count)
        if not bool(torch.isfinite(logits).any()):  # e.g. the regex [^\x00-\U0010FFFF]: refused now, not mid-stream
            raise ValueError(f"guided_decoding_guide ({params.guided_decoding_guide_type}) admits no output "
                             "at all: not even its first token can be generated with this tokenizer")
        return grammar


def apply_grammar_masks(logits: torch.Tensor, states: list[SamplingState]) -> None:
    """Set to -inf, in place, the logits of every token the grammar of a constrained row forbids
    next; rows without a grammar are untouched (and cost nothing)."""
    rows = [i for i, s in enumerate(states) if s.grammar is not None]
    if not rows:
        return
    import xgrammar as xgr

    bitmask = xgr.allocate_token_bitmask(logits.shape[0], logits.shape[1])
    for i in rows:
        states[i].grammar.fill(bitmask, i)
    if logits.device.type != "cpu":
        bitmask = bitmask.to(logits.device, non_blocking=True)
    xgr.apply_token_bitmask_inplace(logits, bitmask, indices=rows)
