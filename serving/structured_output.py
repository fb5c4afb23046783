"""Structured output: a request's grammar (xgrammar), applied by the sampler as a token bitmask.

    admission ──▶ GrammarCompiler.submit: parse now, compile on its thread (a Future, LRU-cached
                  by (type, guide)); the request waits in PendingGrammars, out of the scheduler
    ready     ──▶ GrammarCompiler.matcher(params, compiled) ──▶ RequestGrammar (one xgrammar
                  GrammarMatcher per request, in its SamplingState); the Sequence is queued
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
* Compiled off the loop: admission (`LLMEngine._admit`) parses the guide at once (a syntax error,
  a schema xgrammar cannot convert: a ValueError for that request alone, the Triton model's "bad
  request", the OpenAI endpoint's 400) and hands the expensive part, the per-token tables, to this
  component's one compile thread (`submit`: a Future, cached by key, so a second request with the
  same guide waits on the same compile). xgrammar's C++ compile releases the GIL, so other
  requests keep stepping meanwhile; the request stays out of the scheduler (`PendingGrammars`, as
  vLLM's WAITING_FOR_FSM) until its grammar is ready, so it holds no KV and never samples
  unconstrained. A compile that fails later (or a grammar that admits no first token) fails that
  request alone with finish reason error.
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
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from typing import TYPE_CHECKING, Any, Callable

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
        self._cache: OrderedDict[tuple[str, str], Future] = OrderedDict()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="trtforge-grammar")
        self._cache_size = cache_size
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    def submit(self, guide_type: str, guide: str | None) -> Future:
        """The future CompiledGrammar of (type, guide): the cached one when it was submitted before
        (done or still compiling: never compiled twice), else a compile on this component's thread.
        The guide is parsed here, now: ValueError saying what is wrong when it cannot be."""
        key = (guide_type, guide or "")
        with self._lock:
            future = self._cache.get(key)
            if future is not None:
                self._cache.move_to_end(key)
                self.hits += 1
                return future
        compile_parsed = self._checked(guide_type, lambda: self._parse(guide_type, guide or ""))
        future = self._executor.submit(self._checked, guide_type, compile_parsed)
        with self._lock:
            self.misses += 1
            self._cache[key] = future
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)  # a request waiting on it keeps its own reference
        future.add_done_callback(lambda f: self._forget_failure(key, f))
        return future

    def ready(self, guide_type: str, guide: str | None) -> Any:
        """The CompiledGrammar of (type, guide) when a compile of it has finished and is cached (a
        hit), else None (not submitted yet, or still compiling: `submit`)."""
        key = (guide_type, guide or "")
        with self._lock:
            future = self._cache.get(key)
            if future is None or not future.done():
                return None
            self._cache.move_to_end(key)
            self.hits += 1
            return future.result()  # a failed compile is never cached

    def compile(self, guide_type: str, guide: str | None) -> Any:
        """The CompiledGrammar of (type, guide), waiting for it; ValueError when it cannot be compiled."""
        return self.submit(guide_type, guide).result()

    def _forget_failure(self, key: tuple[str, str], future: Future) -> None:
        """A failed compile is not cached: its exception (and traceback) would be held forever."""
        if future.cancelled() or future.exception() is not None:
            with self._lock:
                if self._cache.get(key) is future:
                    del self._cache[key]

    @staticmethod
    def _checked(guide_type: str, fn: Callable[[], Any]) -> Any:
        try:
            return fn()
        except (RuntimeError, ValueError, TypeError) as exc:  # xgrammar raises RuntimeError
            raise ValueError(f"guided_decoding_guide ({guide_type}) cannot be compiled: {_clean(exc)}") from None

    def close(self) -> None:
        """Stop the compile thread (a compile under way finishes; queued ones are dropped)."""
        self._executor.shutdown(wait=False, cancel_futures=True)

    def _parse(self, guide_type: str, guide: str) -> Callable[[], Any]:
        """Parse the guide now (fast); returns the compile of the parsed grammar (the slow part)."""
        c, xgr = self._compiler, self._xgr
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
            grammar = xgr.Grammar.from_json_schema(guide, any_whitespace=False, strict_mode=strict)
            grammar = xgr.Grammar.from_ebnf(_strict_json_strings(str(grammar)))
        elif guide_type == "regex":
            grammar = xgr.Grammar.from_regex(guide)
        elif guide_type == "ebnf_grammar":
            grammar = xgr.Grammar.from_ebnf(guide)
        elif guide_type == "structural_tag":
            grammar = self._structural_tag(guide)
        else:
            raise ValueError(f"unknown guided_decoding_guide_type {guide_type!r}")
        return lambda: c.compile_grammar(grammar)

    def _structural_tag(self, guide: str) -> Any:
        """xgrammar's structural tag (`{"type": "structural_tag", "format": ...}`), or the older
        form TensorRT-LLM documents (`{"structures": [{"begin", "schema", "end"}], "triggers": [...]}`),
        as a parsed Grammar."""
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
            return self._xgr.Grammar.from_structural_tag(items, list(tag.get("triggers", [])))
        return self._xgr.Grammar.from_structural_tag(guide)

    def matcher(self, params: SamplingParams, compiled: Any = None) -> RequestGrammar:
        """A fresh matcher for a request's (validated) guide, over `compiled` (its CompiledGrammar,
        compiled now, waiting, when not given); ValueError when the grammar admits no output."""
        if compiled is None:
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


class PendingGrammars:
    """The requests whose grammar is still compiling, by request id: each waits here, out of the
    scheduler (no KV, never sampled), until its Future is done."""

    def __init__(self) -> None:
        self._futures: dict[str, Future] = {}
        self._items: dict[str, Any] = {}

    def __len__(self) -> int:
        return len(self._futures)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._futures

    def add(self, request_id: str, future: Future, item: Any) -> None:
        """`item`: what the request joins the scheduler with once ready (its Sequence)."""
        self._futures[request_id] = future
        self._items[request_id] = item

    def discard(self, request_id: str) -> bool:
        """Forget a request (aborted, timed out); the compile itself goes on into the cache, for
        the next request with that guide. True when it was waiting here."""
        self._items.pop(request_id, None)
        return self._futures.pop(request_id, None) is not None

    def pop_ready(self) -> list[tuple[str, Any, Any, ValueError | None]]:
        """(request id, its item, CompiledGrammar or None, the ValueError of a failed compile or
        None) for every request whose compile has finished, in arrival order; they leave the list."""
        ready = [rid for rid, f in self._futures.items() if f.done()]
        out = []
        for rid in ready:
            future, item = self._futures.pop(rid), self._items.pop(rid)
            if future.cancelled():
                out.append((rid, item, None, ValueError("the grammar compile was cancelled (the engine is closing)")))
            elif future.exception() is not None:
                exc = future.exception()
                out.append((rid, item, None, exc if isinstance(exc, ValueError) else ValueError(str(exc))))
            else:
                out.append((rid, item, future.result(), None))
        return out

    def wait(self, timeout: float) -> None:
        """Block until one compile finishes or `timeout` seconds pass (an engine with nothing else
        to run, instead of spinning)."""
        if self._futures:
            wait(list(self._futures.values()), timeout=timeout, return_when=FIRST_COMPLETED)


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
