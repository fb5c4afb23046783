"""The network KV connector: a context server and a generation server on different hosts.

The context side stages a finished prefill's blocks exactly as the shared-memory connector does
(same segment, same state/ack words, same deadlines), and also serves them over TCP: the handle's
location is `tcp://HOST:PORT`. A generation side connects, names the handle in one line of JSON
(op, slot, nonce, secret, mac; at most 4 KiB, within 5 s), and receives

    header (4-byte length ≤ 64 KiB + JSON: ok, layout, nbytes | error) · the blocks · b"OK" / b"XX"

The server serves a handle only to whoever names its slot, nonce, secret and signature (compared
in constant time with what it issued), only once, only before its deadline, and only its own
blocks (from its own record: a request that names block ids must name exactly those). It listens where
kv_connector says (tcp://:PORT: loopback), serves at most 32 connections at once and gives each
transfer a deadline, so a client that connects and never finishes holds a thread for seconds,
not forever. With TLS configured (tls.py: a certificate on the context side, a CA on the
generation side, mutual TLS optional) every connection is TLS from its first byte, and the TLS
handshake shares the request line's 5 s.

The blocks go tensor by tensor, K then V, block by block, straight from the staging area
(scatter-gather `sendmsg`) into the generation pool's blocks (`recvmsg_into`): no copy on
either side beyond the socket's own (under TLS: `send` / `recv_into` view by view, through the
TLS records).

The server checks the handle's slot again after sending (an expiry during the send turns the
trailer into b"XX" and the importer drops what it got), then acknowledges it: the owner's poll
frees the staging blocks as for a local handoff.
"""

from __future__ import annotations

import json
import socket
import ssl
import threading
import time

import torch

from trtforge.config.runtime import parse_address, parse_listen_address
from trtforge.serving.kv_connector.handle import HandoffError, KVHandle
from trtforge.serving.kv_connector.shared_memory import SharedMemoryExporter, _layout

_SOCKET_TIMEOUT_S = 30.0
"""Longest a whole transfer may take (connect, request, header, blocks), either side."""
_REQUEST_TIMEOUT_S = 5.0
"""Longest the server waits for a connection's request line."""
MAX_REQUEST_BYTES = 4096
"""Longest request line the server reads."""
MAX_HEADER_BYTES = 1 << 16
"""Longest response header the importer reads (checked before anything is allocated for it)."""
MAX_CONNECTIONS = 32
"""Connections the server serves at once; more are closed at once."""


