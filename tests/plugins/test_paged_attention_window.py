"""Sliding-window attention in the paged-KV op (`window`): the reference against a dense oracle, and every
implementation the runtime uses (the cpu torch path, the C decode kernel, the Triton kernels in the
interpreter) against the reference — with the blocks wholly before each sequence's window replaced by a
NaN-filled block, so any read of a block the runtime may have freed shows up as NaN."""

from __future__ import annotations

import math
import os

import pytest
import torch

from trtforge.plugins.paged_attention import cpu, cpu_native, reference
from trtforge.plugins.paged_attention.testing import make_case

# (cached_len, new_len) per sequence: prompts longer and shorter than the windows, chunks after
# cached context, decodes far past the window, mixed steps.
SCENARIOS = {
    "prefill": [(0, 37), (0, 5), (0, 16)],
    "chunked": [(16, 21), (40, 7), (5, 33), (3, 2)],
    "decode": [(15, 1), (16, 1), (31, 1), (47, 1), (0, 1), (2, 1), (70, 1)],
    "decode_one": [(60, 1)],
    "mixed": [(0, 13), (33, 1), (20, 12), (7, 1), (0, 1), (64, 5), (31, 1)],
}
WINDOWS = [1, 5, 16, 20]
TOL = dict(atol=1e-5, rtol=1e-5)


