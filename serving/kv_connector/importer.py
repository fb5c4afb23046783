"""The generation side's importer: takes a handle from whichever connector exported it."""

from __future__ import annotations

import torch

from trtforge.serving.kv_connector.handle import KVHandle
from trtforge.serving.kv_connector.shared_memory import SharedMemoryImporter
from trtforge.serving.kv_connector.tcp import TcpImporter


class KVImporter:
    """Dispatches on the handle's location: tcp://HOST:PORT (network), else a shared-memory path."""

    def __init__(self) -> None:
        self._shm = SharedMemoryImporter()
        self._tcp = TcpImporter()

    def _for(self, handle: KVHandle):
        return self._tcp if handle.location.startswith("tcp://") else self._shm

    def import_into(self, handle: KVHandle, kv_tensors: list[torch.Tensor], blocks: list[int]) -> None:
        self._for(handle).import_into(handle, kv_tensors, blocks)

    def release(self, handle: KVHandle) -> None:
        self._for(handle).release(handle)

    @property
    def handoffs_done(self) -> int:
        return self._shm.handoffs_done + self._tcp.handoffs_done

    @property
    def bytes_total(self) -> int:
        return self._shm.bytes_total + self._tcp.bytes_total

    @property
    def seconds_total(self) -> float:
        return self._shm.seconds_total + self._tcp.seconds_total
