"""The `n` choices of one API request: n engine requests that share the prompt's KV blocks.

Each choice is its own request to the ensemble (with a seed, choice i samples with seed + i, so
the choices differ and each is reproducible). They share the prompt through the engine's prefix
cache: the first request is sent alone and the others only once its first response has arrived,
i.e. once its prompt is prefilled and its full KV blocks are in the cache, so every other choice
finds them there (their `num_cached_tokens`; the engine's prefix-cache hit counter) and computes
only the prompt's last, partial block again. Sent all at once they would all prefill the whole
prompt in the same step, before any of it was cached.

`start()` waits for a response of every choice before the answer's status is sent, so a request
the model refuses is a 400 even when streamed. Usage counts the prompt once and the completion
tokens of all choices; `cached_tokens` is the first choice's (what this request found cached).
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass
from typing import AsyncIterator, Callable

import numpy as np

from trtforge.frontend.generation import Tally
from trtforge.frontend.responses import PromptTokensDetails, Usage
from trtforge.frontend.triton_bridge import Piece

UINT64 = 1 << 64


def choice_seed(seed: int | None, index: int) -> int | None:
    """Choice `index`'s seed: the request's plus the index (wrapping in UINT64), None without one."""
    return None if seed is None else (seed + index) % UINT64


@dataclass
class Sample:
    """One choice on its way through."""

    index: int
    tally: Tally
    pieces: AsyncIterator[Piece]
    first: Piece | None = None

    async def next(self) -> Piece | None:
        """The next response (the first one kept by start()), None after the last."""
        if self.first is not None:
            piece, self.first = self.first, None
            return piece
        try:
            return await self.pieces.__anext__()
        except StopAsyncIteration:
            return None


class Samples:
    """The choices of one request; `generate(arrays)` is the bridge's, `arrays(i)` choice i's inputs."""

    def __init__(self, n: int, tally: Callable[[], Tally],
                 generate: Callable[[dict[str, np.ndarray]], AsyncIterator[Piece]],
                 arrays: Callable[[int], dict[str, np.ndarray]]) -> None:
        self.samples = [Sample(i, tally(), generate(arrays(i))) for i in range(n)]

    async def start(self) -> None:
        """The first choice's first response, then (its prompt now cached) the others'."""
        head, *rest = self.samples
        head.first = await head.pieces.__anext__()
        if rest:
            # Every one awaited to its end (none left running when the caller closes them).
            firsts = await asyncio.gather(*(s.pieces.__anext__() for s in rest), return_exceptions=True)
            for sample, piece in zip(rest, firsts):
                if isinstance(piece, BaseException):
                    raise piece
                sample.first = piece

    async def merged(self) -> AsyncIterator[tuple[Sample, Piece]]:
        """Every choice's responses as they come (not yet added to its tally)."""
        waiting: dict[asyncio.Future, Sample] = {asyncio.ensure_future(s.next()): s for s in self.samples}
        try:
            while waiting:
                done, _ = await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
                for future in sorted(done, key=lambda f: waiting[f].index):
                    sample = waiting.pop(future)
                    piece = future.result()
                    if piece is None:
                        continue
                    yield sample, piece
                    if not piece.final:
                        waiting[asyncio.ensure_future(sample.next())] = sample
        finally:
            for future in waiting:
                future.cancel()
            for future in waiting:
                with contextlib.suppress(BaseException):
                    await future

    async def collect(self) -> None:
        """Run every choice to its end."""
        async def run(sample: Sample) -> None:
            while (piece := await sample.next()) is not None:
                sample.tally.add(piece)
                if piece.final:
                    return

        await asyncio.gather(*(run(s) for s in self.samples))

    async def aclose(self) -> None:
        """Cancel what has not finished (Triton frees its KV blocks)."""
        for sample in self.samples:
            await sample.pieces.aclose()  # type: ignore[attr-defined]

    def usage(self) -> Usage:
        first = self.samples[0].tally.usage()
        completion = first.completion_tokens + sum(s.tally.usage().completion_tokens for s in self.samples[1:])
        details = first.prompt_tokens_details
        return Usage(prompt_tokens=first.prompt_tokens, completion_tokens=completion,
                     total_tokens=first.prompt_tokens + completion,
                     prompt_tokens_details=None if details is None else PromptTokensDetails(
                         cached_tokens=details.cached_tokens))
