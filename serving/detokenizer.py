"""Incremental detokenization: token ids in, streamed text deltas out.

Decoding each token on its own loses the spaces that SentencePiece-style tokenizers strip from
the first token of a string ("▁world" alone decodes to "world") — the "streamed text without
spaces" complaint about TensorRT-LLM — and prints U+FFFD when a multi-byte character is split
across tokens. Decoding everything each step is O(length) per token. The vLLM approach fixes
both with a small sliding window over the token ids:

    ids:  ... │ prefix_offset ........ read_offset ........ len(ids)
                └── already emitted ──┘└──── not yet emitted ────┘

    prefix_text = decode(ids[prefix_offset:read_offset])   (context, already emitted)
    new_text    = decode(ids[prefix_offset:])
    delta       = new_text[len(prefix_text):]

Both strings decode the same leading tokens, so whatever the decoder does at the start of a
string (strip a leading space, ...) cancels out and the delta keeps its spaces. If ``new_text``
ends in U+FFFD the last character is incomplete: nothing is emitted and the window widens until
it completes. After an emission the window slides forward, so each step decodes a window of a few
tokens: O(window), not O(length).

The window starts at the first output token, so the concatenated deltas equal
``tokenizer.decode(output_ids, skip_special_tokens=...)`` exactly (for tokenizers without
``clean_up_tokenization_spaces``, whose rewrites like " ." → "." no stream can undo). With
``use_prompt_context=True`` the window starts in the prompt's last tokens instead, and the deltas
equal the text the output adds after the prompt (e.g. keeping the first token's leading space).

Known limits (shared with vLLM): a ByteFallback decoder renders a run of ``<0xNN>`` tokens that
is invalid UTF-8 *as a whole* as U+FFFDs, ASCII bytes included, so garbage bytes after valid ones
can change text already streamed; and a long run of skipped special tokens widens the window.
"""

from __future__ import annotations

from typing import Protocol

_REPLACEMENT_CHAR = "\ufffd"
# Prompt tokens used as context: enough to cover a split multi-byte character (4 bytes) plus a
# token before it, as vLLM's INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET.
_PROMPT_CONTEXT_TOKENS = 5


class _Decoder(Protocol):
    def decode(self, token_ids: list[int], skip_special_tokens: bool = ...) -> str: ...


class IncrementalDetokenizer:
    """Turns one request's output tokens into text deltas; one instance per request."""

    def __init__(
        self,
        tokenizer: _Decoder,
        prompt_token_ids: list[int],
        skip_special_tokens: bool = True,
        use_prompt_context: bool = False,
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        context = list(prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:]) if use_prompt_context else []
        self._ids: list[int] = context  # context + output ids; trimmed as the window slides
        self._prefix_offset = 0
        self._read_offset = len(context)
        self._prefix_text = self._decode(0, len(context))
        self.output_text = ""
        """All text emitted so far (the concatenation of the deltas)."""

    def step(self, new_token_ids: list[int]) -> str:
        """Append the new tokens; return the text they complete (possibly "")."""
        self._ids.extend(new_token_ids)
        new_text = self._decode(self._prefix_offset, len(self._ids))
        if len(new_text) <= len(self._prefix_text) or new_text.endswith(_REPLACEMENT_CHAR):
            # Nothing visible yet (a skipped special token) or a character still incomplete.
            return ""
        return self._emit(new_text)

    def flush(self) -> str:
        """Emit whatever is held back; call once when the request finishes.

        Only an incomplete trailing character can be pending; it comes out as U+FFFD, exactly
        as ``tokenizer.decode`` of the whole output shows it.
        """
        new_text = self._decode(self._prefix_offset, len(self._ids))
        if new_text == self._prefix_text:
            return ""
        return self._emit(new_text)

    def _emit(self, new_text: str) -> str:
        delta = new_text[len(self._prefix_text):]
        # Slide: the just-emitted tokens become the context of the next window.
        self._prefix_text = self._decode(self._read_offset, len(self._ids))
        del self._ids[: self._read_offset]  # keep memory O(window) too
        self._prefix_offset, self._read_offset = 0, len(self._ids)
        self.output_text += delta
        return delta

    def _decode(self, start: int, end: int) -> str:
        if start >= end:
            return ""
        return self._tokenizer.decode(self._ids[start:end], skip_special_tokens=self._skip_special)
