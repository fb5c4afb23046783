"""The KV connector interface: the hook points where the engine hands KV to, or takes it from,
another engine (disaggregated serving), in the shape of vLLM's KV connectors.

A request's life, and the hook the engine calls at each point:

    context engine (exporter)                    generation engine (importer)
    ─────────────────────────                    ────────────────────────────
    prefill done, first token sampled            add_handoff(handle): check_handoff(handle, …)
      save_kv(...) ──▶ handle ──(JSON)─────────▶   scheduler admits it with external KV
      request ends, finish reason handoff          load_kv(handle, blocks) before its step
                                                 request ends: request_finished(handle or None)
    poll(): free what was taken or expired       (releases a handle never imported)

An engine holds one connector for its phase (none when co-located), made by
`make_connector` from its RuntimeConfig; the engine calls these hooks and nothing else of it.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Any, ClassVar

from trtforge.config.runtime import Phase
from trtforge.serving.kv_connector.handle import KVHandle


@dataclass(frozen=True)
class HandoffStats:
    """A connector's running totals, for EngineStats' kv_handoff* fields."""

    handoffs: int = 0
    """Handoffs completed (context: taken by a generation side; generation: imported)."""
    nbytes: int = 0
    """Bytes of K/V copied for them (context: into the staging area; generation: out of it)."""
    seconds: float = 0.0
    """Time spent on those copies."""
    expired: int = 0
    """Context: handoffs freed because nobody took them before their deadline."""
    blocks_held: int = 0
    """Context: staging blocks held by handoffs not yet taken."""


class KVConnector(abc.ABC):
    """One engine's side of the KV handoff. A connector serves one role (`role`): the hooks of
    the other role raise NotImplementedError."""

    role: ClassVar[Phase]
    """The phase of the engine this connector serves (context or generation)."""

    # ---- (a) admission of a request whose KV comes from outside: generation side ----------
    def check_handoff(self, handle: KVHandle, *, vocab_size: int, max_seq_len: int) -> None:
        """Raise ValueError unless `handle` can continue in this engine (authentic, not used
        before, from a connector this engine fetches from, every field within the engine's
        limits); the one place a handle is judged before its request is admitted. A handle it
        refuses is not released: it may be a forgery or a replay of someone else's."""
        raise NotImplementedError(f"a {self.role} connector takes no handoffs")

    def load_kv(self, handle: KVHandle, block_ids: list[int]) -> None:
        """Copy the handle's KV into `block_ids` of the engine's pool (the blocks the scheduler
        gave the request at admission, one for each of handle.blocks: from its first_block on).
        Any error fails that request alone."""
        raise NotImplementedError(f"a {self.role} connector imports no KV")

    # ---- (b) a finished prefill: context side ----------------------------------------------
    def save_kv(self, request_id: str, block_ids: list[int], num_tokens: int, **state: Any) -> KVHandle:
        """Copy positions [0, num_tokens) of a request out of `block_ids` of the engine's pool and
        return the handle a generation engine continues from; `state` fills the handle's request
        fields (prompt_token_ids, first_token, seed, …). The pool blocks may be freed right after.
        Leading FREED_BLOCK entries (freed out of a sliding window) are not copied: the handle's
        first_block says where its blocks start. HandoffError when there is no room to stage it."""
        raise NotImplementedError(f"a {self.role} connector exports no KV")

    # ---- (c) a request ended (finished, aborted, failed, refused at admission) ----------------
    def request_finished(self, handle: KVHandle | None) -> None:  # noqa: B027 - an optional hook: by default there is nothing to do
        """Release what the connector holds for the request; `handle`: the handoff it was
        admitted with and has not imported (generation side), else None."""

    # ---- housekeeping ----------------------------------------------------------------------
    def poll(self) -> None:  # noqa: B027 - an optional hook: by default there is nothing to do
        """Between steps: finish what completed since the last call (frees taken or expired
        handoffs on the context side)."""

    def close(self) -> None:  # noqa: B027 - an optional hook: by default there is nothing to do
        """Release what outlives the process otherwise (the context side's staging area)."""

    @abc.abstractmethod
    def stats(self) -> HandoffStats:
        """Running totals since start."""
