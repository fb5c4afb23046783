"""Where the tensor-parallel ranks run and how they meet (docs/scale-out.md).

Three ways, read from torchrun's environment variables:

    nothing set            one host: this process is rank 0 and starts ranks 1..tp-1 itself
                           (MASTER_ADDR 127.0.0.1, a port the system picks)
    NNODES, NODE_RANK      several hosts, tp/NNODES ranks each: the first process on each host starts
    (+ MASTER_ADDR/PORT)   its host's other ranks; host 0 runs `trtforge generate` (or bench, or the
                           Triton model), the others `trtforge tp-worker ENGINE_DIR`
    RANK, WORLD_SIZE       one process per rank, started by torchrun (or by hand): nothing is spawned
    (+ LOCAL_RANK, MASTER_ADDR/PORT)

Rank 0 hosts the rendezvous (a TCPStore at MASTER_ADDR:MASTER_PORT); every rank sets
`ready/<rank>` there before joining the process group, so rank 0 can wait while watching the
ranks it started: one that dies at start-up is reported with its exit code and log, not waited
for until the timeout.

What listens where: rank 0's store listens on MASTER_ADDR only (torch's own TCPStore would take
every interface), so a one-host launch (127.0.0.1) is reachable from this machine only; with
every rank on this host gloo's own connections (and NCCL's bootstrap) are bound to the loopback
interface too (GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME, unless set). Whoever can reach them
still has to prove the group's key before anything is sent to it (tp_auth.py); the ranks this
process starts get the key in their environment.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Mapping

import torch.distributed as dist

from trtforge.serving.worker.tp_auth import KEY_ENV, KEY_FILE_ENV, is_loopback
from trtforge.serving.worker.tp_comm import TIMEOUT_ENV, timeout_s

THREADS_ENV = "TRTFORGE_TP_THREADS"
PYTHON_ENV = "TRTFORGE_PYTHON"
_LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "NNODES", "NODE_RANK",
                "MASTER_ADDR", "MASTER_PORT")


class LaunchError(ValueError):
    """The ranks cannot be started or did not meet (says what to set or what died); a ValueError,
    so the commands report it as they report a bad option."""


@dataclass
class Launch:
    world_size: int
    rank: int
    """This process's rank."""
    local_rank: int
    """Its index on this host (its GPU with CUDA)."""
    spawn: list[int] = field(default_factory=list)
    """Ranks this process starts on this host."""
    master_addr: str = "127.0.0.1"
    master_port: int = 0

    @property
    def local_ranks(self) -> int:
        """Ranks on this host that this process knows of (itself and those it starts): for the threads."""
        return 1 + len(self.spawn)

    @property
    def spawns_all(self) -> bool:
        """This process is rank 0 and starts every other rank itself."""
        return self.rank == 0 and len(self.spawn) == self.world_size - 1


def launch_from_env(tp_size: int, env: Mapping[str, str] | None = None) -> Launch:
    env = os.environ if env is None else env
    world = int(env.get("WORLD_SIZE", tp_size))
    if world != tp_size:
        raise LaunchError(f"WORLD_SIZE={world} but the engine was built with --tp-size {tp_size}: every rank "
                          f"of the engine is one process, so WORLD_SIZE must be {tp_size}.")
    addr = env.get("MASTER_ADDR", "127.0.0.1")
    if "RANK" in env:  # torchrun-style: one process per rank, nothing to start
        return Launch(world, int(env["RANK"]), int(env.get("LOCAL_RANK", 0)), [], addr,
                      _port(env, required=True))
    nodes = int(env.get("NNODES", 1))
    if nodes > 1:
        if tp_size % nodes:
            raise LaunchError(f"NNODES={nodes} does not divide the engine's {tp_size} ranks: each host runs "
                              f"tp/NNODES ranks.")
        node = int(env.get("NODE_RANK", 0))
        if not 0 <= node < nodes:
            raise LaunchError(f"NODE_RANK={node} is outside 0..{nodes - 1} (NNODES={nodes}).")
        per = tp_size // nodes
        first = node * per
        return Launch(world, first, 0, list(range(first + 1, first + per)), addr, _port(env, required=True))
    return Launch(world, 0, 0, list(range(1, tp_size)), addr, _port(env, required=False))


def _port(env: Mapping[str, str], required: bool) -> int:
    if "MASTER_PORT" not in env:
        if required:
            raise LaunchError("MASTER_PORT is not set: ranks on several hosts meet at MASTER_ADDR:MASTER_PORT "
                              "(rank 0's host, a port open between the hosts).")
        return 0
    return int(env["MASTER_PORT"])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def loopback_interface() -> str | None:
    """The loopback interface's name ("lo" on Linux, "lo0" on macOS), None if neither exists."""
    names = {name for _, name in socket.if_nameindex()} if hasattr(socket, "if_nameindex") else set()
    return next((n for n in ("lo", "lo0") if n in names), None)


def bind_transport(launch: Launch) -> None:
    """With every rank on this host (a loopback MASTER_ADDR), gloo and NCCL's bootstrap listen on
    loopback only: GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME (inherited by the ranks started here),
    each unless it is set already."""
    name = loopback_interface() if is_loopback(launch.master_addr) else None
    for var in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
        if name and var not in os.environ:
            os.environ[var] = name


