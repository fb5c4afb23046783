"""One linear layer's weights as a pre-quantized checkpoint stores them, in trtforge's code domain.

Every reader (gptq.py, awq.py, compressed_tensors.py) turns its format's packed tensors into a
`LinearCodes`: integer codes, float32 scales per group and, for asymmetric schemes, integer zero
points — the checkpoint's own integers, moved by a constant into our signed range, never through a
float round trip. The weight is w = (code - zero) · scale exactly (the integer difference is exact and
the float32 product of it and a float16/bfloat16 scale is exact too).

Our domain: int4 codes are the checkpoint's unsigned 0..15 minus 8 (-8..7, what plugins/cpu/quant_linear.py
packs two per byte), zero points likewise minus 8; int8 codes are signed -128..127 (unsigned 0..255 minus
128).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from trtforge.models.errors import BuildError


@dataclass
class LinearCodes:
    codes: torch.Tensor
    """int8 [N, K]: int4 in -8..7, int8 in -128..127; column j is input `perm[j]` (or j)."""
    scales: torch.Tensor
    """float32 [N, G], one per group of `group` consecutive columns."""
    zeros: torch.Tensor | None
    """int8 [N, G] zero points in the codes' domain (w = (code - zero) · scale); None: symmetric (all 0)."""
    group: int
    """Columns per scale (K: one scale per output channel)."""
    perm: torch.Tensor | None = None
    """int64 [K] (GPTQ act-order): the input each column holds, so groups are contiguous; None: identity."""

    def dequantize(self) -> torch.Tensor:
        """float32 [N, K] in the checkpoint's input order: (code - zero) · scale, each product exact."""
        n, k = self.codes.shape
        q = self.codes.to(torch.int32).view(n, k // self.group, self.group)
        if self.zeros is not None:
            q = q - self.zeros.to(torch.int32).unsqueeze(-1)
        w = (q.float() * self.scales.unsqueeze(-1)).view(n, k)
        if self.perm is None:
            return w
        out = torch.empty_like(w)
        out[:, self.perm] = w
        return out


def concat(parts: list[LinearCodes], names: list[str]) -> LinearCodes:
    """The fused layer (q|k|v, gate|up) of its projections, stacked along the outputs. They must share the
    group size and, with act-order, the input permutation (GPTQ derives both from the same inputs)."""
    if len(parts) == 1:
        return parts[0]
    first = parts[0]
    for p, name in zip(parts[1:], names[1:]):
        if p.group != first.group or p.codes.shape[1] != first.codes.shape[1]:
            raise BuildError(f"{name} is quantized with groups of {p.group}, {names[0]} with {first.group}: "
                             f"trtforge fuses them into one layer, which needs one group size.")
        if (p.perm is None) != (first.perm is None) or (p.perm is not None and not torch.equal(p.perm, first.perm)):
            raise BuildError(f"{name} and {names[0]} have different act-order permutations (g_idx): trtforge fuses "
                             f"them into one layer with one input order. Re-quantize with desc_act=False, or with "
                             f"the same g_idx for the projections that share an input.")
    zeros = None
    if any(p.zeros is not None for p in parts):
        zeros = torch.cat([p.zeros if p.zeros is not None else torch.zeros_like(p.codes[:, :: p.group]) for p in parts])
    return LinearCodes(torch.cat([p.codes for p in parts]), torch.cat([p.scales for p in parts]), zeros,
                       first.group, first.perm)


def unpack_int32(packed: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """int32 words holding 32/bits fields each, field i at bits [i·bits, (i+1)·bits), expanded along `dim`
    (0: word r holds elements r·f .. r·f+f-1 of a column; 1: of a row) → int32 unsigned fields."""
    f = 32 // bits
    words = packed.to(torch.int64) & 0xFFFFFFFF
    shifts = torch.arange(0, 32, bits, dtype=torch.int64)
    if dim == 0:
        fields = (words.unsqueeze(1) >> shifts.view(1, f, 1)) & ((1 << bits) - 1)  # [R, f, C]
        return fields.reshape(packed.shape[0] * f, packed.shape[1]).to(torch.int32)
    fields = (words.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)  # [R, C, f]
    return fields.reshape(packed.shape[0], packed.shape[1] * f).to(torch.int32)


def to_signed(unsigned: torch.Tensor, bits: int) -> torch.Tensor:
    """Unsigned 0..2^bits-1 → our signed domain (minus 2^(bits-1)), int8."""
    return (unsigned - (1 << (bits - 1))).to(torch.int8)


def float_scales(t: torch.Tensor, name: str) -> torch.Tensor:
    if not t.is_floating_point():
        raise BuildError(f"{name} has dtype {t.dtype}: a scale tensor must be floating point.")
    return t.float()


def read_packed(reader: Any, module: str, fmt: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(qweight, qzeros, float32 scales) of a GPTQ/AWQ-style linear `module`: every tensor present, the codes
    and zeros packed in int32 words; `fmt` names the format in the errors."""
    for t in ("qweight", "qzeros", "scales"):
        if not reader.has(f"{module}.{t}"):
            raise BuildError(f"the {fmt} checkpoint is missing {module}.{t}.")
    qweight, qzeros = reader.get(f"{module}.qweight"), reader.get(f"{module}.qzeros")
    for name, t in (("qweight", qweight), ("qzeros", qzeros)):
        if t.dtype != torch.int32:
            raise BuildError(f"{module}.{name} has dtype {t.dtype}; {fmt} packs int32 words.")
    return qweight, qzeros, float_scales(reader.get(f"{module}.scales"), f"{module}.scales")
