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
from trtforge.cli.main import main
from trtforge.models.errors import BuildError
from trtforge.models.quantized_layers import QuantLinear
from trtforge.plugins.cpu import quant_linear as ql
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
    assert tensors[f"{qkv}.bias"].dtype == torch.float32  # biases, norms: engine dtype
    # the LM head: int8 per vocabulary row for both schemes; the (untied) embedding table stays float32
    assert meta["quantization"]["lm_head"] == "int8_wo" and not meta["model"]["tie_word_embeddings"]
    assert tensors["embed_tokens.weight"].dtype == torch.float32 and "lm_head.weight" not in tensors
    vocab = meta["model"]["vocab_size"]
    assert tensors["head_linear.qweight"].dtype == torch.int8 and tensors["head_linear.qweight"].shape == (vocab, 64)
    assert tensors["head_linear.scales"].shape == (vocab,)
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
    from safetensors.torch import load_file

    layers = [(n, m) for n, m in engine.executor.network.named_modules() if isinstance(m, QuantLinear)]
    assert len(layers) == 4 * 2 + 1  # qkv, o, gate_up, down in both layers, and the LM head
    assert "int8_wo weights: quantized GEMV on" in engine.executor.describe()
    x = torch.randn(5, 64)
    name, lin = layers[0]
    stored = load_file(str(out / "rank0.safetensors"))[f"{name}.qweight"]  # as built (a VNNI CPU packs it away)
    want = torch.nn.functional.linear(x, ql.dequantize(stored, lin.scales, "int8_wo", 0), lin.bias)
    torch.testing.assert_close(lin(x), want, atol=0, rtol=0)  # grad mode on: the reference path


@pytest.mark.parametrize("options,needle", [
    (dict(quantization="int4_wo", group_size=48), "does not divide"),
    (dict(quantization="int4_wo", group_size=7), "two per byte"),
    (dict(quantization="int3"), "is unknown"),
    (dict(quantization="int8_wo", lm_head_quantization="int2"), "--lm-head-quantization 'int2' is unknown"),
    (dict(quantization="int8_wo", lm_head_quantization="int4_wo", group_size=48), "LM head"),
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


def test_no_quantize_lm_head_keeps_the_float_head(ckpt, tmp_path):
    out = tmp_path / "e"
    assert _cli_build(ckpt, out, "--quantization", "int8_wo", "--no-quantize-lm-head", "-q").exit_code == 0
    meta = json.loads((out / "engine.json").read_text())
    tensors = load_file(str(out / "rank0.safetensors"))
    assert meta["quantization"]["lm_head"] is None and meta["build"]["quantize_lm_head"] is False
    assert tensors["lm_head.weight"].dtype == torch.float32 and "head_linear.qweight" not in tensors


@pytest.mark.parametrize("head_scheme", ["int8_wo", "int4_wo"])
@pytest.mark.parametrize("variant", ["qwen2-gqa-bias-tied", "llama-gqa-llama3rope"])  # tied, untied
def test_quantized_lm_head_and_embeddings(tmp_path, variant, head_scheme):
    """The int8 head against its references (int8 activations: gemv_a8_reference; float activations:
    dequantise, F.linear), through the GEMV for few rows and GEMV_MAX_ROWS at a time for more (it is
    never dequantised whole); a tied head's embeddings are
    the dequantised rows (each within its row's scale / 2 of the float one); an untied model keeps
    its float embedding table."""
    from tests.helpers.checkpoints import make_variant
    from trtforge.models.quantized_layers import QuantEmbedding
    from trtforge.plugins.cpu.quant_linear import GEMV_MAX_ROWS

    ckpt = make_variant(tmp_path / "ckpt", variant)
    out, cfg = build_engine(str(ckpt), tmp_path / "e", BuildConfig(dtype="float32", quantization="int4_wo",
                                                                    group_size=32, kv_cache_memory="8MiB",
                                                                    lm_head_quantization=head_scheme),
                            progress=False)
    meta = json.loads((out / "engine.json").read_text())["quantization"]
    group = 32 if head_scheme == "int4_wo" else 0
    assert meta["lm_head"] == head_scheme and (meta["lm_head_group_size"] or 0) == group
    net = LLMEngine.from_engine_dir(out).executor.network
    head = net.head_linear
    assert isinstance(head, QuantLinear) and head.scheme == head_scheme and head.group == group and head.gemv_only
    w = ql.dequantize(head.qweight, head.scales, head_scheme, group)
    hidden = cfg.model.hidden_size
    assert ql.a8_ok(hidden, head_scheme, group)  # the GEMV quantises the activation rows per block of 32 too
    with torch.inference_mode():
        for rows in (3, GEMV_MAX_ROWS + 7):
            x = torch.randn(rows, hidden)
            want, m = ql.gemv_a8_reference(x, head.qweight, head.scales, None, head_scheme, group)
            # float32 summation of exact integer block dots (tests/plugins/cpu/test_quant_linear.py)
            bound = (hidden // 32 + (hidden // group if group else 0) + 8) * 2.0 ** -24 * m
            assert ((head(x).double() - want).abs() <= bound).all()
            with_float_x = ql.gemv(x[:GEMV_MAX_ROWS], head.qweight, head.scales, None, head_scheme, group, "float")
            torch.testing.assert_close(with_float_x, x[:GEMV_MAX_ROWS] @ w.T, atol=1e-4, rtol=1e-5)
    from safetensors.torch import load_file as load

    hf = load(str(next(ckpt.glob("*.safetensors"))))
    table = hf["model.embed_tokens.weight"]
    ids = torch.tensor([0, 7, 300, cfg.model.vocab_size - 1])
    got = net.embed_tokens(ids)
    if cfg.model.tie_word_embeddings:
        assert isinstance(net.embed_tokens, QuantEmbedding)
        torch.testing.assert_close(got, w[ids], atol=0, rtol=0)  # exactly the head's dequantised rows
        err = (got - table[ids]).abs()
        if head_scheme == "int8_wo":
            assert bool((err <= head.scales[ids, None] / 2 * (1 + 1e-6)).all())
        else:  # per group: within scale/2, or a clipped extreme within 2.34 scales (the clip search's floor 0.75)
            step = head.scales[ids].repeat_interleave(group, dim=1)
            assert bool((err <= step * 2.34).all()) and float((err <= step / 2 * (1 + 1e-6)).float().mean()) > 0.9
        plan_out = torch.empty(len(ids), hidden)
        assert net.embed_tokens(ids, out=plan_out) is plan_out and torch.equal(plan_out, got)  # the decode plan's call
    else:
        assert isinstance(net.embed_tokens, torch.nn.Embedding) and torch.equal(got, table[ids])
        reach = 0.5 if head_scheme == "int8_wo" else 2.34  # int4: a clipped extreme (see above)
        torch.testing.assert_close(w, hf["lm_head.weight"], atol=float(head.scales.max()) * reach, rtol=0)
