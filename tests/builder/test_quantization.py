"""build-engine --quantization: what the engine stores and records, the refusals, and that the
quantized engine runs end to end (`trtforge generate`, the torch reference path)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file

from tests.helpers.checkpoints import make_checkpoint
from trtforge.builder.build import build_engine
from trtforge.builder.build_config import BuildConfig
from trtforge.builder.errors import BuildError
from trtforge.builder.quant_linear import QuantLinear
from trtforge.plugins.cpu import quant_linear as ql
from trtforge.serving.cli import main
from trtforge.serving.engine import LLMEngine


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("q") / "ckpt", "qwen2")  # hidden 64, intermediate 96


def _cli_build(ckpt: Path, out: Path, *args: str):
    return CliRunner().invoke(main, ["build", str(ckpt), "-o", str(out), "--kv-cache-memory", "8MiB", *args])


@pytest.mark.parametrize("scheme,group", [("int8_wo", None), ("int4_wo", 32)])
def test_engine_stores_packed_weights_and_scales(ckpt, tmp_path, scheme, group):
    out = tmp_path / scheme
    result = _cli_build(ckpt, out, "--quantization", scheme, *(["--group-size", str(group)] if group else []))
    assert result.exit_code == 0, result.output
    assert f"({scheme}; " in result.output and "x smaller" in result.output  # the report: bytes before/after
    meta = json.loads((out / "engine.json").read_text())
    assert meta["quantization"]["scheme"] == scheme and meta["quantization"]["group_size"] == group
    assert meta["build"]["quantization"] == scheme
    tensors = load_file(str(out / "rank0.safetensors"))
    qkv = "layers.0.attn.qkv"
    assert f"{qkv}.weight" not in tensors
    assert tensors[f"{qkv}.qweight"].dtype == (torch.int8 if scheme == "int8_wo" else torch.uint8)
    assert tensors[f"{qkv}.qweight"].shape == ((128, 64) if scheme == "int8_wo" else (128, 32))
    assert tensors[f"{qkv}.scales"].shape == ((128,) if scheme == "int8_wo" else (128, 2))
    assert tensors[f"{qkv}.bias"].dtype == torch.float32  # biases, norms, embeddings: engine dtype
    assert tensors["embed_tokens.weight"].dtype == torch.float32
    report = meta["report"]
    assert report["weight_bytes"] == sum(t.numel() * t.element_size() for n, t in tensors.items()
                                         if n != "rope_inv_freq")
    assert report["weight_bytes"] < report["weight_bytes_unquantized"]


def test_generate_runs_a_quantized_engine(ckpt, tmp_path):
    out = tmp_path / "int4"
    assert _cli_build(ckpt, out, "--quantization", "int4_wo", "--group-size", "32", "-q").exit_code == 0
    result = CliRunner().invoke(main, ["generate", str(out), "--prompt", "Hello world", "--max-tokens", "6",
                                       "--ignore-eos", "--json"])
    assert result.exit_code == 0, result.output
    assert len(json.loads(result.output)["output_ids"]) == 6


def test_network_reference_path_equals_the_dequantised_float_network(ckpt, tmp_path):
    """With the kernels off, a QuantLinear is F.linear on the dequantised weights, exactly."""
    out, _ = build_engine(str(ckpt), tmp_path / "e", BuildConfig(quantization="int8_wo", kv_cache_memory="8MiB"),
                          progress=False)
    engine = LLMEngine.from_engine_dir(out)
    layers = [m for m in engine.executor.network.modules() if isinstance(m, QuantLinear)]
    assert len(layers) == 4 * 2  # qkv, o, gate_up, down in both layers
    assert "int8_wo weights: quantized GEMV on" in engine.executor.describe()
    x = torch.randn(5, 64)
    lin = layers[0]
    want = torch.nn.functional.linear(x, ql.dequantize(lin.qweight, lin.scales, "int8_wo", 0), lin.bias)
    torch.testing.assert_close(lin(x), want, atol=0, rtol=0)  # grad mode on: the reference path


@pytest.mark.parametrize("options,needle", [
    (dict(quantization="int4_wo", group_size=48), "does not divide"),
    (dict(quantization="int4_wo", group_size=7), "two per byte"),
    (dict(quantization="int3"), "is unknown"),
    (dict(quantization="int8_wo", backend="tensorrt"), "not supported with --backend tensorrt yet"),
    (dict(quantization="int8_wo", backend="trtllm"), "not supported with --backend trtllm yet"),
])
def test_impossible_options_are_refused(ckpt, tmp_path, options, needle):
    with pytest.raises(BuildError, match=needle):
        build_engine(str(ckpt), tmp_path / "e", BuildConfig(kv_cache_memory="8MiB", **options), progress=False)
    assert not (tmp_path / "e").exists()


def test_odd_in_features_refused_for_int4(tmp_path):
    odd = make_checkpoint(tmp_path / "odd", "qwen2", intermediate_size=95)
    with pytest.raises(BuildError, match="odd in_features"):
        build_engine(str(odd), tmp_path / "e", BuildConfig(quantization="int4_wo", group_size=32,
                                                            kv_cache_memory="8MiB"), progress=False)


def test_cli_refuses_tensorrt_before_looking_for_it(ckpt, tmp_path):
    result = _cli_build(ckpt, tmp_path / "e", "--backend", "tensorrt", "--quantization", "int8_wo")
    assert result.exit_code != 0 and "not supported with --backend tensorrt yet" in result.output
