"""The one-host KV connector: a shared-memory segment between the context and generation processes.

The context process (the owner) creates one segment, sized like its KV pool but faulted in only
where used:

    [header: layout JSON] [state: int64 × H] [ack: int64 × H] [secret: 16 bytes × H]
    [staging copy of each KV tensor]

`save_kv` copies a finished prefill's blocks from the context engine's pool into free staging
blocks and publishes a signed handle in a free slot (secret[slot], then state[slot] = nonce); the
context engine can then free its pool blocks at once. A sliding-window model's prefill may have
freed its leading blocks already: only the live ones are staged (the handle's first_block). The
generation process maps the segment by path (0600: this user's processes only), checks the slot
holds the handle's nonce and secret and was not taken yet, copies the staging blocks into its own
pool and writes ack[slot] = nonce. The owner's `poll` frees the staging blocks of every
acknowledged handle, and of every handle past its deadline (state[slot] = 0 first).

Why this is safe without locks: only the owner writes `state`, only importers write `ack`, both
as aligned 8-byte stores. An importer checks state[slot] == nonce before *and after* its copy: a
handle that expired while it was copying fails (its blocks may have been reused), one that
passes the second check was intact for the whole copy. A late ack of an expired handle writes a
nonce nobody waits for any more. Nonces are random (62 bits, never 0, which marks a free slot) and
every handoff has its own secret, so a stale handle never matches a reused slot and no handle tells
the next one.
"""

from __future__ import annotations

import hmac
import json
import mmap
import os
import re
import secrets
import threading
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from trtforge.config.runtime import Phase
from trtforge.serving.core.kv_cache_manager import FREED_BLOCK
from trtforge.serving.kv_connector import auth
from trtforge.serving.kv_connector.base import HandoffStats, KVConnector
from trtforge.serving.kv_connector.handle import HandoffError, KVHandle

MAGIC = b"TRTFKV02"
HEADER_BYTES = 4096
_ALIGN = 64
DEFAULT_DIR = auth.DEFAULT_DIR
SEGMENT_NAME = re.compile(r"trtforge-kv-\d+-[0-9a-f]{10}")
"""The file name of a segment (what a shared-memory location may name, in the handoff directory)."""


def _layout(kv_tensors: list[torch.Tensor]) -> list[dict]:
    """Per tensor: its shape with the block axis (axis 1) left out, and its dtype."""
    return [{"shape": [t.shape[0], *t.shape[2:]], "dtype": str(t.dtype).removeprefix("torch.")}
            for t in kv_tensors]


def _block_bytes(layout: list[dict]) -> int:
    return sum(int(np.prod(x["shape"])) * torch.empty((), dtype=getattr(torch, x["dtype"])).element_size()
               for x in layout)


