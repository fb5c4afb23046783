"""Prompt lookup (vLLM's `ngram` method, "prompt lookup decoding"): the drafts are the tokens that
followed the latest earlier occurrence of the sequence's last n tokens, in its own prompt and
output, for n from prompt_lookup_max down to prompt_lookup_min (the longest match wins).

A request that quotes, rewrites or continues a passage repeats runs of tokens it has already seen;
there the lookup predicts several tokens at no model cost. Where nothing repeats it proposes
nothing, and the step is an ordinary decode.

The search runs in C: each request's tokens are kept as packed 4-byte integers (extended by the
new tokens of each step) and the n-gram is found with `bytes.rfind`; a hit at an offset that is
not a multiple of 4 straddles two tokens and is skipped.
"""

from __future__ import annotations

from array import array

from trtforge.serving.spec_decode.proposer import ProposalRequest

_ITEM = array("i").itemsize


def lookup(packed: bytes, n: int, k: int) -> list[int]:
    """Up to k tokens that followed the latest occurrence, before the end, of the last n tokens of
    `packed` (tokens as native 4-byte ints); [] if there is none."""
    length = len(packed) // _ITEM
    if length <= n or k < 1:
        return []
    pattern = packed[(length - n) * _ITEM:]
    end = (length - 1) * _ITEM  # the occurrence must end before the last token: one follows it
    while True:
        pos = packed.rfind(pattern, 0, end)
        if pos < 0:
            return []
        if pos % _ITEM == 0:
            start = pos // _ITEM + n
            return array("i", packed[start * _ITEM:min(start + k, length) * _ITEM]).tolist()
        end = pos + len(pattern) - 1  # misaligned: look further left


class NgramProposer:
    """Prompt lookup over each request's committed tokens (kept packed per request)."""

    def __init__(self, prompt_lookup_min: int, prompt_lookup_max: int):
        self.min_n, self.max_n = prompt_lookup_min, prompt_lookup_max
        self._tokens: dict[str, array] = {}

    def propose(self, requests: list[ProposalRequest]) -> list[list[int]]:
        return [self.propose_one(r.request_id, r.prompt_token_ids, r.output_token_ids, r.max_drafts)
                for r in requests]

    def propose_one(self, request_id: str, prompt: list[int], output: list[int], k: int) -> list[int]:
        packed = self._tokens.get(request_id)
        known = len(prompt) + len(output)
        if packed is None or len(packed) > known or len(packed) < len(prompt):
            packed = self._tokens[request_id] = array("i", prompt)
        packed.extend(output[len(packed) - len(prompt):])
        data = packed.tobytes()
        longest = min(self.max_n, known - 1)
        if longest < self.min_n:
            return []
        shortest = lookup(data, self.min_n, k)
        if not shortest:  # no longer n-gram can occur where its last min_n tokens do not
            return []
        for n in range(longest, self.min_n, -1):
            drafts = lookup(data, n, k)
            if drafts:
                return drafts
        return shortest

    def forget(self, request_id: str) -> None:
        self._tokens.pop(request_id, None)
