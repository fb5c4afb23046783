"""KV connectors: how a finished prefill's KV blocks move from a `context` engine to a
`generation` engine (disaggregated serving).

The engine sees one interface, `KVConnector` (base.py), and calls its hooks: `save_kv` on the
context side when a prefill is done, `check_handoff` / `load_kv` on the generation side when a
handed-over request is admitted, `request_finished` when a request ends, `poll` between steps:

    context side (owner)                       generation side
    ─────────────────────                      ───────────────
    handle = exporter.save_kv(...)  ──handle──▶ importer.load_kv(handle, blocks)
    exporter.poll()  ◀── "taken" ───────────── (or request_finished(handle) if it never imports)
      frees what was taken, and what passed its deadline

The handle (`KVHandle`) is plain data (JSON): it travels in the `context_phase_params` tensor of
the Triton requests, so the two sides may be different processes. Clients can send one too, so it
is signed (HMAC with a key both sides share, auth.py), carries a per-handoff secret, is used once,
and is judged in full by the generation side before anything is done with it (importer.py). It has an owner (the
exporter that holds its blocks) and a deadline: a handle nobody takes is freed by its owner,
so no block leaks when a client goes away between the phases or the generation side is gone.

Implementations: `shared_memory` (one host: a /dev/shm segment written by the context process
and read by the generation process) and `tcp` (hosts apart: the same staging, served over TCP).
The generation side's `KVImporter` takes either, by the handle's location.
"""

from __future__ import annotations

import torch

from trtforge.config.runtime import SHARED_MEMORY_CONNECTOR, Phase, RuntimeConfig
from trtforge.serving.kv_connector.auth import HandoffKeyError, handoff_key
from trtforge.serving.kv_connector.base import HandoffStats, KVConnector
from trtforge.serving.kv_connector.handle import HandoffError, KVHandle
from trtforge.serving.kv_connector.importer import KVImporter
from trtforge.serving.kv_connector.shared_memory import SharedMemoryExporter
from trtforge.serving.kv_connector.tcp import TcpExporter
from trtforge.serving.kv_connector.tls import TlsConfigError, client_context, server_context


def make_connector(runtime: RuntimeConfig, kv_tensors: list[torch.Tensor], num_blocks: int,
                   block_size: int) -> KVConnector | None:
    """The connector of an engine in `runtime.phase`, over its KV pools (`kv_tensors`, block axis
    at dim 1; `num_blocks` of `block_size` tokens): None co-located; the context side's exporter
    by `runtime.kv_connector` (shm, or tcp://HOST:PORT to listen there); the generation side's
    importer (shared-memory handles of this host, or tcp ones of `runtime.kv_peers`). Both sign
    or check handles with the handoff key (auth.handoff_key: ValueError when none is configured
    for a tcp connector); a tcp connector speaks TLS when runtime's kv_tls_* files say so
    (tls.py; TlsConfigError, a ValueError, for a missing or unusable file)."""
    if runtime.phase is Phase.BOTH:
        return None
    if runtime.phase is Phase.GENERATION:
        key = handoff_key(runtime.kv_auth_key_file, one_host=not runtime.kv_peers)
        tls = client_context(runtime.kv_tls_ca_file, runtime.kv_tls_cert_file, runtime.kv_tls_key_file)
        return KVImporter(kv_tensors, block_size, key=key, peers=runtime.kv_peers, tls=tls)
    one_host = runtime.kv_connector == SHARED_MEMORY_CONNECTOR
    key = handoff_key(runtime.kv_auth_key_file, one_host=one_host)
    tls = server_context(runtime.kv_tls_cert_file, runtime.kv_tls_key_file, runtime.kv_tls_ca_file)
    if one_host:
        if tls is not None:
            raise TlsConfigError("kv_tls_cert_file is for the tcp KV connector; this context model "
                                 "hands KV over shared memory (kv_connector=shm)")
        return SharedMemoryExporter(kv_tensors, num_blocks, block_size, runtime.handoff_timeout_s,
                                    key=key)
    return TcpExporter(kv_tensors, num_blocks, block_size, runtime.handoff_timeout_s,
                       listen=runtime.kv_connector, advertise_host=runtime.kv_advertise_host, key=key,
                       tls=tls)


__all__ = ["HandoffError", "HandoffKeyError", "HandoffStats", "KVConnector", "KVHandle", "KVImporter",
           "SharedMemoryExporter", "TcpExporter", "TlsConfigError", "make_connector"]
