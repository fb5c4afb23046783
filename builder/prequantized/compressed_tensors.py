"""compressed-tensors checkpoints (quant_method "compressed-tensors", as llm-compressor writes them).

One weight-only integer scheme targeting Linear layers (a single config group), stored compressed:
  * format "pack-quantized" (e.g. W4A16): `<m>.weight_packed` int32 [N, ceil(K·b/32)] — each row's codes
    packed densely along K, element j at bits j·b, stored as code + 2^(b-1) (codes are signed);
    `<m>.weight_shape` [N, K]; `<m>.weight_scale` [N, G] (strategy "group": K / group_size groups;
    "channel": one); asymmetric: `<m>.weight_zero_point` int32 [ceil(N·b/32), G] packed the same way along
    the outputs (dim 0); act-order "group": `<m>.weight_g_idx` [K];
  * format "int-quantized" / "naive-quantized" (8 bits): `<m>.weight` int8 [N, K] (the codes),
    `<m>.weight_scale` [N, 1], optionally `<m>.weight_zero_point` int8 [N, 1].
  w[n, k] = weight_scale[n, g(k)] · (code[n, k] - zero_point[n, g(k)]).

Maps onto int4_wo (4 bits, strategy group) and int8_wo (8 bits, strategy channel); zero points become
offsets. Refused by name: activation quantization (W8A8, W4A8: input_activations), float types (FP8, NVFP4),
other strategies (tensor, block; int4 per channel), several config groups, targets other than Linear,
sparsity, a quantized KV cache, and checkpoints not stored compressed.
"""

from __future__ import annotations

from typing import Any

import torch

from trtforge.builder.prequantized.codes import LinearCodes, float_scales, to_signed, unpack_int32
from trtforge.builder.prequantized.gptq import permutation
from trtforge.models.errors import BuildError

PACKED = "pack-quantized"
INT = ("int-quantized", "naive-quantized")


def parse(qc: dict[str, Any]) -> Any:
    from trtforge.builder.prequantized import SourceQuantization

    groups = qc.get("config_groups") or {}
    if len(groups) != 1:
        raise BuildError(f"compressed-tensors with {len(groups)} config_groups is not supported: trtforge reads one "
                         f"scheme for every quantized Linear.")
    (name, scheme), = groups.items()
    fmt = str(scheme.get("format") or qc.get("format") or "").lower()
    targets = list(scheme.get("targets") or [])
    if targets != ["Linear"]:
        raise BuildError(f"compressed-tensors scheme {name!r} targets {targets}: trtforge reads schemes that target "
                         f"Linear layers (targets [\"Linear\"]).")
    if scheme.get("input_activations") or scheme.get("output_activations"):
        raise BuildError(f"compressed-tensors scheme {name!r} quantizes activations too (W8A8 / W4A8 "
                         f"input_activations): trtforge reads weight-only schemes (W4A16, W8A16).")
    _check_checkpoint(qc)
    w = scheme.get("weights") or {}
    bits, kind = int(w.get("num_bits", 0)), str(w.get("type", "int")).lower()
    if kind != "int":
        raise BuildError(f"compressed-tensors with {kind} {bits}-bit weights is not supported: trtforge reads integer "
                         f"weights (4 and 8 bits).")
    if bits not in (4, 8):
        raise BuildError(f"compressed-tensors with {bits}-bit weights is not supported: trtforge reads 4-bit "
                         f"(int4_wo) and 8-bit (int8_wo) integer weights.")
    if fmt != PACKED and not (fmt in INT and bits == 8):
        raise BuildError(f"compressed-tensors format {fmt!r} with {bits}-bit weights is not supported: trtforge "
                         f"reads {PACKED} (4 or 8 bits) and {INT[0]} (8 bits).")
    strategy = str(w.get("strategy") or "").lower()
    if bits == 4 and strategy != "group":
        raise BuildError(f"compressed-tensors 4-bit strategy {strategy!r} is not supported: trtforge's int4 format "
                         f"has one group size for every layer (strategy \"group\").")
    if bits == 8 and strategy != "channel":
        raise BuildError(f"compressed-tensors 8-bit strategy {strategy!r} is not supported: trtforge's int8 format "
                         f"has one scale per output channel (strategy \"channel\").")
    if w.get("dynamic"):
        raise BuildError("compressed-tensors with dynamic weight scales is not supported.")
    actorder = w.get("actorder")
    group = int(w["group_size"]) if strategy == "group" else -1
    return SourceQuantization("compressed-tensors", bits, group, bool(w.get("symmetric", True)),
                              actorder == "group", {"format_name": fmt, "strategy": strategy,
                                                    "actorder": actorder}, tuple(qc.get("ignore") or ()))


