"""The paged-KV attention op: implementations vs the reference, the reference vs dense attention,
the KV write, the op registration (opcheck) and implementation selection."""

from __future__ import annotations

import contextlib
import math
import os
import subprocess
import sys

import pytest
import torch

import trtforge.plugins.paged_attention as pa
from trtforge.plugins import kernels
from trtforge.plugins.paged_attention import cpu, cpu_native, op, reference
from trtforge.plugins.paged_attention.testing import make_case

# (cached_len, new_len) per sequence. Lengths are chosen to start, end and cross block
# boundaries for block sizes 1, 16 and 32.
SCENARIOS = {
    "prefill": [(0, 37), (0, 5), (0, 1), (0, 16)],
    "chunked_prefill": [(16, 21), (40, 7), (5, 33)],
    "decode": [(15, 1), (16, 1), (31, 1), (47, 1), (0, 1), (2, 1)],
    "decode_one": [(40, 1)],  # batch-1 decode: the CPU path trims padding instead of masking it
    "mixed": [(0, 13), (33, 1), (20, 12), (7, 1), (0, 1), (64, 5), (31, 1)],
}
FP32_TOL = dict(atol=1e-5, rtol=1e-5)
# bf16 inputs vs the fp32 reference on the same (upcast) inputs: bf16 keeps 8 mantissa bits, so
# the output's own rounding is ~4e-3 relative; SDPA may also round probabilities to bf16 before
# the P@V product. 2e-2 covers both and still catches any wrong position or head (errors ~1).
BF16_TOL = dict(atol=2e-2, rtol=2e-2)


@pytest.fixture
def torch_decode(monkeypatch):
    """Send pure-decode steps down the torch SDPA path instead of the C kernel (cpu_native)."""
    monkeypatch.setattr(cpu_native, "MAX_CONTEXT_TOKENS", -1)


_forced = contextlib.ExitStack()


def force(impl: str) -> None:
    """Force the attention implementation for the rest of the test (kernels.override, undone by _default_impl)."""
    _forced.enter_context(kernels.override(attention=impl))


@pytest.fixture(autouse=True)
def _default_impl(monkeypatch):
    monkeypatch.delenv(op.ENV_VAR, raising=False)
    yield
    _forced.close()


def run_op(case, impl: str) -> torch.Tensor:
    """Run the registered op with implementation `impl` on the case (mutates case.kv_cache)."""
    force(impl)
    return torch.ops.trtforge.paged_attention(*case.op_args())


