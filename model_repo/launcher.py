"""Start and stop a real Triton Inference Server on a model repository.

Where the server comes from, in order: an explicit path, `$TRTFORGE_TRITONSERVER`,
`/opt/tritonserver/bin/tritonserver` (NGC container), then the build bundled in the
`nvidia-pytriton` wheel. The wheel's build needs three things the NGC image has built in:

* a backend directory where the python backend's stub for *this* Python version sits next to
  `libtriton_python.so` — we make a private one of symlinks in a temp dir rather than writing
  into site-packages;
* `LD_LIBRARY_PATH` with the wheel's `nvidia_pytriton.libs` **and** this interpreter's own
  `LIBDIR` — without the latter the stub loads the system libpython against our stdlib
  (`undefined symbol: _PyModule_Add`);
* this interpreter's `bin` first on `PATH`: the embedded Python of the stub locates its prefix
  from the `python3` it finds there, which is how models see the venv's site-packages (trtforge,
  torch) without PYTHONPATH games.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

NGC_TRITONSERVER = Path("/opt/tritonserver/bin/tritonserver")


@dataclass(frozen=True)
class TritonInstall:
    """Where a tritonserver binary and its python backend live."""

    binary: Path
    """The tritonserver executable."""

    backend_dir: Path
    """Directory holding `python/libtriton_python.so` (the `--backend-directory` source)."""

    stub: Path | None
    """The python-backend stub to place next to libtriton_python.so; None when the backend
    directory already has the right one (NGC container)."""

    lib_dirs: tuple[Path, ...] = ()
    """Extra shared-library directories the binary and the stub need on LD_LIBRARY_PATH."""


def find_tritonserver(explicit: str | os.PathLike | None = None) -> TritonInstall:
    """Locate a tritonserver; raise FileNotFoundError saying what was tried and how to fix it."""
    explicit = explicit or os.environ.get("TRTFORGE_TRITONSERVER")
    candidate = Path(explicit) if explicit else NGC_TRITONSERVER
    if candidate.is_file():
        root = candidate.resolve().parent.parent
        return TritonInstall(binary=candidate, backend_dir=root / "backends", stub=None)
    if explicit:
        raise FileNotFoundError(
            f"tritonserver {str(candidate)!r} does not exist; pass the path of the "
            "tritonserver executable (e.g. /opt/tritonserver/bin/tritonserver)."
        )
    try:
        import pytriton  # optional dependency, only needed to serve
    except ImportError as exc:
        raise FileNotFoundError(
            f"No tritonserver found: {NGC_TRITONSERVER} does not exist and the nvidia-pytriton "
            "wheel is not installed. Install it (pip install 'trtforge[serve]'), run inside the "
            "NGC tritonserver container, or set TRTFORGE_TRITONSERVER."
        ) from exc
    root = Path(pytriton.__file__).parent
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    stub = root / "tritonserver" / "python_backend_stubs" / version / "triton_python_backend_stub"
    if not stub.is_file():
        raise FileNotFoundError(
            f"nvidia-pytriton at {root} has no python-backend stub for Python {version} "
            f"({stub} is missing); use a Python version it ships a stub for."
        )
    return TritonInstall(
        binary=root / "tritonserver" / "bin" / "tritonserver",
        backend_dir=root / "tritonserver" / "backends",
        stub=stub,
        lib_dirs=(root.parent / "nvidia_pytriton.libs",),
    )


def make_backend_dir(install: TritonInstall, dest: Path) -> Path:
    """A private backend directory: the install's backends, symlinked, plus the stub."""
    if install.stub is None:
        return install.backend_dir
    for backend in install.backend_dir.iterdir():
        if not backend.is_dir() or backend.name.startswith("__"):
            continue
        (dest / backend.name).mkdir(parents=True, exist_ok=True)
        for item in backend.iterdir():
            if item.is_file():
                (dest / backend.name / item.name).symlink_to(item)
    (dest / "python" / install.stub.name).symlink_to(install.stub)
    return dest


def server_env(install: TritonInstall, base: dict[str, str] | None = None) -> dict[str, str]:
    """The environment tritonserver and its python stubs must run with (see module doc)."""
    env = dict(os.environ if base is None else base)
    libs = [str(p) for p in install.lib_dirs]
    if install.stub is not None:
        libs.append(str(sysconfig.get_config_var("LIBDIR")))
    if env.get("LD_LIBRARY_PATH"):
        libs.append(env["LD_LIBRARY_PATH"])
    if libs:
        env["LD_LIBRARY_PATH"] = os.pathsep.join(libs)
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    # One stub per model instance; they must not each spawn a thread per core on small hosts.
    env.setdefault("OMP_NUM_THREADS", str(max(1, min(4, os.cpu_count() or 1))))
    return env


