"""Remember which large files were hashed, so an unchanged weight file is not re-hashed at every load.

Why: sha256 of a 0.5B model's float32 weights (2 GB) takes ~1.7 s on a 2-core machine, eight times
as long as mapping the file from the page cache — the checksum, not the weights, would be the
start-up time of every `trtforge generate` and of every Triton model load.

A record maps a file's stamp (device, inode, size, mtime_ns, ctime_ns) to the digest it had. Writing
to a file, truncating it, or replacing it changes its ctime or its inode, and no user tool can set
a ctime back, so a matching stamp means the bytes are those that were hashed. ctime ticks coarsely
(a kernel tick), so as in git's "racily clean" rule a record is kept only for a file whose ctime was
already `SETTLE_S` old when hashing began: a write in the same tick as the hash cannot hide.

Records live in `$TRTFORGE_CACHE_DIR` (default `~/.cache/trtforge`)/verified, one small JSON file per
weight file. A record vouches for a file's bytes, so the directory must be one only this user can
write (plugins/native.private_dir: created 0700; another owner, group/world-writable, or a parent
that lets others swap it): else records are neither read nor written and every file is hashed, as
with an unreadable or unwritable cache — another user sharing TRTFORGE_CACHE_DIR could otherwise
plant a record that passes a modified weight file.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
import time
from pathlib import Path
from typing import Callable

from trtforge.plugins.native import UnsafeCacheDir, cache_root, private_dir

log = logging.getLogger(__name__)

MIN_BYTES = 16 << 20
"""Smaller files are hashed every time (milliseconds); only big ones are worth a record."""
SETTLE_S = 2.0


def cache_dir() -> Path:
    return cache_root() / "verified"


_warned: set[Path] = set()


def _private_cache_dir() -> Path | None:
    """cache_dir() where only this user can write it; None (said once per directory) otherwise."""
    directory = cache_dir()
    try:
        return private_dir(directory)
    except UnsafeCacheDir as err:
        if directory not in _warned:
            _warned.add(directory)
            log.warning("not using remembered checksums (every engine file is hashed at load): %s", err)
    except OSError:
        pass  # unwritable: hashing again is all it costs
    return None


def _stamp(path: Path) -> list[int]:
    st = os.stat(path)
    return [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]


def _record_path(directory: Path, path: Path, stamp: list[int]) -> Path:
    key = f"{stamp[0]}:{stamp[1]}:{path.resolve()}"
    return directory / (hashlib.sha256(key.encode()).hexdigest()[:32] + ".json")


def _recorded(directory: Path, path: Path, stamp: list[int]) -> str | None:
    try:
        record = json.loads(_record_path(directory, path, stamp).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(record, dict):
        return None
    return record.get("sha256") if record.get("stamp") == stamp else None


def _remember(directory: Path, path: Path, stamp: list[int], digest: str) -> None:
    target = _record_path(directory, path, stamp)
    try:
        fd, tmp = tempfile.mkstemp(dir=target.parent, suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            json.dump({"file": str(path.resolve()), "stamp": stamp, "sha256": digest}, f)
        os.replace(tmp, target)  # atomic: concurrent loaders never read half a record
    except OSError:
        pass


def digest_of(path: Path, hash_file: Callable[[Path], str]) -> str:
    """hash_file(path), or the digest recorded for this exact unchanged file."""
    before = _stamp(path)
    if before[2] < MIN_BYTES:
        return hash_file(path)
    directory = _private_cache_dir()
    if directory is None:
        return hash_file(path)
    known = _recorded(directory, path, before)
    if known is not None:
        return known
    started_ns = time.time_ns()
    digest = hash_file(path)
    settled = before[4] <= started_ns - int(SETTLE_S * 1e9)
    if settled and _stamp(path) == before:
        _remember(directory, path, before, digest)
    return digest
