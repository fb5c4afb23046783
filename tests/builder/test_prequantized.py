"""Pre-quantized GPTQ / AWQ / compressed-tensors checkpoints (builder/prequantized/): the codes read are the
checkpoint's own — their weights bit-identical to what the format's own package dequantises them to — and the
engine built from them matches HF transformers running those dequantised weights.

Oracles: compressed-tensors' own decompressors (installed with the dev extra), and for GPTQ / AWQ gptqmodel's
dequantisers, whose results for these deterministic checkpoints are stored by prequantized_oracle.py
(gptqmodel does not install beside this project's torch; see there)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file

from tests.builder.prequantized_checkpoints import CASES, PROJECTIONS, make_prequantized
from trtforge.builder import prequantized
from trtforge.builder.build import build_engine
from trtforge.builder.build_config import BuildConfig
from trtforge.builder.checkpoint import TensorReader, load_hf_config
from trtforge.cli.main import main
from trtforge.config.sampling import SamplingParams
from trtforge.models.errors import BuildError
from trtforge.models.quantized_layers import QuantLinear
from trtforge.serving.engine import LLMEngine

ORACLE = json.loads((Path(__file__).with_name("data") / "prequantized_oracle.json").read_text())["cases"]
PROMPTS = ([5, 17, 300, 42], [7] * 3 + list(range(100, 130)), list(range(9, 60, 2)))
MAX_NEW = 16


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    cache: dict[str, Path] = {}

    def get(case: str) -> Path:
        if case not in cache:
            cache[case] = make_prequantized(tmp_path_factory.mktemp(case) / "ckpt", case)
        return cache[case]
    return get


def _modules(ckpt: Path) -> list[str]:
    names = load_file(str(ckpt / "model.safetensors")).keys()
    return sorted({n.rsplit(".", 1)[0] for n in names if n.rsplit(".", 1)[0].split(".layers.")[-1].split(".", 1)[-1]
                   in PROJECTIONS})


def _ours(ckpt: Path) -> dict[str, prequantized.LinearCodes]:
    src = prequantized.detect(load_hf_config(ckpt))
    with TensorReader(ckpt) as reader:
        return {f"{m}.weight": prequantized.read_linear(src, reader, [f"{m}.weight"]) for m in _modules(ckpt)}


def _library(ckpt: Path, case: str) -> dict[str, torch.Tensor]:
    """The format's own package's dequantised weights: compressed-tensors' decompressor, run here."""
    from compressed_tensors.compressors import NaiveQuantizationCompressor, PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationConfig

    qc = QuantizationConfig.model_validate(json.loads((ckpt / "config.json").read_text())["quantization_config"])
    scheme = qc.config_groups["group_0"]
    compressor = PackedQuantizationCompressor if CASES[case]["bits"] == 4 else NaiveQuantizationCompressor
    tensors = load_file(str(ckpt / "model.safetensors"))
    out = {}
    for m in _modules(ckpt):
        state = {k[len(m) + 1:]: v for k, v in tensors.items() if k.startswith(m + ".") and k != f"{m}.bias"}
        out[f"{m}.weight"] = compressor.decompress(state, scheme)["weight"]
    return out


