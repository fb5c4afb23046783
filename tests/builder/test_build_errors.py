"""Bad input to build-engine: a clear one-paragraph error naming the culprit, a non-zero exit, and
no output directory (nor any temporary directory) left behind."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file, save_file

from tests.helpers.checkpoints import make_checkpoint
from trtforge.cli.build import build_engine


@pytest.fixture(scope="module")
def good_ckpt(tmp_path_factory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("good") / "ckpt", "qwen2")


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _build(ckpt: Path, out: Path, *args: str):
    result = CliRunner().invoke(build_engine, [str(ckpt), "-o", str(out), "-q", *args])
    leftovers = [p.name for p in out.parent.iterdir() if p.name.startswith(f".{out.name}.building-")]
    return result, leftovers


def _assert_clean_failure(result, out: Path, leftovers: list[str], *needles: str) -> None:
    assert result.exit_code != 0, result.output
    assert not out.exists(), "a failed build must leave no output directory"
    assert not leftovers, f"temporary build directories left behind: {leftovers}"
    assert "Traceback" not in result.output
    for needle in needles:
        assert needle in result.output, f"{needle!r} not in error: {result.output}"


def _rewrite_weights(ckpt: Path, edit) -> None:
    tensors = load_file(str(ckpt / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(ckpt / "model.safetensors"), metadata={"format": "pt"})


def test_missing_tensor(tmp_path, good_ckpt):
    ckpt = _copy(good_ckpt, tmp_path / "ckpt")
    _rewrite_weights(ckpt, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    result, left = _build(ckpt, tmp_path / "engine")
    _assert_clean_failure(result, tmp_path / "engine", left, "missing tensor", "model.layers.1.mlp.up_proj.weight")


def test_wrongly_shaped_tensor(tmp_path, good_ckpt):
    ckpt = _copy(good_ckpt, tmp_path / "ckpt")
    _rewrite_weights(ckpt, lambda t: t.__setitem__("model.layers.0.self_attn.k_proj.weight", torch.zeros(7, 64)))
    result, left = _build(ckpt, tmp_path / "engine")
    _assert_clean_failure(result, tmp_path / "engine", left, "model.layers.0.self_attn.k_proj.weight",
                          "[7, 64]", "[32, 64]")


def test_unknown_architecture(tmp_path, good_ckpt):
    ckpt = _copy(good_ckpt, tmp_path / "ckpt")
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["architectures"] = ["FalconForCausalLM"]
    (ckpt / "config.json").write_text(json.dumps(cfg))
    result, left = _build(ckpt, tmp_path / "engine")
    _assert_clean_failure(result, tmp_path / "engine", left, "FalconForCausalLM", "Qwen2ForCausalLM",
                          "GPT2LMHeadModel", "LlamaForCausalLM")


def test_missing_tokenizer(tmp_path, good_ckpt):
    ckpt = _copy(good_ckpt, tmp_path / "ckpt")
    (ckpt / "tokenizer.json").unlink()
    result, left = _build(ckpt, tmp_path / "engine")
    _assert_clean_failure(result, tmp_path / "engine", left, "no tokenizer")


@pytest.mark.parametrize("args,needles", [
    (["--max-num-tokens", "8", "--kv-block-size", "16", "--max-batch-size", "4"],
     ["--max-num-tokens 8", "--kv-block-size 16"]),
    (["--max-num-tokens", "32", "--max-batch-size", "64"], ["--max-batch-size 64"]),
    (["--max-seq-len", "100000"], ["--max-seq-len 100000", "512"]),
    (["--kv-cache-memory", "1KiB"], ["--kv-cache-memory 1KiB"]),
    (["--kv-cache-memory", "lots"], ["'lots'"]),
    (["--dtype", "int3"], ["--dtype 'int3'"]),
    (["--backend", "vllm"], ["'vllm' is not one of 'torch', 'tensorrt', 'trtllm'"]),  # only backends that exist
    (["--schedule", "prefill_chunk_size=-3"], ["prefill_chunk_size=-3"]),
    (["--schedule", "policy=yolo"], ["policy", "guaranteed_no_evict"]),
    (["--schedule", "block_size=64"], ["['block_size'] describe the engine", "--kv-block-size"]),
])
def test_contradictory_or_impossible_options(tmp_path, good_ckpt, args, needles):
    result, left = _build(good_ckpt, tmp_path / "engine", *args)
    _assert_clean_failure(result, tmp_path / "engine", left, *needles)


def test_pickled_weights_refused_unless_allowed(tmp_path, good_ckpt):
    ckpt = _copy(good_ckpt, tmp_path / "ckpt")
    torch.save(load_file(str(ckpt / "model.safetensors")), ckpt / "pytorch_model.bin")
    (ckpt / "model.safetensors").unlink()
    result, left = _build(ckpt, tmp_path / "engine")
    _assert_clean_failure(result, tmp_path / "engine", left, "pickled", "--allow-pickle")
    result, _ = _build(ckpt, tmp_path / "engine", "--allow-pickle")
    assert result.exit_code == 0, result.output
    assert (tmp_path / "engine" / "rank0.safetensors").is_file()


def test_existing_output_needs_force(tmp_path, good_ckpt):
    out = tmp_path / "engine"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    result, left = _build(good_ckpt, out)
    assert result.exit_code != 0 and "--force" in result.output
    assert (out / "keep.txt").read_text() == "mine", "an existing directory must not be touched without --force"
    result, _ = _build(good_ckpt, out, "--force")
    assert result.exit_code == 0 and not (out / "keep.txt").exists()


def test_missing_checkpoint_and_hub_id_without_network(tmp_path, monkeypatch):
    result, _ = _build(tmp_path / "nowhere", tmp_path / "engine")
    assert result.exit_code != 0 and "does not exist" in result.output
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # this machine has no hub; offline mode makes it fail at once
    result, _ = _build(Path("Qwen/Qwen2.5-0.5B-Instruct"), tmp_path / "engine")
    assert result.exit_code != 0 and not (tmp_path / "engine").exists()
    assert "could not download 'Qwen/Qwen2.5-0.5B-Instruct'" in result.output
    assert "local directory" in result.output


@pytest.mark.parametrize("old_torch", ["2.5.1+cu124", "2.4.0", "1.13.1"])
def test_allow_pickle_refused_under_torch_before_2_6(tmp_path, good_ckpt, monkeypatch, old_torch):
    """torch < 2.6 runs code from a crafted pickle despite weights_only=True (CVE-2025-32434):
    --allow-pickle is refused there before any weights file is read, safetensors or not."""
    ckpt = _copy(good_ckpt, tmp_path / "ckpt")
    torch.save(load_file(str(ckpt / "model.safetensors")), ckpt / "pytorch_model.bin")
    (ckpt / "model.safetensors").unlink()
    monkeypatch.setattr(torch, "__version__", old_torch)
    loads = []
    monkeypatch.setattr(torch, "load", lambda *a, **k: loads.append(a))
    result, left = _build(ckpt, tmp_path / "engine", "--allow-pickle")
    _assert_clean_failure(result, tmp_path / "engine", left, "--allow-pickle needs torch >= 2.6",
                          f"this torch is {old_torch}", "CVE-2025-32434")
    assert not loads, "the pickle was opened"
    result, left = _build(good_ckpt, tmp_path / "engine", "--allow-pickle")  # refused even for safetensors
    _assert_clean_failure(result, tmp_path / "engine", left, "--allow-pickle needs torch >= 2.6")


def test_pickle_check_at_the_unpickling_site(tmp_path, good_ckpt, monkeypatch):
    """TensorReader(allow_pickle=True) used on its own checks the version too."""
    from trtforge.builder.checkpoint import TensorReader, check_pickle_safe
    from trtforge.models.errors import BuildError

    ckpt = _copy(good_ckpt, tmp_path / "ckpt")
    torch.save(load_file(str(ckpt / "model.safetensors")), ckpt / "pytorch_model.bin")
    (ckpt / "model.safetensors").unlink()
    monkeypatch.setattr(torch, "__version__", "2.5.0")
    with pytest.raises(BuildError, match="CVE-2025-32434"):
        TensorReader(ckpt, allow_pickle=True)
    for safe in ("2.6.0", "2.6.0+cpu", "2.13.0a0+git1234", "3.0"):
        check_pickle_safe(safe)
    for unsafe in ("2.5.1", "garbage", ""):
        with pytest.raises(BuildError):
            check_pickle_safe(unsafe)
