"""Decide, after each new token, whether a request is finished and which text may be streamed.

Stop strings are matched on text, across token boundaries. A delta that ends with the beginning
of a stop string ("...\\n\\nUs" while "\\n\\nUser:" is a stop string) is held back until the
next tokens either complete the match (the request stops and the held text is never sent) or
break it (the held text is sent). So a client never sees text that is later retracted, and
holds back at most ``len(longest stop string) - 1`` characters, only while they could still
become a match.

The scan is linear in the new text: each stop string runs a Knuth-Morris-Pratt automaton whose
state (the length of the stop's prefix the output currently ends with) persists between tokens,
so a step costs O(len(delta) x number of stop strings), whatever the length of the output or of
the stop strings (SamplingParams bounds both: MAX_STOP_STRINGS, MAX_STOP_STRING_CHARS).

Intended use by the engine, per new token of a request::

    state.output_token_ids.append(token)
    delta = detokenizer.step([token])
    reason, text = checker.check(state, token, delta)
    if reason is not None and not isinstance(checker.stop_reason, str):
        text += detokenizer.flush()  # an incomplete trailing character, if any
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from trtforge.serving.outputs import FinishReason

if TYPE_CHECKING:  # keep this module free of torch, like the scheduler
    from trtforge.serving.sampler import SamplingState


class StopChecker:
    """Per-request stop logic; holds the text it has not released yet."""

    def __init__(self, max_seq_len: int | None = None) -> None:
        """``max_seq_len``: the engine's limit on prompt + output tokens (None: no limit)."""
        self.max_seq_len = max_seq_len
        self.stop_reason: str | int | None = None
        """What ended the request with finish reason STOP: the matched stop string, or the
        stop token id (EOS included); None otherwise."""
        self._held = ""
        self._matcher: _StopMatcher | None = None

    def check(self, state: SamplingState, new_token_id: int,
              delta: str) -> tuple[FinishReason | None, str]:
        """Return ``(finish_reason, text_to_emit)`` for the token just appended to the output.

        ``state.output_token_ids`` must already end with ``new_token_id``; ``delta`` is the text
        the detokenizer produced for it. ``finish_reason`` is STOP, LENGTH or None.
        Stop conditions (EOS, stop tokens, stop strings) count only once ``min_tokens`` tokens
        came before this one, matching the sampler, which masks EOS and stop tokens until then.
        """
        outputs = state.output_token_ids
        if not outputs or outputs[-1] != new_token_id:
            raise ValueError(
                f"StopChecker.check: token {new_token_id} is not the last output token "
                f"({outputs[-1:] or 'no outputs'}); append it to state.output_token_ids first."
            )
        params = state.params
        may_stop = len(outputs) > params.min_tokens
        if may_stop and params.stop:
            if self._matcher is None or self._matcher.stops is not params.stop:
                self._matcher = _StopMatcher(params.stop)  # once per request: O(total stop length)
            text, matched = self._scan(delta, params.include_stop_str_in_output)
            if matched is not None:
                self.stop_reason = matched
                return FinishReason.STOP, text
        else:
            text, self._held = self._held + delta, ""
        if may_stop and (
            (new_token_id in state.eos_token_ids and not params.ignore_eos)
            or new_token_id in params.stop_token_ids
        ):
            self.stop_reason = new_token_id
            return FinishReason.STOP, text + self.release()
        total = len(state.prompt_token_ids) + len(outputs)
        if len(outputs) >= params.max_tokens or (
            self.max_seq_len is not None and total >= self.max_seq_len
        ):
            return FinishReason.LENGTH, text + self.release()
        return None, text

    def release(self, extra: str = "") -> str:
        """Return (and forget) the held-back text plus ``extra``; for a finished request."""
        text, self._held = self._held + extra, ""
        return text

    def _scan(self, delta: str, include_stop: bool) -> tuple[str, str | None]:
        """Find the earliest stop string in held + delta; hold back a possible partial match."""
        buf = self._held + delta
        best = self._matcher.feed(delta, len(self._held))
        if best is not None:
            at, stop = best
            self._held = ""
            return buf[: at + len(stop)] if include_stop else buf[:at], stop
        keep = self._matcher.partial  # <= len(buf): the held text grows by at most the delta
        self._held = buf[len(buf) - keep:] if keep else ""
        return buf[: len(buf) - keep], None


class _StopMatcher:
    """The stop strings of one request, each with its KMP automaton and current state."""

    def __init__(self, stops: list[str]) -> None:
        self.stops = stops
        """The list the automata were built from (the request's ``params.stop``)."""
        self._fail = [_failure_function(stop) for stop in stops]
        self._state = [0] * len(stops)

    @property
    def partial(self) -> int:
        """Length of the longest suffix of the text so far that is a proper prefix of a stop
        string: what must be held back."""
        return max(self._state, default=0)

    def feed(self, text: str, base: int) -> tuple[int, str] | None:
        """Advance every automaton over ``text``, which starts at ``base`` in the caller's
        buffer: the (start in that buffer, stop string) of the earliest-starting match that ends
        in ``text`` (ties: the first stop string listed), or None."""
        best: tuple[int, str] | None = None
        for k, stop in enumerate(self.stops):
            end = self._advance(k, text)
            if end is not None:
                start = base + end + 1 - len(stop)
                if best is None or start < best[0]:
                    best = (start, stop)
        return best

    def _advance(self, k: int, text: str) -> int | None:
        """Run stop ``k``'s automaton over ``text``: the index in ``text`` where its first match
        ends, or None (its state is then the length of its prefix that the text ends with)."""
        stop, fail, q = self.stops[k], self._fail[k], self._state[k]
        first, i, n = stop[0], 0, len(text)
        while i < n:
            if q == 0:  # not inside a partial match: jump to the next possible start, in C
                i = text.find(first, i)
                if i == -1:
                    break
            ch = text[i]
            while q and stop[q] != ch:
                q = fail[q - 1]
            if stop[q] == ch:
                q += 1
                if q == len(stop):
                    self._state[k] = q
                    return i
            i += 1
        self._state[k] = q
        return None


def _failure_function(stop: str) -> list[int]:
    """KMP: ``fail[i]`` is the length of the longest proper prefix of ``stop[:i + 1]`` that is
    also its suffix."""
    fail, k = [0] * len(stop), 0
    for i in range(1, len(stop)):
        while k and stop[i] != stop[k]:
            k = fail[k - 1]
        if stop[i] == stop[k]:
            k += 1
        fail[i] = k
    return fail