@pytest.mark.parametrize("case", sorted(CASES))
def test_weights_are_bit_identical_to_the_formats_own_dequantisation(ckpts, case):
    ckpt = ckpts(case)
    ours = _ours(ckpt)
    assert len(ours) == 14
    if CASES[case]["fmt"] == "compressed-tensors":
        library = _library(ckpt, case)
        for name, lin in ours.items():
            ref = library[name]
            assert torch.equal(lin.dequantize().to(ref.dtype), ref), name  # the library rounds to the scale dtype
        return
    for name, lin in ours.items():
        want = ORACLE[case][name]
        w = lin.dequantize().to(getattr(torch, want["dtype"]))
        assert hashlib.sha256(w.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest() == want["sha256"], name


def test_compressed_tensors_codes_equal_the_librarys_unpacked_codes(ckpts):
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32

    ckpt = ckpts("ct-qwen2-w4a16-asym")
    tensors = load_file(str(ckpt / "model.safetensors"))
    for name, lin in _ours(ckpt).items():
        m = name[: -len(".weight")]
        shape = torch.Size(tensors[f"{m}.weight_shape"].tolist())
        assert torch.equal(lin.codes, unpack_from_int32(tensors[f"{m}.weight_packed"], 4, shape))
        zp = unpack_from_int32(tensors[f"{m}.weight_zero_point"], 4, torch.Size([shape[0], lin.scales.shape[1]]),
                               packed_dim=0)
        assert torch.equal(lin.zeros, zp)


def _hf_reference(ckpt: Path, case: str, ours: dict[str, prequantized.LinearCodes], exact: bool = True):
    """HF transformers' float model of the checkpoint. Its decoder weights: exact — (code - zero) · scale in
    float32, which the first test proves equal to the library's dequantised weights once rounded to the
    library's dtype (gptqmodel's GPTQ path computes in float32: equal as they are; AWQ and compressed-tensors
    round each weight to float16 / bfloat16); not exact — the library's rounded weights themselves."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(str(ckpt))
    del cfg.quantization_config
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    state = {k: v for k, v in load_file(str(ckpt / "model.safetensors")).items() if k.rsplit(".", 1)[0]
             not in {n[: -len(".weight")] for n in ours} or k.endswith(".bias")}
    if exact:
        weights = {n: lin.dequantize() for n, lin in ours.items()}
    elif CASES[case]["fmt"] == "compressed-tensors":
        weights = _library(ckpt, case)
    else:  # bit-identical to gptqmodel's (the test above): its values, at its precision
        dtypes = {n: getattr(torch, ORACLE[case][n]["dtype"]) for n in ours}
        weights = {n: lin.dequantize().to(dtypes[n]) for n, lin in ours.items()}
    state.update({n: w.float() for n, w in weights.items()})
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and all("rotary" in k or k == "lm_head.weight" for k in missing), (missing, unexpected)
    if cfg.tie_word_embeddings:
        model.tie_weights()
    return model


def _engine(tmp: Path, ckpt: Path) -> tuple[Path, dict]:
    out, cfg = build_engine(str(ckpt), tmp / "engine", BuildConfig(dtype="float32", max_batch_size=4,
                                                                    max_num_tokens=128, kv_cache_memory="8MiB"),
                            progress=False)
    return out, json.loads((out / "engine.json").read_text())


@pytest.mark.parametrize("case", sorted(CASES))
def test_engine_matches_transformers_on_the_dequantised_weights(ckpts, case, tmp_path, monkeypatch):
    ckpt = ckpts(case)
    out, meta = _engine(tmp_path, ckpt)
    hf = _hf_reference(ckpt, case, _ours(ckpt))
    spec = CASES[case]
    # the weights in float products exactly (float activations): HF parity up to summation order and the
    # oracle's own rounding of each weight to its scales' dtype (float16 / bfloat16 where the library rounds)
    monkeypatch.setenv("TRTFORGE_QUANT_ACTIVATIONS", "float")
    engine = LLMEngine.from_engine_dir(out)
    layers = [m for m in engine.executor.network.modules() if isinstance(m, QuantLinear)]
    assert len(layers) == 8 and all(m.c_kernels for m in layers)
    assert all((m.zeros is not None) == (not spec["sym"]) for m in layers)
    tol = 1e-3
    outs = engine.generate([list(p) for p in PROMPTS], SamplingParams(max_tokens=MAX_NEW, ignore_eos=True))
    with torch.no_grad():
        for p, o in zip(PROMPTS, outs):
            ids = torch.tensor([list(p) + o.output_token_ids])
            ref = hf(ids).logits[0]
            # greedy: each generated token is HF's argmax given the same prefix, or within tol of it (a tie)
            for i, tok in enumerate(o.output_token_ids):
                row = ref[len(p) - 1 + i]
                assert row.max() - row[tok] <= 2 * tol, f"{case}: token {i} of a {len(p)}-token prompt"
            strict = [int(ref[len(p) - 1 + i].argmax()) == t for i, t in enumerate(o.output_token_ids)]
            assert sum(strict) >= len(strict) - 1
    from tests.builder.test_parity import _prompt_logits

    for p, got in zip(PROMPTS, _prompt_logits(engine, [list(p) for p in PROMPTS])):
        with torch.no_grad():
            ref = hf(torch.tensor([list(p)])).logits[0]
        assert (got - ref).abs().max().item() < tol, f"{case}: prompt logits differ"
    # against the library's own (rounded) weights: within what rounding each weight to 11 / 8 bits moves
    rounded = _hf_reference(ckpt, case, _ours(ckpt), exact=False)
    eps = {"compressed-tensors": 2**-8, "awq": 2**-11}.get(spec["fmt"], 0.0)
    for p in PROMPTS:
        with torch.no_grad():
            a, b = hf(torch.tensor([list(p)])).logits[0], rounded(torch.tensor([list(p)])).logits[0]
        assert (a - b).abs().max().item() <= tol + 40 * eps * a.abs().max().item()


@pytest.mark.parametrize("case", ["gptq-qwen2-asym", "gptq-llama-actorder", "gptq-qwen2-int8"])
def test_default_kernels_int8_activations_stay_close(ckpts, case, tmp_path):
    """With int8 activations (the default CPU kernels) and zero points / act-order around them."""
    ckpt = ckpts(case)
    out, _ = _engine(tmp_path, ckpt)
    hf = _hf_reference(ckpt, case, _ours(ckpt))
    engine = LLMEngine.from_engine_dir(out)
    for p, got in zip(PROMPTS, __import__("tests.builder.test_parity", fromlist=["_"])._prompt_logits(
            engine, [list(p) for p in PROMPTS])):
        with torch.no_grad():
            ref = hf(torch.tensor([list(p)])).logits[0]
        assert (got - ref).abs().max().item() < 0.25 * ref.abs().max().item()
        assert (got.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.8


@pytest.mark.parametrize("case,fields", [
    ("gptq-llama-actorder", {"format": "gptq", "bits": 4, "group_size": 32, "sym": False, "desc_act": True,
                             "checkpoint_format": "gptq"}),
    ("awq-qwen2", {"format": "awq", "bits": 4, "group_size": 64, "sym": False, "desc_act": False, "version": "gemm"}),
    ("ct-llama-w8a16", {"format": "compressed-tensors", "bits": 8, "group_size": -1, "sym": True, "desc_act": False,
                        "format_name": "int-quantized", "strategy": "channel", "actorder": None}),
])
def test_engine_json_and_report_name_family_and_scheme(ckpts, case, fields, tmp_path):
    ckpt = ckpts(case)
    out = tmp_path / "e"
    result = CliRunner().invoke(main, ["build", str(ckpt), "-o", str(out), "--dtype", "float32",
                                       "--kv-cache-memory", "8MiB"])
    assert result.exit_code == 0, result.output
    meta = json.loads((out / "engine.json").read_text())
    q = meta["quantization"]
    assert q["source_quantization"] == fields and meta["report"]["source_quantization"] == fields
    assert q["scheme"] == ("int4_wo" if fields["bits"] == 4 else "int8_wo") and q["lm_head"] is None
    assert q["zero_points"] == (not fields["sym"]) and q["act_order"] == fields["desc_act"]
    family = CASES[case]["arch"]
    assert meta["report"]["family"] == family
    assert f"pre-quantized ({family}) {fields['format']} {fields['bits']}-bit" in result.output
    tensors = load_file(str(out / "rank0.safetensors"))
    assert "lm_head.weight" in tensors or meta["model"]["tie_word_embeddings"]  # the head as the checkpoint has it
    assert ("layers.0.attn.qkv.perm" in tensors) == fields["desc_act"]
    assert ("layers.0.attn.qkv.zeros" in tensors) == (not fields["sym"])


def _edit(ckpt: Path, tmp: Path, **changes) -> Path:
    import shutil

    dst = tmp / "edited"
    shutil.copytree(ckpt, dst)
    cfg = json.loads((dst / "config.json").read_text())
    for key, value in changes.items():
        target = cfg["quantization_config"]
        *path, last = key.split("__")
        for p in path:
            target = target[p]
        target[last] = value
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


@pytest.mark.parametrize("case,changes,message", [
    ("gptq-llama-sym", {"bits": 3}, "GPTQ with 3 bits is not supported"),
    ("gptq-llama-sym", {"checkpoint_format": "marlin"}, "GPTQ checkpoint_format 'marlin' is not supported"),
    ("gptq-qwen2-int8", {"group_size": 128}, "GPTQ 8-bit with group_size 128 is not supported"),
    ("gptq-llama-sym", {"desc_act": False, "sym": False, "lm_head": True}, "quantized lm_head"),
    ("awq-llama", {"version": "gemv"}, "AWQ version 'gemv' is not supported"),
    ("awq-llama", {"bits": 8}, "AWQ with 8 bits is not supported"),
    ("ct-llama-w4a16-sym", {"config_groups__group_0__input_activations": {"num_bits": 8, "type": "int"}},
     "quantizes activations too (W8A8"),
    ("ct-llama-w4a16-sym", {"config_groups__group_0__targets": ["Embedding"]}, "targets ['Embedding']"),
    ("ct-llama-w4a16-sym", {"config_groups__group_0__weights__type": "float"}, "float 4-bit weights"),
    ("ct-llama-w4a16-sym", {"config_groups__group_0__weights__strategy": "tensor"}, "4-bit strategy 'tensor'"),
    ("gptq-llama-sym", {"quant_method": "bitsandbytes"}, "quant_method 'bitsandbytes'"),
])
def test_unsupported_variants_are_refused_by_name(ckpts, case, changes, message, tmp_path):
    ckpt = _edit(ckpts(case), tmp_path, **changes)
    with pytest.raises(BuildError, match=message.replace("(", r"\(").replace("[", r"\[")):
        build_engine(str(ckpt), tmp_path / "e", BuildConfig(dtype="float32", kv_cache_memory="8MiB"), progress=False)


def test_quantization_flag_conflicts_with_a_prequantized_checkpoint(ckpts, tmp_path):
    result = CliRunner().invoke(main, ["build", str(ckpts("awq-llama")), "-o", str(tmp_path / "e"),
                                       "--quantization", "int8_wo", "--kv-cache-memory", "8MiB"])
    assert result.exit_code != 0
    assert "--quantization int8_wo conflicts with a pre-quantized awq checkpoint" in result.output


def test_act_order_with_different_orders_in_a_fused_layer_is_refused(ckpts, tmp_path):
    import shutil

    from safetensors.torch import save_file

    dst = tmp_path / "ckpt"
    shutil.copytree(ckpts("gptq-llama-actorder"), dst)
    t = load_file(str(dst / "model.safetensors"))
    name = "model.layers.0.self_attn.k_proj.g_idx"
    t[name] = t[name].flip(0).contiguous()
    save_file(t, str(dst / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(BuildError, match="different act-order permutations"):
        build_engine(str(dst), tmp_path / "e", BuildConfig(dtype="float32", kv_cache_memory="8MiB"), progress=False)
