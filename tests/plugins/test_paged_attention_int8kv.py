"""int8 KV (`torch.ops.trtforge.paged_attention_int8kv`): the quantisation, the reference, the
torch CPU path and the C decode kernel against the reference, and int8 vs float KV within a bound
derived from the quantisation step."""

from __future__ import annotations

import contextlib
import math

import pytest
import torch

from trtforge.plugins import kernels
from trtforge.plugins.paged_attention import cpu, cpu_native, op, reference
from trtforge.plugins.paged_attention.reference import dequantize_kv, quantize_kv
from trtforge.plugins.paged_attention.testing import make_case

# As tests/plugins/test_paged_attention.py: lengths start, end and cross block boundaries.
SCENARIOS = {
    "prefill": [(0, 37), (0, 5), (0, 1), (0, 16)],
    "chunked_prefill": [(16, 21), (40, 7), (5, 33)],
    "decode": [(15, 1), (16, 1), (31, 1), (47, 1), (0, 1), (2, 1)],
    "decode_one": [(40, 1)],
    "mixed": [(0, 13), (33, 1), (20, 12), (7, 1), (0, 1), (64, 5), (31, 1)],
}
FP32_TOL = dict(atol=1e-5, rtol=1e-5)  # same stored values, float32 summation order only
BF16_TOL = dict(atol=2e-2, rtol=2e-2)  # bf16 queries/outputs: ~4e-3 relative rounding, as there


_forced = contextlib.ExitStack()


def force(impl: str) -> None:
    """Force the attention implementation for the rest of the test (kernels.override, undone by _default_impl)."""
    _forced.enter_context(kernels.override(attention=impl))


@pytest.fixture(autouse=True)
def _default_impl(monkeypatch):
    monkeypatch.delenv(op.ENV_VAR, raising=False)
    yield
    _forced.close()


@pytest.fixture
def torch_decode(monkeypatch):
    """Pure-decode steps down the torch path instead of the C kernel."""
    monkeypatch.setattr(cpu_native, "MAX_CONTEXT_TOKENS", -1)


def half_step(scale: torch.Tensor) -> torch.Tensor:
    """The rounding bound of one stored value, scale / 2, plus float32 rounding of q * scale."""
    return scale / 2 * (1 + 1e-6) + 1e-12


def test_quantize_kv_error_is_at_most_half_a_step():
    x = torch.randn(257, 3, 64, generator=torch.Generator().manual_seed(0)) * torch.rand(257, 3, 1) * 10
    x[5, 1] = 0.0  # an all-zero head row
    q, scale = quantize_kv(x)
    assert q.dtype == torch.int8 and scale.dtype == torch.float32 and scale.shape == (257, 3)
    assert int(q.abs().max()) == 127 and int(q.min()) >= -127
    torch.testing.assert_close(scale, x.abs().amax(-1) / 127, atol=0, rtol=0)
    err = (dequantize_kv(q, scale) - x).abs()
    assert bool((err <= half_step(scale).unsqueeze(-1)).all())
    assert float(scale[5, 1]) == 0.0 and not q[5, 1].any()


def test_reference_stores_quantised_rows_at_the_new_slots_only():
    case = make_case(SCENARIOS["mixed"], block_size=16, spare_blocks=4).int8_kv()
    before, before_scales = case.kv_cache.clone(), case.kv_scales.clone()
    reference.paged_attention(*case.op_args())
    pool, scales = case.kv_cache.flatten(1, 2), case.kv_scales.flatten(1, 2)  # [2, slots, Hkv(, D)]
    slots = case.meta.slot_mapping
    for i, x in enumerate((case.k, case.v)):
        want_q, want_scale = quantize_kv(x)
        assert torch.equal(pool[i, slots], want_q) and torch.equal(scales[i, slots], want_scale)
        err = (dequantize_kv(pool[i, slots], scales[i, slots]) - x).abs()
        assert bool((err <= half_step(scales[i, slots]).unsqueeze(-1)).all())
    untouched = torch.ones(pool.shape[1], dtype=torch.bool)
    untouched[slots] = False
    assert torch.equal(pool[:, untouched], before.flatten(1, 2)[:, untouched])
    assert torch.equal(scales[:, untouched], before_scales.flatten(1, 2)[:, untouched])


