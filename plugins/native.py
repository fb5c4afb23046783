"""Build and load trtforge's small C kernels for the CPU, at first use, with the system compiler.

Why C, and why not a torch C++ extension: a CPU decode step of a 0.5B model is ~1,000 tiny ATen
ops (norms, RoPE, KV write, attention on one row) at 5–40 µs of dispatch each, ~20 % of the step
on a 2-core machine. A few fused C loops replace them. They only take raw pointers, so they
compile without PyTorch's headers in about a second (a `torch.utils.cpp_extension` build of the
same code takes ~1 minute on that machine) and are called through `ctypes` (~2 µs a call).

The shared library lands in `$TRTFORGE_CACHE_DIR` (default `~/.cache/trtforge`)/native, named by
a hash of the source, the compiler command and the CPU's flags (the code is built with
`-march=native`, so a cache shared between different machines must not mix binaries: the ISA is
chosen at compile time — the compiler's own instructions for native_vec.h's vector types, and
AVX2/FMA intrinsics under `#ifdef __AVX2__` in quant_linear.c and cpu_decode.c; plugins/kernels.py
reports which ISA this is). No
compiler, a failed build or `TRTFORGE_CPU_NATIVE=0`: `load` returns None, says why once in the
log, and callers keep their torch path — slower, same results.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shlex
import shutil
import subprocess
import tempfile
from pathlib import Path

log = logging.getLogger(__name__)

ENV_VAR = "TRTFORGE_CPU_NATIVE"
CFLAGS = ("-O3", "-march=native", "-std=c11", "-shared", "-fPIC", "-fno-math-errno")
"""No -ffast-math: the kernels must keep IEEE semantics (NaN checks, exp accuracy) for HF parity."""

_loaded: dict[str, ctypes.CDLL | None] = {}


def enabled() -> bool:
    return os.environ.get(ENV_VAR, "1") != "0"


def cache_dir() -> Path:
    root = os.environ.get("TRTFORGE_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "trtforge")
    return Path(root) / "native"


def cpu_flags() -> str:
    """The CPU's feature flags line from /proc/cpuinfo ("" where there is none): the build cache key
    and the instruction set the kernels registry reports (plugins/kernels.py)."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((ln for ln in f if ln.startswith(("flags", "Features"))), "")
    except OSError:
        return ""


def _compiler() -> list[str] | None:
    cc = shlex.split(os.environ.get("CC", "cc"))
    return cc if cc and shutil.which(cc[0]) else None


def build(source: Path, extra_flags: tuple[str, ...] = ()) -> Path:
    """Compile `source` into the cache (once per source/compiler/flags/CPU); returns the .so path.
    extra_flags: e.g. -fopenmp (the library then shares torch's libgomp.so.1 thread pool).

    Raises RuntimeError with the compiler's output when there is no compiler or the build fails."""
    cc = _compiler()
    if cc is None:
        raise RuntimeError(f"no C compiler found (tried {os.environ.get('CC', 'cc')!r}; set CC)")
    include = Path(__file__).parent  # native_vec.h and any other shared header
    text = source.read_bytes() + b"".join(h.read_bytes() for h in sorted(include.glob("*.h")))
    flags = (*CFLAGS, *extra_flags)
    key = hashlib.sha256(text + repr((cc, flags)).encode() + cpu_flags().encode()).hexdigest()[:16]
    out = cache_dir() / f"{source.stem}-{key}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    # Build into a temporary name and rename: concurrent processes (Triton model instances,
    # pytest workers) may build the same library at once, and none may load a half-written one.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    cmd = [*cc, *flags, f"-I{include}", "-o", tmp, str(source), "-lm"]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        if proc.returncode != 0:
            raise RuntimeError(f"`{shlex.join(cmd)}` failed ({proc.returncode}):\n{proc.stderr.strip()}")
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


def load(source: Path, signatures: dict[str, tuple[object, list[object]]],
         extra_flags: tuple[str, ...] = ()) -> ctypes.CDLL | None:
    """The compiled library of `source` with `signatures` ({name: (restype, argtypes)}) applied,
    or None when native kernels are disabled or cannot be built (the reason is logged once)."""
    name = str(source)
    if name in _loaded:
        return _loaded[name]
    lib = None
    if not enabled():
        log.info("native CPU kernels disabled (%s=0): using the torch path", ENV_VAR)
    else:
        try:
            lib = ctypes.CDLL(str(build(source, extra_flags)))
            for fn, (restype, argtypes) in signatures.items():
                getattr(lib, fn).restype = restype
                getattr(lib, fn).argtypes = argtypes
        except (RuntimeError, OSError, subprocess.SubprocessError, AttributeError) as err:
            log.warning("native CPU kernels from %s unavailable, using the torch path "
                        "(slower, same results): %s", source.name, err)
            lib = None
    _loaded[name] = lib
    return lib


class NativeLibrary:
    """One C source's library, built and loaded at its first `get()` and kept.

    Why an object: each kernel module needs the same lazy handle, and tests swap it (a wrapper
    that counts kernel calls, or None to force the torch path) by setting `lib`."""

    def __init__(self, source: Path, signatures: dict[str, tuple[object, list[object]]],
                 extra_flags: tuple[str, ...] = ()):
        self.source, self.signatures, self.extra_flags = source, signatures, extra_flags
        self.lib: ctypes.CDLL | None | bool = False
        """The loaded library; None where it cannot be built; False until the first `get()`."""

    def get(self) -> ctypes.CDLL | None:
        """The library (loaded now if not yet), or None where it cannot be built."""
        if self.lib is False:
            self.lib = load(self.source, self.signatures, self.extra_flags)
        return self.lib  # type: ignore[return-value]
