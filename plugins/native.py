"""Build and load trtforge's small C kernels for the CPU, at first use, with the system compiler.

Why C, and why not a torch C++ extension: a CPU decode step of a 0.5B model is ~1,000 tiny ATen
ops (norms, RoPE, KV write, attention on one row) at 5–40 µs of dispatch each, ~20 % of the step
on a 2-core machine. A few fused C loops replace them. They only take raw pointers, so they
compile without PyTorch's headers in about a second (a `torch.utils.cpp_extension` build of the
same code takes ~1 minute on that machine) and are called through `ctypes` (~2 µs a call).

The ISA is chosen at run time, per process: `isa()` is what this CPU has ("avx512": AVX-512
F/BW/VL + AVX2/FMA; "avx2": AVX2 + FMA; "portable": anything else), or a lower one named by
`TRTFORGE_CPU_ISA` (avx2 or portable: how tests and benchmarks run the other code paths on an
AVX-512 machine). Each source is compiled for that ISA (`ISA_FLAGS`: -march=native for the CPU's
own ISA, -march=haswell for a forced AVX2, the compiler's baseline for portable), so the same C
takes AVX-512 code (512-bit vector types, `#ifdef __AVX512F__`), AVX2/FMA intrinsics under
`#ifdef __AVX2__`, or plain loops. `NativeLibrary.for_isa` builds one source for another ISA in
the same process (tests check every path against its reference that way).

The shared library lands in `$TRTFORGE_CACHE_DIR` (default `~/.cache/trtforge`)/native, named by
a hash of the source, the compiler command (with the ISA's flags) and the CPU's flags, so a cache
shared between different machines never mixes binaries. No
compiler, a failed build or `TRTFORGE_CPU_NATIVE=0`: `load` returns None, says why once in the
log, and callers keep their torch path — slower, same results.

The cache is code this process runs, so nobody else may write it (`private_dir`): the directory is
created 0700 and refused (torch path, with the reason) when another user owns it, its group or
everyone may write it, or a directory above it lets another user swap it (writable by others
without the sticky bit, or owned by someone other than this user or root). Each build writes a
record `NAME-KEY.json` (atomically, after the library) with the full sha256 of the build inputs
and of the library, which is stored under its own digest (`NAME-KEY-SO.so`, so concurrent builds
never leave a record naming other bytes); a library is loaded only when its bytes match the
record, otherwise it is rebuilt. A planted or truncated .so is therefore never loaded.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import logging
import os
import shlex
import shutil
import stat
import subprocess
import tempfile
from pathlib import Path

log = logging.getLogger(__name__)

ENV_VAR = "TRTFORGE_CPU_NATIVE"
ISA_ENV = "TRTFORGE_CPU_ISA"
ISAS = ("avx512", "avx2", "portable")
"""The instruction sets the kernels are built for, best first."""
CFLAGS = ("-O3", "-std=c11", "-shared", "-fPIC", "-fno-math-errno")
"""No -ffast-math: the kernels must keep IEEE semantics (NaN checks, exp accuracy) for HF parity."""
ISA_FLAGS = {"native": ("-march=native",), "avx2": ("-march=haswell", "-mtune=generic"), "portable": ()}
"""Compiler flags per ISA: the CPU's own ISA is built with -march=native (everything it has),
a lower forced one with that ISA's baseline."""

_loaded: dict[str, ctypes.CDLL | None] = {}


def enabled() -> bool:
    return os.environ.get(ENV_VAR, "1") != "0"


