"""The KV handoff's key: what authenticates a handle between a context and a generation engine.

A handle is signed by the context side (HMAC-SHA256 over all its fields, with a key both sides
hold) and checked by the generation side before anything else is done with it; it also carries a
per-handoff secret (128 random bits) that the context side's connector compares, in constant
time, before it lets anyone take the handle's blocks. So a client that sends its own
`context_phase_params` cannot name another request's KV, alter a handle it was given, or guess one.

Where the key comes from (`handoff_key`), first match:

1. `kv_auth_key_file` (RuntimeConfig): a file only its owner may read (mode 0600 or stricter),
   holding at least 32 characters (e.g. `openssl rand -hex 32`);
2. the environment variable TRTFORGE_KV_AUTH_KEY (at least 32 characters);
3. one host (shared-memory connector, and a generation engine without `kv_peers`): a key created
   once per user beside the handoff segments (`{handoff dir}/trtforge-kv-key-{uid}`, 0600), so
   a one-host repository needs nothing configured; whoever can read the segments can read it.

Across hosts (tcp) there is no default: both sides must be given the same key (1 or 2).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import stat

KEY_ENV = "TRTFORGE_KV_AUTH_KEY"
"""Environment variable holding the handoff key (when no kv_auth_key_file is configured)."""
HANDOFF_DIR_ENV = "TRTFORGE_KV_HANDOFF_DIR"
"""Directory of the shared-memory segments (and of the one-host key); default /dev/shm."""
DEFAULT_DIR = "/dev/shm"
MIN_KEY_CHARS = 32
SECRET_BYTES = 16
"""Per-handoff secret: 128 random bits (hex in the handle)."""
_DOMAIN = b"trtforge kv handle v1\n"


class HandoffKeyError(ValueError):
    """The handoff key is missing, unreadable or unsafe (the message says what to do)."""


def handoff_dir() -> str:
    return os.environ.get(HANDOFF_DIR_ENV, DEFAULT_DIR)


def new_secret() -> str:
    return secrets.token_hex(SECRET_BYTES)


def new_nonce() -> int:
    """A slot's generation number: random (never predictable from another handle), never 0."""
    return secrets.randbits(62) + 1


def sign(key: bytes, message: bytes) -> str:
    return hmac.new(key, _DOMAIN + message, hashlib.sha256).hexdigest()


def verify(key: bytes, message: bytes, mac: str) -> bool:
    return hmac.compare_digest(sign(key, message), mac)


def handoff_key(key_file: str | None, one_host: bool) -> bytes:
    """The key of an engine: from `key_file`, else $TRTFORGE_KV_AUTH_KEY, else (one host only)
    the per-user key beside the segments. HandoffKeyError (a ValueError) saying what to configure."""
    if key_file:
        return read_key_file(key_file)
    env = os.environ.get(KEY_ENV, "")
    if env:
        if len(env.strip()) < MIN_KEY_CHARS:
            raise HandoffKeyError(f"{KEY_ENV} is too short: give at least {MIN_KEY_CHARS} random "
                            "characters (e.g. `openssl rand -hex 32`)")
        return env.strip().encode()
    if one_host:
        return local_key()
    raise HandoffKeyError("the tcp KV connector needs a key shared by the context and the generation "
                    "servers, and none is configured: write one with `openssl rand -hex 32 > "
                    "kv.key && chmod 600 kv.key`, copy it to both hosts and set kv_auth_key_file "
                    f"(emit-repo --context-kv-auth-key-file / --generation-kv-auth-key-file), or set "
                    f"{KEY_ENV} in both servers' environment (docs/scale-out.md)")


def read_key_file(path: str, what: str = "kv_auth_key_file", error: type[Exception] = HandoffKeyError) -> bytes:
    """The key in `path`: a regular file only this user can read, at least MIN_KEY_CHARS long;
    `error` naming `what` (the setting that named the file) otherwise. Shared with the
    tensor-parallel group key (serving/worker/tp_auth.py)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError as exc:
        raise error(f"{what} {path} cannot be read: {exc.strerror}") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise error(f"{what} {path} is not a regular file")
        if info.st_mode & 0o077:
            raise error(f"{what} {path} is accessible to other users (mode "
                        f"{stat.S_IMODE(info.st_mode):04o}): `chmod 600 {path}`")
        data = os.read(fd, 4096).strip()
    finally:
        os.close(fd)
    if len(data) < MIN_KEY_CHARS:
        raise error(f"{what} {path} holds {len(data)} characters: write at least "
                    f"{MIN_KEY_CHARS} random ones (e.g. `openssl rand -hex 32 > {path}`)")
    return data


def local_key(directory: str | None = None) -> bytes:
    """The one-host key of this user, created (0600) on first use; refused when the file is not
    this user's own or others may read it (someone else could have planted it)."""
    directory = directory or handoff_dir()
    path = os.path.join(directory, f"trtforge-kv-key-{os.geteuid()}")
    try:
        return _own_key(path)
    except FileNotFoundError:
        pass
    tmp = f"{path}.{secrets.token_hex(8)}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        os.write(fd, secrets.token_hex(32).encode())
    finally:
        os.close(fd)
    try:
        os.link(tmp, path)  # atomic: of two processes creating it at once, one key wins
    except FileExistsError:
        pass
    finally:
        os.unlink(tmp)
    return _own_key(path)


def _own_key(path: str) -> bytes:
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    try:
        info = os.fstat(fd)
        if info.st_uid != os.geteuid() or info.st_mode & 0o077 or not stat.S_ISREG(info.st_mode):
            raise HandoffKeyError(f"the KV handoff key {path} is not this user's own 0600 file; remove it "
                            "(or set kv_auth_key_file)")
        data = os.read(fd, 4096).strip()
    finally:
        os.close(fd)
    if len(data) < MIN_KEY_CHARS:
        raise HandoffKeyError(f"the KV handoff key {path} is truncated; remove it")
    return data
