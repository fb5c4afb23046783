"""Weight-only quantisation (plugins/cpu/quant_linear.py): packing, rounding error, and the C kernels
against the reference (dequantise, then matmul).

Tolerances are derived, not tuned: the exact product of x and the dequantised weights (float64 here)
and any float32 evaluation of it differ by at most (K + 4)·u·(|x|·|W| + |b|), u = 2⁻²⁴ — K roundings
of a summation in any order (γ_K), plus the dequantising multiply, the scale and the bias. Both the
reference and the kernel must meet it, whatever order they sum in.
"""

from __future__ import annotations

import ctypes
import platform

import pytest
import torch

from trtforge.plugins import native
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
    """Every weight inside the code range is within half its scale (int4: the clipped extremes are
    outside it, by construction of the clip search)."""
    w = _weights(20, 256, seed=1)
    q, s = ql.quantize(w, scheme, group)
    back = ql.dequantize(q, s, scheme, group)
    per_elem = s.unsqueeze(1).expand(20, 256) if scheme == "int8_wo" else s.repeat_interleave(group, dim=1)
    # Real arithmetic gives ≤ s/2; float32 rounds w/s and q·s once each (relative u, |q| ≤ 127).
    bound = per_elem * (0.5 + 2 * 128 * U)
    inside = ((w / per_elem).le(7.5) & (w / per_elem).ge(-8.5) if scheme == "int4_wo"
              else torch.ones_like(w, dtype=torch.bool))
    assert (back - w).abs().le(bound)[inside].all()
    assert torch.equal(back[0], torch.zeros(256))
    if scheme == "int4_wo":
        codes = ql.unpack_int4(q)
        assert codes.min() >= -8 and codes.max() <= 7
    else:
        assert q.abs().max() <= 127 and inside.all()


@pytest.mark.parametrize("group", [32, 128])
def test_int4_clip_search_never_loses_to_round_to_nearest(group):
    """Per group, the chosen scale's squared error ≤ that of max|w| / 7 (the search includes it), and
    on Gaussian weights clearly below it overall."""
    w = _weights(64, 512, seed=3)
    q, s = ql.quantize(w, "int4_wo", group)
    err = (ql.dequantize(q, s, "int4_wo", group) - w).square().view(64, -1, group).sum(-1)
    blocks = w.view(64, -1, group)
    rtn_s = blocks.abs().amax(-1, keepdim=True) / 7
    rtn_s = torch.where(rtn_s > 0, rtn_s, torch.ones_like(rtn_s))
    rtn_err = (torch.round(blocks / rtn_s).clamp(-7, 7) * rtn_s - blocks).square().sum(-1)
    assert (err <= rtn_err * (1 + 1e-5) + 1e-12).all()
    assert err.sum() < 0.9 * rtn_err.sum()


def _exact_and_tolerance(x, w, b):
    x64, w64 = x.double(), w.double()
    exact = x64 @ w64.T + (0 if b is None else b.double())
    k = x.shape[-1]
    tol = (k + 4) * U * (x64.abs() @ w64.abs().T + (0 if b is None else b.double().abs()))
    return exact, tol


@pytest.mark.parametrize("scheme,group", [("int8_wo", 0), ("int4_wo", 16), ("int4_wo", 64)])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 7, 32])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.usefixtures("each_isa")
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
        got = ql.gemv(x, q, s, b, scheme, group, activations="float")  # the exact path
    assert (reference.double() - exact).abs().le(tol).all()
    assert (got.double() - exact).abs().le(tol).all(), (got.double() - exact).abs().div(tol).max()


@pytest.mark.parametrize("scheme,group", [("int8_wo", 0), ("int4_wo", 32)])
@pytest.mark.usefixtures("each_isa")
def test_dequantize_into_is_the_reference(scheme, group):
    q, s = ql.quantize(_weights(13, 96, seed=3), scheme, group)
    out = torch.empty(13, 96)
    ql.dequantize_into(out, q, s, scheme, group)
    assert torch.equal(out, ql.dequantize(q, s, scheme, group))  # one IEEE multiply each: bit-equal