def cache_root() -> Path:
    """`$TRTFORGE_CACHE_DIR`, default `~/.cache/trtforge`: native libraries and remembered digests
    (models/verified_files.py) below it."""
    return Path(os.environ.get("TRTFORGE_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "trtforge"))


def cache_dir() -> Path:
    return cache_root() / "native"


class UnsafeCacheDir(RuntimeError):
    """A cache directory that someone other than this user could write."""


def private_dir(path: Path) -> Path:
    """`path`, created 0700 where missing, once it is sure that only this user (or root) can change
    what is in it; UnsafeCacheDir saying who else could, and what to do, otherwise."""
    missing = [p for p in (path, *path.parents) if not p.exists()]
    for directory in reversed(missing):  # ~/.cache/trtforge too: 0700 whatever the umask
        directory.mkdir(mode=0o700, exist_ok=True)
    reason = _others_can_write(path)
    if reason is not None:
        raise UnsafeCacheDir(f"{reason}: another user could plant files there that trtforge would trust. "
                             f"Make it private, or point TRTFORGE_CACHE_DIR at a directory only you can "
                             f"write (e.g. `mkdir -m 700 ~/.cache/trtforge-private`).")
    return path


def _others_can_write(path: Path) -> str | None:
    """Why someone other than this user could change `path`'s entries (None: nobody can): the
    directory itself must be ours and not group/world-writable; a directory above it (as named and
    as resolved) owned by another user, or writable by others without the sticky bit, could have
    it renamed away and replaced."""
    if not hasattr(os, "getuid"):  # no POSIX owners (Windows): nothing to check
        return None
    uid = os.getuid()
    link, st = os.lstat(path), os.stat(path)
    if stat.S_ISLNK(link.st_mode) and link.st_uid not in (uid, 0):
        return f"{path} is a symbolic link owned by uid {link.st_uid}, who could point it elsewhere"
    if st.st_uid != uid:
        return f"{path} is owned by uid {st.st_uid}, not by this user (uid {uid})"
    if st.st_mode & 0o022:
        return f"{path} is writable by its group or by everyone (mode {stat.S_IMODE(st.st_mode):o})"
    return _parents_let_others_swap(path, uid)


def _parents_let_others_swap(path: Path, uid: int) -> str | None:
    for parent in sorted(set(Path(os.path.abspath(path)).parents) | set(path.resolve().parents)):
        pst = os.lstat(parent)
        if pst.st_uid not in (uid, 0):
            return f"{parent}, above {path}, is owned by uid {pst.st_uid}, who could replace it"
        shared = pst.st_mode & 0o022 and not pst.st_mode & stat.S_ISVTX
        if shared and not stat.S_ISLNK(pst.st_mode):
            return (f"{parent}, above {path}, is writable by others without the sticky bit "
                    f"(mode {stat.S_IMODE(pst.st_mode):o}), so they could replace it")
    return None


def cpu_flags() -> str:
    """The CPU's feature flags line from /proc/cpuinfo ("" where there is none): the build cache key
    and the instruction set the kernels registry reports (plugins/kernels.py)."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((ln for ln in f if ln.startswith(("flags", "Features"))), "")
    except OSError:
        return ""


def detected_isa() -> str:
    """This CPU's best ISA as the kernels know them (ISAS): "avx512" (AVX-512 F/BW/VL with AVX2 and
    FMA), "avx2" (AVX2 and FMA), else "portable"."""
    flags = set(cpu_flags().partition(":")[2].split())
    if {"avx2", "fma"} <= flags:
        return "avx512" if {"avx512f", "avx512bw", "avx512vl"} <= flags else "avx2"
    return "portable"


def supported_isas() -> tuple[str, ...]:
    """The ISAs this CPU can run: its own and every lower one."""
    return ISAS[ISAS.index(detected_isa()):]


def isa() -> str:
    """The ISA this process builds its kernels for: `TRTFORGE_CPU_ISA` when set (one of
    `supported_isas()`, else ValueError: an AVX-512 build cannot run on an AVX2 CPU), else the
    CPU's own."""
    forced = os.environ.get(ISA_ENV, "").strip().lower()
    if not forced:
        return detected_isa()
    if forced not in supported_isas():
        raise ValueError(f"{ISA_ENV}={forced!r}: this CPU ({detected_isa()}) runs "
                         f"{', '.join(supported_isas())}")
    return forced


def isa_flags(name: str) -> tuple[str, ...]:
    """The compiler flags that build kernels for ISA `name` on this CPU."""
    return ISA_FLAGS["native" if name == detected_isa() else name]


def _compiler() -> list[str] | None:
    cc = shlex.split(os.environ.get("CC", "cc"))
    return cc if cc and shutil.which(cc[0]) else None


def build(source: Path, extra_flags: tuple[str, ...] = (), target: str | None = None) -> Path:
    """Compile `source` into the cache (once per source/compiler/flags/CPU); returns the .so path,
    whose bytes match the sha256 recorded when it was built (else it is built again).
    extra_flags: e.g. -fopenmp (the library then shares torch's libgomp.so.1 thread pool).
    target: the ISA to build for (default `isa()`).

    Raises RuntimeError with the compiler's output when there is no compiler or the build fails,
    UnsafeCacheDir (a RuntimeError) when others could write the cache directory."""
    cc = _compiler()
    if cc is None:
        raise RuntimeError(f"no C compiler found (tried {os.environ.get('CC', 'cc')!r}; set CC)")
    include = Path(__file__).parent  # native_vec.h and any other shared header
    text = source.read_bytes() + b"".join(h.read_bytes() for h in sorted(include.glob("*.h")))
    flags = (*CFLAGS, *isa_flags(target or isa()), *extra_flags)
    inputs = hashlib.sha256(text + repr((cc, flags)).encode() + cpu_flags().encode()).hexdigest()
    directory = private_dir(cache_dir())
    record = directory / f"{source.stem}-{inputs[:16]}.json"
    built = _verified_library(record, inputs)
    if built is not None:
        return built
    # Build into a temporary name and rename: concurrent processes (Triton model instances,
    # pytest workers) may build the same library at once, and none may load a half-written one.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=directory)
    os.close(fd)
    cmd = [*cc, *flags, f"-I{include}", "-o", tmp, str(source), "-lm"]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        if proc.returncode != 0:
            raise RuntimeError(f"`{shlex.join(cmd)}` failed ({proc.returncode}):\n{proc.stderr.strip()}")
        digest = _sha256(Path(tmp))
        out = _library_path(record, digest)
        os.replace(tmp, out)  # named by its digest: a concurrent build of other bytes cannot clash
        _write_atomically(record, json.dumps({"source": str(source), "compiler": cc, "flags": flags,
                                              "inputs": inputs, "sha256": digest}))
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


def _sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def _is_sha256(value: object) -> bool:
    return isinstance(value, str) and len(value) == 64 and all(c in "0123456789abcdef" for c in value)


def _library_path(record: Path, digest: str) -> Path:
    return record.with_name(f"{record.stem}-{digest[:16]}.so")


def _verified_library(record: Path, inputs: str) -> Path | None:
    """The library `record` names when its bytes are those the build recorded; None (and a warning
    when there was something to distrust) when it must be built."""
    try:
        recorded = json.loads(record.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        recorded = None
    recorded = recorded if isinstance(recorded, dict) else {}
    digest = recorded.get("sha256")
    if recorded.get("inputs") != inputs or not _is_sha256(digest):
        log.warning("%s is not a record of this build (unreadable, or other inputs): rebuilding", record)
        return None
    library = _library_path(record, digest)
    try:
        st = os.lstat(library)
        if stat.S_ISREG(st.st_mode) and _sha256(library) == digest:
            return library
    except OSError:
        return None
    log.warning("%s does not match the sha256 recorded when it was built (%s): not loading it, rebuilding",
                library, record.name)
    return None


def _write_atomically(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def load(source: Path, signatures: dict[str, tuple[object, list[object]]],
         extra_flags: tuple[str, ...] = (), target: str | None = None) -> ctypes.CDLL | None:
    """The compiled library of `source` for ISA `target` (default `isa()`) with `signatures`
    ({name: (restype, argtypes)}) applied, or None when native kernels are disabled or cannot be
    built (the reason is logged once)."""
    target = target or isa()
    name = f"{source}:{target}"
    if name in _loaded:
        return _loaded[name]
    lib = None
    if not enabled():
        log.info("native CPU kernels disabled (%s=0): using the torch path", ENV_VAR)
    else:
        try:
            lib = ctypes.CDLL(str(build(source, extra_flags, target)))
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
                 extra_flags: tuple[str, ...] = (), target: str | None = None):
        self.source, self.signatures, self.extra_flags = source, signatures, extra_flags
        self.target = target
        """The ISA it is built for; None: this process's `isa()`."""
        self.lib: ctypes.CDLL | None | bool = False
        """The loaded library; None where it cannot be built; False until the first `get()`."""

    def get(self) -> ctypes.CDLL | None:
        """The library (loaded now if not yet), or None where it cannot be built."""
        if self.lib is False:
            self.lib = load(self.source, self.signatures, self.extra_flags, self.target)
        return self.lib  # type: ignore[return-value]

    def for_isa(self, target: str) -> "NativeLibrary":
        """The same source built for ISA `target` (one of `supported_isas()`), loaded at its `get()`."""
        if target not in supported_isas():
            raise ValueError(f"{target!r} is not an ISA this CPU runs ({', '.join(supported_isas())})")
        return NativeLibrary(self.source, self.signatures, self.extra_flags, target)
