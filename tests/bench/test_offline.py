"""`trtforge bench offline` end to end on a tiny model: the report is complete and self-consistent.

Not a timed test: nothing here asserts a speed. It checks that one run measures every system on
the same requests, counts exactly the tokens asked for, derives its ratios from its own
measurements, and writes the JSON and the plot — so the benchmark behind docs/benchmarks.md keeps
working when the engine changes.
"""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from tests.helpers.checkpoints import make_checkpoint
from trtforge.bench.workload import make_workload
from trtforge.builder.build import build_engine
from trtforge.builder.build_config import BuildConfig
from trtforge.cli.main import main as trtforge_cli

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

NUM, BASELINE = 6, 3
PROMPTS, OUTPUTS = (4, 24), (3, 12)
SEED_LENS, SEED_OUT = [4, 16], 6


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bench-offline")
    ckpt = make_checkpoint(tmp / "ckpt", arch="qwen2")
    engine, _ = build_engine(str(ckpt), tmp / "engine",
                             BuildConfig(dtype="float32", max_batch_size=8, max_num_tokens=64, max_seq_len=128,
                                         kv_block_size=4, kv_cache_memory="256KiB"), progress=False)
    return tmp, ckpt, engine


def test_bench_offline_report_is_complete_and_consistent(dirs):
    tmp, ckpt, engine = dirs
    json_path, plot_path = tmp / "offline.json", tmp / "seed.png"
    result = CliRunner().invoke(trtforge_cli, [
        "bench", "offline", str(ckpt), str(engine), "--num-requests", str(NUM),
        "--baseline-requests", str(BASELINE), "--prompt-len-min", str(PROMPTS[0]),
        "--prompt-len-max", str(PROMPTS[1]), "--output-len-min", str(OUTPUTS[0]),
        "--output-len-max", str(OUTPUTS[1]), "--static-batch-size", "2", "--threads", "1",
        "--kv-cache-memory", "64KiB", "--seed-prompt-lens", ",".join(map(str, SEED_LENS)),
        "--seed-output-len", str(SEED_OUT), "--copy-probe-mib", "32",
        "--json", str(json_path), "--plot", str(plot_path)])
    assert result.exit_code == 0, result.output + repr(result.exception)
    report = json.loads(json_path.read_text())

    # Every system ran, on the requests it should have, and produced exactly the tokens asked for.
    with open(engine / "engine.json") as f:
        vocab = json.load(f)["model"]["vocab_size"]
    workload = make_workload(NUM, PROMPTS, OUTPUTS, vocab, 0)
    wanted = {"hf_one_at_a_time": workload[:BASELINE], "hf_static_batch": workload[:BASELINE],
              "trtforge_inflight": workload, "trtforge_inflight_baseline_subset": workload[:BASELINE]}
    systems = {s["name"]: s for s in report["systems"]}
    assert set(systems) == set(wanted)
    for name, reqs in wanted.items():
        s = systems[name]
        assert s["num_requests"] == len(reqs), name
        assert s["useful_output_tokens"] == sum(r.output_len for r in reqs), name
        assert s["prompt_tokens"] == sum(len(r.prompt_token_ids) for r in reqs), name
        assert s["elapsed_s"] > 0
        assert s["output_tokens_per_s"] == pytest.approx(s["useful_output_tokens"] / s["elapsed_s"])
    # Padded static batches compute at least the useful tokens; the others exactly those.
    assert systems["hf_static_batch"]["generated_tokens"] >= systems["hf_static_batch"]["useful_output_tokens"]
    assert systems["trtforge_inflight"]["generated_tokens"] == systems["trtforge_inflight"]["useful_output_tokens"]

    # Ratios come from the measured rates.
    tps = {name: s["output_tokens_per_s"] for name, s in systems.items()}
    assert report["ratios"]["inflight_vs_hf_one_at_a_time"] == pytest.approx(
        tps["trtforge_inflight"] / tps["hf_one_at_a_time"])
    assert report["ratios"]["inflight_vs_hf_static_batch"] == pytest.approx(
        tps["trtforge_inflight"] / tps["hf_static_batch"])
    assert 0 <= report["kv"]["waste_mean"] < 1

    # Seed experiment: one row per prompt length, bound derived from the probes around it.
    rows = report["seed_experiment"]
    assert [r["prompt_len"] for r in rows] == SEED_LENS
    for r in rows:
        assert r["ttft_s"] > 0 and r["decode_s_per_token"] > 0
        assert r["copy_bandwidth_before"] > 0 and r["copy_bandwidth_after"] > 0
        assert r["decode_vs_bound"] == pytest.approx(r["decode_s_per_token"] / r["decode_bound_s"])

    # Decode breakdown: the linear layers' bytes are the model's matrices, counted independently.
    m = json.loads((engine / "engine.json").read_text())["model"]
    q, kv = m["num_heads"] * m["head_dim"], m["num_kv_heads"] * m["head_dim"]
    h, inter = m["hidden_size"], m["intermediate_size"]
    per_layer = h * (q + 2 * kv) + q * h + h * 2 * inter + inter * h
    b = report["decode_breakdown"]
    assert b["linear_bytes"] == 4 * (m["num_layers"] * per_layer + h * m["vocab_size"])
    assert b["num_linear_calls"] == 4 * m["num_layers"] + 1
    assert b["step_s"] > 0 and b["linears_s"] > 0
    assert b["other_s"] == pytest.approx(b["step_s"] - b["linears_s"])

    assert plot_path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "batch-1 decode step" in result.output and "Seed experiment" in result.output