def context_from_pool(case, s: int, pool_index: int) -> torch.Tensor:
    """Sequence s's cache positions 0..seq_len-1 read by slot arithmetic: [L, Hkv, D]."""
    pool = case.kv_cache[pool_index].flatten(0, 1)  # [num_blocks * bs, Hkv, D]
    bs = case.kv_cache.shape[2]
    seq_len = int(case.meta.seq_lens[s])
    table = case.meta.block_tables[s].long()
    positions = torch.arange(seq_len)
    return pool[table[positions // bs] * bs + positions % bs]


def dense_causal_attention(q, keys, values, first_pos: int, scale: float, softcap: float = 0.0) -> torch.Tensor:
    """Textbook attention, one head at a time: q [n, Hq, D] at positions first_pos.., keys/values
    [L, Hkv, D] -> [n, Hq, D], float64 so it is well below every tolerance used here. softcap > 0:
    scores capped as Gemma 2 does (softcap * tanh(s / softcap))."""
    n, num_heads, _ = q.shape
    group = num_heads // keys.shape[1]
    q, keys, values = q.double(), keys.double(), values.double()
    out = torch.empty(q.shape, dtype=torch.float64)
    causal = torch.ones(n, keys.shape[0]).tril(diagonal=first_pos).bool()
    for h in range(num_heads):
        scores = (q[:, h] @ keys[:, h // group].T) * scale
        if softcap:
            scores = softcap * torch.tanh(scores / softcap)
        scores[~causal] = -math.inf
        weights = scores.exp() / scores.exp().sum(-1, keepdim=True)
        out[:, h] = weights @ values[:, h // group]
    return out


@pytest.mark.parametrize("cached,new", [(0, 23), (19, 6)])
def test_reference_matches_dense_attention(cached, new):
    """The oracle is checked against textbook attention, not only against itself."""
    case = make_case([(cached, new)], block_size=4, num_heads=6, num_kv_heads=2, seed=3)
    q, k, v = case.q, case.k, case.v
    keys = torch.cat([context_from_pool(case, 0, 0)[:cached], k])
    values = torch.cat([context_from_pool(case, 0, 1)[:cached], v])
    expected = dense_causal_attention(q, keys, values, cached, case.scale)
    got = reference.paged_attention(*case.op_args())
    torch.testing.assert_close(got.double(), expected, **FP32_TOL)


@pytest.mark.parametrize("impl", ["cpu", "auto"])
@pytest.mark.parametrize("block_size", [1, 16, 32])
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_op_matches_reference(scenario, block_size, impl):
    case = make_case(SCENARIOS[scenario], block_size=block_size, num_heads=4, num_kv_heads=2)
    expected = reference.paged_attention(*case.clone().op_args())
    torch.testing.assert_close(run_op(case, impl), expected, **FP32_TOL)


@pytest.mark.parametrize("ratio", [1, 2, 4, 8])
@pytest.mark.parametrize("scenario", ["mixed", "decode"])
def test_gqa_ratios(scenario, ratio):
    case = make_case(SCENARIOS[scenario], block_size=16, num_heads=2 * ratio, num_kv_heads=2,
                     seed=ratio)
    expected = reference.paged_attention(*case.clone().op_args())
    torch.testing.assert_close(run_op(case, "cpu"), expected, **FP32_TOL)


@pytest.mark.parametrize("impl", ["reference", "cpu"])
def test_writes_exactly_the_new_slots(impl):
    case = make_case(SCENARIOS["mixed"], block_size=16, spare_blocks=4)
    before = case.kv_cache.clone()
    run_op(case, impl)
    after_flat = case.kv_cache.flatten(1, 2)  # [2, slots, Hkv, D]
    slots = case.meta.slot_mapping
    torch.testing.assert_close(after_flat[0, slots], case.k, atol=0, rtol=0)
    torch.testing.assert_close(after_flat[1, slots], case.v, atol=0, rtol=0)
    untouched = torch.ones(after_flat.shape[1], dtype=torch.bool)
    untouched[slots] = False
    assert torch.equal(after_flat[:, untouched], before.flatten(1, 2)[:, untouched])


@pytest.mark.parametrize("scenario", ["mixed", "chunked_prefill"])
def test_bf16_against_fp32_reference(scenario):
    case = make_case(SCENARIOS[scenario], block_size=16, num_heads=8, num_kv_heads=2,
                     dtype=torch.bfloat16, seed=7)
    expected = reference.paged_attention(*case.clone().to(dtype=torch.float32).op_args())
    got = run_op(case, "cpu")
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), expected, **BF16_TOL)


def test_strided_qkv_from_fused_projection():
    """q/k/v as views into one fused qkv activation, the way the model produces them."""
    case = make_case(SCENARIOS["mixed"], block_size=16, num_heads=4, num_kv_heads=2)
    expected = reference.paged_attention(*case.clone().op_args())
    num_tokens, head_dim = case.q.shape[0], case.q.shape[2]
    qkv = torch.cat([case.q, case.k, case.v], dim=1)  # [T, Hq + 2 Hkv, D]
    case.q, case.k, case.v = qkv[:, :4], qkv[:, 4:6], qkv[:, 6:8]
    assert not case.q.is_contiguous() and case.q.shape == (num_tokens, 4, head_dim)
    torch.testing.assert_close(run_op(case, "cpu"), expected, **FP32_TOL)


def test_wrapper_takes_metadata():
    case = make_case(SCENARIOS["mixed"], block_size=16)
    expected = reference.paged_attention(*case.clone().op_args())
    got = pa.paged_attention(case.q, case.k, case.v, case.kv_cache, case.meta, case.scale)
    torch.testing.assert_close(got, expected, **FP32_TOL)


@pytest.mark.parametrize("impl", ["reference", "cpu"])
def test_opcheck(impl):
    """Validates the schema (mutation of kv_cache only), the fake impl and tracing support."""
    force(impl)
    case = make_case([(3, 2), (5, 1)], block_size=4, num_heads=4, num_kv_heads=2, head_dim=8)
    torch.library.opcheck(torch.ops.trtforge.paged_attention.default, case.op_args())


def test_impl_selection(monkeypatch):
    assert op.resolve_impl(torch.device("cpu")) is cpu.paged_attention
    monkeypatch.setenv(op.ENV_VAR, "reference")
    assert op.resolve_impl(torch.device("cpu")) is reference.paged_attention
    force("cpu")  # the explicit choice beats the environment
    assert op.resolve_impl(torch.device("cpu")) is cpu.paged_attention
    # auto on CUDA: the Triton kernels if they import, else the torch path; never an error.
    force("auto")
    assert op.resolve_impl(torch.device("cuda")) in (op._triton_impl, cpu.paged_attention)


def test_bad_impl_names_explain_themselves(monkeypatch):
    with pytest.raises(ValueError, match="'fast'.*choose one of"):
        force("fast")
    monkeypatch.setenv(op.ENV_VAR, "cuda")
    with pytest.raises(ValueError, match="TRTFORGE_ATTENTION_IMPL='cuda'"):
        op.resolve_impl(torch.device("cpu"))


def test_bad_shapes_explain_themselves():
    case = make_case([(3, 2)], block_size=4, num_heads=4, num_kv_heads=2, head_dim=8)
    case.k = case.k[:, :1]
    with pytest.raises(ValueError, match=r"k must be \[T=2, Hkv=2, D=8\].*got \[2, 1, 8\]"):
        run_op(case, "cpu")


def test_cpu_path_refuses_kv_cache_of_another_dtype():
    case = make_case([(3, 2)], block_size=4, num_heads=4, num_kv_heads=2, head_dim=8)
    case.kv_cache = case.kv_cache.to(torch.bfloat16)
    with pytest.raises(ValueError, match="kv_cache torch.bfloat16 and q torch.float32"):
        run_op(case, "cpu")


TRITON_THROUGH_OP = """
import torch
from trtforge.plugins import kernels
from trtforge.plugins.paged_attention import reference
from trtforge.plugins.paged_attention.testing import make_case
case = make_case([(5, 3), (9, 1), (0, 6)], block_size=4, num_heads=4, num_kv_heads=2)
expected = reference.paged_attention(*case.clone().op_args())
with kernels.override(attention="triton"):
    got = torch.ops.trtforge.paged_attention(*case.op_args())
torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
"""


def test_triton_impl_through_the_op():
    """The op's adapter to the Triton kernels, interpreted on CPU when there is no GPU.

    Runs in a fresh interpreter with TRITON_INTERPRET=1 from the start: the interpreter flag must
    be set before anything imports `triton`, and calling a custom op imports torch._dynamo, which
    imports triton (a default set later inside triton_kernels is then too late).
    """
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    env.pop(op.ENV_VAR, None)
    proc = subprocess.run([sys.executable, "-c", TRITON_THROUGH_OP], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]


class _Attend(torch.nn.Module):
    def forward(self, q, k, v, kv_cache, slot_mapping, block_tables, seq_lens, query_start_loc):
        return torch.ops.trtforge.paged_attention(q, k, v, kv_cache, slot_mapping, block_tables,
                                                  seq_lens, query_start_loc, 0.25)


def test_torch_export_with_dynamic_batch():
    """The op exports as one node with dynamic token/sequence counts and runs another batch."""
    force("cpu")
    small = make_case([(3, 2), (5, 1)], block_size=4, spare_blocks=3)
    tokens, seqs = torch.export.Dim("tokens", max=4096), torch.export.Dim("seqs", max=256)
    width = torch.export.Dim("width", max=4096)
    dynamic = ({0: tokens}, {0: tokens}, {0: tokens}, None, {0: tokens},
               {0: seqs, 1: width}, {0: seqs}, {0: seqs + 1})
    program = torch.export.export(_Attend(), small.op_args()[:-1], dynamic_shapes=dynamic)
    targets = [n.target for n in program.graph.nodes if n.op == "call_function"]
    assert targets == [torch.ops.trtforge.paged_attention.default]
    # Same pool size (7 blocks), different batch: 3 sequences, 11 tokens, wider block table.
    other = make_case([(0, 7), (9, 1), (2, 3)], block_size=4, spare_blocks=0, seed=5)
    expected = reference.paged_attention(*other.clone().op_args()[:-1], 0.25)
    got = program.module()(*other.op_args()[:-1])
    torch.testing.assert_close(got, expected, **FP32_TOL)


def test_cpu_path_works_inside_then_outside_inference_mode():
    """Scratch buffers first allocated under inference_mode must not break a later plain call."""
    from trtforge.plugins.paged_attention import cpu
    from trtforge.plugins.paged_attention.testing import make_case

    case = make_case([(20, 1), (5, 1)], block_size=16, num_heads=4, num_kv_heads=2, head_dim=16,
                     dtype=torch.float32, device="cpu")
    cpu.clear_workspace()
    with torch.inference_mode():
        inside = cpu.paged_attention(*case.clone().op_args())
    with torch.no_grad():
        outside = cpu.paged_attention(*case.clone().op_args())
    torch.testing.assert_close(inside, outside)


def test_cpu_decode_mask_follows_lengths_not_shapes(torch_decode):
    """The CPU path keeps the last decode padding mask per thread (every layer of a step asks for
    the same one): two steps with the same shapes but different lengths must each get theirs."""
    cpu.clear_workspace()
    for seqs in ([(15, 1), (40, 1)], [(40, 1), (15, 1)], [(15, 1), (40, 1)]):
        case = make_case(seqs, block_size=16, num_heads=4, num_kv_heads=2, seed=len(seqs))
        expected = reference.paged_attention(*case.clone().op_args())
        with torch.inference_mode():
            got = cpu.paged_attention(*case.clone().op_args())
        torch.testing.assert_close(got, expected, **FP32_TOL)


@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("scenario", ["decode", "decode_one"])
def test_torch_decode_path_matches_reference(scenario, block_size, torch_decode):
    """The SDPA decode path stays right for what the C kernel does not take (bf16, long batches)."""
    case = make_case(SCENARIOS[scenario], block_size=block_size, num_heads=6, num_kv_heads=2, seed=3)
    expected = reference.paged_attention(*case.clone().op_args())
    torch.testing.assert_close(cpu.paged_attention(*case.op_args()), expected, **FP32_TOL)


# 8, 24, 40, 136: the AVX-512 build's last vector is a half one; 64, 80, 136: one or two tiles of four
# vectors and a remainder of 0-3 (every specialisation of the value tiles).
@pytest.mark.parametrize("head_dim", [8, 24, 40, 64, 80, 136])
@pytest.mark.parametrize("group", [1, 2, 7])
@pytest.mark.parametrize("block_size", [1, 16, 32])
@pytest.mark.usefixtures("each_isa")
def test_native_decode_matches_reference(block_size, group, head_dim):
    """The C decode kernel: outputs vs the reference, and the pool written bit for bit alike.
    Context lengths cross blocks, end mid-way through the kernel's groups of 8 or 16 positions and
    come in no order (the kernel takes the longest first and must put each output back)."""
    seqs = [(15, 1), (16, 1), (31, 1), (47, 1), (0, 1), (2, 1), (66, 1)]
    case = make_case(seqs, block_size=block_size, num_heads=2 * group, num_kv_heads=2,
                     head_dim=head_dim, seed=group)
    ref_case = case.clone()
    expected = reference.paged_attention(*ref_case.op_args())
    args = case.op_args()
    assert cpu_native.applies(*args[:7], case.meta.seq_lens.tolist())
    torch.testing.assert_close(cpu_native.decode(*args[:7], case.scale), expected, **FP32_TOL)
    assert torch.equal(case.kv_cache, ref_case.kv_cache)


@pytest.mark.usefixtures("each_isa")
def test_native_decode_long_and_short_contexts():
    """One long context among short ones, more pairs than threads: every output where it belongs."""
    seqs = [(3, 1)] * 5 + [(700, 1)] + [(40, 1)] * 4 + [(1, 1)]
    case = make_case(seqs, block_size=16, num_heads=14, num_kv_heads=2, head_dim=64, seed=11)
    expected = reference.paged_attention(*case.clone().op_args())
    torch.testing.assert_close(cpu_native.decode(*case.op_args()[:7], case.scale), expected, **FP32_TOL)


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("num_seqs", [2, 5, 13])
@pytest.mark.usefixtures("each_isa")
def test_native_decode_work_items_of_pairs_and_of_whole_sequences(threads, num_seqs):
    """Few sequences: (sequence, KV head) pairs are the threads' work items; at least 4 sequences per
    thread: a sequence with all its KV heads (3 here, so a sequence's heads are not a pair). Both ways
    every output lands where the reference puts it."""
    seqs = [(5 + 37 * i % 90, 1) for i in range(num_seqs)]
    case = make_case(seqs, block_size=16, num_heads=6, num_kv_heads=3, head_dim=64, seed=num_seqs)
    expected = reference.paged_attention(*case.clone().op_args())
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = cpu_native.decode(*case.op_args()[:7], case.scale)
    finally:
        torch.set_num_threads(before)
    torch.testing.assert_close(got, expected, **FP32_TOL)


@pytest.mark.usefixtures("each_isa")
def test_native_decode_propagates_nan_to_its_head_only():
    """IEEE semantics: a NaN in one query head makes that head's output NaN (as the reference's)
    and leaves every other head of the batch as the reference computes it."""
    case = make_case([(30, 1), (17, 1)], block_size=16, num_heads=6, num_kv_heads=2, head_dim=64, seed=4)
    case.q[1, 4, 5] = float("nan")
    expected = reference.paged_attention(*case.clone().op_args())
    got = cpu_native.decode(*case.op_args()[:7], case.scale)
    assert got[1, 4].isnan().all() and expected[1, 4].isnan().all()
    keep = torch.ones(got.shape[:2], dtype=torch.bool)
    keep[1, 4] = False
    torch.testing.assert_close(got[keep], expected[keep], **FP32_TOL)


def test_native_decode_rejects_out_of_range_blocks_without_writing():
    case = make_case([(20, 1), (5, 1)], block_size=16, num_heads=4, num_kv_heads=2)
    case.meta.block_tables[1, 0] = case.kv_cache.shape[1]  # one past the pool
    before = case.kv_cache.clone()
    with pytest.raises(ValueError, match="out of range"):
        cpu_native.decode(*case.op_args()[:7], case.scale)
    assert torch.equal(case.kv_cache, before)


def test_native_decode_routing():
    """The kernel takes float32 CPU decode batches up to MAX_CONTEXT_TOKENS of context."""
    case = make_case([(40, 1), (9, 1)], block_size=16, num_heads=4, num_kv_heads=2)
    args, lens = case.op_args()[:7], case.meta.seq_lens.tolist()
    assert cpu_native.applies(*args, lens)
    assert not cpu_native.applies(*case.to(dtype=torch.bfloat16).op_args()[:7], lens)
    assert not cpu_native.applies(*args, [cpu_native.MAX_CONTEXT_TOKENS, 1])


def test_op_names_are_the_published_contract():
    """Exported graphs and TensorRT plans carry these names and docs/tensorrt.md publishes them:
    changing one orphans the engines already built, so it must be deliberate."""
    from trtforge.plugins.paged_attention import names

    assert (names.DOMAIN, names.DOMAIN_VERSION, names.OP_TYPE) == ("trtforge", 1, "PagedAttention")
    assert (names.PLUGIN_NAMESPACE, names.PLUGIN_VERSION) == ("trtforge", "1")
    assert names.QUALIFIED_NAME == "trtforge::PagedAttention"
    assert names.INPUT_NAMES == ("q", "k", "v", "kv_cache", "slot_mapping", "block_tables", "seq_lens",
                                 "query_start_loc")
    assert names.OUTPUT_NAMES == ("out", "kv_cache_out")


# ---- attention soft-capping (Gemma 2's attn_logit_softcapping): the `softcap` argument -------------------
SOFTCAP = 2.0  # small against these random scores (|s| up to ~4), so tanh bends them visibly


@pytest.mark.parametrize("cached,new", [(0, 23), (19, 6)])
def test_reference_softcap_matches_dense_attention(cached, new):
    case = make_case([(cached, new)], block_size=4, num_heads=6, num_kv_heads=2, seed=3)
    case.q = case.q * 3  # scores well past the cap
    keys = torch.cat([context_from_pool(case, 0, 0)[:cached], case.k])
    values = torch.cat([context_from_pool(case, 0, 1)[:cached], case.v])
    expected = dense_causal_attention(case.q, keys, values, cached, case.scale, SOFTCAP)
    got = reference.paged_attention(*case.op_args(), softcap=SOFTCAP)
    torch.testing.assert_close(got.double(), expected, **FP32_TOL)
    uncapped = dense_causal_attention(case.q, keys, values, cached, case.scale)
    assert (expected - uncapped).abs().max() > 0.1, "the cap must change the answer for this test to mean anything"


@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_cpu_softcap_matches_reference(scenario, block_size, torch_decode):
    """The torch path (decode batch, prompt, chunk after cached context), not the C kernel."""
    case = make_case(SCENARIOS[scenario], block_size=block_size, num_heads=6, num_kv_heads=2, seed=5)
    case.q = case.q * 3
    expected = reference.paged_attention(*case.clone().op_args(), softcap=SOFTCAP)
    torch.testing.assert_close(cpu.paged_attention(*case.op_args(), softcap=SOFTCAP), expected, **FP32_TOL)


@pytest.mark.parametrize("group", [1, 3])
@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.usefixtures("each_isa")
def test_native_decode_softcap_matches_reference(block_size, group):
    seqs = [(15, 1), (16, 1), (31, 1), (47, 1), (0, 1), (66, 1)]
    case = make_case(seqs, block_size=block_size, num_heads=2 * group, num_kv_heads=2, head_dim=24, seed=group)
    case.q = case.q * 3
    ref_case = case.clone()
    expected = reference.paged_attention(*ref_case.op_args(), softcap=SOFTCAP)
    args = case.op_args()
    assert cpu_native.applies(*args[:7], case.meta.seq_lens.tolist())
    torch.testing.assert_close(cpu_native.decode(*args[:7], case.scale, None, SOFTCAP), expected, **FP32_TOL)
    assert torch.equal(case.kv_cache, ref_case.kv_cache)


@pytest.mark.parametrize("scenario", ["mixed", "decode"])
def test_int8_kv_softcap_matches_reference(scenario):
    """Both int8 paths (the C kernel for the decode step, the torch path for the mixed one)."""
    case = make_case(SCENARIOS[scenario], block_size=16, num_heads=4, num_kv_heads=2, seed=9).int8_kv()
    case.q = case.q * 3
    expected = reference.paged_attention(*case.clone().op_args(), softcap=SOFTCAP)
    torch.testing.assert_close(cpu.paged_attention(*case.op_args(), softcap=SOFTCAP), expected, **FP32_TOL)


@pytest.mark.parametrize("impl", ["reference", "cpu"])
def test_op_takes_softcap(impl):
    """Through torch.ops (what traced graphs call), the schema's default left as it was, and opcheck."""
    case = make_case(SCENARIOS["mixed"], block_size=16, num_heads=4, num_kv_heads=2)
    expected = reference.paged_attention(*case.clone().op_args(), softcap=SOFTCAP)
    force(impl)
    torch.testing.assert_close(torch.ops.trtforge.paged_attention(*case.clone().op_args(), softcap=SOFTCAP),
                               expected, **FP32_TOL)
    meta = case.meta
    got = pa.paged_attention(case.q, case.k, case.v, case.kv_cache.clone(), meta, case.scale, softcap=SOFTCAP)
    torch.testing.assert_close(got, expected, **FP32_TOL)
    small = make_case([(3, 2), (5, 1)], block_size=4, num_heads=4, num_kv_heads=2, head_dim=8)
    torch.library.opcheck(torch.ops.trtforge.paged_attention.default, small.op_args(), {"softcap": SOFTCAP})
    assert "float softcap=0." in str(torch.ops.trtforge.paged_attention.default._schema)


def test_softcap_is_never_sent_to_triton():
    """Triton has no soft-capping: the auto preference falls through to the torch path, a request
    by name is refused (before importing anything), and the Triton adapter refuses it too."""
    cuda = torch.device("cuda")
    assert op.attention_impl(("triton", "cpu"), cuda, softcap=True).name == "cpu"
    with pytest.raises(RuntimeError, match="no score soft-capping"):
        op.attention_impl(("triton",), cuda, softcap=True)
    case = make_case([(3, 2)], block_size=4, num_heads=4, num_kv_heads=2, head_dim=8)
    with pytest.raises(RuntimeError, match="no score soft-capping"):
        op._triton_impl(*case.op_args(), softcap=SOFTCAP)