def listen_socket(addr: str, port: int) -> socket.socket:
    """A socket listening on `addr` (its first address) only; port 0: one the system picks."""
    family, kind, proto, _, where = socket.getaddrinfo(addr, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(where)
        sock.listen(512)
    except OSError as exc:
        sock.close()
        raise LaunchError(f"rank 0 cannot listen on MASTER_ADDR:MASTER_PORT = {addr}:{port}: {exc.strerror} "
                          "(MASTER_ADDR must be an address of this host; another port if it is taken)") from None
    return sock


def python_executable() -> str:
    """The interpreter for ranks we start (inside Triton's python stub sys.executable is the stub)."""
    explicit = os.environ.get(PYTHON_ENV)
    if explicit:
        return explicit
    if Path(sys.executable).name.startswith("python") and Path(sys.executable).is_file():
        return sys.executable
    for candidate in (Path(sys.prefix) / "bin" / "python3", shutil.which("python3")):
        if candidate and Path(candidate).is_file():
            return str(candidate)
    raise LaunchError(f"cannot find a python interpreter to start the other ranks (sys.executable is "
                      f"{sys.executable!r}): set {PYTHON_ENV}.")


@dataclass
class Child:
    rank: int
    process: subprocess.Popen
    log: Path

    def tail(self, n: int = 2000) -> str:
        try:
            return self.log.read_text(errors="replace")[-n:].strip()
        except OSError:
            return ""

    def describe_exit(self) -> str:
        code = self.process.poll()
        if code is None:
            return f"rank {self.rank} (pid {self.process.pid}) is running"
        tail = self.tail()
        return f"rank {self.rank} exited with code {code}" + (f"; its log ({self.log}) ends:\n{tail}" if tail else "")


def spawn_ranks(launch: Launch, engine_dir: str, device: str, threads: int | None, key: bytes) -> list[Child]:
    """Start `launch.spawn` as `python -m trtforge.serving.worker.tp_worker ENGINE_DIR` with RANK set
    and the group's `key` in their environment (never on their command line)."""
    children = []
    logs = Path(tempfile.mkdtemp(prefix="trtforge-tp-"))
    for i, rank in enumerate(launch.spawn, start=1):
        env = {k: v for k, v in os.environ.items() if k not in _LAUNCH_VARS and k != KEY_FILE_ENV}
        env.update(RANK=str(rank), WORLD_SIZE=str(launch.world_size), LOCAL_RANK=str(launch.local_rank + i),
                   MASTER_ADDR=launch.master_addr, MASTER_PORT=str(launch.master_port))
        env[KEY_ENV] = key.decode()
        if threads:
            env[THREADS_ENV] = str(threads)
        log = logs / f"rank{rank}.log"
        with open(log, "wb") as out:
            proc = subprocess.Popen([python_executable(), "-m", "trtforge.serving.worker.tp_worker", engine_dir,
                                     "--device", device], env=env, stdout=out, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL)
        children.append(Child(rank, proc, log))
    return children


def open_store(launch: Launch) -> dist.TCPStore:
    """Rank 0 hosts the store, listening on MASTER_ADDR only (port 0: a free one, written back into
    `launch`); the others connect (retrying until the timeout). Under torchrun its agent already
    hosts one at MASTER_ADDR:MASTER_PORT: every rank connects to that."""
    timeout = timedelta(seconds=timeout_s())
    if launch.rank == 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        sock = listen_socket(launch.master_addr, launch.master_port)
        launch.master_port = sock.getsockname()[1]
        return dist.TCPStore(launch.master_addr, launch.master_port, launch.world_size, True, timeout,
                             wait_for_workers=False, master_listen_fd=sock.detach())
    return dist.TCPStore(launch.master_addr, launch.master_port, launch.world_size, False, timeout,
                         wait_for_workers=False)


def wait_for_ranks(store: dist.TCPStore, launch: Launch, children: list[Child]) -> None:
    """Rank 0: wait until every rank has set ready/<rank>, failing fast when a started one died."""
    deadline = time.monotonic() + timeout_s()
    missing = [r for r in range(1, launch.world_size)]
    while missing:
        dead = [c for c in children if c.process.poll() is not None]
        if dead:
            raise LaunchError("a tensor-parallel rank died while starting: "
                              + "; ".join(c.describe_exit() for c in dead))
        if time.monotonic() > deadline:
            remote = [r for r in missing if r not in {c.rank for c in children}]
            raise LaunchError(
                f"ranks {missing} did not join at {launch.master_addr}:{launch.master_port} within {timeout_s():g} s "
                f"({TIMEOUT_ENV}). " + (f"Ranks {remote} run on other hosts: start `trtforge tp-worker ENGINE_DIR` "
                                       f"there with NNODES/NODE_RANK (or RANK/WORLD_SIZE) and this MASTER_ADDR/PORT."
                                       if remote else ""))
        if store.check([f"ready/{missing[0]}"]):
            missing.pop(0)
        else:
            time.sleep(0.05)


def stop_children(children: list[Child], wait_s: float = 10.0) -> None:
    deadline = time.monotonic() + wait_s
    for c in children:
        try:
            c.process.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            c.process.kill()
            c.process.wait()