# ---- int8 activations (the decode default): W8A8 / W4A8 dot products ------------------------------
# Tolerances, derived:
#   * against `gemv_a8_reference` (float64, every block's integer dot exact): the kernel's float32
#     operations on the path of any one term — the block's int32 lanes converted exactly (|lane| ≤
#     4·127·127), one FMA with the block scale, at most nb accumulations (nb = K/32 blocks), one more
#     per int4 group (the group-scale FMA), the 8-lane sum (3), the row scale and the bias — are at
#     most nb + groups + 6 roundings: |kernel − reference| ≤ (nb + groups + 8)·u·m, m the same sum of
#     absolute values (`gemv_a8_reference`'s second result).
#   * against the float product x·dequantize(W)ᵀ: each activation is rounded to q·d with
#     |x − q·d| ≤ d·(1/2 + 128u) (x/d is rounded once in float32, |x/d| ≤ 127), so the exact results
#     differ by at most Σ_i |W_ni|·d_{r,b(i)}·(1/2 + 128u); plus the float32 evaluation bound above.
A8_CASES = [("int8_wo", 0), ("int4_wo", 32), ("int4_wo", 64), ("int4_wo", 128), ("int4_wo", 96)]
"""int4 groups of 32 (odd blocks per group: scale per block), 64 / 128 (per group), 96 (odd, > 32)."""


def _a8_case(scheme, group, rows, k, bias, seed):
    n = 18  # four blocks of 4 weight rows + 2 left over
    q, s = ql.quantize(_weights(n, k, seed=seed), scheme, group)
    g = torch.Generator().manual_seed(1000 + seed)
    x = torch.randn(rows, k, generator=g) * torch.linspace(0.01, 10, k)  # blocks of very different scales
    x[0, :32] = 0.0  # an all-zero activation block: scale 1, contributes 0
    b = torch.randn(n, generator=g) if bias else None
    return x, q, s, b


