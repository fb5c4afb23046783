"""The network KV connector: a context server and a generation server on different hosts.

The context side stages a finished prefill's blocks exactly as the shared-memory connector does
(same segment, same state/ack words, same deadlines), and also serves them over TCP: the handle's
location is `tcp://HOST:PORT`. A generation side connects, names the handle (slot, nonce,
blocks), and receives

    header (4-byte length + JSON: ok, layout, nbytes | error) · the blocks · b"OK" / b"XX"

The blocks go tensor by tensor, K then V, block by block, straight from the staging area
(scatter-gather `sendmsg`) into the generation pool's blocks (`recvmsg_into`): no copy on
either side beyond the socket's own.

The server checks the handle before sending and again after (an expiry during the send turns
the trailer into b"XX" and the importer drops what it got), then acknowledges it: the owner's
poll frees the staging blocks as for a local handoff. One thread per connection; the copy out of
the staging area is the only work done for a request.
"""

from __future__ import annotations

import json
import socket
import threading
import time

import torch

from trtforge.config.runtime import parse_address
from trtforge.serving.kv_connector.handle import HandoffError, KVHandle
from trtforge.serving.kv_connector.shared_memory import SharedMemoryExporter, _layout

_SOCKET_TIMEOUT_S = 30.0
"""Longest wait on one connect or send/receive of a transfer (not the handoff's deadline)."""


class TcpExporter(SharedMemoryExporter):
    """Context side across hosts: stages blocks like SharedMemoryExporter and serves them on TCP
    at `listen` (tcp://HOST:PORT, port 0: any free one); handles name `advertise_host` (None: the
    listen host, or this host's name when it listens on every interface)."""

    def __init__(self, kv_tensors: list[torch.Tensor], num_blocks: int, block_size: int,
                 handoff_timeout_s: float, listen: str, advertise_host: str | None) -> None:
        super().__init__(kv_tensors, num_blocks, block_size, handoff_timeout_s)
        host, port = parse_address(listen)
        try:
            self._server = socket.create_server((host, port), reuse_port=False)
        except OSError as exc:
            super().close()
            raise ValueError(f"the KV connector cannot listen on {listen}: {exc}") from None
        port = self._server.getsockname()[1]
        if advertise_host is None:
            advertise_host = host if host not in ("0.0.0.0", "", "::") else socket.gethostname()
        self._location = f"tcp://{advertise_host}:{port}"
        self._closed = threading.Event()
        threading.Thread(target=self._accept, name="trtforge-kv-tcp", daemon=True).start()

    @property
    def location(self) -> str:
        return self._location

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                conn, _ = self._server.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        seg = self.segment
        with conn, conn.makefile("rb") as reader:
            conn.settimeout(_SOCKET_TIMEOUT_S)
            try:
                request = json.loads(reader.readline(1 << 20))
                slot, nonce = int(request["slot"]), int(request["nonce"])
                if int(seg.state[slot]) != nonce:
                    conn.sendall(_framed({"ok": False, "error": "expired before it was taken (its deadline "
                                                               "passed and the context server freed it)"}))
                    return
                if request.get("op") == "release":
                    seg.ack[slot] = nonce
                    conn.sendall(_framed({"ok": True}))
                    return
                views = _block_views(seg.staging, request["blocks"])
                conn.sendall(_framed({"ok": True, "layout": seg.layout,
                                      "nbytes": sum(len(v) for v in views)}))
                _scatter(conn.sendmsg, views)
                intact = int(seg.state[slot]) == nonce  # not expired while we copied
                conn.sendall(b"OK" if intact else b"XX")
                if intact:
                    seg.ack[slot] = nonce
            except (OSError, ValueError, KeyError):
                return  # the importer gets a broken connection: its request fails, the deadline frees

    def close(self) -> None:
        self._closed.set()
        try:
            try:  # wakes the accept() blocked in the other thread (a bare close() would not)
                self._server.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            self._server.close()
        finally:
            super().close()


