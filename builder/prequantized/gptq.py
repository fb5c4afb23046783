"""GPTQ checkpoints in the AutoGPTQ / GPTQModel layout (quant_method "gptq").

Per linear `<m>` (K inputs, N outputs, b bits, f = 32 / b codes per int32 word):
  * `<m>.qweight` int32 [K / f, N]: input k of output n in word (k // f, n), bits (k % f)·b — packed along K;
  * `<m>.qzeros` int32 [G, N / f]: the zero point of group g, output n in word (g, n // f), bits (n % f)·b —
    packed along N. checkpoint_format "gptq" (v1, the default) stores every zero point minus 1 (the
    historic AutoGPTQ offset; a stored 0b1111 is zero point 0), "gptq_v2" stores them as they are;
  * `<m>.scales` float16 [G, N]; `<m>.g_idx` int32 [K]: the group of each input (act-order, desc_act:
    a permutation of the groups; otherwise k // group_size).
  w[n, k] = scales[g_idx[k], n] · (q[k, n] - z[g_idx[k], n]). Symmetric checkpoints store z = 2^(b-1).

Maps onto int4_wo (4 bits; per group, the zero points as offsets where sym is false) and int8_wo (8 bits, one
group per output channel: group_size -1). Act-order layers are stored with their input columns sorted by
group (then each group is contiguous) and the permutation, which the layer applies to its input.
"""

from __future__ import annotations

from typing import Any

import torch

from trtforge.builder.prequantized.codes import LinearCodes, read_packed, to_signed, unpack_int32
from trtforge.models.errors import BuildError

CHECKPOINT_FORMATS = ("gptq", "gptq_v2")


def parse(qc: dict[str, Any]) -> Any:
    from trtforge.builder.prequantized import SourceQuantization

    bits = int(qc.get("bits", 4))
    if bits not in (4, 8):
        raise BuildError(f"GPTQ with {bits} bits is not supported: trtforge reads 4-bit (int4_wo) and 8-bit "
                         f"(int8_wo) GPTQ checkpoints.")
    fmt = str(qc.get("checkpoint_format") or qc.get("format") or "gptq").lower()
    if fmt not in CHECKPOINT_FORMATS:
        raise BuildError(f"GPTQ checkpoint_format {fmt!r} is not supported: trtforge reads the AutoGPTQ / GPTQModel "
                         f"layouts {', '.join(CHECKPOINT_FORMATS)} (qweight packed along the inputs).")
    pack = str(qc.get("pack_dtype") or "int32").replace("torch.", "")
    if pack != "int32":
        raise BuildError(f"GPTQ with pack_dtype {pack} is not supported: trtforge reads int32-packed qweight/qzeros.")
    group = int(qc.get("group_size", 128))
    if bits == 4 and group == -1:
        raise BuildError("GPTQ 4-bit with group_size -1 (one scale per output channel) is not supported: "
                         "trtforge's int4 format has one group size for every layer.")
    if bits == 8 and group != -1:
        raise BuildError(f"GPTQ 8-bit with group_size {group} is not supported: trtforge's int8 format has one "
                         f"scale per output channel (group_size -1).")
    if qc.get("dynamic"):
        raise BuildError("GPTQ with per-module `dynamic` overrides is not supported: trtforge needs one bits / "
                         "group_size for every quantized layer.")
    if qc.get("lm_head"):
        raise BuildError("GPTQ with a quantized lm_head (lm_head: true) is not supported: trtforge reads quantized "
                         "decoder linears and keeps the checkpoint's float LM head.")
    return SourceQuantization("gptq", bits, group, bool(qc.get("sym", True)), bool(qc.get("desc_act", False)),
                              {"checkpoint_format": fmt}, tuple(qc.get("modules_to_not_convert") or ()))


def primary_tensor(src: Any, module: str) -> str:
    return f"{module}.qweight"


def logical_shape(src: Any, reader: Any, module: str) -> tuple[int, int]:
    words, n = reader.index[f"{module}.qweight"].shape
    return n, words * 32 // src.bits


def read(src: Any, reader: Any, module: str) -> LinearCodes:
    bits, mask = src.bits, (1 << src.bits) - 1
    qweight, qzeros, scales = read_packed(reader, module, "GPTQ")  # scales [G, N]
    q = unpack_int32(qweight, bits, 0)  # [K, N] unsigned
    k, n = q.shape
    groups = scales.shape[0]
    z = unpack_int32(qzeros, bits, 1)[:, :n]  # [G, N]
    if src.details["checkpoint_format"] == "gptq":
        z = (z + 1) & mask  # v1: stored minus one, per field
    if tuple(scales.shape) != (groups, n) or z.shape[0] != groups or k % groups:
        raise BuildError(f"{module}: scales {list(scales.shape)} / qzeros {list(qzeros.shape)} do not fit qweight "
                         f"{list(qweight.shape)} ({bits}-bit GPTQ: [G, N] and [G, N·{bits}/32]).")
    group = k // groups
    if src.group_size != -1 and group != src.group_size:
        raise BuildError(f"{module} has {groups} groups of {group} inputs, but quantization_config says group_size "
                         f"{src.group_size}.")
    zeros = to_signed(z.t().contiguous(), bits)  # [N, G]
    if src.sym:
        if bool(zeros.any()):
            raise BuildError(f"{module}: quantization_config says sym=true but its qzeros are not all "
                             f"{1 << (bits - 1)}; the checkpoint is inconsistent.")
        zeros_out = None
    else:
        zeros_out = zeros
    codes = to_signed(q.t().contiguous(), bits)  # [N, K]
    perm = permutation(reader, f"{module}.g_idx", k, group, src.desc_act)
    if perm is not None:
        codes = codes[:, perm].contiguous()
    return LinearCodes(codes, scales.t().contiguous(), zeros_out, group, perm)


def permutation(reader: Any, name: str, k: int, group: int, desc_act: bool) -> torch.Tensor | None:
    """From the g_idx tensor `name`: None where g_idx is k // group (or absent); with act-order the stable
    sort of g_idx, which makes every group contiguous (checked: each holds `group` inputs)."""
    if not reader.has(name):
        return None
    g_idx = reader.get(name).to(torch.int64)
    plain = torch.arange(k) // group
    if g_idx.shape != (k,):
        raise BuildError(f"{name} has shape {list(g_idx.shape)}, not [{k}].")
    if torch.equal(g_idx, plain):
        return None
    if not desc_act:
        raise BuildError(f"{name} is not input // group_size, but quantization_config says desc_act=false.")
    perm = torch.sort(g_idx, stable=True).indices
    if not torch.equal(g_idx[perm], plain):
        raise BuildError(f"{name} does not give every group {group} inputs: trtforge's int4 layout needs "
                         f"whole groups.")
    return perm
