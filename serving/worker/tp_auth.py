"""Who may be a rank: the tensor-parallel group's key and the proof every rank gives of it.

torch.distributed authenticates nothing: whoever reaches rank 0's store (MASTER_ADDR:MASTER_PORT)
can register as a rank, receive every step's token ids and send back numbers that end up in
every answer. So right after joining, before rank 0 sends anything else, every rank proves it
holds the group's key over the group's own connections (`prove`): each draws 128 random bits,
all of them are gathered, and each rank sends HMAC-SHA256(key, all the nonces, its rank), which
every other rank checks in constant time. A process without the key is refused with a clear
error by the ranks it joined, and a stale proof is worth nothing (the nonces are new each time).
The traffic itself is not encrypted (docs/scale-out.md).

Where the key comes from (`group_key`), first match:

1. TRTFORGE_TP_AUTH_KEY_FILE: a file only its owner may read (0600), at least 32 characters
   (`openssl rand -hex 32`);
2. TRTFORGE_TP_AUTH_KEY (at least 32 characters) — also how rank 0 hands its key to the ranks it
   starts;
3. every rank on this host (MASTER_ADDR a loopback address): rank 0 that starts all the other
   ranks itself draws a fresh key; ranks launched separately (torchrun, NNODES on one host) use
   the per-user one-host key beside the KV handoff segments (kv_connector/auth.py).

Across hosts there is no default: every host must be given the same key (1 or 2).
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import os
import secrets
import socket
from typing import Mapping

import torch

from trtforge.serving.kv_connector.auth import MIN_KEY_CHARS, HandoffKeyError, local_key, read_key_file

KEY_ENV = "TRTFORGE_TP_AUTH_KEY"
KEY_FILE_ENV = "TRTFORGE_TP_AUTH_KEY_FILE"
_DOMAIN = b"trtforge tensor-parallel group v1\n"
_NONCE_WORDS = 2  # 128 bits as two int64
_TAG_WORDS = 4  # an HMAC-SHA256 as four int64


class GroupAuthError(ValueError):
    """The group's key is missing or unsafe, or a rank did not prove it (the message says which)."""


def is_loopback(host: str) -> bool:
    """True when every address `host` resolves to is a loopback one (127.0.0.0/8, ::1)."""
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except OSError:
        return False
    return bool(infos) and all(ipaddress.ip_address(i[4][0].split("%")[0]).is_loopback for i in infos)


def group_key(master_addr: str, spawns_all: bool, env: Mapping[str, str] | None = None) -> bytes:
    """The key of this launch (see the module docstring). `spawns_all`: this process is rank 0
    and starts every other rank itself."""
    env = os.environ if env is None else env
    if env.get(KEY_FILE_ENV):
        return _read_key_file(env[KEY_FILE_ENV])
    given = env.get(KEY_ENV, "").strip()
    if given:
        if len(given) < MIN_KEY_CHARS:
            raise GroupAuthError(f"{KEY_ENV} is too short: give at least {MIN_KEY_CHARS} random "
                                 "characters (e.g. `openssl rand -hex 32`)")
        return given.encode()
    if is_loopback(master_addr):
        if spawns_all:
            return secrets.token_hex(32).encode()
        try:
            return local_key()
        except (OSError, HandoffKeyError) as exc:
            raise GroupAuthError(f"no tensor-parallel key is configured and the one-host key cannot "
                                 f"be used ({exc}): set {KEY_FILE_ENV} or {KEY_ENV} on every rank") from None
    raise GroupAuthError(
        f"ranks on several hosts (MASTER_ADDR={master_addr}) need a key shared by every rank, and none is "
        f"configured: write one with `openssl rand -hex 32 > tp.key && chmod 600 tp.key`, copy it to "
        f"every host and set {KEY_FILE_ENV}=tp.key (or {KEY_ENV}) for every rank (docs/scale-out.md)")


def _read_key_file(path: str) -> bytes:
    return read_key_file(path, KEY_FILE_ENV, GroupAuthError)


def _tag(key: bytes, nonces: bytes, rank: int) -> bytes:
    return hmac.new(key, _DOMAIN + nonces + rank.to_bytes(4, "little"), hashlib.sha256).digest()


def _words(data: bytes, device: torch.device) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.int64).to(device)


def _bytes(t: torch.Tensor) -> bytes:
    return t.cpu().contiguous().numpy().tobytes()


def prove(key: bytes, rank: int, world: int, device: torch.device, all_gather) -> None:
    """Every rank calls it right after joining. `all_gather(tensor) -> [world, n] tensor` (the
    group's collective). GroupAuthError naming the ranks whose proof is wrong."""
    nonces = _bytes(all_gather(_words(secrets.token_bytes(8 * _NONCE_WORDS), device)))
    tags = all_gather(_words(_tag(key, nonces, rank), device))
    wrong = [r for r in range(world) if r != rank
             and not hmac.compare_digest(_bytes(tags[r]), _tag(key, nonces, r))]
    if wrong:
        raise GroupAuthError(
            f"rank {rank}: rank(s) {wrong} did not prove the tensor-parallel group's key: a process "
            f"that is not one of this engine's ranks joined at MASTER_ADDR:MASTER_PORT, or the hosts "
            f"were given different keys ({KEY_FILE_ENV} / {KEY_ENV}); nothing was sent to them")