def free_port() -> int:
    """A TCP port the OS says is free right now."""
    with contextlib.closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class TritonServer:
    """One tritonserver process on a model repository; use as a context manager."""

    repo: Path
    """The model repository to serve."""

    http_port: int = 0
    """HTTP/REST port; 0 picks a free one."""

    grpc_port: int = 0
    """gRPC port; 0 picks a free one."""

    metrics_port: int = 0
    """Prometheus metrics port; 0 picks a free one."""

    tritonserver: str | None = None
    """Path of the tritonserver executable; None searches (see `find_tritonserver`)."""

    log_file: Path | None = None
    """Where the server's stdout/stderr go; None inherits ours (foreground `trtforge serve`)."""

    exit_timeout_s: int = 15
    """How long tritonserver waits for in-flight requests when asked to stop."""

    extra_args: list[str] = field(default_factory=list)
    """More tritonserver command-line arguments, passed through unchanged."""

    process: subprocess.Popen | None = field(default=None, init=False)
    _tmp: tempfile.TemporaryDirectory | None = field(default=None, init=False, repr=False)

    @property
    def http_url(self) -> str:
        return f"127.0.0.1:{self.http_port}"

    @property
    def grpc_url(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.metrics_port}/metrics"

    def command(self, install: TritonInstall, backend_dir: Path) -> list[str]:
        return [
            str(install.binary),
            f"--model-repository={Path(self.repo).resolve()}",
            f"--backend-directory={backend_dir}",
            f"--http-port={self.http_port}",
            f"--grpc-port={self.grpc_port}",
            f"--metrics-port={self.metrics_port}",
            f"--exit-timeout-secs={self.exit_timeout_s}",
            *self.extra_args,
        ]

    def start(self) -> "TritonServer":
        """Start the process (does not wait; see `wait_ready`)."""
        if not any(Path(self.repo).glob("*/config.pbtxt")):
            raise FileNotFoundError(
                f"{self.repo} is not a Triton model repository (no */config.pbtxt); create one "
                "with `trtforge emit-repo ENGINE_DIR REPO_DIR`."
            )
        install = find_tritonserver(self.tritonserver)
        from trtforge.model_repo.trtllm.serve_check import check_trtllm_repo

        check_trtllm_repo(Path(self.repo), install.backend_dir)  # TensorRT-LLM models need their backend
        self._tmp = tempfile.TemporaryDirectory(prefix="trtforge-backends-")
        backend_dir = make_backend_dir(install, Path(self._tmp.name))
        for name in ("http_port", "grpc_port", "metrics_port"):
            if not getattr(self, name):
                setattr(self, name, free_port())
        out = open(self.log_file, "ab") if self.log_file else None  # lives with the process
        env = server_env(install)
        # The router of a disaggregated repository reaches this server's own phase models by gRPC.
        env["TRTFORGE_TRITON_GRPC_URL"] = f"127.0.0.1:{self.grpc_port}"
        self.process = subprocess.Popen(
            self.command(install, backend_dir), env=env,
            stdout=out, stderr=subprocess.STDOUT if out else None,
            start_new_session=True,  # our signal handler, not the terminal, decides when it stops
        )
        if out:
            out.close()
        return self

    def log_tail(self, n_chars: int = 4000) -> str:
        if not self.log_file or not Path(self.log_file).exists():
            return "(server output went to the console)"
        return Path(self.log_file).read_text(errors="replace")[-n_chars:]

    def wait_ready(self, timeout_s: float = 180.0) -> None:
        """Poll /v2/health/ready; raise RuntimeError with the server's log if it dies or stalls."""
        deadline = time.monotonic() + timeout_s
        url = f"http://{self.http_url}/v2/health/ready"
        while time.monotonic() < deadline:
            code = self.process.poll() if self.process else -1
            if code is not None:
                raise RuntimeError(
                    f"tritonserver exited with code {code} before becoming ready. Its log:\n"
                    f"{self.log_tail()}"
                )
            with contextlib.suppress(urllib.error.URLError, OSError):
                with urllib.request.urlopen(url, timeout=2) as resp:
                    if resp.status == 200:
                        return
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(
            f"tritonserver was not ready after {timeout_s:.0f} s (models still loading?); "
            f"raise the timeout. Its log:\n{self.log_tail()}"
        )

    def stop(self, timeout_s: float | None = None) -> int | None:
        """SIGTERM (Triton drains and unloads models), then SIGKILL after the timeout."""
        proc, self.process = self.process, None
        code = None
        if proc is not None:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
            try:
                code = proc.wait(timeout=timeout_s or self.exit_timeout_s + 15)
            except subprocess.TimeoutExpired:
                proc.kill()
                code = proc.wait()
            # A python stub stuck in a model's finalize() can outlive a server that gave up on
            # it; they all share the session (= process group) we started the server in.
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None
        return code

    def __enter__(self) -> "TritonServer":
        self.start()
        try:
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

