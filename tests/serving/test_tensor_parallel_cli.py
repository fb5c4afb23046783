"""`trtforge generate` on a tp=2 engine as a user runs it: one host (rank 0 starts rank 1 itself), and
two "hosts" on 127.0.0.1 launched torchrun-style (NNODES=2, NODE_RANK 0 runs `trtforge generate`,
NODE_RANK 1 `trtforge tp-worker`). Both print the greedy tokens of the tp=1 engine."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.helpers.checkpoints import make_checkpoint
from trtforge.builder.build import build_engine
from trtforge.builder.build_config import BuildConfig
from trtforge.config.sampling import SamplingParams
from trtforge.serving.engine import LLMEngine
from trtforge.serving.worker.tp_launch import free_port

PROMPTS = ["the quick brown fox", "once upon a time there was"]
MAX_TOKENS = 12
CLI = [sys.executable, "-m", "trtforge.cli.main"]


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tp-cli")
    ckpt = make_checkpoint(tmp / "ckpt", "qwen2", num_attention_heads=4, num_key_value_heads=2)
    opts = dict(dtype="float32", max_batch_size=4, max_num_tokens=128, kv_cache_memory="8MiB")
    tp1 = build_engine(str(ckpt), tmp / "tp1", BuildConfig(**opts), progress=False)[0]
    tp2 = build_engine(str(ckpt), tmp / "tp2", BuildConfig(**opts, tp_size=2), progress=False)[0]
    engine = LLMEngine.from_engine_dir(tp1)
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    want = [o.output_token_ids for o in engine.generate(PROMPTS, params)]
    return tp2, want


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "NNODES", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT")}
    return {**env, "TRTFORGE_TP_TIMEOUT_S": "60", **extra}


def _generate_args(engine_dir) -> list[str]:
    args = [*CLI, "generate", str(engine_dir), "--json", "--max-tokens", str(MAX_TOKENS), "--ignore-eos"]
    for p in PROMPTS:
        args += ["--prompt", p]
    return args


def _tokens(stdout: str) -> list[list[int]]:
    return [json.loads(line)["output_ids"] for line in stdout.splitlines() if line.startswith("{")]


def test_generate_starts_the_other_rank_itself(engines):
    tp2, want = engines
    out = subprocess.run(_generate_args(tp2), env=_env(), capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert _tokens(out.stdout) == want


def test_two_hosts_with_torchrun_style_environment(engines):
    tp2, want = engines
    hosts = dict(NNODES="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    worker = subprocess.Popen([*CLI, "tp-worker", str(tp2)], env=_env(**hosts, NODE_RANK="1"),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out = subprocess.run(_generate_args(tp2), env=_env(**hosts, NODE_RANK="0"), capture_output=True, text=True,
                             timeout=120)
        _, worker_err = worker.communicate(timeout=30)  # rank 0's STOP ends it
    finally:
        if worker.poll() is None:
            worker.kill()
    assert out.returncode == 0, out.stderr[-3000:]
    assert _tokens(out.stdout) == want
    assert worker.returncode == 0, worker_err[-3000:]


def test_worker_refuses_to_be_rank_zero(engines):
    tp2, _ = engines
    out = subprocess.run([*CLI, "tp-worker", str(tp2)], env=_env(NNODES="2", NODE_RANK="0", MASTER_PORT="1"),
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "rank 0 runs `trtforge generate`" in out.stderr, out.stderr