def poisoned(case, window: int, block_size: int):
    """The case with one extra NaN block, and every block-table entry wholly before the first position any
    of the sequence's new tokens sees pointing at it (what a freed block's placeholder may hold)."""
    kv = case.kv_cache
    pool = torch.cat([kv, torch.full_like(kv[:, :1], float("nan"))], dim=1).contiguous()
    poison = pool.shape[1] - 1
    tables = case.meta.block_tables.clone()
    starts, lens = case.meta.query_start_loc.tolist(), case.meta.seq_lens.tolist()
    for s, seq_len in enumerate(lens):
        cached = seq_len - (starts[s + 1] - starts[s])
        first = max(0, cached - window + 1)
        tables[s, : first // block_size] = poison
    meta = case.meta
    meta = type(meta)(meta.slot_mapping, tables, meta.seq_lens, meta.query_start_loc, meta.max_query_len,
                      meta.max_seq_len)
    return type(case)(**{**case.__dict__, "kv_cache": pool, "meta": meta})


def dense_oracle(case, window: int) -> torch.Tensor:
    """Windowed causal attention in float64 from the whole (unpoisoned) context, after the KV write."""
    kv = case.kv_cache.clone()
    m = case.meta
    reference.write_kv(kv, case.k, case.v, m.slot_mapping)
    group = case.q.shape[1] // kv.shape[-2]
    out = torch.empty(case.q.shape, dtype=torch.float64)
    starts, lens = m.query_start_loc.tolist(), m.seq_lens.tolist()
    for s, seq_len in enumerate(lens):
        a, b = starts[s], starts[s + 1]
        keys = reference.gather_context(kv[0], m.block_tables[s], seq_len).double().repeat_interleave(group, 1)
        values = reference.gather_context(kv[1], m.block_tables[s], seq_len).double().repeat_interleave(group, 1)
        for j in range(b - a):
            p = seq_len - (b - a) + j
            lo = max(0, p - window + 1) if window else 0
            scores = torch.einsum("hd,lhd->hl", case.q[a + j].double(), keys[lo: p + 1]) * case.scale
            out[a + j] = torch.einsum("hl,lhd->hd", torch.softmax(scores, -1), values[lo: p + 1])
    return out


@pytest.mark.parametrize("scenario", list(SCENARIOS))
@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("block_size", [4, 16])
def test_reference_matches_dense_oracle(scenario, window, block_size):
    case = make_case(SCENARIOS[scenario], block_size=block_size, seed=3)
    expected = dense_oracle(case, window)
    bad = poisoned(case, window, block_size)
    out = reference.paged_attention(*bad.op_args(), window=window)
    torch.testing.assert_close(out.double(), expected, **TOL)


def test_window_bites_and_large_window_is_full_attention():
    case = make_case(SCENARIOS["mixed"], block_size=4, seed=5)
    full = reference.paged_attention(*case.clone().op_args())
    assert torch.equal(reference.paged_attention(*case.clone().op_args(), window=10_000), full)
    windowed = reference.paged_attention(*case.clone().op_args(), window=5)
    assert (windowed - full).abs().max() > 1e-2, "a window of 5 on 69-token contexts must change the output"


@pytest.fixture(params=["native", "torch"])
def decode_path(request, monkeypatch):
    """Pure-decode float32 steps through the C kernel ("native") or the torch SDPA path."""
    if request.param == "torch":
        monkeypatch.setattr(cpu_native, "MAX_CONTEXT_TOKENS", -1)
    else:  # scripts/test.sh requires a C compiler: a kernel that does not build fails, it is not skipped
        assert cpu_native.library() is not None, "the C decode kernel does not build here"
    return request.param


@pytest.mark.parametrize("scenario", list(SCENARIOS))
@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("block_size", [4, 16])
def test_cpu_matches_reference(scenario, window, block_size, decode_path):
    case = make_case(SCENARIOS[scenario], block_size=block_size, head_dim=16, seed=7)
    expected = reference.paged_attention(*case.clone().op_args(), window=window)
    bad = poisoned(case.clone(), window, block_size)
    out = cpu.paged_attention(*bad.op_args(), window=window)
    cpu.clear_workspace()
    torch.testing.assert_close(out, expected, **TOL)


@pytest.mark.parametrize("scenario", ["decode", "mixed", "chunked"])
def test_cpu_int8_and_softcap_with_window(scenario, decode_path):
    case = make_case(SCENARIOS[scenario], block_size=4, head_dim=16, seed=9).int8_kv()
    expected = reference.paged_attention(*case.clone().op_args(), softcap=3.0, window=6)
    ours = case.clone()
    out = cpu.paged_attention(*ours.op_args(), softcap=3.0, window=6)
    torch.testing.assert_close(out, expected, **TOL)


@pytest.mark.parametrize("window", [3, 16, 33])
def test_native_decode_each_isa(each_isa, window):
    case = make_case([(c, 1) for c in (0, 2, 15, 16, 31, 47, 100, 200)], block_size=16, num_heads=8,
                     num_kv_heads=2, head_dim=40, seed=11)
    expected = reference.paged_attention(*case.clone().op_args(), window=window)
    bad = poisoned(case.clone(), window, 16)
    m = bad.meta
    out = cpu_native.decode(bad.q, bad.k, bad.v, bad.kv_cache, m.slot_mapping, m.block_tables, m.seq_lens,
                            bad.scale, window=window)
    torch.testing.assert_close(out, expected, **TOL)


@pytest.mark.parametrize("scenario", ["prefill", "chunked", "decode", "mixed"])
@pytest.mark.parametrize("window", [5, 20])
@pytest.mark.parametrize("splits", [1, 4])
def test_triton_matches_reference(scenario, window, splits):
    tk = pytest.importorskip("trtforge.plugins.paged_attention.triton_kernels",
                             reason="needs the `triton` package")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and os.environ.get("TRITON_INTERPRET", "0") != "1":
        pytest.skip("Triton kernels compiled for a GPU that is absent")
    case = make_case(SCENARIOS[scenario], block_size=16, head_dim=16, seed=13)
    expected = reference.paged_attention(*case.clone().op_args(), window=window)
    bad = poisoned(case.clone(), window, 16).to(device)
    m = bad.meta
    out = tk.paged_attention_triton(*bad.op_args(), m.max_query_len, m.max_seq_len, num_kv_splits=splits,
                                    window=window)
    torch.testing.assert_close(out.cpu(), expected, atol=2e-5, rtol=2e-5)
    assert not math.isnan(out.float().sum().item())
