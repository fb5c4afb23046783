"""`trtforge serve --openai-port 0` as a subprocess for the OpenAI e2e tests, and metric reads."""

from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.e2e.helpers import BIN


@dataclass
class ServeProcess:
    """A running `trtforge serve` with its Triton and OpenAI addresses."""

    proc: subprocess.Popen
    openai_url: str
    """Base URL of the API, ending in /v1."""
    metrics_url: str
    grpc_url: str
    output: list[str] = field(default_factory=list)

    def metric(self, name: str) -> float:
        """A trtforge_* gauge/counter of the served model, from Triton's metrics port."""
        text = urllib.request.urlopen(self.metrics_url, timeout=10).read().decode()
        for line in text.splitlines():
            if line.startswith(name + "{") and 'model="ensemble"' in line:
                return float(line.rsplit(" ", 1)[1])
        raise AssertionError(f"{name} not in {self.metrics_url}")

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()


def start_serve(repo: Path, log: Path, *extra: str, timeout_s: float = 240,
                env: dict[str, str] | None = None) -> ServeProcess:
    """Start `trtforge serve REPO` on free ports and wait for both servers' ready lines; `env`
    is added to the environment (TRTFORGE_API_KEY is removed from it unless given there)."""
    cmd = [str(BIN / "trtforge"), "serve", str(repo), "--http-port", "0", "--grpc-port", "0",
           "--metrics-port", "0", "--openai-port", "0", "--log-file", str(log), *extra]
    base = {k: v for k, v in os.environ.items() if k != "TRTFORGE_API_KEY"}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**base, "PYTHONUNBUFFERED": "1", **(env or {})})
    lines: queue.Queue = queue.Queue()
    output: list[str] = []

    def pump() -> None:  # keeps the pipe drained for the whole life of the process
        for line in proc.stdout:
            output.append(line)
            lines.put(line)
        lines.put(None)

    threading.Thread(target=pump, daemon=True).start()
    found: dict[str, str] = {}
    deadline = time.monotonic() + timeout_s
    while "openai" not in found:
        try:
            line = lines.get(timeout=max(0.1, deadline - time.monotonic()))
        except queue.Empty:
            line = None
        if line is None:
            proc.kill()
            pytest.fail("trtforge serve did not print its ready lines:\n" + "".join(output)
                        + (log.read_text()[-3000:] if log.exists() else ""))
        if m := re.search(r"gRPC (\S+)\s+metrics (\S+)", line):
            found["grpc"], found["metrics"] = m.group(1), m.group(2)
        if m := re.search(r"OpenAI-compatible API: (\S+/v1)", line):
            found["openai"] = m.group(1)
    return ServeProcess(proc, found["openai"], found["metrics"], found["grpc"], output)


def wait_for(predicate, timeout_s: float = 20.0, interval_s: float = 0.1) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval_s)
    return predicate()
