"""Weight-only quantisation (plugins/cpu/quant_linear.py): packing, rounding error, and the C kernels
against the reference (dequantise, then matmul).

Tolerances are derived, not tuned: the exact product of x and the dequantised weights (float64 here)
and any float32 evaluation of it differ by at most (K + 4)·u·(|x|·|W| + |b|), u = 2⁻²⁴ — K roundings
of a summation in any order (γ_K), plus the dequantising multiply, the scale and the bias. Both the
reference and the kernel must meet it, whatever order they sum in.
"""

from __future__ import annotations

import pytest
import torch

from trtforge.plugins.cpu import quant_linear as ql

U = 2.0 ** -24


def _weights(n: int, k: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g)
    w[0] = 0.0  # an all-zero row: scale 1, exact
    w[1, :8] *= 50.0  # an outlier group: other groups keep their own scale
    return w


def test_kernels_build_here():
    assert ql.library() is not None


def test_int4_pack_unpack_round_trip():
    q = torch.arange(-8, 8, dtype=torch.int8).repeat(3, 2)  # every value in both nibble positions
    q = torch.cat([q, q.flip(1)])
    packed = ql.pack_int4(q)
    assert packed.dtype == torch.uint8 and packed.shape == (q.shape[0], q.shape[1] // 2)
    assert torch.equal(ql.unpack_int4(packed), q)
    assert int(packed[0, 0]) == (0x8 | (0x9 << 4))  # -8 low nibble, -7 high nibble


@pytest.mark.parametrize("scheme,group", [("int8_wo", 0), ("int4_wo", 32), ("int4_wo", 128)])
def test_quantise_error_is_at_most_half_a_scale(scheme, group):
    w = _weights(20, 256, seed=1)
    q, s = ql.quantize(w, scheme, group)
    back = ql.dequantize(q, s, scheme, group)
    per_elem = s.unsqueeze(1).expand(20, 256) if scheme == "int8_wo" else s.repeat_interleave(group, dim=1)
    # Real arithmetic gives ≤ s/2; float32 rounds w/s and q·s once each (relative u, |q| ≤ 127).
    bound = per_elem * (0.5 + 2 * 128 * U)
    assert (back - w).abs().le(bound).all()
    assert torch.equal(back[0], torch.zeros(256))
    assert ql.unpack_int4(q).abs().max() <= 7 if scheme == "int4_wo" else q.abs().max() <= 127


def _exact_and_tolerance(x, w, b):
    x64, w64 = x.double(), w.double()
    exact = x64 @ w64.T + (0 if b is None else b.double())
    k = x.shape[-1]
    tol = (k + 4) * U * (x64.abs() @ w64.abs().T + (0 if b is None else b.double().abs()))
    return exact, tol


@pytest.mark.parametrize("scheme,group", [("int8_wo", 0), ("int4_wo", 16), ("int4_wo", 64)])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 7, 32])
@pytest.mark.parametrize("bias", [True, False])
def test_gemv_matches_reference(scheme, group, rows, bias):
    n, k = 18, 128  # 18 = four blocks of 4 weight rows + 2 left over
    q, s = ql.quantize(_weights(n, k, seed=rows), scheme, group)
    g = torch.Generator().manual_seed(100 + rows)
    x = torch.randn(rows, k, generator=g)
    b = torch.randn(n, generator=g) if bias else None
    w = ql.dequantize(q, s, scheme, group)
    exact, tol = _exact_and_tolerance(x, w, b)
    reference = torch.nn.functional.linear(x, w, b)
    with torch.inference_mode():
        assert ql.kernel_ok(x, k, group or 8)
        got = ql.gemv(x, q, s, b, scheme, group)
    assert (reference.double() - exact).abs().le(tol).all()
    assert (got.double() - exact).abs().le(tol).all(), (got.double() - exact).abs().div(tol).max()


@pytest.mark.parametrize("scheme,group", [("int8_wo", 0), ("int4_wo", 32)])
def test_dequantize_into_is_the_reference(scheme, group):
    q, s = ql.quantize(_weights(13, 96, seed=3), scheme, group)
    out = torch.empty(13, 96)
    ql.dequantize_into(out, q, s, scheme, group)
    assert torch.equal(out, ql.dequantize(q, s, scheme, group))  # one IEEE multiply each: bit-equal
