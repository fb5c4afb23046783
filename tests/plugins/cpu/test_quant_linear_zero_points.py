"""QuantLinear with pre-quantized zero points and an act-order permutation (models/quantized_layers.py):
the C kernels on the codes plus `zero_point_correction`, against the reference — (q - zero) · scale
dequantised in torch, then F.linear — and against the float weight it stands for."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from trtforge.models.quantized_layers import QuantLinear
from trtforge.plugins import kernels as registry
from trtforge.plugins.cpu import quant_linear as ql


def _layer(scheme: str, group: int, k: int, n: int, act: str, perm: bool, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    if scheme == "int4_wo":
        codes = torch.randint(-8, 8, (n, k), generator=g, dtype=torch.int8)
        zeros = torch.randint(-8, 8, (n, k // group), generator=g, dtype=torch.int8)
        qweight, scales = ql.pack_int4(codes), torch.rand(n, k // group, generator=g) * 0.05 + 0.01
    else:
        codes = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8)
        zeros = torch.randint(-128, 128, (n,), generator=g, dtype=torch.int8)
        qweight, scales = codes, torch.rand(n, generator=g) * 0.005 + 0.001
    state = {"qweight": qweight, "scales": scales, "zeros": zeros, "bias": torch.randn(n, generator=g)}
    if perm:
        state["perm"] = torch.randperm(k, generator=g)
    kernels = registry.choose("cpu", torch.float32)
    kernels = type(kernels)(**{**kernels.__dict__, "quant_activations": act})
    lin = QuantLinear(k, n, True, scheme, group, kernels=kernels)
    lin.load_state_dict(state, assign=True)
    return lin, state


@pytest.mark.usefixtures("each_isa")  # every ISA build of quant_linear.c (asserted to build: no skip)
@pytest.mark.parametrize("scheme,group", [("int4_wo", 32), ("int4_wo", 64), ("int8_wo", 0)])
@pytest.mark.parametrize("rows", [1, 5, 40])
@pytest.mark.parametrize("perm", [False, True])
def test_kernel_with_zero_points_equals_the_reference(scheme, group, rows, perm):
    k, n = 128, 48
    lin, state = _layer(scheme, group, k, n, "float", perm)
    assert lin.c_kernels and lin.native  # the decode plan calls it too, with its zero points around the kernel
    x = torch.randn(rows, k)
    w = ql.dequantize(state["qweight"], state["scales"], scheme, group, torch.float64, state["zeros"])
    xp = x[:, state["perm"]] if perm else x
    ref = (xp.double() @ w.t() + state["bias"].double()).float()
    got = lin(x)
    assert torch.allclose(got, ref, rtol=1e-4, atol=1e-4 * ref.abs().max().item())
    # the float weight in the input order: w[:, j] is input perm[j]
    full = torch.empty_like(w)
    full[:, state["perm"] if perm else torch.arange(k)] = w
    assert torch.allclose(F.linear(x.double(), full, state["bias"].double()).float(), ref, atol=1e-4)


@pytest.mark.usefixtures("each_isa")  # every ISA build of quant_linear.c (asserted to build: no skip)
def test_int8_activations_with_zero_points_and_a_minus_128_code():
    lin, state = _layer("int8_wo", 0, 128, 48, "int8", False)
    assert int(state["qweight"].min()) == -128 and not lin.a8  # -128: the float-activation kernel
    lin4, state4 = _layer("int4_wo", 32, 128, 48, "int8", True)
    assert lin4.a8
    x = torch.randn(7, 128)
    w = ql.dequantize(state4["qweight"], state4["scales"], "int4_wo", 32, torch.float64, state4["zeros"])
    ref = (x[:, state4["perm"]].double() @ w.t() + state4["bias"].double()).float()
    assert (lin4(x) - ref).abs().max() < 0.02 * ref.abs().max()  # activations rounded to int8 per block of 32


@pytest.mark.usefixtures("each_isa")  # every ISA build of quant_linear.c (asserted to build: no skip)
@pytest.mark.parametrize("n", [48, 45, 104])  # 45: past the last vector of eight; 104: blocks of 32 + 8
@pytest.mark.parametrize("rows", [1, 3, 70])
@pytest.mark.parametrize("groups", [1, 4])  # 1: int8_wo (one group of K)
def test_zero_point_correction_helper_equals_the_reference(n, rows, groups):
    """quant_linear.c's correction (the CPU decode plan's) against `zero_point_correction` in torch."""
    g = torch.Generator().manual_seed(rows + n)
    k = 128
    x = torch.randn(rows, k, generator=g)
    zs = (torch.randint(-8, 8, (n, groups), generator=g) * (torch.rand(n, groups, generator=g) * 0.05)).float()
    y0 = torch.randn(rows, n, generator=g)
    ref = y0 - ql.zero_point_correction(x, zs)
    got = ql.zero_point_correction_into(y0.clone(), x, zs.t().contiguous())
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.usefixtures("each_isa")  # every ISA build of quant_linear.c (asserted to build: no skip)
def test_gather_columns_helper():
    x = torch.randn(5, 96)
    perm = torch.randperm(96)
    assert torch.equal(ql.gather_columns(x, perm), x[:, perm])
    lin, _ = _layer("int4_wo", 32, 128, 48, "float", True)
    assert lin.native  # the decode plan runs it, with the gather and the correction around the GEMV
    assert torch.equal(lin.zero_scales_t(), (lin.scales * lin.zeros.float()).t())
