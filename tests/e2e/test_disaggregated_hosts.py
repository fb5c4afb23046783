"""Context and generation servers as separate `trtforge serve` processes ("hosts" on loopback),
the KV moving over the network connector (TCP), a router server in front. Greedy answers equal
the co-located engine's; killing the generation server mid-stream fails those requests with a
clear error and leaves nothing held on the context server.

The count of tests here is checked in conftest.EXPECTED_TESTS; keep it in step.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.e2e.helpers import BIN, run_cli
from trtforge.model_repo import client

pytestmark = pytest.mark.e2e

PROMPTS = ["Hello world", "The quick brown fox", "Café au lait"]
MAX_TOKENS = 12


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Server:
    """One `trtforge serve` process."""

    process: subprocess.Popen
    grpc: str
    http: str
    metrics: str

    @classmethod
    def start(cls, repo: Path, log: Path) -> "Server":
        http, grpc, metrics = _free_port(), _free_port(), _free_port()
        process = subprocess.Popen([str(BIN / "trtforge"), "serve", str(repo), "--http-port", str(http),
                                    "--grpc-port", str(grpc), "--metrics-port", str(metrics),
                                    "--log-file", str(log)], stdout=subprocess.DEVNULL,
                                   stderr=subprocess.STDOUT)
        return cls(process, f"127.0.0.1:{grpc}", f"127.0.0.1:{http}", f"127.0.0.1:{metrics}")

    def wait_ready(self, timeout_s: float = 300) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            assert self.process.poll() is None, "trtforge serve exited while loading"
            try:
                if urllib.request.urlopen(f"http://{self.http}/v2/health/ready", timeout=2).status == 200:
                    return
            except OSError:
                pass
            time.sleep(0.25)
        pytest.fail(f"server {self.http} not ready within {timeout_s} s")

    def metric(self, name: str, model: str) -> float:
        text = urllib.request.urlopen(f"http://{self.metrics}/metrics", timeout=10).read().decode()
        for line in text.splitlines():
            if line.startswith(name + "{") and f'model="{model}"' in line:
                return float(line.rsplit(" ", 1)[1])
        raise KeyError(name)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            self.process.wait(timeout=60)

    def kill(self) -> None:
        """The host goes away: SIGKILL to tritonserver and its model processes (its own session),
        then to `trtforge serve`."""
        pid = self.process.pid
        for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split():
            os.killpg(int(child), signal.SIGKILL)
        self.process.kill()
        self.process.wait(timeout=60)


@pytest.fixture(scope="module")
def hosts(engine_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("hosts")
    # The key both "hosts" share (copied to each host in a real deployment: docs/scale-out.md).
    key = root / "kv.key"
    key.write_text(os.urandom(32).hex())
    key.chmod(0o600)
    run_cli("trtforge", "emit-repo", str(engine_dir), str(root / "ctx"), "--disaggregated", "--only",
            "context", "--context-kv-connector", "tcp://127.0.0.1:0", "--context-handoff-timeout-s", "5",
            "--context-kv-auth-key-file", str(key))
    run_cli("trtforge", "emit-repo", str(engine_dir), str(root / "gen"), "--disaggregated", "--only",
            "generation", "--generation-kv-auth-key-file", str(key), "--generation-kv-peers", "127.0.0.1")
    servers = {"context": Server.start(root / "ctx", root / "ctx.log"),
               "generation": Server.start(root / "gen", root / "gen.log")}
    try:
        run_cli("trtforge", "emit-repo", str(engine_dir), str(root / "router"), "--disaggregated",
                "--only", "router", "--context-url", servers["context"].grpc,
                "--generation-url", servers["generation"].grpc)
        servers["router"] = Server.start(root / "router", root / "router.log")
        from trtforge.config.sampling import SamplingParams
        from trtforge.serving.engine import LLMEngine

        engine = LLMEngine.from_engine_dir(engine_dir)
        expected = {p: o.text for p, o in zip(PROMPTS, engine.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS)))}
        for server in servers.values():
            server.wait_ready()
        yield servers, expected, engine.scheduler_config.max_seq_len
    finally:
        for server in servers.values():
            server.stop()


def _held(server: Server) -> float:
    return (server.metric("trtforge_kv_blocks_used", "context")
            + server.metric("trtforge_kv_handoff_blocks_held", "context"))


def test_router_with_context_and_generation_servers_answers_like_colocated(hosts):
    servers, expected, _ = hosts
    router = servers["router"]

    def run(prompt: str) -> str:
        return "".join(client.stream_grpc(router.grpc, prompt, MAX_TOKENS))

    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(run, PROMPTS * 3))
    assert answers == [expected[p] for p in PROMPTS * 3]
    answer = client.generate_http(router.http, PROMPTS[0], MAX_TOKENS)
    assert answer["text_output"] == PROMPTS[0] + expected[PROMPTS[0]]
    ctx, gen = servers["context"], servers["generation"]
    _wait(lambda: ctx.metric("trtforge_kv_handoffs_total", "context") == 3 * len(PROMPTS) + 1)
    assert ctx.metric("trtforge_kv_handoffs_total", "context") == 3 * len(PROMPTS) + 1
    assert gen.metric("trtforge_kv_handoffs_total", "generation") >= 3 * len(PROMPTS) + 1
    assert gen.metric("trtforge_kv_handoff_bytes_total", "generation") > 0
    assert _held(ctx) == 0 and gen.metric("trtforge_kv_blocks_used", "generation") == 0


def test_generation_server_killed_mid_stream_fails_cleanly(hosts):
    servers, expected, max_seq_len = hosts
    router, ctx = servers["router"], servers["context"]
    stream = client.stream_grpc(router.grpc, "Hello world", max_seq_len - 16)
    next(stream), next(stream), next(stream)  # decoding on the generation server
    servers["generation"].kill()
    with pytest.raises(RuntimeError, match="generation server .* failed"):
        for _ in stream:
            pass
    _wait(lambda: _held(ctx) == 0)
    assert _held(ctx) == 0  # the handoff had been taken: nothing left on the context server
    # The router and the context server keep serving: a new request fails with the same clear
    # error (no generation server left), and frees its handoff on the context server.
    with pytest.raises(RuntimeError, match="generation server"):
        "".join(client.stream_grpc(router.grpc, PROMPTS[1], MAX_TOKENS))
    _wait(lambda: _held(ctx) == 0, 15)  # its handoff expires (handoff timeout 5 s)
    assert _held(ctx) == 0


def _wait(predicate, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate() and time.monotonic() < deadline:
        time.sleep(0.1)
