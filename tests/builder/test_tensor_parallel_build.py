"""build-engine --tp-size: the shards put back together are the tp-1 weights, engine.json records
the mapping, impossible sizes are refused with the reason, and --tp-size 1 writes what it always did."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file

from tests.helpers.checkpoints import make_checkpoint
from trtforge.builder.build import build_engine
from trtforge.builder.build_config import BuildConfig
from trtforge.cli.build import build_engine as build_cli
from trtforge.models.errors import BuildError

OPTS = dict(dtype="float32", max_batch_size=4, max_num_tokens=64, kv_cache_memory="4MiB")


@pytest.fixture(scope="module")
def qwen2_mqa(tmp_path_factory):
    """Qwen2 with one KV head (replicated on both ranks), tied embeddings, q/k/v biases."""
    tmp = tmp_path_factory.mktemp("qwen2")
    ckpt = make_checkpoint(tmp / "ckpt", "qwen2", num_attention_heads=4, num_key_value_heads=1,
                           tie_word_embeddings=True, vocab_size=301)
    tp1 = build_engine(str(ckpt), tmp / "tp1", BuildConfig(**OPTS), progress=False)[0]
    tp2 = build_engine(str(ckpt), tmp / "tp2", BuildConfig(**OPTS, tp_size=2), progress=False)[0]
    return ckpt, tp1, tp2


def test_shards_reassemble_the_single_rank_weights(qwen2_mqa):
    _, tp1, tp2 = qwen2_mqa
    full = load_file(tp1 / "rank0.safetensors")
    r0, r1 = load_file(tp2 / "rank0.safetensors"), load_file(tp2 / "rank1.safetensors")
    d = 16  # head_dim: hidden 64 / 4 heads
    qkv = full["layers.0.attn.qkv.weight"]  # rows: 4 q heads | 1 k head | 1 v head
    q, k, v = qkv[:4 * d], qkv[4 * d:5 * d], qkv[5 * d:]
    assert torch.equal(r0["layers.0.attn.qkv.weight"], torch.cat([q[:2 * d], k, v]))
    assert torch.equal(r1["layers.0.attn.qkv.weight"], torch.cat([q[2 * d:], k, v]))  # the KV head replicated
    assert torch.equal(torch.cat([r0["layers.1.attn.o_proj.weight"], r1["layers.1.attn.o_proj.weight"]], 1),
                       full["layers.1.attn.o_proj.weight"])
    gate_up, i = full["layers.0.mlp.gate_up.weight"], 96  # intermediate size
    assert torch.equal(r1["layers.0.mlp.gate_up.weight"], torch.cat([gate_up[i // 2:i], gate_up[i + i // 2:]]))
    assert torch.equal(torch.cat([r0["layers.0.mlp.down.weight"], r1["layers.0.mlp.down.weight"]], 1),
                       full["layers.0.mlp.down.weight"])
    assert torch.equal(r0["embed_tokens.weight"], full["embed_tokens.weight"])  # replicated; tied head slices it
    assert "lm_head.weight" not in r0


def test_engine_json_records_the_mapping(qwen2_mqa):
    _, tp1, tp2 = qwen2_mqa
    cfg = json.loads((tp2 / "engine.json").read_text())
    assert cfg["tp_size"] == 2 and cfg["build"]["tp_size"] == 2
    tp = cfg["tensor_parallel"]
    assert tp["kv_heads_replicated"] and tp["embeddings"] == "replicated"
    assert [r["q_heads"] for r in tp["ranks"]] == [[0, 2], [2, 4]]
    assert [r["kv_heads"] for r in tp["ranks"]] == [[0, 1], [0, 1]]
    assert [r["vocab"] for r in tp["ranks"]] == [[0, 151], [151, 301]]
    assert {"rank0.safetensors", "rank1.safetensors"} <= set(cfg["files"])
    single = json.loads((tp1 / "engine.json").read_text())  # tp 1: the keys engines had before --tp-size
    assert single["tp_size"] == 1 and "tensor_parallel" not in single and "tp_size" not in single["build"]
    assert sorted(p.name for p in tp1.glob("rank*")) == ["rank0.safetensors"]


def test_single_rank_weights_are_unchanged_by_the_sharding_code(qwen2_mqa, tmp_path):
    """--tp-size 1 goes through convert.py alone: a rebuild is byte-identical."""
    ckpt, tp1, _ = qwen2_mqa
    again = build_engine(str(ckpt), tmp_path / "again", BuildConfig(**OPTS, tp_size=1), progress=False)[0]
    assert (again / "rank0.safetensors").read_bytes() == (tp1 / "rank0.safetensors").read_bytes()


@pytest.mark.parametrize("tp, options, message", [
    (3, {}, "does not divide the 4 attention heads"),
    (2, {"intermediate_size": 95, "num_key_value_heads": 2}, "does not divide the MLP's intermediate size 95"),
    (4, {"num_key_value_heads": 3, "num_attention_heads": 12, "hidden_size": 96}, "does not fit the 3 KV heads"),
])
def test_impossible_sizes_are_refused(tmp_path, tp, options, message):
    ckpt = make_checkpoint(tmp_path / "ckpt", "llama", **options)
    with pytest.raises(BuildError, match=message):
        build_engine(str(ckpt), tmp_path / "out", BuildConfig(**OPTS, tp_size=tp), progress=False)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("args, message", [
    (["--tp-size", "2", "--backend", "tensorrt"], "not supported with --backend tensorrt"),
    (["--tp-size", "2", "--quantization", "int8_wo"], "with --quantization int8_wo is not supported"),
    (["--tp-size", "0"], "--tp-size must be ≥ 1"),
])
def test_cli_refuses_unsupported_combinations(tmp_path, args, message):
    result = CliRunner().invoke(build_cli, ["no-such-checkpoint", "--output", str(tmp_path / "o"), *args])
    assert result.exit_code != 0 and message in result.output, result.output