def _a8_tolerance(m, k, group):
    return (k // 32 + (k // group if group else 0) + 8) * U * m


def _k_values(group):
    return [k for k in (96, 128, 384) if not group or k % group == 0]  # 96: a lone last block of 32


@pytest.mark.usefixtures("each_isa")
def test_activation_quantisation_is_the_reference_bit_for_bit():
    g = torch.Generator().manual_seed(5)
    x = torch.randn(32, 160, generator=g) * 3
    x[1, :32] = 0.0  # all-zero block
    x[2, :32] = torch.arange(32) - 15.5  # max 16.5: d = 16.5/127, x/d hits ties and ±127
    x[3, 32:64] = 1e-30  # tiny values
    xq, d = torch.empty(32, 160, dtype=torch.int8), torch.empty(32, 5)
    ql.library().trtforge_quantize_activations(x.data_ptr(), 32, 160, xq.data_ptr(), d.data_ptr())
    rq, rd = ql.quantize_activations(x)
    assert torch.equal(xq, rq) and torch.equal(d, rd)
    assert rq.abs().max() == 127 and torch.equal(rq[1, :32], torch.zeros(32, dtype=torch.int8)) and rd[1, 0] == 1
    back = rq.float().view(32, 5, 32) * rd.unsqueeze(-1)
    assert (back.view(32, 160) - x).abs().le(rd.repeat_interleave(32, dim=1) * (0.5 + 128 * U)).all()


@pytest.mark.parametrize("scheme,group", A8_CASES)
@pytest.mark.parametrize("bias", [True, False])
def test_gemv_a8_is_the_integer_reference(scheme, group, bias, each_isa):
    """Every row count 1..32 (the 4-output blocks, the 1-3 left over, rows looped inside a block, in
    pairs and one left over), and prefill-sized counts (the kernel takes any number of rows); the
    other ISAs' builds on a subset of those (the float64 reference is this test's cost)."""
    all_rows = [*range(1, 33), 70, 129] if each_isa == native.detected_isa() else [1, 2, 3, 5, 32, 70]
    for k in _k_values(group):
        for rows in all_rows:
            x, q, s, b = _a8_case(scheme, group, rows, k, bias, seed=rows + k)
            want, m = ql.gemv_a8_reference(x, q, s, b, scheme, group)
            with torch.inference_mode():
                assert ql.a8_ok(k, scheme, group) and ql.kernel_ok(x, k, group or 8)
                got = ql.gemv(x, q, s, b, scheme, group)  # the default takes int8 activations here
            err = (got.double() - want).abs()
            tol = _a8_tolerance(m, k, group)
            assert err.le(tol).all(), (scheme, group, k, rows, err.div(tol).max())


@pytest.mark.parametrize("scheme,group", A8_CASES)
@pytest.mark.parametrize("rows", [1, 3, 32])
@pytest.mark.usefixtures("each_isa")
def test_gemv_a8_against_the_float_product(scheme, group, rows):
    for k in _k_values(group):
        x, q, s, b = _a8_case(scheme, group, rows, k, True, seed=7 * rows + k)
        w = ql.dequantize(q, s, scheme, group)
        exact, _ = _exact_and_tolerance(x, w, b)
        _, m = ql.gemv_a8_reference(x, q, s, b, scheme, group)
        _, d = ql.quantize_activations(x)
        step = d.double().repeat_interleave(32, dim=1) @ w.double().abs().T * (0.5 + 128 * U)
        with torch.inference_mode():
            got = ql.gemv(x, q, s, b, scheme, group, activations="int8")
            exact_kernel = ql.gemv(x, q, s, b, scheme, group, activations="float")
        err = (got.double() - exact).abs()
        assert err.le(step + _a8_tolerance(m, k, group)).all(), err.div(step).max()
        # not vacuous: the activations really are rounded (the float-activation kernel is much closer)
        assert (exact_kernel.double() - exact).abs().max() * 100 < err.max()


def test_a8_shapes_it_does_not_take():
    """K or the int4 group not a multiple of 32: refused by name, the default falls back to the
    float-activation kernel (the weight-only result); TRTFORGE_QUANT_ACTIVATIONS=float likewise."""
    x, q, s, b = _a8_case("int8_wo", 0, 2, 40, True, seed=1)
    assert not ql.a8_ok(40, "int8_wo", 0)
    with torch.inference_mode():
        with pytest.raises(ValueError, match="multiples of 32"):
            ql.gemv(x, q, s, b, "int8_wo", 0, activations="int8")
        got = ql.gemv(x, q, s, b, "int8_wo", 0)
    exact, tol = _exact_and_tolerance(x, ql.dequantize(q, s, "int8_wo", 0), b)
    assert (got.double() - exact).abs().le(tol).all()
    x, q, s, b = _a8_case("int4_wo", 16, 2, 128, True, seed=2)
    assert not ql.a8_ok(128, "int4_wo", 16) and ql.a8_ok(128, "int4_wo", 32)
    with torch.inference_mode():
        got = ql.gemv(x, q, s, b, "int4_wo", 16)
    exact, tol = _exact_and_tolerance(x, ql.dequantize(q, s, "int4_wo", 16), b)
    assert (got.double() - exact).abs().le(tol).all()


def test_a8_can_be_switched_off(monkeypatch):
    """TRTFORGE_QUANT_ACTIVATIONS=float: the kernels registry's quant_activations, which a QuantLinear
    takes when it is built (the shape would still allow int8 activations)."""
    from trtforge.models.quantized_layers import QuantLinear
    from trtforge.plugins import kernels

    assert QuantLinear(128, 18, False, "int4_wo", 32).a8
    monkeypatch.setenv(kernels.QUANT_ACTIVATIONS_ENV, "float")
    assert kernels.choose("cpu", torch.float32).quant_activations == "float"
    assert not QuantLinear(128, 18, False, "int4_wo", 32).a8 and ql.a8_ok(128, "int4_wo", 32)
    with kernels.override(quant_activations="int8"):  # an override beats the environment
        assert QuantLinear(128, 18, False, "int4_wo", 32).a8
    assert ql.gemv_function("int4_wo", False) is ql.library().trtforge_gemv_int4
    assert ql.gemv_function("int4_wo", True) is ql.library().trtforge_gemv_int4_a8


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="-mno-avx2 is an x86 flag")
def test_portable_scalar_a8_kernels(tmp_path, monkeypatch):
    """The same source built without AVX/AVX2/FMA (the #else branch: plain C loops) against the
    same integer reference and tolerance."""
    monkeypatch.setenv("TRTFORGE_CACHE_DIR", str(tmp_path))
    so = native.build(ql.LIBRARY.source, (*ql.LIBRARY.extra_flags, "-mno-avx", "-mno-avx2", "-mno-fma"))
    lib = ctypes.CDLL(str(so))
    for name, (restype, argtypes) in ql._SIGNATURES.items():
        getattr(lib, name).restype, getattr(lib, name).argtypes = restype, argtypes
    for scheme, group in A8_CASES:
        for k in _k_values(group):
            for rows in (1, 5, 32):
                x, q, s, b = _a8_case(scheme, group, rows, k, True, seed=rows)
                want, m = ql.gemv_a8_reference(x, q, s, b, scheme, group)
                y = torch.empty(rows, 18)
                args = (x.data_ptr(), rows, q.data_ptr(), s.data_ptr(), b.data_ptr(), y.data_ptr(), 18, k)
                if scheme == "int8_wo":
                    assert lib.trtforge_gemv_int8_a8(*args, 2) == 0
                else:
                    assert lib.trtforge_gemv_int4_a8(*args, group, 2) == 0
                assert (y.double() - want).abs().le(_a8_tolerance(m, k, group)).all(), (scheme, group, k, rows)