def test_reference_is_float_attention_over_the_dequantised_cache():
    """The int8 oracle = the float oracle on a pool holding value * scale and on k/v rounded the
    same way: int8 KV changes what is stored, nothing else."""
    case = make_case(SCENARIOS["mixed"], block_size=16, num_heads=4, num_kv_heads=2).int8_kv()
    dense = case.clone()
    dense.kv_cache, dense.kv_scales = dequantize_kv(case.kv_cache, case.kv_scales), None
    dense.k, dense.v = dequantize_kv(*quantize_kv(case.k)), dequantize_kv(*quantize_kv(case.v))
    torch.testing.assert_close(reference.paged_attention(*case.op_args()),
                               reference.paged_attention(*dense.op_args()), **FP32_TOL)


def _run(case, impl: str) -> torch.Tensor:
    force(impl)
    return torch.ops.trtforge.paged_attention_int8kv(*case.op_args())


@pytest.mark.parametrize("impl", ["cpu", "auto"])
@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_torch_path_matches_reference(scenario, block_size, impl, torch_decode):
    case = make_case(SCENARIOS[scenario], block_size=block_size, num_heads=6, num_kv_heads=2, seed=2).int8_kv()
    ref = case.clone()
    expected = reference.paged_attention(*ref.op_args())
    torch.testing.assert_close(_run(case, impl), expected, **FP32_TOL)
    assert torch.equal(case.kv_cache, ref.kv_cache) and torch.equal(case.kv_scales, ref.kv_scales)


@pytest.mark.parametrize("head_dim", [8, 24, 64, 136])  # 8, 24, 136: the AVX-512 build's half vectors
@pytest.mark.parametrize("group", [1, 2, 7])
@pytest.mark.parametrize("block_size", [1, 16, 32])
@pytest.mark.usefixtures("each_isa")
def test_native_decode_matches_reference(block_size, group, head_dim):
    """The C kernel's int8 path: the stored bytes and scales equal the reference's bit for bit
    (same IEEE operations), outputs equal up to float32 summation order."""
    seqs = [(15, 1), (16, 1), (31, 1), (47, 1), (0, 1), (2, 1), (66, 1)]
    case = make_case(seqs, block_size=block_size, num_heads=2 * group, num_kv_heads=2, head_dim=head_dim,
                     seed=group).int8_kv()
    ref = case.clone()
    expected = reference.paged_attention(*ref.op_args())
    args = case.op_args()
    assert cpu_native.applies(*args[:7], case.meta.seq_lens.tolist(), case.kv_scales)
    got = cpu_native.decode(*args[:7], case.scale, case.kv_scales)
    torch.testing.assert_close(got, expected, **FP32_TOL)
    assert torch.equal(case.kv_cache, ref.kv_cache) and torch.equal(case.kv_scales, ref.kv_scales)


def test_native_decode_rejects_out_of_range_blocks_without_writing():
    case = make_case([(20, 1), (5, 1)], block_size=16, num_heads=4, num_kv_heads=2).int8_kv()
    case.meta.block_tables[1, 0] = case.kv_cache.shape[1]
    before, before_scales = case.kv_cache.clone(), case.kv_scales.clone()
    with pytest.raises(ValueError, match="out of range"):
        cpu_native.decode(*case.op_args()[:7], case.scale, case.kv_scales)
    assert torch.equal(case.kv_cache, before) and torch.equal(case.kv_scales, before_scales)


@pytest.mark.parametrize("scenario", ["mixed", "decode"])
def test_bf16_queries_with_int8_kv(scenario):
    case = make_case(SCENARIOS[scenario], block_size=16, num_heads=8, num_kv_heads=2, seed=7)
    expected = reference.paged_attention(*case.clone().int8_kv().op_args())
    got = _run(case.to(dtype=torch.bfloat16).int8_kv(), "cpu")
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), expected, **BF16_TOL)


