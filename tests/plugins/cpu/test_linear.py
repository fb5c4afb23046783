"""The CPU linear layer (plugins/cpu/linear.py): the C GEMV for up to GEMV_MAX_ROWS rows and
oneDNN beyond, both against F.linear, with and without bias, on shapes that leave remainders."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from trtforge.plugins.cpu import linear as cpu_linear
from trtforge.plugins.cpu.linear import GEMV_MAX_ROWS, CpuLinear


def test_gemv_builds_here():
    assert cpu_linear.library() is not None


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, GEMV_MAX_ROWS, GEMV_MAX_ROWS + 1, 70])
def test_matches_f_linear(rows, bias):
    g = torch.Generator().manual_seed(rows)
    out_features, in_features = 18, 40  # 18 = four blocks of 4 weight rows + 2 left over
    w = torch.randn(out_features, in_features, generator=g)
    b = torch.randn(out_features, generator=g) if bias else None
    x = torch.randn(rows, in_features, generator=g)
    layer = CpuLinear(w, b)
    with torch.inference_mode():
        got = layer(x)
    torch.testing.assert_close(got, F.linear(x, w, b), atol=2e-5, rtol=2e-5)


def test_three_dimensional_input_and_autograd_fallback():
    g = torch.Generator().manual_seed(0)
    w, x = torch.randn(8, 16, generator=g), torch.randn(2, 3, 16, generator=g)
    layer = CpuLinear(w, None)
    with torch.inference_mode():
        torch.testing.assert_close(layer(x), F.linear(x, w), atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(layer(x), F.linear(x, w), atol=2e-5, rtol=2e-5)  # grad mode: oneDNN


@pytest.mark.parametrize("shape", [(33, 40), (2, 35, 40), (64, 40)])
def test_onednn_rows_padded_to_a_few_shapes(shape):
    """Rows reach oneDNN padded to a multiple of ONEDNN_ROW_QUANTUM (one cached kernel per padded
    count, not per count); the result is F.linear's, in the input's shape."""
    from trtforge.plugins.cpu.linear import onednn_linear

    g = torch.Generator().manual_seed(len(shape))
    x, w, b = torch.randn(*shape, generator=g), torch.randn(18, 40, generator=g), torch.randn(18, generator=g)
    y = onednn_linear(x, w, b)
    assert y.shape == (*shape[:-1], 18)
    torch.testing.assert_close(y, torch.nn.functional.linear(x, w, b), rtol=1e-5, atol=1e-5)