class TcpExporter(SharedMemoryExporter):
    """Context side across hosts: stages blocks like SharedMemoryExporter and serves them on TCP
    at `listen` (tcp://HOST:PORT, port 0: any free one; no host: 127.0.0.1); handles name
    `advertise_host` (None: the listen host, or this host's name when it listens on every
    interface). `key`: the handoff key (SharedMemoryExporter); `tls`: tls.server_context's (None:
    plain TCP)."""

    def __init__(self, kv_tensors: list[torch.Tensor], num_blocks: int, block_size: int,
                 handoff_timeout_s: float, listen: str, advertise_host: str | None,
                 key: bytes | None = None, tls: ssl.SSLContext | None = None) -> None:
        super().__init__(kv_tensors, num_blocks, block_size, handoff_timeout_s, key=key)
        self._tls = tls
        host, port = parse_listen_address(listen)
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
        self._slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        self.connections_refused = 0
        """Connections closed at once because MAX_CONNECTIONS were being served."""
        self.tls_failures = 0
        """Connections closed because their TLS handshake failed (no or a wrong certificate,
        plain TCP, too slow)."""
        threading.Thread(target=self._accept, name="trtforge-kv-tcp", daemon=True).start()

    @property
    def location(self) -> str:
        return self._location

    @property
    def address(self) -> tuple[str, int]:
        """Where the server listens (host, port)."""
        return self._server.getsockname()[:2]

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                conn, _ = self._server.accept()
            except OSError:
                return
            if not self._slots.acquire(blocking=False):
                self.connections_refused += 1
                conn.close()
                continue
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        deadline = time.monotonic() + _SOCKET_TIMEOUT_S
        try:
            if self._tls is not None:
                try:
                    conn = _handshake(self._tls, conn)
                except (OSError, ValueError):  # closed by _handshake
                    self.tls_failures += 1
                    return
            with conn:
                self._answer(conn, deadline)
        except (OSError, HandoffError):
            pass  # the importer gets a broken connection: its request fails, the deadline frees
        finally:
            self._slots.release()

    def _answer(self, conn: socket.socket, deadline: float) -> None:
        seg = self.segment
        try:
            request = json.loads(_read_line(conn, min(deadline, time.monotonic() + _REQUEST_TIMEOUT_S)))
            if not isinstance(request, dict) or request.get("op") not in ("take", "release"):
                raise ValueError("is not a request (op take or release)")
            blocks = request.get("blocks") if request["op"] == "take" else None
            if blocks is not None and not isinstance(blocks, list):
                raise ValueError("names blocks that are not a list")
            live = self.claim(request.get("slot"), request.get("nonce"), request.get("secret"),
                              request.get("mac"), blocks)
        except (ValueError, RecursionError) as exc:  # JSON, size, or the handoff refused: say why
            _send(conn, _framed({"ok": False, "error": str(exc) or type(exc).__name__}), deadline)
            _linger(conn)
            return
        slot, nonce = request["slot"], live.nonce
        if request["op"] == "release":
            seg.ack[slot] = nonce
            _send(conn, _framed({"ok": True}), deadline)
            return
        views = _block_views(seg.staging, live.blocks)
        _send(conn, _framed({"ok": True, "layout": seg.layout, "nbytes": sum(len(v) for v in views)}),
              deadline)
        _scatter(conn, "sendmsg", views, deadline)
        intact = int(seg.state[slot]) == nonce  # not expired while we copied
        if intact:  # before the trailer: when the importer is done, the owner's poll can free it
            seg.ack[slot] = nonce
        _send(conn, b"OK" if intact else b"XX", deadline)

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
    server and copies them in (KVImporter picks it by the handle's location, once check_handoff
    has authenticated it and found the host among the allowed peers). `tls`:
    tls.client_context's (None: plain TCP)."""

    def __init__(self, tls: ssl.SSLContext | None = None) -> None:
        self._tls = tls
        self.handoffs_done = 0
        self.bytes_total = 0
        self.seconds_total = 0.0

    def import_into(self, handle: KVHandle, kv_tensors: list[torch.Tensor], blocks: list[int]) -> None:
        if len(blocks) != len(handle.blocks):
            raise ValueError(f"{len(blocks)} destination blocks for a handle of {len(handle.blocks)}")
        start = time.perf_counter()
        deadline = time.monotonic() + _SOCKET_TIMEOUT_S
        direct = all(t.device.type == "cpu" and t.is_contiguous() for t in kv_tensors)
        # Straight into the pool's blocks; a GPU pool goes through a host buffer of the same shape.
        landing = kv_tensors if direct else [torch.empty((t.shape[0], len(blocks), *t.shape[2:]),
                                                         dtype=t.dtype) for t in kv_tensors]
        views = _block_views(landing, blocks if direct else list(range(len(blocks))))
        with _connect(handle, self._tls) as conn:
            _send(conn, _request(handle, "take"), deadline)
            header = _header(conn, handle, deadline)
            if header.get("layout") != _layout(kv_tensors):
                raise HandoffError(f"the KV layouts differ: context {header.get('layout')} vs "
                                   f"generation {_layout(kv_tensors)} (the two servers must serve "
                                   "the same engine)")
            if header.get("nbytes") != sum(len(v) for v in views):
                raise HandoffError(f"the handoff of {handle.request_id} has {header.get('nbytes')} "
                                   f"bytes; its {len(blocks)} blocks hold {sum(len(v) for v in views)} here")
            _scatter(conn, "recvmsg_into", views, deadline)
            trailer = _recv_exact(conn, 2, deadline)
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
            deadline = time.monotonic() + _REQUEST_TIMEOUT_S
            with _connect(handle, self._tls, _REQUEST_TIMEOUT_S) as conn:
                _send(conn, _request(handle, "release"), deadline)
                _header(conn, handle, deadline)
        except (HandoffError, OSError, ValueError):
            pass  # gone or expired: nothing is held for it any more


def _request(handle: KVHandle, op: str) -> bytes:
    # No block ids: the server sends the handle's own blocks, from its own record.
    request = {"op": op, "slot": handle.slot, "nonce": handle.nonce, "secret": handle.secret,
               "mac": handle.mac}
    return json.dumps(request, separators=(",", ":")).encode() + b"\n"


def _connect(handle: KVHandle, tls: ssl.SSLContext | None,
             timeout_s: float = _SOCKET_TIMEOUT_S) -> socket.socket:
    host, port = parse_address(handle.location)
    try:
        conn = socket.create_connection((host, port), timeout=timeout_s)
    except OSError as exc:
        raise HandoffError(f"the context server at {handle.location} holding the KV of "
                           f"{handle.request_id} cannot be reached ({exc}); it has gone away") from None
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    if tls is None:
        return conn
    try:  # checks the certificate against kv_tls_ca_file and the location's host name
        return tls.wrap_socket(conn, server_hostname=host)
    except (OSError, ValueError) as exc:
        conn.close()
        raise HandoffError(f"the TLS handshake with the context server at {handle.location} failed "
                           f"({exc}): its certificate must be signed by kv_tls_ca_file and name "
                           f"{host!r}") from None