@pytest.mark.parametrize("scenario", ["mixed", "decode", "chunked_prefill"])
def test_int8_vs_float_kv_within_the_quantisation_bound(scenario):
    """Attention over int8 KV vs over the float pool it came from, per token and head, within
    what the rounding allows: a key off by at most sk/2 per element moves a score by at most
    delta = scale * ||q||_1 * max sk / 2, which scales every softmax weight by a factor within
    exp(+-2 delta), so sum_j |p'_j - p_j| <= exp(2 delta) - 1; a value off by at most sv/2 moves
    the output by at most max sv / 2. Hence |out' - out| <= (exp(2 delta) - 1) max|v| + max sv / 2."""
    case = make_case(SCENARIOS[scenario], block_size=16, num_heads=4, num_kv_heads=2, head_dim=32, seed=5)
    exact = reference.paged_attention(*case.clone().op_args())
    int8 = case.clone().int8_kv()
    got = _run(int8, "cpu")
    group = 2
    m = case.meta
    for s in range(len(case.seqs)):
        a, b = int(m.query_start_loc[s]), int(m.query_start_loc[s + 1])
        length = int(m.seq_lens[s])
        _, sk = (reference.gather_context(p, m.block_tables[s], length) for p in (int8.kv_cache[0], int8.kv_scales[0]))
        sv = reference.gather_context(int8.kv_scales[1], m.block_tables[s], length)
        values = reference.gather_context(dequantize_kv(int8.kv_cache[1], int8.kv_scales[1]), m.block_tables[s], length)
        for h in range(4):
            kv_head = h // group
            delta = case.scale * case.q[a:b, h].abs().sum(-1) * float(sk[:, kv_head].max()) / 2  # [n]
            bound = ((torch.exp(2 * delta) - 1) * float(values[:, kv_head].abs().max())
                     + float(sv[:, kv_head].max()) / 2)
            err = (got[a:b, h] - exact[a:b, h]).abs().amax(-1)
            assert bool((err <= bound * 1.001 + 1e-6).all()), (s, h, err, bound)
            assert float(err.max()) > 0  # the KV really was quantised


def test_opcheck_and_the_float_op_unchanged():
    force("cpu")
    case = make_case([(3, 2), (5, 1)], block_size=4, num_heads=4, num_kv_heads=2, head_dim=8).int8_kv()
    torch.library.opcheck(torch.ops.trtforge.paged_attention_int8kv.default, case.op_args())
    with pytest.raises(ValueError, match="int8 kv_cache"):
        torch.ops.trtforge.paged_attention_int8kv(*make_case([(3, 2)], block_size=4).op_args(),
                                                  torch.zeros(2, 1, 4, 2))


def test_triton_impl_refuses_int8_kv():
    force("triton")
    case = make_case([(3, 1)], block_size=4).int8_kv()
    with pytest.raises(RuntimeError, match="int8 KV"):
        torch.ops.trtforge.paged_attention_int8kv(*case.op_args())


def test_kv_bytes_per_token_counts_int8_and_scales():
    """int8 KV costs D bytes + one float32 scale per token, head and K/V: vs float32 4D/(D+4)
    (3.76x at D=64, 3.88x at D=128), vs bfloat16/float16 2D/(D+4) (1.88x, 1.94x)."""
    from types import SimpleNamespace

    from trtforge.models.kv_sizing import kv_bytes_per_token

    for d in (64, 128):
        cfg = SimpleNamespace(num_layers=24, num_kv_heads=2, head_dim=d)
        assert kv_bytes_per_token(cfg, "float32", "int8") == 2 * 24 * 2 * (d + 4)
        assert kv_bytes_per_token(cfg, "float32") == kv_bytes_per_token(cfg, "float32", "auto") == 2 * 24 * 2 * d * 4
        ratio_fp32 = kv_bytes_per_token(cfg, "float32") / kv_bytes_per_token(cfg, "float32", "int8")
        ratio_bf16 = kv_bytes_per_token(cfg, "bfloat16") / kv_bytes_per_token(cfg, "bfloat16", "int8")
        assert math.isclose(ratio_fp32, 4 * d / (d + 4)) and math.isclose(ratio_bf16, 2 * d / (d + 4))


def test_cpu_workspace_cleared_between_dtypes():
    """A float step after an int8 one (and back) on the same thread: scratch buffers keyed apart."""
    cpu.clear_workspace()
    case = make_case(SCENARIOS["mixed"], block_size=16, num_heads=4, num_kv_heads=2)
    for c in (case.clone().int8_kv(), case.clone(), case.clone().int8_kv()):
        expected = reference.paged_attention(*c.clone().op_args())
        torch.testing.assert_close(cpu.paged_attention(*c.op_args()), expected, **FP32_TOL)
