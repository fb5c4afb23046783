"""The generation side's connector: judges a handle (`check_handoff`), then takes its blocks from
the connector that exported it.

A handle comes from a client (`context_phase_params`), so it is judged in full before its request
is admitted: its signature (the handoff key), that it was not used before, that its location is
a connector this engine was configured to fetch from (shared memory of this host, or one of
`kv_peers`), and every field's range against this engine (block size, block count, vocabulary,
max_seq_len, generator state).
"""

from __future__ import annotations

import os
import re
import ssl
import time

import torch

from trtforge.config.runtime import Phase, parse_address, parse_peers
from trtforge.serving.kv_connector import auth
from trtforge.serving.kv_connector.base import HandoffStats, KVConnector
from trtforge.serving.kv_connector.handle import MAX_GENERATOR_STATE_CHARS, KVHandle
from trtforge.serving.kv_connector.shared_memory import SEGMENT_NAME, SharedMemoryImporter
from trtforge.serving.kv_connector.tcp import TcpImporter

_HEX = re.compile(r"[0-9a-f]*")
_MAX_USED = 1 << 16
"""Handles remembered as used (replays refused); older ones are past their deadline anyway."""
_USED_GRACE_S = 300.0
"""How long past its deadline a used handle is remembered (clock skew between hosts)."""


class KVImporter(KVConnector):
    """Imports into `kv_tensors` (the engine's KV pools, block axis at dim 1; blocks of
    `block_size` tokens). `key`: the handoff key (None: this user's one-host key); `peers`:
    kv_peers (None: shared-memory handles of this host only, in the handoff directory); `tls`:
    tls.client_context's, for tcp peers (None: plain TCP)."""

    role = Phase.GENERATION

    def __init__(self, kv_tensors: list[torch.Tensor], block_size: int, key: bytes | None = None,
                 peers: str | None = None, tls: ssl.SSLContext | None = None) -> None:
        self.kv_tensors = kv_tensors
        self.block_size = block_size
        self.key = key if key is not None else auth.local_key()
        self.peers = parse_peers(peers) if peers else []
        self._shm = SharedMemoryImporter()
        if tls is not None and not self.peers:
            raise ValueError("kv_tls_ca_file is for fetching from context servers on other hosts: "
                             "this generation model has no kv_peers (it takes shared-memory handoffs)")
        self._tcp = TcpImporter(tls)
        self._used: dict[str, float] = {}  # mac -> deadline, of handles admitted once
        self.refused_total = 0
        """Handles refused by check_handoff."""

    def _for(self, handle: KVHandle) -> SharedMemoryImporter | TcpImporter:
        return self._tcp if handle.location.startswith("tcp://") else self._shm

    def check_handoff(self, handle: KVHandle, *, vocab_size: int, max_seq_len: int) -> None:
        try:
            self._check(handle, vocab_size, max_seq_len)
        except ValueError:
            self.refused_total += 1
            raise
        self._remember(handle)

    def _check(self, handle: KVHandle, vocab_size: int, max_seq_len: int) -> None:
        rid = handle.request_id[:64]
        if not handle.verify(self.key):
            raise ValueError(f"the KV handoff {rid!r} is not authenticated: its signature does not "
                             "match (forged or altered, or the context and generation models do "
                             "not share one kv_auth_key_file)")
        if handle.mac in self._used:
            raise ValueError(f"the KV handoff {rid!r} was already used (a handle is taken once)")
        self._check_location(handle)
        problems = self._range_problems(handle, vocab_size, max_seq_len)
        if problems:
            raise ValueError(f"the KV handoff {rid!r} does not fit this engine: {'; '.join(problems)}")

    def _range_problems(self, handle: KVHandle, vocab_size: int, max_seq_len: int) -> list[str]:
        """What in the handle's fields is out of this engine's range (empty: nothing)."""
        n = handle.num_tokens
        problems = []
        if handle.block_size != self.block_size:
            problems.append(f"block size {handle.block_size} (this engine: {self.block_size})")
        if not 0 < n == len(handle.prompt_token_ids) or n >= max_seq_len:
            problems.append(f"num_tokens={n} for {len(handle.prompt_token_ids)} prompt ids "
                            f"(max_seq_len {max_seq_len})")
        n_blocks = -(-n // self.block_size) - handle.first_block  # first_block: checked by the scheduler's window
        if not 0 <= handle.first_block < -(-n // self.block_size) or len(handle.blocks) != n_blocks \
                or len(set(handle.blocks)) != len(handle.blocks) or any(b < 0 for b in handle.blocks):
            problems.append(f"{len(handle.blocks)} blocks for {n} tokens (from block {handle.first_block})")
        if not 0 <= handle.first_token < vocab_size:
            problems.append(f"first_token={handle.first_token} outside the vocabulary (0..{vocab_size - 1})")
        if any(not 0 <= t < vocab_size for t in handle.prompt_token_ids):
            problems.append(f"prompt token ids outside the vocabulary (0..{vocab_size - 1})")
        if handle.slot < 0 or handle.nonce <= 0 or handle.nbytes < 0 or not 0 <= handle.seed < 1 << 64:
            problems.append("slot, nonce, nbytes or seed out of range")
        if len(handle.secret) != 2 * auth.SECRET_BYTES or not _HEX.fullmatch(handle.secret):
            problems.append("a malformed secret")
        state = handle.generator_state
        if state is not None and (len(state) > MAX_GENERATOR_STATE_CHARS or len(state) % 2
                                  or not _HEX.fullmatch(state)):
            problems.append("a malformed generator_state")
        if not handle.cum_logprob <= 0:
            problems.append(f"cum_logprob={handle.cum_logprob}")
        return problems

    def _check_location(self, handle: KVHandle) -> None:
        """Fetch only from the connector kind (and hosts) this engine was configured for."""
        location = handle.location
        if location.startswith("tcp://"):
            try:
                host, port = parse_address(location)
            except ValueError:
                host, port = "", -1
            if any(host.lower() == h and p in (None, port) for h, p in self.peers):
                return
            allowed = ", ".join(h if p is None else f"{h}:{p}" for h, p in self.peers)
            raise ValueError(f"the KV handoff names {location[:80]!r}, which is not a context "
                             "server this generation engine fetches from ("
                             + (f"kv_peers: {allowed}" if allowed else
                                "it takes shared-memory handoffs of this host; set kv_peers for "
                                "context servers on other hosts") + ")")
        if self.peers:
            raise ValueError("the KV handoff names a shared-memory segment; this generation engine "
                             "fetches from its kv_peers over tcp only")
        directory, name = os.path.split(location)
        if directory != auth.handoff_dir() or not SEGMENT_NAME.fullmatch(name):
            raise ValueError(f"the KV handoff names {location[:80]!r}, which is not a handoff "
                             f"segment of this host (in {auth.handoff_dir()})")

    def _remember(self, handle: KVHandle) -> None:
        now = time.time()
        if len(self._used) >= _MAX_USED:
            self._used = {m: d for m, d in self._used.items() if d + _USED_GRACE_S > now}
            while len(self._used) >= _MAX_USED:  # still full: forget the oldest admitted
                del self._used[next(iter(self._used))]
        self._used[handle.mac] = handle.deadline

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
