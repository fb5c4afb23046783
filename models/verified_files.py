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
weight file. An unreadable or unwritable cache only means hashing again.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Callable

MIN_BYTES = 16 << 20
"""Smaller files are hashed every time (milliseconds); only big ones are worth a record."""
SETTLE_S = 2.0


def cache_dir() -> Path:
    root = os.environ.get("TRTFORGE_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "trtforge")
    return Path(root) / "verified"


def _stamp(path: Path) -> list[int]:
    st = os.stat(path)
    return [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]


def _record_path(path: Path, stamp: list[int]) -> Path:
    key = f"{stamp[0]}:{stamp[1]}:{path.resolve()}"
    return cache_dir() / (hashlib.sha256(key.encode()).hexdigest()[:32] + ".json")


def _recorded(path: Path, stamp: list[int]) -> str | None:
    try:
        record = json.loads(_record_path(path, stamp).read_text())
    except (OSError, ValueError):
        return None
    return record.get("sha256") if record.get("stamp") == stamp else None


def _remember(path: Path, stamp: list[int], digest: str) -> None:
    target = _record_path(path, stamp)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
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
    known = _recorded(path, before)
    if known is not None:
        return known
    started_ns = time.time_ns()
    digest = hash_file(path)
    settled = before[4] <= started_ns - int(SETTLE_S * 1e9)
    if settled and _stamp(path) == before:
        _remember(path, before, digest)
    return digest