@dataclass
class _Segment:
    """A mapped segment: control arrays and one staging tensor per KV tensor."""

    path: str
    mm: mmap.mmap
    state: np.ndarray
    ack: np.ndarray
    secrets: np.ndarray
    """uint8 [H, 16]: each slot's handoff secret."""
    staging: list[torch.Tensor]
    layout: list[dict]
    num_blocks: int

    @classmethod
    def map(cls, path: str, create: dict | None = None) -> "_Segment":
        """Map an existing segment, or create one (create = {"layout", "num_blocks", "max_handles"})."""
        if create is not None:
            layout, nblocks, nhandles = create["layout"], create["num_blocks"], create["max_handles"]
            offsets, off = [], HEADER_BYTES + (16 + auth.SECRET_BYTES) * nhandles
            for x in layout:
                off = -(-off // _ALIGN) * _ALIGN
                offsets.append(off)
                item = torch.empty((), dtype=getattr(torch, x["dtype"])).element_size()
                off += int(np.prod(x["shape"])) * nblocks * item
            header = json.dumps({"layout": layout, "num_blocks": nblocks, "max_handles": nhandles,
                                 "offsets": offsets, "size": off}).encode()
            if len(header) + 12 > HEADER_BYTES:
                raise ValueError("KV layout too large for the segment header")
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                os.ftruncate(fd, off)  # sparse: pages are allocated when a handoff touches them
                mm = mmap.mmap(fd, off)
            finally:
                os.close(fd)
            mm[:12] = MAGIC + len(header).to_bytes(4, "little")
            mm[12:12 + len(header)] = header
        else:
            try:
                fd = os.open(path, os.O_RDWR)
            except FileNotFoundError:
                raise HandoffError(f"KV handoff segment {path} is gone (its context model was "
                                   "unloaded or restarted)") from None
            try:
                if os.fstat(fd).st_uid != os.geteuid():
                    raise HandoffError(f"{path} is not this user's KV handoff segment")
                mm = mmap.mmap(fd, 0)
            finally:
                os.close(fd)
            if mm[:8] != MAGIC:
                raise HandoffError(f"{path} is not a trtforge KV handoff segment")
        n = int.from_bytes(mm[8:12], "little")
        meta = json.loads(bytes(mm[12:12 + n]))
        nh = meta["max_handles"]
        state = np.frombuffer(mm, dtype=np.int64, count=nh, offset=HEADER_BYTES)
        ack = np.frombuffer(mm, dtype=np.int64, count=nh, offset=HEADER_BYTES + 8 * nh)
        secret = np.frombuffer(mm, dtype=np.uint8, count=auth.SECRET_BYTES * nh,
                               offset=HEADER_BYTES + 16 * nh).reshape(nh, auth.SECRET_BYTES)
        staging = []
        for x, off in zip(meta["layout"], meta["offsets"]):
            dtype = getattr(torch, x["dtype"])
            shape = [x["shape"][0], meta["num_blocks"], *x["shape"][1:]]
            count = int(np.prod(shape))
            staging.append(torch.frombuffer(mm, dtype=dtype, count=count, offset=off).view(shape))
        return cls(path, mm, state, ack, secret, staging, meta["layout"], meta["num_blocks"])

    def holds(self, handle: KVHandle) -> bool:
        """The handle's slot is live with its nonce and secret (compared in constant time)."""
        slot = handle.slot
        if not 0 <= slot < len(self.state) or handle.nonce <= 0:
            return False
        try:
            secret = bytes.fromhex(handle.secret)
        except ValueError:
            return False
        same = hmac.compare_digest(bytes(self.secrets[slot]), secret)
        return same and int(self.state[slot]) == handle.nonce


def live_blocks(block_ids: list[int]) -> tuple[int, list[int]]:
    """(index of the first live entry, the live entries) of a block table whose leading entries may
    be FREED_BLOCK (out of the sliding window); ValueError for a freed entry after a live one."""
    first = 0
    while first < len(block_ids) and block_ids[first] == FREED_BLOCK:
        first += 1
    live = block_ids[first:]
    if FREED_BLOCK in live or first == len(block_ids):
        raise ValueError(f"cannot hand over a block table whose freed entries are not exactly its leading "
                         f"ones, or that has no live block: {block_ids}")
    return first, live


def _copy_blocks(dst: list[torch.Tensor], dst_blocks: list[int], src: list[torch.Tensor],
                 src_blocks: list[int]) -> None:
    src_idx = torch.tensor(src_blocks, dtype=torch.long)
    dst_idx = torch.tensor(dst_blocks, dtype=torch.long)
    for d, s in zip(dst, src):
        rows = s.index_select(1, src_idx.to(s.device))
        d.index_copy_(1, dst_idx.to(d.device), rows.to(d.device))


@dataclass
class _Live:
    nonce: int
    blocks: list[int]
    deadline: float
    secret: str
    mac: str
    taken: bool = False
    """Claimed by a taker (tcp): a handle is served once."""


class SharedMemoryExporter(KVConnector):
    """Context side: owns the segment, its staging blocks and the handles' deadlines.
    `handoff_timeout_s`: how long a handle waits to be taken before its blocks are freed;
    `key`: the handoff key handles are signed with (None: this user's one-host key, auth.py)."""

    role = Phase.CONTEXT

    def __init__(self, kv_tensors: list[torch.Tensor], num_blocks: int, block_size: int,
                 handoff_timeout_s: float, directory: str | None = None,
                 max_handles: int = 4096, key: bytes | None = None) -> None:
        directory = directory or auth.handoff_dir()
        self.key = key if key is not None else auth.local_key(directory)
        _remove_orphans(directory)
        path = os.path.join(directory, f"trtforge-kv-{os.getpid()}-{secrets.token_hex(5)}")
        self.kv_tensors = kv_tensors
        self.block_size = block_size
        self.handoff_timeout_s = handoff_timeout_s
        self.segment = _Segment.map(path, create={"layout": _layout(kv_tensors),
                                                  "num_blocks": num_blocks, "max_handles": max_handles})
        self.num_blocks = num_blocks
        self.block_bytes = _block_bytes(self.segment.layout)
        self._free_blocks = deque(range(num_blocks))
        self._free_slots = deque(range(max_handles))
        self._live: dict[int, _Live] = {}
        self._lock = threading.Lock()  # _live: the engine thread and the tcp server's threads
        self.handoffs_done = 0
        """Handles taken (imported, or released unused) by a generation side."""
        self.handoffs_expired = 0
        """Handles freed because nobody took them before their deadline."""
        self.bytes_total = 0
        self.seconds_total = 0.0
        """Time spent copying blocks into the segment."""

    @property
    def path(self) -> str:
        return self.segment.path

    @property
    def location(self) -> str:
        """Where importers find the handles' blocks (the segment's path here)."""
        return self.path

    @property
    def blocks_held(self) -> int:
        """Staging blocks held by handles not yet taken or expired."""
        return self.num_blocks - len(self._free_blocks)

    def save_kv(self, request_id: str, block_ids: list[int], num_tokens: int, **state: Any) -> KVHandle:
        """Copy `block_ids` of the engine's pool into free staging blocks and publish a handle
        (KVConnector.save_kv). HandoffError when the staging area or the control table is full.
        Leading FREED_BLOCK entries (blocks freed out of the sliding window) are not sent: the
        handle's first_block says where its blocks start."""
        self.poll()
        first, block_ids = live_blocks(block_ids)
        n = len(block_ids)
        if n > len(self._free_blocks) or not self._free_slots:
            raise HandoffError(
                f"the KV handoff area is full ({self.blocks_held} of {self.num_blocks} blocks, "
                f"{len(self._live)} handles waiting for the generation model); retry later")
        start = time.perf_counter()
        blocks = [self._free_blocks.popleft() for _ in range(n)]
        slot = self._free_slots.popleft()
        _copy_blocks(self.segment.staging, blocks, self.kv_tensors, block_ids)
        seconds = time.perf_counter() - start
        nonce, secret = auth.new_nonce(), auth.new_secret()
        deadline = time.time() + self.handoff_timeout_s
        nbytes = n * self.block_bytes
        handle = KVHandle(request_id=request_id, location=self.location, slot=slot, nonce=nonce,
                          blocks=blocks, num_tokens=num_tokens, block_size=self.block_size,
                          deadline=deadline, nbytes=nbytes, export_seconds=seconds, secret=secret,
                          first_block=first, **state).sign(self.key)
        with self._lock:
            self._live[slot] = _Live(nonce, blocks, deadline, secret, handle.mac)
        self.segment.secrets[slot] = np.frombuffer(bytes.fromhex(secret), dtype=np.uint8)
        self.segment.state[slot] = nonce  # published: an importer may take it from now on
        self.bytes_total += nbytes
        self.seconds_total += seconds
        return handle

    def claim(self, slot: int, nonce: int, secret: str, mac: str, blocks: list[int] | None) -> _Live:
        """The live handoff a taker names, marked taken (`blocks`: the ids it names, which must be
        the handoff's own; None: a release). ValueError, saying why, for a free, expired, foreign,
        altered or already taken one; secrets and signatures are compared in constant time."""
        with self._lock:
            live = self._live.get(slot) if isinstance(slot, int) else None
            match = live is not None and isinstance(secret, str) and isinstance(mac, str)
            match = match and hmac.compare_digest(live.secret.encode(), secret.encode())
            match = match and hmac.compare_digest(live.mac.encode(), mac.encode()) and live.nonce == nonce
            if not match:
                raise ValueError("is not held by this context server (expired and freed, or never "
                                 "issued here: its slot, nonce, secret or signature do not match)")
            if time.time() > live.deadline:
                raise ValueError("expired before it was taken (its deadline passed and the context "
                                 "server frees it)")
            if live.taken:
                raise ValueError("was already taken (a handle is used once)")
            if blocks is not None and blocks != live.blocks:
                raise ValueError("names blocks that are not its own")
            live.taken = True
            return live

    def poll(self) -> None:
        """Free the staging blocks of handles taken since the last call, or past their deadline."""
        if not self._live:
            return
        now = time.time()
        seg = self.segment
        with self._lock:
            for slot, live in list(self._live.items()):
                if int(seg.ack[slot]) == live.nonce:
                    self.handoffs_done += 1
                elif now > live.deadline:
                    self.handoffs_expired += 1
                else:
                    continue
                seg.state[slot] = 0  # before the blocks are reused: an importer still copying fails
                seg.secrets[slot] = 0
                del self._live[slot]
                self._free_blocks.extend(live.blocks)
                self._free_slots.append(slot)

    def close(self) -> None:
        """Unlink the segment (importers still mapping it keep their mapping until they drop it)."""
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass

    def stats(self) -> HandoffStats:
        return HandoffStats(handoffs=self.handoffs_done, nbytes=self.bytes_total,
                            seconds=self.seconds_total, expired=self.handoffs_expired,
                            blocks_held=self.blocks_held)


class SharedMemoryImporter:
    """Generation side's transport for handles in a segment on this host: maps owners' segments
    on demand and copies handed-over blocks in (KVImporter picks it by the handle's location)."""

    def __init__(self) -> None:
        self._segments: dict[str, _Segment] = {}
        self.handoffs_done = 0
        self.bytes_total = 0
        self.seconds_total = 0.0
        """Time spent copying blocks into the engine's pool."""

    def _segment(self, path: str) -> _Segment:
        seg = self._segments.get(path)
        if seg is None or not os.path.exists(path):
            self._segments.pop(path, None)
            seg = self._segments[path] = _Segment.map(path)
        return seg

    def import_into(self, handle: KVHandle, kv_tensors: list[torch.Tensor], blocks: list[int]) -> None:
        """Copy the handle's blocks into `blocks` of the engine's pool, then acknowledge it.
        HandoffError if it expired (before or during the copy) or its owner is gone."""
        seg = self._segment(handle.location)
        if seg.layout != _layout(kv_tensors):
            raise HandoffError(f"the KV layouts differ: context {seg.layout} vs generation "
                               f"{_layout(kv_tensors)} (the two models must serve the same engine)")
        if len(blocks) != len(handle.blocks):
            raise ValueError(f"{len(blocks)} destination blocks for a handle of {len(handle.blocks)}")
        if not all(0 <= b < seg.num_blocks for b in handle.blocks):
            raise HandoffError(f"the handoff of {handle.request_id} names blocks outside its segment")
        self._check(seg, handle, "before it was taken")
        if int(seg.ack[handle.slot]) == handle.nonce:
            raise HandoffError(f"the KV handoff of {handle.request_id} was already taken (a handle "
                               "is used once)")
        start = time.perf_counter()
        _copy_blocks(kv_tensors, blocks, seg.staging, handle.blocks)
        self._check(seg, handle, "while it was being copied")
        seg.ack[handle.slot] = handle.nonce
        self.seconds_total += time.perf_counter() - start
        self.bytes_total += handle.nbytes
        self.handoffs_done += 1

    def release(self, handle: KVHandle) -> None:
        """Tell the owner the handle will not be imported (the request ended first)."""
        try:
            seg = self._segment(handle.location)
        except HandoffError:
            return  # the owner is gone: nothing is held any more
        if seg.holds(handle):
            seg.ack[handle.slot] = handle.nonce

    @staticmethod
    def _check(seg: _Segment, handle: KVHandle, when: str) -> None:
        if not seg.holds(handle):
            raise HandoffError(f"the KV handoff of {handle.request_id} expired {when} (its deadline "
                               "passed and the context model freed it)")


_ORPHAN = re.compile(r"trtforge-kv-(\d+)-[0-9a-f]+$")


def _remove_orphans(directory: str) -> None:
    """Remove segments left by context processes that died without closing them."""
    try:
        names = os.listdir(directory)
    except OSError:
        return
    for name in names:
        m = _ORPHAN.match(name)
        if m and not Path(f"/proc/{m.group(1)}").exists():
            try:
                os.unlink(os.path.join(directory, name))
            except OSError:
                pass
