"""AWQ checkpoints in the AutoAWQ GEMM layout (quant_method "awq", version "gemm").

Per linear `<m>` (K inputs, N outputs, 4 bits):
  * `<m>.qweight` int32 [K, N / 8]: packed along the outputs, with AutoAWQ's interleave: nibble p (bits
    4p) of word (k, j) is output 8j + AWQ_ORDER[p], AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7];
  * `<m>.qzeros` int32 [G, N / 8]: zero points packed the same way (no offset), one per group and output;
  * `<m>.scales` float16 [G, N].
  w[n, k] = scales[k // group, n] · (q[k, n] - z[k // group, n]).

Maps onto int4_wo per group with the zero points as offsets (AWQ is asymmetric).
"""

from __future__ import annotations

from typing import Any

import torch

from trtforge.builder.prequantized.codes import LinearCodes, read_packed, to_signed, unpack_int32
from trtforge.models.errors import BuildError

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
"""Output 8j + AWQ_ORDER[p] sits in nibble p of a word."""


def parse(qc: dict[str, Any]) -> Any:
    from trtforge.builder.prequantized import SourceQuantization

    bits = int(qc.get("bits", qc.get("w_bit", 4)))
    if bits != 4:
        raise BuildError(f"AWQ with {bits} bits is not supported: trtforge reads 4-bit AWQ (GEMM layout).")
    version = str(qc.get("version") or "gemm").lower()
    if version != "gemm":
        raise BuildError(f"AWQ version {version!r} is not supported: trtforge reads AutoAWQ's GEMM layout "
                         f"(version \"gemm\"); GEMV / Marlin / ExLlama packings differ.")
    if not qc.get("zero_point", True):
        raise BuildError("AWQ without zero points (zero_point: false) is not supported: trtforge reads AutoAWQ's "
                         "asymmetric GEMM checkpoints.")
    group = int(qc.get("group_size", qc.get("q_group_size", 128)))
    if group == -1:
        raise BuildError("AWQ with group_size -1 (one scale per output channel) is not supported: trtforge's int4 "
                         "format has one group size for every layer.")
    return SourceQuantization("awq", 4, group, False, False, {"version": version},
                              tuple(qc.get("modules_to_not_convert") or ()))


def primary_tensor(src: Any, module: str) -> str:
    return f"{module}.qweight"


def logical_shape(src: Any, reader: Any, module: str) -> tuple[int, int]:
    k, words = reader.index[f"{module}.qweight"].shape
    return words * 8, k


def _deinterleave(fields: torch.Tensor) -> torch.Tensor:
    """[R, N] fields in nibble order → output order."""
    r, n = fields.shape
    out = torch.empty_like(fields).view(r, n // 8, 8)
    out[:, :, list(AWQ_ORDER)] = fields.view(r, n // 8, 8)
    return out.view(r, n)


def read(src: Any, reader: Any, module: str) -> LinearCodes:
    qweight, qzeros, scales = read_packed(reader, module, "AWQ")  # scales [G, N]
    q = _deinterleave(unpack_int32(qweight, 4, 1))  # [K, N] unsigned
    z = _deinterleave(unpack_int32(qzeros, 4, 1))  # [G, N]
    k, n = q.shape
    groups = scales.shape[0]
    if tuple(scales.shape) != (groups, n) or tuple(z.shape) != (groups, n) or groups * src.group_size != k:
        raise BuildError(f"{module}: scales {list(scales.shape)} / qzeros {list(qzeros.shape)} do not fit qweight "
                         f"{list(qweight.shape)} with group_size {src.group_size} (AWQ GEMM: [K/group, N] and "
                         f"[K/group, N/8]).")
    return LinearCodes(to_signed(q.t().contiguous(), 4), scales.t().contiguous(), to_signed(z.t().contiguous(), 4),
                       src.group_size)
