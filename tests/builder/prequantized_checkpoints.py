"""Tiny random pre-quantized checkpoints in the real GPTQ / AWQ / compressed-tensors layouts.

`make_prequantized(dir, case)` writes a random float Llama or Qwen2 checkpoint with transformers' own
config classes (tests/helpers/checkpoints.py), then replaces every decoder linear's `weight` by random
codes, scales (float16 / bfloat16) and zero points packed as the format stores them, and adds the
`quantization_config` such a checkpoint's config.json has. compressed-tensors checkpoints are packed by
compressed-tensors itself (`pack_to_int32`) with its own config classes. Deterministic per case (seeded),
so scripts/prequantized_oracle.py, run elsewhere with gptqmodel, hashes the same tensors.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from tests.helpers.checkpoints import make_checkpoint

PROJECTIONS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
               "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)

# name: (arch, format, bits, group, sym, desc_act, extra config overrides)
CASES: dict[str, dict[str, Any]] = {
    "gptq-llama-sym": dict(arch="llama", fmt="gptq", bits=4, group=32, sym=True),
    "gptq-qwen2-asym": dict(arch="qwen2", fmt="gptq", bits=4, group=32, sym=False),
    "gptq-llama-actorder": dict(arch="llama", fmt="gptq", bits=4, group=32, sym=False, desc_act=True),
    "gptq-qwen2-int8": dict(arch="qwen2", fmt="gptq", bits=8, group=-1, sym=True),
    "awq-llama": dict(arch="llama", fmt="awq", bits=4, group=32, sym=False),
    "awq-qwen2": dict(arch="qwen2", fmt="awq", bits=4, group=64, sym=False),
    "ct-llama-w4a16-sym": dict(arch="llama", fmt="compressed-tensors", bits=4, group=32, sym=True),
    "ct-qwen2-w4a16-asym": dict(arch="qwen2", fmt="compressed-tensors", bits=4, group=32, sym=False),
    "ct-llama-w8a16": dict(arch="llama", fmt="compressed-tensors", bits=8, group=-1, sym=True),
}
DIMS = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2)


def _i32(words: torch.Tensor) -> torch.Tensor:
    """int64 holding 32-bit patterns → int32 with the same bits."""
    words = words & 0xFFFFFFFF
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def pack_along(fields: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Unsigned fields packed 32/bits per int32 word along `dim`, field i at bits i·bits."""
    f = 32 // bits
    x = fields.to(torch.int64)
    if dim == 0:
        x = x.view(x.shape[0] // f, f, x.shape[1])
        return _i32(sum(x[:, i] << (i * bits) for i in range(f)))
    x = x.view(x.shape[0], x.shape[1] // f, f)
    return _i32(sum(x[:, :, i] << (i * bits) for i in range(f)))


def _random_layer(g: torch.Generator, n: int, k: int, bits: int, group: int, sym: bool, scale_dtype: torch.dtype):
    """(unsigned codes [N, K], scales [N, G], unsigned zero points [N, G]) — GPTQ / AWQ's integers."""
    groups = 1 if group == -1 else k // group
    top = (1 << bits) - 1
    q = torch.randint(0, top + 1, (n, k), generator=g)
    scales = (torch.rand(n, groups, generator=g) * 0.04 + 0.02) / (1 << (bits - 4))
    z = torch.full((n, groups), 1 << (bits - 1)) if sym else torch.randint(0, top + 1, (n, groups), generator=g)
    return q, scales.to(scale_dtype), z


def make_prequantized(directory: Path, case: str) -> Path:
    spec = CASES[case]
    bits, group, sym, fmt = spec["bits"], spec["group"], spec["sym"], spec["fmt"]
    desc_act = spec.get("desc_act", False)
    directory = Path(directory)
    make_checkpoint(directory, spec["arch"], **DIMS)
    tensors = load_file(str(directory / "model.safetensors"))
    g = torch.Generator().manual_seed(sum(map(ord, case)))
    out: dict[str, torch.Tensor] = {}
    orders: dict[tuple[str, str], torch.Tensor] = {}  # act-order: one input order per layer input (GPTQ's H)
    for name, t in tensors.items():
        module = name[: -len(".weight")]
        if not (name.endswith(".weight") and module.split(".layers.")[-1].split(".", 1)[-1] in PROJECTIONS):
            out[name] = t
            continue
        n, k = t.shape
        scale_dtype = torch.bfloat16 if fmt == "compressed-tensors" else torch.float16
        q, scales, z = _random_layer(g, n, k, bits, group, sym, scale_dtype)
        if fmt == "gptq":
            layer, proj = module.split(".layers.")[-1].split(".", 1)
            shared = {"self_attn.k_proj": "self_attn.q_proj", "self_attn.v_proj": "self_attn.q_proj",
                      "mlp.up_proj": "mlp.gate_proj"}.get(proj, proj)
            order = orders.setdefault((layer, shared), torch.randperm(k, generator=g))
            out.update(_gptq(module, q, scales, z, bits, order if desc_act else None))
        elif fmt == "awq":
            out.update(_awq(module, q, scales, z))
        else:
            out.update(_compressed_tensors(module, q, scales, z, bits, sym))
    save_file({k: v.contiguous() for k, v in out.items()}, str(directory / "model.safetensors"),
              metadata={"format": "pt"})
    cfg = json.loads((directory / "config.json").read_text())
    cfg["quantization_config"] = quantization_config(case)
    (directory / "config.json").write_text(json.dumps(cfg, indent=2))
    return directory


def quantization_config(case: str) -> dict[str, Any]:
    spec = CASES[case]
    bits, group, sym = spec["bits"], spec["group"], spec["sym"]
    if spec["fmt"] == "gptq":  # what GPTQModel / AutoGPTQ write
        return {"quant_method": "gptq", "bits": bits, "group_size": group, "desc_act": spec.get("desc_act", False),
                "sym": sym, "checkpoint_format": "gptq", "pack_dtype": "int32", "damp_percent": 0.01,
                "true_sequential": True, "static_groups": False, "lm_head": False}
    if spec["fmt"] == "awq":  # AutoAWQ
        return {"quant_method": "awq", "bits": bits, "group_size": group, "zero_point": True, "version": "gemm",
                "modules_to_not_convert": None}
    from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig, QuantizationScheme

    weights = QuantizationArgs(num_bits=bits, type="int", symmetric=sym, strategy="group" if bits == 4 else "channel",
                               group_size=group if bits == 4 else None)
    config = QuantizationConfig(config_groups={"group_0": QuantizationScheme(targets=["Linear"], weights=weights)},
                                format="pack-quantized" if bits == 4 else "int-quantized",
                                quantization_status="compressed", ignore=["lm_head"])
    return config.model_dump(mode="json")


def _gptq(module: str, q, scales, z, bits, order) -> dict[str, torch.Tensor]:
    n, k = q.shape
    groups = scales.shape[1]
    g_idx = torch.arange(k) // (k // groups)
    if order is not None:  # act-order: groups follow a permutation of the inputs, each still `group` of them
        g_idx = g_idx[order]
    # the weight of input i is in group g_idx[i]: q [N, K] stays as drawn, scales / zeros per group
    return {f"{module}.qweight": pack_along(q.t(), bits, 0),
            f"{module}.qzeros": pack_along(((z - 1) & ((1 << bits) - 1)).t(), bits, 1),  # v1: zero - 1
            f"{module}.scales": scales.t().contiguous(),
            f"{module}.g_idx": g_idx.to(torch.int32)}


def _awq(module: str, q, scales, z) -> dict[str, torch.Tensor]:
    def interleave(fields: torch.Tensor) -> torch.Tensor:  # [R, N]: nibble p of word j is column 8j + AWQ_ORDER[p]
        r, n = fields.shape
        return fields.view(r, n // 8, 8)[:, :, list(AWQ_ORDER)].reshape(r, n)

    return {f"{module}.qweight": pack_along(interleave(q.t().contiguous()), 4, 1),
            f"{module}.qzeros": pack_along(interleave(z.t().contiguous()), 4, 1),
            f"{module}.scales": scales.t().contiguous()}


def _compressed_tensors(module: str, q, scales, z, bits, sym) -> dict[str, torch.Tensor]:
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    n, k = q.shape
    half = 1 << (bits - 1)
    codes = (q - half).to(torch.int8)  # compressed-tensors' codes are signed
    if bits == 8:
        return {f"{module}.weight": codes, f"{module}.weight_scale": scales}
    out = {f"{module}.weight_packed": pack_to_int32(codes, bits), f"{module}.weight_scale": scales,
           f"{module}.weight_shape": torch.tensor([n, k])}
    if not sym:
        out[f"{module}.weight_zero_point"] = pack_to_int32((z - half).to(torch.int8), bits, packed_dim=0)
    return out