class TcpImporter:
    """Generation side's transport for tcp:// handles: fetches a handle's blocks from its context
    server and copies them in (KVImporter picks it by the handle's location)."""

    def __init__(self) -> None:
        self.handoffs_done = 0
        self.bytes_total = 0
        self.seconds_total = 0.0

    def import_into(self, handle: KVHandle, kv_tensors: list[torch.Tensor], blocks: list[int]) -> None:
        if len(blocks) != len(handle.blocks):
            raise ValueError(f"{len(blocks)} destination blocks for a handle of {len(handle.blocks)}")
        start = time.perf_counter()
        direct = all(t.device.type == "cpu" and t.is_contiguous() for t in kv_tensors)
        # Straight into the pool's blocks; a GPU pool goes through a host buffer of the same shape.
        landing = kv_tensors if direct else [torch.empty((t.shape[0], len(blocks), *t.shape[2:]),
                                                         dtype=t.dtype) for t in kv_tensors]
        views = _block_views(landing, blocks if direct else list(range(len(blocks))))
        with _connect(handle) as conn:
            conn.sendall(_line({"op": "take", "slot": handle.slot, "nonce": handle.nonce,
                                "blocks": handle.blocks}))
            header = _header(conn, handle)
            if header["layout"] != _layout(kv_tensors):
                raise HandoffError(f"the KV layouts differ: context {header['layout']} vs generation "
                                   f"{_layout(kv_tensors)} (the two servers must serve the same engine)")
            if header["nbytes"] != sum(len(v) for v in views):
                raise HandoffError(f"the handoff of {handle.request_id} has {header['nbytes']} bytes; "
                                   f"its {len(blocks)} blocks hold {sum(len(v) for v in views)} here")
            _scatter(lambda b: conn.recvmsg_into(b)[0], views)
            trailer = _recv_exact(conn, 2)
        if trailer != b"OK":
            # The blocks were handed to the request; it fails, and they are freed with it.
            raise HandoffError(f"the KV handoff of {handle.request_id} expired while it was being sent")
        if not direct:
            index = torch.tensor(blocks, dtype=torch.long)
            for t, rows in zip(kv_tensors, landing):
                t.index_copy_(1, index.to(t.device), rows.to(t.device))
        self.seconds_total += time.perf_counter() - start
        self.bytes_total += header["nbytes"]
        self.handoffs_done += 1

    def release(self, handle: KVHandle) -> None:
        try:
            with _connect(handle) as conn:
                conn.sendall(_line({"op": "release", "slot": handle.slot, "nonce": handle.nonce}))
                _header(conn, handle)
        except (HandoffError, OSError, ValueError):
            pass  # gone or expired: nothing is held for it any more


def _connect(handle: KVHandle) -> socket.socket:
    host, port = parse_address(handle.location)
    try:
        conn = socket.create_connection((host, port), timeout=_SOCKET_TIMEOUT_S)
    except OSError as exc:
        raise HandoffError(f"the context server at {handle.location} holding the KV of "
                           f"{handle.request_id} cannot be reached ({exc}); it has gone away") from None
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return conn


def _header(conn: socket.socket, handle: KVHandle) -> dict:
    try:
        size = int.from_bytes(_recv_exact(conn, 4), "little")
        header = json.loads(_recv_exact(conn, size))
    except (OSError, ValueError) as exc:
        raise HandoffError(f"the context server at {handle.location} broke off the handoff: {exc}") from None
    if not header.get("ok"):
        raise HandoffError(f"the KV handoff of {handle.request_id} {header.get('error', 'failed')}")
    return header


def _line(obj: dict) -> bytes:
    return json.dumps(obj).encode() + b"\n"


def _framed(obj: dict) -> bytes:
    body = json.dumps(obj).encode()
    return len(body).to_bytes(4, "little") + body


def _recv_exact(conn: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    _scatter(lambda b: conn.recvmsg_into(b)[0], [memoryview(buf)])
    return bytes(buf)


def _block_views(tensors: list[torch.Tensor], blocks: list[int]) -> list[memoryview]:
    """Byte views of tensor[kv, blocks] for every tensor and K/V half, in wire order; a run of
    consecutive block ids is one view."""
    runs, start = [], 0
    for i in range(1, len(blocks) + 1):
        if i == len(blocks) or blocks[i] != blocks[i - 1] + 1:
            runs.append((blocks[start], blocks[i - 1] + 1))
            start = i
    return [memoryview(t[kv, lo:hi].numpy()).cast("B") for t in tensors for kv in range(t.shape[0])
            for lo, hi in runs]


_IOV_MAX = 512


def _scatter(op, views: list[memoryview]) -> None:
    """Run a scatter-gather socket call (sendmsg / recvmsg_into) until every view is done."""
    i, offset = 0, 0
    while i < len(views):
        batch = [views[i][offset:]] + views[i + 1:i + _IOV_MAX]
        try:
            n = op(batch)
        except OSError as exc:
            raise HandoffError(f"the KV handoff broke off: {exc}") from None
        if n == 0:
            raise HandoffError("the peer closed the connection in the middle of a KV handoff")
        while n:
            left = len(views[i]) - offset
            if n >= left:
                n, i, offset = n - left, i + 1, 0
            else:
                offset, n = offset + n, 0
