"""The engine directory: contents, report, verification on load, and the CLI around it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from tests.helpers.checkpoints import build_tiny_engine, make_checkpoint
from trtforge.builder.build_config import BuildConfig
from trtforge.builder.report import make_report
from trtforge.cli.main import main
from trtforge.config.fields import parse_bytes
from trtforge.models.engine_dir import read_engine_config
from trtforge.models.errors import EngineLoadError
from trtforge.models.kv_sizing import kv_bytes_per_token
from trtforge.models.model_config import ModelConfig


@pytest.fixture(scope="module")
def engine(tmp_path_factory) -> Path:
    return build_tiny_engine(tmp_path_factory.mktemp("eng"), "llama", "--max-seq-len", "256",
                             "--kv-cache-memory", "8MiB", "--schedule", "prefill_chunk_size=64")


def test_engine_directory_contents(engine):
    names = {p.name for p in engine.iterdir()}
    assert {"engine.json", "rank0.safetensors", "tokenizer.json", "tokenizer_config.json"} <= names
    cfg = json.loads((engine / "engine.json").read_text())
    assert cfg["schema_version"] == 1 and cfg["backend"] == "torch" and cfg["dtype"] == "float32"
    assert set(cfg["versions"]) >= {"trtforge", "torch", "transformers"}
    assert cfg["model"]["architecture"] == "LlamaForCausalLM"
    assert cfg["build"]["max_seq_len"] == 256 and cfg["build"]["kv_block_size"] == 16
    assert cfg["scheduling"]["prefill_chunk_size"] == 64
    assert set(cfg["files"]) == names - {"engine.json"}
    m = cfg["model"]
    assert cfg["report"]["kv_bytes_per_token"] == 2 * m["num_layers"] * m["num_kv_heads"] * m["head_dim"] * 4
    assert cfg["report"]["kv_tokens"] == 8 * 2**20 // cfg["report"]["kv_bytes_per_token"] // 16 * 16
    assert cfg["report"]["parameters"] > 0 and cfg["report"]["peak_rss_bytes"] > 0


def test_kv_bytes_per_token_llama2_7b():
    llama2_7b = ModelConfig(architecture="LlamaForCausalLM", family="llama", vocab_size=32000, hidden_size=4096,
                            num_layers=32, num_heads=32, num_kv_heads=32, head_dim=128, intermediate_size=11008,
                            norm="rms", norm_eps=1e-5, activation="silu", gated_mlp=True, position="rope",
                            max_position_embeddings=4096, tie_word_embeddings=False, qkv_bias=False,
                            o_bias=False, mlp_bias=False, qk_norm=False)
    assert kv_bytes_per_token(llama2_7b, "float16") == 512 * 1024
    report = make_report(llama2_7b, BuildConfig(kv_cache_memory="4GiB", max_seq_len=4096), "float16", 1, 2)
    assert report.kv_tokens == 8192 and report.full_length_sequences == 2


def test_parse_bytes():
    assert parse_bytes("4GiB") == 4 * 2**30 and parse_bytes("512MB") == 512 * 10**6 and parse_bytes(100) == 100


def test_load_refuses_modified_weights(engine, tmp_path):
    import shutil

    copy = Path(shutil.copytree(engine, tmp_path / "copy"))
    with open(copy / "rank0.safetensors", "r+b") as f:
        f.seek(-4, 2)
        f.write(b"\x00\x01\x02\x03")
    with pytest.raises(EngineLoadError, match="rank0.safetensors does not match the sha256"):
        read_engine_config(copy)


def test_load_refuses_other_schema(engine, tmp_path):
    import shutil

    copy = Path(shutil.copytree(engine, tmp_path / "copy"))
    cfg = json.loads((copy / "engine.json").read_text())
    cfg["schema_version"] = 99
    cfg["versions"]["trtforge"] = "9.9.9"
    (copy / "engine.json").write_text(json.dumps(cfg))
    with pytest.raises(EngineLoadError, match=r"schema version 99 \(written by trtforge 9.9.9\).*build-engine"):
        read_engine_config(copy)
    (copy / "engine.json").unlink()
    with pytest.raises(EngineLoadError, match="not a trtforge engine directory"):
        read_engine_config(copy)


def test_generate_cli_jsonl_and_json_output(engine, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "Hello world"}\n{"input_ids": [5, 6, 7], "max_tokens": 3}\n'
                       '{"prompt": "The quick brown fox jumps"}\n')
    result = CliRunner().invoke(main, ["generate", str(engine), "--prompts-file", str(prompts),
                                       "--max-tokens", "5", "--ignore-eos", "--json"])
    assert result.exit_code == 0, result.output
    rows = [json.loads(line) for line in result.output.splitlines()]
    assert [r["index"] for r in rows] == [0, 1, 2]
    assert [len(r["output_ids"]) for r in rows] == [5, 3, 5]
    assert all(r["finish_reason"] == "length" for r in rows)
    # the same prompt alone gives the same greedy output (batching does not change results)
    alone = CliRunner().invoke(main, ["generate", str(engine), "--prompt", "Hello world", "--max-tokens", "5",
                                      "--ignore-eos", "--json"])
    assert json.loads(alone.output)["output_ids"] == rows[0]["output_ids"]


def test_generate_cli_bad_input(engine, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "no prompt key"}\n')
    result = CliRunner().invoke(main, ["generate", str(engine), "--prompts-file", str(bad)])
    assert result.exit_code != 0 and "exactly one" in result.output
    long_prompt = " ".join(["hello"] * 400)
    result = CliRunner().invoke(main, ["generate", str(engine), "--prompt", long_prompt])
    assert result.exit_code != 0 and "too long for max_seq_len=256" in result.output
    result = CliRunner().invoke(main, ["generate", str(engine), "--prompt", "hi", "--top-p", "1.5"])
    assert result.exit_code != 0 and "top_p=1.5" in result.output


def test_model_without_eos_stops_at_length(tmp_path):
    ckpt = make_checkpoint(tmp_path / "ckpt", "gpt2")
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["eos_token_id"] = None
    (ckpt / "config.json").write_text(json.dumps(cfg))
    (ckpt / "generation_config.json").unlink(missing_ok=True)
    out = tmp_path / "engine"
    built = CliRunner().invoke(main, ["build", str(ckpt), "-o", str(out), "-q", "--kv-cache-memory", "8MiB"])
    assert built.exit_code == 0, built.output
    result = CliRunner().invoke(main, ["generate", str(out), "--prompt", "Hello", "--max-tokens", "12", "--json"])
    assert result.exit_code == 0, result.output
    row = json.loads(result.output)
    assert row["finish_reason"] == "length" and len(row["output_ids"]) == 12


def test_sharded_checkpoint(tmp_path):
    from transformers import AutoModelForCausalLM

    ckpt = make_checkpoint(tmp_path / "ckpt", "qwen2")
    model = AutoModelForCausalLM.from_pretrained(str(ckpt))
    sharded = tmp_path / "sharded"
    model.save_pretrained(str(sharded), max_shard_size="100KB")
    for f in ckpt.glob("tokenizer*"):
        (sharded / f.name).write_bytes(f.read_bytes())
    assert (sharded / "model.safetensors.index.json").is_file()
    out = tmp_path / "engine"
    result = CliRunner().invoke(main, ["build", str(sharded), "-o", str(out), "-q", "--kv-cache-memory", "8MiB"])
    assert result.exit_code == 0, result.output
    from safetensors.torch import load_file

    ours = load_file(str(out / "rank0.safetensors"))
    assert ours["embed_tokens.weight"].equal(model.model.embed_tokens.weight)


def test_generation_config_eos_ids_are_stop_ids(tmp_path):
    ckpt = make_checkpoint(tmp_path / "ckpt", "qwen2")
    gen = json.loads((ckpt / "generation_config.json").read_text())
    gen["eos_token_id"] = [0, 7]  # like Qwen2.5-Instruct: <|im_end|> only in generation_config.json
    (ckpt / "generation_config.json").write_text(json.dumps(gen))
    out = tmp_path / "engine"
    built = CliRunner().invoke(main, ["build", str(ckpt), "-o", str(out), "-q", "--kv-cache-memory", "8MiB"])
    assert built.exit_code == 0, built.output
    assert json.loads((out / "engine.json").read_text())["model"]["eos_token_ids"] == [0, 7]