def _handshake(tls: ssl.SSLContext, conn: socket.socket) -> ssl.SSLSocket:
    """The server side of a connection's TLS handshake, within the request line's time."""
    conn.settimeout(_REQUEST_TIMEOUT_S)
    wrapped = tls.wrap_socket(conn, server_side=True, do_handshake_on_connect=False)
    try:
        wrapped.do_handshake()
    except BaseException:
        wrapped.close()
        raise
    return wrapped


def _header(conn: socket.socket, handle: KVHandle, deadline: float) -> dict:
    try:
        size = int.from_bytes(_recv_exact(conn, 4, deadline), "little")
        if size > MAX_HEADER_BYTES:  # before anything is allocated for it
            raise ValueError(f"a {size}-byte header (at most {MAX_HEADER_BYTES})")
        header = json.loads(_recv_exact(conn, size, deadline))
        if not isinstance(header, dict):
            raise ValueError("the header is not a JSON object")
    except (OSError, ValueError, HandoffError) as exc:
        raise HandoffError(f"the context server at {handle.location} broke off the handoff: {exc}") from None
    if header.get("ok") is not True:
        raise HandoffError(f"the KV handoff of {handle.request_id} {header.get('error', 'failed')}")
    return header


def _framed(obj: dict) -> bytes:
    body = json.dumps(obj).encode()
    return len(body).to_bytes(4, "little") + body


def _remaining(conn: socket.socket, deadline: float) -> None:
    """Give the next socket call what is left of the transfer's deadline."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise HandoffError("the KV handoff took longer than its deadline")
    conn.settimeout(left)


def _send(conn: socket.socket, data: bytes, deadline: float) -> None:
    _scatter(conn, "sendmsg", [memoryview(data)], deadline)


def _linger(conn: socket.socket, max_bytes: int = 1 << 16, timeout_s: float = 0.2) -> None:
    """Close gracefully after an error answer: unread input would turn the close into a reset
    that can discard the answer before the client reads it."""
    try:
        if not isinstance(conn, ssl.SSLSocket):  # (a TLS socket has no half-close)
            conn.shutdown(socket.SHUT_WR)
        conn.settimeout(timeout_s)
        while max_bytes > 0:
            chunk = conn.recv(min(max_bytes, 4096))
            if not chunk:
                return
            max_bytes -= len(chunk)
    except OSError:
        pass


def _read_line(conn: socket.socket, deadline: float) -> bytes:
    """One request line, at most MAX_REQUEST_BYTES, by `deadline` (ValueError otherwise)."""
    buf = bytearray()
    while True:
        try:
            _remaining(conn, deadline)
            chunk = conn.recv(MAX_REQUEST_BYTES + 1 - len(buf))
        except (OSError, HandoffError):
            raise ValueError("no complete request line in time") from None
        if not chunk:
            raise ValueError("the connection closed before a request line")
        buf += chunk
        if b"\n" in buf:
            return bytes(buf[:buf.index(b"\n")])
        if len(buf) > MAX_REQUEST_BYTES:
            raise ValueError(f"the request line is longer than {MAX_REQUEST_BYTES} bytes")


def _recv_exact(conn: socket.socket, n: int, deadline: float) -> bytes:
    buf = bytearray(n)
    _scatter(conn, "recvmsg_into", [memoryview(buf)], deadline)
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


def _scatter(conn: socket.socket, op: str, views: list[memoryview], deadline: float) -> None:
    """Run a scatter-gather socket call (sendmsg / recvmsg_into) until every view is done, or
    the transfer's deadline passes (HandoffError)."""
    if isinstance(conn, ssl.SSLSocket):  # no scatter-gather through TLS: one view per call
        call = (lambda b: conn.send(b[0])) if op == "sendmsg" else (lambda b: conn.recv_into(b[0]))
    else:
        call = conn.sendmsg if op == "sendmsg" else (lambda b: conn.recvmsg_into(b)[0])
    i, offset = 0, 0
    while i < len(views):
        if not len(views[i]):
            i += 1
            continue
        batch = [views[i][offset:]] + views[i + 1:i + _IOV_MAX]
        try:
            _remaining(conn, deadline)
            n = call(batch)
        except ssl.SSLError as exc:
            raise HandoffError(f"the KV handoff's TLS connection broke off ({exc}); a context server "
                               "with mutual TLS closes it when this server's certificate "
                               "(kv_tls_cert_file) is missing or not signed by its kv_tls_ca_file") from None
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
