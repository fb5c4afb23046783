"""KV connectors: how a finished prefill's KV blocks move from a `context` engine to a
`generation` engine (disaggregated serving).

One small interface, three verbs:

    context side (owner)                       generation side
    ─────────────────────                      ───────────────
    handle = exporter.export(...)   ──handle──▶ importer.import_into(handle, kv_tensors, blocks)
    exporter.poll()  ◀── "taken" ───────────── (or importer.release(handle) if it never imports)
      frees what was taken, and what passed its deadline

The handle (`KVHandle`) is plain data (JSON): it travels in the `context_phase_params` tensor of
the Triton requests, so the two sides may be different processes. It has an owner (the
exporter that holds its blocks) and a deadline: a handle nobody takes is freed by its owner,
so no block leaks when a client goes away between the phases or the generation side is gone.

Implementations: `shared_memory` (one host: a /dev/shm segment written by the context process
and read by the generation process) and `tcp` (hosts apart: the same staging, served over TCP).
The generation side's `KVImporter` takes either, by the handle's location.
"""

from trtforge.serving.kv_connector.handle import HandoffError, KVHandle
from trtforge.serving.kv_connector.importer import KVImporter
from trtforge.serving.kv_connector.shared_memory import SharedMemoryExporter, SharedMemoryImporter
from trtforge.serving.kv_connector.tcp import TcpExporter, TcpImporter, parse_address


def make_exporter(connector: str, kv_tensors, num_blocks: int, block_size: int,
                  handoff_timeout_s: float, advertise_host: str | None = None):
    """`shm` (one host) or `tcp://HOST:PORT` (listen there; port 0: any free port)."""
    if connector in ("", "shm"):
        return SharedMemoryExporter(kv_tensors, num_blocks, block_size, handoff_timeout_s)
    parse_address(connector)  # ValueError naming a bad one
    return TcpExporter(kv_tensors, num_blocks, block_size, handoff_timeout_s, listen=connector,
                       advertise_host=advertise_host)


__all__ = ["HandoffError", "KVHandle", "KVImporter", "SharedMemoryExporter", "SharedMemoryImporter",
           "TcpExporter", "TcpImporter", "make_exporter"]