@pytest.mark.parametrize("scheme,group", [("int8_wo", 0), ("int4_wo", 128), ("int4_wo", 32)])
def test_quant_linear_takes_the_a8_kernel_for_prefill_too(scheme, group):
    """QuantLinear (models/quantized_layers.py) with more than GEMV_MAX_ROWS rows: the int8-activation
    kernel (the integer reference) by default; built with float activations the dequantise + GEMM path
    (the float product on the dequantised weights)."""
    from trtforge.models.quantized_layers import QuantLinear
    from trtforge.plugins import kernels
    from trtforge.plugins.cpu.quant_linear import GEMV_MAX_ROWS

    k, n, rows = 256, 18, GEMV_MAX_ROWS * 3 + 5
    x, q, s, b = _a8_case(scheme, group, rows, k, True, seed=11)

    def layer(choice: kernels.Kernels | None = None) -> QuantLinear:
        lin = QuantLinear(k, n, True, scheme, group or 128, kernels=choice)
        lin.qweight.copy_(q), lin.scales.copy_(s)
        with torch.no_grad():
            lin.bias.copy_(b)
        return lin

    want, m = ql.gemv_a8_reference(x, q, s, b, scheme, group)
    with torch.inference_mode():
        got = layer()(x.view(1, rows, k)).view(rows, n)
    assert (got.double() - want).abs().le(_a8_tolerance(m, k, group)).all()
    with kernels.override(quant_activations="float"):
        float_acts = layer(kernels.choose("cpu", torch.float32))
    with torch.inference_mode():
        got = float_acts(x)
    exact, tol = _exact_and_tolerance(x, ql.dequantize(q, s, scheme, group), b)
    assert (got.double() - exact).abs().le(tol).all()
    assert (got.double() - want).abs().max() > 0  # the two paths really differ (activation rounding)


# ---- int8 x int8 on packed panels: AVX-512 VNNI, or AVX2 on the same layout ---------------------
needs_panels = pytest.mark.skipif(ql.panels_kernel() is None, reason="needs an AVX2 CPU (the portable build has "
                                  "no packed int8 GEMM; its row kernels above are tested on every CPU)")


def test_vnni_kernel_only_in_vnni_builds(each_isa):
    lib = ql.LIBRARY.lib
    has = "avx512_vnni" in native.cpu_flags().split() and each_isa == "avx512"
    assert bool(lib.trtforge_vnni()) == has
    assert ql.panels_kernel(lib) == ("vnni" if has else None if each_isa == "portable" else "avx2")
    if each_isa == "portable":
        with pytest.raises(RuntimeError, match="no packed int8 GEMM"):
            ql.pack_int8_vnni(torch.zeros(16, 32, dtype=torch.int8), lib)