def _check_checkpoint(qc: dict[str, Any]) -> None:
    if qc.get("kv_cache_scheme"):
        raise BuildError("compressed-tensors with a kv_cache_scheme is not supported: trtforge builds its own KV "
                         "cache (--kv-cache-dtype int8).")
    if qc.get("sparsity_config"):
        raise BuildError("compressed-tensors with a sparsity_config is not supported.")
    status = str(qc.get("quantization_status") or "compressed").lower()
    if status != "compressed":
        raise BuildError(f"compressed-tensors quantization_status {status!r} is not supported: trtforge reads "
                         f"checkpoints stored compressed.")


def primary_tensor(src: Any, module: str) -> str:
    return f"{module}.weight_packed" if src.details["format_name"] == PACKED else f"{module}.weight"


def logical_shape(src: Any, reader: Any, module: str) -> tuple[int, int]:
    if src.details["format_name"] != PACKED:
        return tuple(reader.index[f"{module}.weight"].shape)  # type: ignore[return-value]
    if reader.has(f"{module}.weight_shape"):
        n, k = (int(v) for v in reader.get(f"{module}.weight_shape").tolist())
        return n, k
    n, words = reader.index[f"{module}.weight_packed"].shape
    return n, words * 32 // src.bits


def read(src: Any, reader: Any, module: str) -> LinearCodes:
    bits = src.bits
    if not reader.has(f"{module}.weight_scale"):
        raise BuildError(f"the compressed-tensors checkpoint is missing {module}.weight_scale.")
    scales = float_scales(reader.get(f"{module}.weight_scale"), f"{module}.weight_scale")  # [N, G]
    n, k = logical_shape(src, reader, module)
    if src.details["format_name"] == PACKED:
        packed = reader.get(f"{module}.weight_packed")
        if packed.dtype != torch.int32:
            raise BuildError(f"{module}.weight_packed has dtype {packed.dtype}; pack-quantized packs int32 words.")
        codes = to_signed(unpack_int32(packed, bits, 1)[:, :k].contiguous(), bits)
    else:
        codes = reader.get(f"{module}.weight")
        if codes.dtype != torch.int8:
            raise BuildError(f"{module}.weight has dtype {codes.dtype}; {src.details['format_name']} stores "
                             f"int8 codes.")
    groups = scales.shape[1] if scales.dim() == 2 else 0
    if tuple(codes.shape) != (n, k) or scales.shape[0] != n or not groups or k % groups:
        raise BuildError(f"{module}: weight_scale {list(scales.shape)} does not fit the [{n}, {k}] weight.")
    group = k // groups
    if src.group_size != -1 and group != src.group_size:
        raise BuildError(f"{module} has {groups} groups of {group} inputs, but the scheme says group_size "
                         f"{src.group_size}.")
    zeros = _zero_points(src, reader, module, n, groups)
    perm = permutation(reader, f"{module}.weight_g_idx", k, group, src.desc_act)
    if perm is not None:
        codes = codes[:, perm].contiguous()
    return LinearCodes(codes.contiguous(), scales.contiguous(), zeros, group, perm)


def _zero_points(src: Any, reader: Any, module: str, n: int, groups: int) -> torch.Tensor | None:
    name = f"{module}.weight_zero_point"
    if not reader.has(name):
        if not src.sym:
            raise BuildError(f"the compressed-tensors checkpoint is asymmetric but lacks {name}.")
        return None
    zp = reader.get(name)
    if src.details["format_name"] == PACKED:
        zp = to_signed(unpack_int32(zp, src.bits, 0)[:n].contiguous(), src.bits)
    zp = zp.to(torch.int8).reshape(n, groups)
    if src.sym:
        if bool(zp.any()):
            raise BuildError(f"{name} is not all zero, but the scheme is symmetric; the checkpoint is inconsistent.")
        return None
    return zp
