"""How the router picks a server for a request: least-loaded, or prefix affinity (pure Python).

`LeastLoaded`: the server with the fewest requests in flight from this router (the first one
listed on a tie). The disaggregated router uses it for its context and generation servers.

Both leave out, for `retry_after_s`, a server the router could not reach or whose connection
broke (`failed`): the requests it was serving fail, new ones go to the others (all of them down:
each is tried again).

`PrefixAffinity` (the router over co-located workers, `emit-repo --only router --worker-url …`):
the worker most likely to hold the prompt's KV blocks in its prefix cache, as Dynamo's kv router
and llm-d's scheduler aim for, without their view of the workers' caches. What it knows: per
worker, the chained hashes of the block-aligned prompt prefixes it sent there recently (a bounded
LRU, `max_blocks` per worker). The block size is the engine's `kv_block_size`, the tokens are the
engine's own encoding of the prompt, and the chain starts from the request's `cache_salt` (which
keeps namespaces apart, as the engine's prefix cache does). What it does not know: what a worker
evicted (it credits a worker with blocks it may no longer hold; Dynamo's kv router sees
evictions in our KV events), what a worker cached for another router or from its own answers,
and how full the workers' pools are.

Choice: among the workers with at most `max_imbalance` more requests in flight than the least
busy one (so one hot prefix cannot pile every request onto one worker), the one whose remembered
blocks match the longest leading run of the prompt's blocks; ties: fewer requests in flight,
then the worker chosen least recently (new prompts spread over idle workers).

Not thread-safe: the router calls it holding its own lock.
"""

from __future__ import annotations

import enum
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass


class Policy(str, enum.Enum):
    """`router_policy` of a router over co-located workers."""

    LEAST_LOADED = "least-loaded"
    PREFIX_AFFINITY = "prefix-affinity"

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class AffinityConfig:
    """The parameters of PrefixAffinity (`router_…` in the router's config.pbtxt)."""

    block_size: int
    """Tokens per KV block: the engine's kv_block_size (its prefix cache matches whole blocks)."""
    max_blocks: int = 65536
    """Block hashes remembered per worker (least recently used forgotten first)."""
    max_imbalance: int = 2
    """A worker is a candidate only while it has at most this many more requests in flight than
    the least busy worker."""

    def __post_init__(self) -> None:
        for name, least in (("block_size", 1), ("max_blocks", 1), ("max_imbalance", 0)):
            if getattr(self, name) < least:
                raise ValueError(f"router {name}={getattr(self, name)} is invalid: must be >= {least}")


# Parameters of the router over co-located workers (its config.pbtxt), beside engine_dir and
# exclude_input_in_output (params.AdapterOptions).
WORKER_ROUTER_ROLE = "router"
"""`role` of a router over co-located workers (the disaggregated one: phases.ROUTER_ROLE)."""
WORKER_MODEL = "worker_model"
WORKER_URLS = "worker_urls"
ROUTER_POLICY = "router_policy"
ROUTER_MAX_BLOCKS = "router_max_blocks"
ROUTER_MAX_IMBALANCE = "router_max_imbalance"
ROUTER_DOCS = {
    WORKER_MODEL: "The model the workers serve (the co-located `ensemble`).",
    WORKER_URLS: "gRPC addresses HOST:PORT of the co-located worker servers, comma-separated.",
    ROUTER_POLICY: "prefix-affinity (the worker that most likely holds the prompt's KV blocks) | "
                   "least-loaded (fewest requests in flight).",
    ROUTER_MAX_BLOCKS: "prefix-affinity: block hashes remembered per worker (LRU).",
    ROUTER_MAX_IMBALANCE: "prefix-affinity: a worker is chosen only while it has at most this many "
                          "more requests in flight than the least busy one.",
}


def block_hashes(token_ids: Sequence[int], block_size: int, salt: str | None = None) -> list[int]:
    """Hash i covers the first (i + 1) * block_size tokens (chained: hash i folds in hash i-1).
    A partial last block is left out: the prefix cache shares whole blocks only."""
    previous = hash(("trtforge-prefix", salt or ""))
    out = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        previous = hash((previous, tuple(token_ids[start:start + block_size])))
        out.append(previous)
    return out


class LeastLoaded:
    """The server with the fewest requests in flight; `choose` counts one more, `release` one less."""

    retry_after_s = 5.0
    """How long a server that `failed` is left out."""

    def __init__(self, urls: Sequence[str]) -> None:
        if not urls:
            raise ValueError("a router needs at least one server address")
        self.urls = list(dict.fromkeys(urls))
        self.in_flight = {url: 0 for url in self.urls}
        self.down_until = {url: float("-inf") for url in self.urls}

    def choose(self, blocks: Sequence[int] = (), now: float | None = None) -> str:
        url = min(self.up(now), key=lambda u: self.in_flight[u])
        self.in_flight[url] += 1
        return url

    def release(self, url: str) -> None:
        self.in_flight[url] -= 1

    def failed(self, url: str, now: float | None = None) -> None:
        """`url` could not be reached or its connection broke: leave it out for a while."""
        self.down_until[url] = (time.monotonic() if now is None else now) + self.retry_after_s

    def up(self, now: float | None = None) -> list[str]:
        """The servers not left out (all of them when every one is)."""
        now = time.monotonic() if now is None else now
        return [u for u in self.urls if self.down_until[u] <= now] or self.urls


class PrefixAffinity(LeastLoaded):
    """Longest remembered prefix among the workers within the imbalance cap (module doc)."""

    def __init__(self, urls: Sequence[str], config: AffinityConfig) -> None:
        super().__init__(urls)
        self.config = config
        self.blocks: dict[str, OrderedDict[int, None]] = {url: OrderedDict() for url in self.urls}
        self._last_chosen = {url: -1 for url in self.urls}
        self._choices = 0

    def matched(self, url: str, blocks: Sequence[int]) -> int:
        """Leading blocks of the prompt this router sent to `url` recently."""
        known = self.blocks[url]
        n = 0
        for h in blocks:
            if h not in known:
                break
            n += 1
        return n

    def choose(self, blocks: Sequence[int] = (), now: float | None = None) -> str:
        up = self.up(now)
        least = min(self.in_flight[u] for u in up)
        candidates = [u for u in up if self.in_flight[u] <= least + self.config.max_imbalance]
        url = max(candidates, key=lambda u: (self.matched(u, blocks), -self.in_flight[u],
                                             -self._last_chosen[u]))
        self.in_flight[url] += 1
        self._last_chosen[url] = self._choices
        self._choices += 1
        self._remember(url, blocks)
        return url

    def _remember(self, url: str, blocks: Sequence[int]) -> None:
        known = self.blocks[url]
        for h in blocks:
            known[h] = None
            known.move_to_end(h)
        while len(known) > self.config.max_blocks:
            known.popitem(last=False)


def make_router(policy: Policy | str, urls: Sequence[str], config: AffinityConfig) -> LeastLoaded:
    """The policy named `policy` over `urls` (ValueError naming the choices otherwise)."""
    try:
        policy = Policy(policy)
    except ValueError:
        raise ValueError(f"router_policy={policy!r} is invalid: choose "
                         f"{' or '.join(p.value for p in Policy)}") from None
    return PrefixAffinity(urls, config) if policy == Policy.PREFIX_AFFINITY else LeastLoaded(urls)