@pytest.mark.parametrize("rows", [1, 3, 4, 5, 64])
def test_panel_gemm_on_every_isa(each_isa, rows):
    """The AVX2 panel kernel where the ISA is AVX2 (also on an AVX-512 machine), VNNI's on AVX-512 VNNI:
    both within float32 summation order of `gemv_a8_reference`; the portable build refuses."""
    lib = ql.LIBRARY.lib
    g = torch.Generator().manual_seed(rows)
    q, scales = ql.quantize(torch.randn(40, 96, generator=g), "int8_wo", 0)
    x, b = torch.randn(rows, 96, generator=g) * 3, torch.randn(40, generator=g)
    if ql.panels_kernel(lib) is None:
        with pytest.raises(RuntimeError, match="no packed int8 GEMM"):
            ql.pack_int8_vnni(q, lib)
        return
    with torch.inference_mode():
        got = ql.gemm_int8_vnni(x, *ql.pack_int8_vnni(q, lib), scales, b, 40, lib)
    ref, magnitude = ql.gemv_a8_reference(x, q, scales, b, "int8_wo", 0)
    assert ((got.double() - ref).abs() <= 64 * 2.0 ** -24 * magnitude + 1e-30).all()


@needs_panels
@pytest.mark.parametrize("n,k", [(16, 32), (50, 96), (33, 896)])
def test_vnni_pack_is_the_reference_layout(n, k):
    q, _ = ql.quantize(torch.randn(n, k, generator=torch.Generator().manual_seed(n)), "int8_wo", 0)
    packed, wsum = ql.pack_int8_vnni(q)
    ref_packed, ref_wsum = ql.pack_int8_vnni_reference(q)
    assert torch.equal(packed, ref_packed) and torch.equal(wsum, ref_wsum)


@needs_panels
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("rows", [1, 2, 7, 8, 9, 17, 64, 100])
@pytest.mark.parametrize("n,k", [(50, 96), (16, 320)])
def test_vnni_gemm_is_the_integer_reference(n, k, rows, bias):
    """Every block's integer dot exact (VNNI: the +128 offset taken back out; AVX2: x's sign on the
    weights): within float32 summation order of `gemv_a8_reference`."""
    g = torch.Generator().manual_seed(rows * n)
    q, scales = ql.quantize(torch.randn(n, k, generator=g), "int8_wo", 0)
    x, b = torch.randn(rows, k, generator=g) * 3, (torch.randn(n, generator=g) if bias else None)
    with torch.inference_mode():
        got = ql.gemm_int8_vnni(x, *ql.pack_int8_vnni(q), scales, b, n)
    ref, magnitude = ql.gemv_a8_reference(x, q, scales, b, "int8_wo", 0)
    assert ((got.double() - ref).abs() <= 64 * 2.0 ** -24 * magnitude + 1e-30).all()


@needs_panels
def test_int8_layers_pack_for_panels_at_load():
    from trtforge.models.quantized_layers import QuantLinear

    layer = QuantLinear(64, 40, True, "int8_wo", 0)
    q, scales = ql.quantize(torch.randn(40, 64, generator=torch.Generator().manual_seed(3)), "int8_wo", 0)
    with torch.no_grad():
        layer.qweight.copy_(q), layer.scales.copy_(scales), layer.bias.copy_(torch.arange(40.0))
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(4))
    with torch.inference_mode():
        before = layer(x)
        layer.pack_weights()
        assert layer.vnni is not None and layer.qweight is None  # a decoder layer holds the packed copy only
        after = layer(x)
    torch.testing.assert_close(after, before, atol=1e-4, rtol=1e-5)  # the row kernels, same integer dots
    assert torch.equal(ql.unpack_int8_vnni(layer.vnni[0], 40), q)
    torch.testing.assert_close(layer(x), x @ (q.float() * scales[:, None]).T + layer.bias, atol=1e-4, rtol=1e-5)
