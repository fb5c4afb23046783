"""The Mixture-of-Experts decode kernels of plugins/cpu/fused.c (the CPU decode plan's MoE layers) against their
torch references in models/moe.py — the router (softmax, top-k, renormalisation; the pairs numbered in expert
order as `SparseMoE._grouped` sorts them), the gather of each expert's rows, the weighted combine with and without
a shared expert — and Qwen3's per-head q/k RMSNorm against F.rms_norm, on every ISA build."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from trtforge.models.moe import route
from trtforge.plugins.cpu import fused as cpu_fused

EXACTISH = dict(atol=2e-6, rtol=2e-6)  # float32, another summation order / exp


@pytest.fixture(autouse=True)
def _inference():
    with torch.inference_mode():
        yield


def _lib():
    return cpu_fused.LIBRARY.lib


@pytest.mark.usefixtures("each_isa")
@pytest.mark.parametrize("tokens", [1, 5, 40])
@pytest.mark.parametrize("experts,k,normalize", [(8, 2, True), (6, 2, False), (32, 4, True), (128, 8, True)])
def test_route_is_the_torch_router_and_the_grouped_order(tokens, experts, k, normalize):
    logits = torch.randn(tokens, experts, generator=torch.Generator().manual_seed(tokens * experts)) * 2
    got = cpu_fused.moe_route(logits, k, normalize)
    weights, ids = route(logits, k, normalize)
    assert torch.equal(got["ids"], ids)
    torch.testing.assert_close(got["weights"], weights, **EXACTISH)
    flat = ids.flatten()
    order = torch.argsort(flat, stable=True)  # models/moe.py's grouping: by expert, token order within
    assert torch.equal(got["counts"], torch.bincount(flat, minlength=experts))
    assert torch.equal(got["sorted_token"], order // k)
    assert torch.equal(got["position"], torch.argsort(order))
    if tokens > 1:  # random logits: the tokens do not all choose the same experts
        assert len({tuple(sorted(r)) for r in ids.tolist()}) > 1


@pytest.mark.usefixtures("each_isa")
def test_route_never_picks_a_nan_over_a_number():
    logits = torch.tensor([[float("nan"), 0.5, -1.0, 2.0]])
    got = cpu_fused.moe_route(logits, 2, True)
    assert got["ids"].tolist() == [[3, 1]]


@pytest.mark.usefixtures("each_isa")
@pytest.mark.parametrize("dim", [8, 24, 1040])  # one 8, 16 + 8, blocks of 16 then 8
def test_gather_rows(dim):
    x = torch.randn(6, dim)
    rows = torch.tensor([4, 0, 4, 5, 1], dtype=torch.int64)
    out = torch.empty(5, dim)
    _lib().trtforge_gather_rows(x.data_ptr(), rows.data_ptr(), 5, dim, out.data_ptr())
    assert torch.equal(out, x.index_select(0, rows))


@pytest.mark.usefixtures("each_isa")
@pytest.mark.parametrize("tokens,k", [(1, 2), (3, 4), (9, 8)])
@pytest.mark.parametrize("dim", [24, 1040])
@pytest.mark.parametrize("shared", [False, True])
def test_combine_is_the_grouped_paths_weighted_sum(tokens, k, dim, shared):
    g = torch.Generator().manual_seed(tokens * k + dim)
    r = cpu_fused.moe_route(torch.randn(tokens, 16, generator=g), k, True)
    ys = torch.randn(tokens * k, dim, generator=g)  # expert outputs, in expert order
    sh, gate = torch.randn(tokens, dim, generator=g), torch.randn(tokens, 1, generator=g)
    out = torch.empty(tokens, dim)
    _lib().trtforge_moe_combine(ys.data_ptr(), r["position"].data_ptr(), r["weights"].data_ptr(), tokens, k, dim,
                                sh.data_ptr() if shared else None, gate.data_ptr() if shared else None,
                                out.data_ptr())
    ref = (ys.index_select(0, r["position"]).view(tokens, k, dim) * r["weights"].unsqueeze(-1)).sum(1)
    if shared:  # SparseMoE._add_shared
        ref = ref + torch.sigmoid(gate) * sh
    torch.testing.assert_close(out, ref, **EXACTISH)


@pytest.mark.usefixtures("each_isa")
@pytest.mark.parametrize("tokens", [1, 4])
@pytest.mark.parametrize("head_dim", [24, 64, 128])
def test_head_rms_norm_in_place_on_strided_heads(tokens, head_dim):
    """Qwen3's q/k norms: the first `heads` heads of each token's qkv row, rows `stride` floats apart."""
    hq, hkv = 4, 2
    qkv = torch.randn(tokens, hq + 2 * hkv, head_dim)
    w = torch.randn(head_dim)
    ref = qkv.clone()
    ref[:, :hq] = F.rms_norm(qkv[:, :hq], (head_dim,), w, 1e-6)
    stride = (hq + 2 * hkv) * head_dim
    _lib().trtforge_head_rms_norm(qkv.data_ptr(), w.data_ptr(), tokens, hq, stride, head_dim, 1e-6)
    torch.testing.assert_close(qkv, ref, **EXACTISH)
    assert torch.equal(qkv[:, hq:], ref[:, hq:])  # the other heads untouched
