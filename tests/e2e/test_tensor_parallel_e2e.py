"""A real tritonserver serving a tp=2 engine: the python model's process is rank 0 and starts rank 1
itself; greedy text over gRPC equals the tp=1 engine's, and stopping the server ends rank 1 too.

The count of tests here is checked in conftest.EXPECTED_TESTS; keep it in step.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from tests.e2e.helpers import BUILD_FLAGS, run_cli
from trtforge.model_repo import client
from trtforge.model_repo.launcher import TritonServer

pytestmark = pytest.mark.e2e

PROMPTS = ["Hello world", "The quick brown fox"]
MAX_TOKENS = 12


def _descendants(pid: int) -> set[int]:
    parents: dict[int, list[int]] = {}
    for status in Path("/proc").glob("[0-9]*/status"):
        try:
            ppid = next(line.split()[1] for line in status.read_text().splitlines() if line.startswith("PPid:"))
        except (OSError, StopIteration):
            continue
        parents.setdefault(int(ppid), []).append(int(status.parent.name))
    found, todo = set(), [pid]
    while todo:
        for kid in parents.get(todo.pop(), []):
            found.add(kid)
            todo.append(kid)
    return found


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def test_tp2_engine_served_by_tritonserver_matches_tp1(tmp_path):
    run_cli("trtforge", "demo-checkpoint", str(tmp_path / "ckpt"), "--arch", "qwen2", "--size", "tiny")
    for tp in (1, 2):
        run_cli("build-engine", str(tmp_path / "ckpt"), "--output", str(tmp_path / f"tp{tp}"), "-q", *BUILD_FLAGS,
                "--tp-size", str(tp))
    assert json.loads((tmp_path / "tp2" / "engine.json").read_text())["tp_size"] == 2
    run_cli("trtforge", "emit-repo", str(tmp_path / "tp2"), str(tmp_path / "repo"))
    server = TritonServer(tmp_path / "repo", log_file=tmp_path / "tritonserver.log")
    server.start()
    try:
        from trtforge.config.sampling import SamplingParams
        from trtforge.serving.engine import LLMEngine

        tp1 = LLMEngine.from_engine_dir(tmp_path / "tp1")  # the oracle, while the server loads
        expected = [o.text for o in tp1.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS))]
        server.wait_ready(timeout_s=300)
        got = ["".join(client.stream_grpc(server.grpc_url, p, MAX_TOKENS)) for p in PROMPTS]
        assert got == expected
        assert all(expected)
        ranks = [p for p in _descendants(server.process.pid) if "trtforge.serving.worker.tp_worker" in _cmdline(p)]
        assert len(ranks) == 1, "the python model should have started rank 1"
        log = (tmp_path / "tritonserver.log").read_text(errors="replace")
        assert "tensor parallel: 2 ranks" in log
    finally:
        assert server.stop() == 0
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline and Path(f"/proc/{ranks[0]}").exists():
        time.sleep(0.1)
    assert not Path(f"/proc/{ranks[0]}").exists() or "zombie" in Path(f"/proc/{ranks[0]}/status").read_text(), \
        "rank 1 outlived the server"
