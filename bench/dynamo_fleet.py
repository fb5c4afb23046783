"""A Dynamo fleet on one host, as processes: `trtforge dynamo-worker`s and Dynamo's own OpenAI
frontend (`python -m dynamo.frontend`), with file discovery, the TCP request plane and the ZMQ event
plane, every listener on loopback. Used by the multi-turn benchmark and the e2e tests; it only
starts and watches processes (nothing here imports Dynamo).

The benchmark's third fleet is trtforge's own, also on loopback: `trtforge serve` workers of a
plain repository and a router server (`emit-repo --only router --worker-url …`) with the OpenAI
endpoint in front (`start_triton_fleet`); `cpu_seconds` tells whether an idle fleet is quiet."""

from __future__ import annotations

import os
import random
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

BIN = Path(sys.executable).parent
"""Where this environment's `trtforge` lives."""
PLANES = ["--discovery-backend", "file", "--request-plane", "tcp", "--event-plane", "zmq"]
LOOPBACK = ("DYN_TCP_RPC_HOST", "DYN_TCP_RESPONSE_STREAM_HOST", "DYN_EVENT_PLANE_HOST", "DYN_SYSTEM_HOST")
# Dynamo's transport logs at ERROR when the peer of a stream has gone away: a cancelled stream (or
# a client runtime that shut down) closes its connection while the worker still writes to it
# ("writer task returned error ... Broken pipe", "push_handler: Failed to ... response"). Those
# lines are the runtime reporting that the reader left, not a failure of ours.
_TRANSPORT_CANCEL = re.compile(r"dynamo_runtime::pipeline::network::(tcp::client.*(Broken pipe|Connection reset)"
                               r"|ingress::push_handler: Failed to)")
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def free_port() -> int:
    """A free loopback port below 32768 (Dynamo 1.6.1 parses DYN_SYSTEM_PORT as an i16)."""
    for _ in range(200):
        port = random.randrange(20000, 32768)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise AssertionError("no free port below 32768")


def get(url: str) -> str:
    return urllib.request.urlopen(url, timeout=10).read().decode()


def wait(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout_s} s: {what}")
        time.sleep(0.1)


@dataclass
class Proc:
    proc: subprocess.Popen
    log: Path

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def errors(self) -> list[str]:
        """Python tracebacks and ERROR lines in its log (bar the transport's cancelled-stream one)."""
        text = _ANSI.sub("", self.log.read_text(errors="replace"))
        bad = [line for line in text.splitlines() if re.search(r"\bERROR\b", line)
               and not _TRANSPORT_CANCEL.search(line)]
        return (["Traceback: " + text[text.index("Traceback"):][:3000]] if "Traceback" in text else []) + bad


@dataclass
class Worker(Proc):
    system_port: int

    def metric(self, name: str, endpoint: str = "generate") -> float:
        for line in get(f"http://127.0.0.1:{self.system_port}/metrics").splitlines():
            if line.startswith(name + "{") and f'dynamo_endpoint="{endpoint}"' in line:
                return float(line.rsplit(" ", 1)[1])
        return 0.0

    @property
    def requests(self) -> int:
        return int(self.metric("dynamo_component_requests_total"))

    @property
    def cache_usage(self) -> float:
        return self.metric("dynamo_component_gpu_cache_usage_percent")


def env(root: Path, **extra: str) -> dict[str, str]:
    return {**os.environ, "DYN_FILE_KV": str(root / "discovery"), "PYTHONUNBUFFERED": "1",
            "DYN_LOG": "warn", **{k: "127.0.0.1" for k in LOOPBACK}, **extra}


def _start(cmd: list[str], log: Path, environ: dict[str, str]) -> subprocess.Popen:
    with open(log, "w") as out:
        return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=environ)


def start_worker(root: Path, engine_dir: Path, name: str, *args: str, model: str = "tiny") -> Worker:
    port = free_port()
    log = root / f"{name}.log"
    cmd = [str(BIN / "trtforge"), "dynamo-worker", str(engine_dir), "--served-model-name", model, *PLANES, *args]
    return Worker(_start(cmd, log, env(root, DYN_SYSTEM_PORT=str(port))), log, port)


