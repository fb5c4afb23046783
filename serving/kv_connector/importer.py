"""The generation side's connector: takes a handle from whichever connector exported it."""

from __future__ import annotations

import torch

from trtforge.config.runtime import Phase
from trtforge.serving.kv_connector.base import HandoffStats, KVConnector
from trtforge.serving.kv_connector.handle import KVHandle
from trtforge.serving.kv_connector.shared_memory import SharedMemoryImporter
from trtforge.serving.kv_connector.tcp import TcpImporter


class KVImporter(KVConnector):
    """Imports into `kv_tensors` (the engine's KV pools, block axis at dim 1; blocks of
    `block_size` tokens). Dispatches on the handle's location: tcp://HOST:PORT (network), else a
    shared-memory path."""

    role = Phase.GENERATION

    def __init__(self, kv_tensors: list[torch.Tensor], block_size: int) -> None:
        self.kv_tensors = kv_tensors
        self.block_size = block_size
        self._shm = SharedMemoryImporter()
        self._tcp = TcpImporter()

    def _for(self, handle: KVHandle) -> SharedMemoryImporter | TcpImporter:
        return self._tcp if handle.location.startswith("tcp://") else self._shm

    def check_handoff(self, handle: KVHandle) -> None:
        if handle.block_size != self.block_size or handle.num_tokens != len(handle.prompt_token_ids):
            raise ValueError(f"the handoff of {handle.request_id} does not fit this engine "
                             f"(block size {handle.block_size} vs {self.block_size})")

    def load_kv(self, handle: KVHandle, block_ids: list[int]) -> None:
        self._for(handle).import_into(handle, self.kv_tensors, block_ids)

    def request_finished(self, handle: KVHandle | None) -> None:
        """Tell the owner a handle will not be imported, so it frees its blocks at once."""
        if handle is not None:
            self._for(handle).release(handle)

    def stats(self) -> HandoffStats:
        parts = (self._shm, self._tcp)
        return HandoffStats(handoffs=sum(p.handoffs_done for p in parts),
                            nbytes=sum(p.bytes_total for p in parts),
                            seconds=sum(p.seconds_total for p in parts))
