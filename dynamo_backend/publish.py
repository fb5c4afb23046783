"""What the KV-aware router learns from a worker: the prefix cache's events and the load.

Runs on the engine thread after every step (EngineLoop's after_step): the KV manager's event log
(serving/core/kv_events.py) is drained into Dynamo's KvEventPublisher — one `publish_stored` per
run of chained blocks (token ids, tokens per block, block ids, the run's parent), one
`publish_removed` per run of evictions, in the order they happened — and a ComponentSnapshot of
KV blocks used / total and the prefix-cache hit rate goes to the snapshot publisher at most every
`snapshot_interval_s`. Until Dynamo hands over its publishers the events wait in the (bounded) log.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from trtforge.serving.core.kv_events import BlockRemoved, BlockStored, KVEvent, KVEventLog, block_id


def stored_runs(events: list[KVEvent]) -> list[tuple[str, Any]]:
    """Events grouped as Dynamo takes them: ("stored", (blocks, parent_key, salt)) for a run of
    BlockStored each the child of the one before, ("removed", keys) for a run of BlockRemoved."""
    runs: list[tuple[str, Any]] = []
    for event in events:
        if isinstance(event, BlockStored):
            last = runs[-1] if runs else None
            if last and last[0] == "stored" and last[1][0][-1].key == event.parent_key \
                    and last[1][2] == event.cache_salt:
                last[1][0].append(event)
            else:
                runs.append(("stored", ([event], event.parent_key, event.cache_salt)))
        elif isinstance(event, BlockRemoved):
            if runs and runs[-1][0] == "removed":
                runs[-1][1].append(event.key)
            else:
                runs.append(("removed", [event.key]))
    return runs


class RouterFeed:
    def __init__(self, log: KVEventLog, block_size: int, snapshot_interval_s: float = 0.05) -> None:
        self.log, self.block_size = log, block_size
        self.kv_publisher: Any = None
        self.snapshot_publisher: Any = None
        self._interval, self._last_snapshot = snapshot_interval_s, 0.0
        self.events_published = 0

    def publish(self, engine_stats: Callable[[], Any]) -> None:
        """Flush the events and (rate-limited) the load; `engine_stats` is LLMEngine.stats, called
        only when a snapshot is due (not on every step)."""
        if self.kv_publisher is not None and len(self.log):
            for kind, run in stored_runs(self.log.drain()):
                if kind == "stored":
                    blocks, parent, salt = run
                    self.kv_publisher.publish_stored(
                        token_ids=[t for b in blocks for t in b.token_ids],
                        num_block_tokens=[len(b.token_ids) for b in blocks],
                        block_hashes=[block_id(b.key) for b in blocks],
                        parent_hash=None if parent is None else block_id(parent),
                        cache_salt=salt)
                    self.events_published += len(blocks)
                else:
                    self.kv_publisher.publish_removed(block_hashes=[block_id(k) for k in run])
                    self.events_published += len(run)
        now = time.monotonic()
        if self.snapshot_publisher is not None and now - self._last_snapshot >= self._interval:
            from dynamo.common.backend.publisher import ComponentSnapshot

            self._last_snapshot = now
            stats = engine_stats()
            queried = stats.prefix_cache_queried_tokens
            self.snapshot_publisher.publish(0, ComponentSnapshot(
                kv_used_blocks=stats.kv_blocks_used, kv_total_blocks=stats.kv_blocks_total,
                gpu_cache_usage=stats.kv_blocks_used / max(stats.kv_blocks_total, 1), dp_rank=0,
                kv_cache_hit_rate=stats.prefix_cache_hit_tokens / queried if queried else None))