def start_frontend(root: Path, mode: str) -> tuple[Proc, str]:
    """Dynamo's OpenAI frontend (router mode `mode`) and its base URL."""
    port = free_port()
    log = root / f"frontend-{mode}.log"
    cmd = [sys.executable, "-m", "dynamo.frontend", "--http-host", "127.0.0.1", "--http-port", str(port),
           "--router-mode", mode, *PLANES]
    return Proc(_start(cmd, log, env(root)), log), f"http://127.0.0.1:{port}/v1"


def start_triton_fleet(root: Path, engine_dir: Path, workers: int, emit_options: list[str],
                       model: str = "tiny", policy: str | None = None) -> tuple[list[Proc], str]:
    """`workers` `trtforge serve` workers of a plain repository (`emit_options`: its emit-repo
    flags) and a router server over them with the OpenAI endpoint; the processes (router last) and
    the endpoint's base URL, once every server is ready."""
    def serve(repo: Path, name: str, *extra: str) -> tuple[Proc, int, int]:
        http, grpc = free_port(), free_port()
        cmd = [str(BIN / "trtforge"), "serve", str(repo), "--http-port", str(http), "--grpc-port", str(grpc),
               "--metrics-port", str(free_port()), "--log-file", str(root / f"{name}.triton.log"), *extra]
        return Proc(_start(cmd, root / f"{name}.log", {**os.environ, "PYTHONUNBUFFERED": "1"}), root / f"{name}.log"), \
            http, grpc

    def emit(repo: Path, *flags: str) -> None:
        subprocess.run([str(BIN / "trtforge"), "emit-repo", str(engine_dir), str(repo), *flags], check=True,
                       capture_output=True)

    emit(root / "triton-worker", *emit_options)
    started = [serve(root / "triton-worker", f"triton-worker{i}") for i in range(workers)]
    try:
        _wait_triton([p for p, _, _ in started], [h for _, h, _ in started])
        urls = [x for _, _, grpc in started for x in ("--worker-url", f"127.0.0.1:{grpc}")]
        emit(root / "triton-router", "--only", "router", *urls, *(["--router-policy", policy] if policy else []))
        port = free_port()
        router = serve(root / "triton-router", "triton-router", "--openai-port", str(port),
                       "--served-model-name", model)
        started.append(router)
        url = f"http://127.0.0.1:{port}/v1"
        _wait_triton([p for p, _, _ in started], [router[1]], lambda: model in get(url + "/models"))
    except BaseException:
        for p, _, _ in started:
            p.stop()
        raise
    return [p for p, _, _ in started], url


def _wait_triton(procs: list[Proc], http_ports: list[int], also=lambda: True, timeout_s: float = 300) -> None:
    def ready() -> bool:
        for p in procs:
            if p.proc.poll() is not None:
                raise AssertionError(f"{p.log.name} exited {p.proc.returncode}:\n{p.log.read_text()[-3000:]}")
        try:
            return all(urllib.request.urlopen(f"http://127.0.0.1:{h}/v2/health/ready", timeout=2).status == 200
                       for h in http_ports) and also()
        except OSError:
            return False

    wait(ready, timeout_s, "the Triton servers are ready")


def cpu_seconds(procs: list[Proc]) -> float:
    """CPU time (user + system) used so far by the processes and all their descendants."""
    tick = os.sysconf("SC_CLK_TCK")
    total, todo = 0.0, [p.proc.pid for p in procs]
    while todo:
        pid = todo.pop()
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / tick
            for task in Path(f"/proc/{pid}/task").iterdir():
                todo += [int(c) for c in (task / "children").read_text().split()]
        except (OSError, IndexError, ValueError):
            continue  # gone meanwhile
    return total


def wait_ready(procs: list[Proc], urls: list[str], workers: list[Worker], timeout_s: float = 180,
               model: str = "tiny") -> None:
    def ready() -> bool:
        for p in procs:
            if p.proc.poll() is not None:
                raise AssertionError(f"{p.log.name} exited {p.proc.returncode}:\n{p.log.read_text()[-3000:]}")
        try:
            return all(model in get(u + "/models") for u in urls) and \
                all(get(f"http://127.0.0.1:{w.system_port}/metrics") for w in workers)
        except OSError:
            return False

    wait(ready, timeout_s, "the frontends list the model and the workers answer")
