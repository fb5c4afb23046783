"""Decide, after each new token, whether a request is finished and which text may be streamed.

Stop strings are matched on text, across token boundaries. A delta that ends with the beginning
of a stop string ("...\\n\\nUs" while "\\n\\nUser:" is a stop string) is held back until the
next tokens either complete the match (the request stops and the held text is never sent) or
break it (the held text is sent). So a client never sees text that is later retracted, and
holds back at most ``len(longest stop string) - 1`` characters, only while they could still
become a match.

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
            text, matched = self._scan(delta, params.stop, params.include_stop_str_in_output)
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

    def _scan(self, delta: str, stops: list[str], include_stop: bool) -> tuple[str, str | None]:
        """Find the earliest stop string in held + delta; hold back a possible partial match."""
        buf = self._held + delta
        best: tuple[int, str] | None = None
        for stop in stops:
            at = buf.find(stop)
            if at != -1 and (best is None or at < best[0]):
                best = (at, stop)
        if best is not None:
            at, stop = best
            self._held = ""
            return buf[: at + len(stop)] if include_stop else buf[:at], stop
        keep = _partial_match_len(buf, stops)
        self._held = buf[len(buf) - keep:] if keep else ""
        return buf[: len(buf) - keep], None


def _partial_match_len(text: str, stops: list[str]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of some stop string."""
    longest = 0
    for stop in stops:
        for n in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:n]):
                longest = n
                break
    return longest
