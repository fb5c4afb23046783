"""The Triton paged-attention kernels against the plain-PyTorch reference.

Without a GPU the kernels run on CPU tensors in Triton's interpreter ("interpreter" variants:
tiny shapes, it is slow); on a CUDA machine the same tests run compiled on the GPU ("cuda"
variants: larger shapes, bf16 included). `TRITON_INTERPRET` must be set before `@triton.jit`
decorates the kernels, which `triton_kernels` does itself when there is no CUDA.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from trtforge.plugins.paged_attention import reference, triton_kernels as tk
from trtforge.plugins.paged_attention.testing import make_case

INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"
DEVICES = [
    pytest.param("cpu", id="interpreter", marks=pytest.mark.skipif(
        not INTERPRETED, reason="kernels are compiled for the GPU here (CUDA present, "
                                "TRITON_INTERPRET unset); the cuda variants cover them")),
    pytest.param("cuda", id="cuda", marks=pytest.mark.skipif(
        not torch.cuda.is_available(), reason="needs a CUDA GPU")),
]
# Tolerances vs the fp32 reference on the same (upcast) inputs. fp32 dots run in IEEE mode; the
# 16-bit ones round the probabilities to the input dtype before P@V (as flash attention does).
# A wrong position, head or mask costs errors of order 1, far above these.
TOL = {torch.float32: dict(atol=2e-5, rtol=2e-5), torch.float16: dict(atol=3e-3, rtol=3e-3),
       torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}

# (cached_len, new_len) per sequence; lengths start, end and cross 16/32-token blocks.
SMALL = {
    "prefill": [(0, 7), (0, 19)],
    "chunked": [(10, 6), (33, 17)],
    "decode": [(5, 1), (16, 1), (31, 1), (47, 1)],
    "mixed": [(0, 9), (20, 1), (13, 5), (40, 1)],
}
# GPU variants: long enough for many KV tiles and splits, several query blocks per sequence.
LARGE = {
    "prefill": [(0, 300), (0, 17), (0, 1)],
    "chunked": [(512, 128), (1000, 77), (31, 200)],
    "decode": [(c, 1) for c in (1, 15, 16, 255, 1000, 2047, 4095)],
    "mixed": [(0, 129), (2000, 1), (700, 64), (33, 1), (0, 1), (4000, 1)],
}


def _scenarios(device: str) -> dict:
    return SMALL if device == "cpu" else LARGE


def check_against_reference(case, num_kv_splits=None, tol=None):
    """Run the kernels and the reference on copies of `case`; compare outputs and pools."""
    ours, theirs = case.clone(), case.clone()
    m = ours.meta
    out = tk.paged_attention_triton(*ours.op_args(), m.max_query_len, m.max_seq_len,
                                    num_kv_splits=num_kv_splits)
    ref_args = [t.cpu() if isinstance(t, torch.Tensor) else t for t in theirs.op_args()]
    expected = reference.paged_attention(*ref_args)
    tol = tol or TOL[case.q.dtype]
    torch.testing.assert_close(out.cpu().float(), expected.float(), **tol)
    assert torch.equal(ours.kv_cache.cpu(), ref_args[3]), "KV pool differs after the write"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("scenario", ["prefill", "chunked", "decode", "mixed"])
def test_scenarios(device, scenario):
    case = make_case(_scenarios(device)[scenario], block_size=16, num_heads=4, num_kv_heads=2,
                     head_dim=16 if device == "cpu" else 128, device=device, seed=1)
    check_against_reference(case)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (4, 2), (8, 2), (8, 1), (14, 2)])
def test_gqa_groups(device, num_heads, num_kv_heads):
    """G = 1, 2, 4, 8 and Qwen2-0.5B's 7 (not a power of two: tile rows are partly idle)."""
    case = make_case(_scenarios(device)["mixed"], block_size=16, num_heads=num_heads,
                     num_kv_heads=num_kv_heads, head_dim=16 if device == "cpu" else 64,
                     device=device, seed=2)
    check_against_reference(case)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("head_dim,block_size", [(64, 32), (128, 16), (80, 1)])
def test_head_dims_and_block_sizes(device, head_dim, block_size):
    """D = 80 is padded to 128 inside the kernel; block size 1 puts every position in its own
    block (the block table is read per position, so any block size works)."""
    seqs = [(0, 5), (19, 1), (3, 4)] if device == "cpu" else _scenarios(device)["mixed"]
    case = make_case(seqs, block_size=block_size, num_heads=4, num_kv_heads=2,
                     head_dim=head_dim, device=device, seed=3)
    check_against_reference(case)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision(device, dtype):
    case = make_case(_scenarios(device)["mixed"], block_size=16, num_heads=8, num_kv_heads=2,
                     head_dim=32 if device == "cpu" else 128, dtype=dtype, device=device, seed=4)
    check_against_reference(case)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("scenario,num_kv_splits", [("decode", 4), ("decode", 0), ("mixed", 2)])
def test_split_kv(device, scenario, num_kv_splits):
    """Partitioned context + combine kernel. 0 stands for "many" (16 interpreted, 64 on the GPU):
    most splits of the short sequences are then empty (m = -inf, l = 0) and must weigh zero."""
    num_kv_splits = num_kv_splits or (16 if device == "cpu" else 64)
    case = make_case(_scenarios(device)[scenario], block_size=16, num_heads=8, num_kv_heads=2,
                     head_dim=16 if device == "cpu" else 128, device=device, seed=5)
    check_against_reference(case, num_kv_splits=num_kv_splits)


@pytest.mark.parametrize("device", DEVICES)
def test_default_split_heuristic_long_decode(device):
    """num_kv_splits=None: on the GPU a small long-context decode batch takes the split path."""
    seqs = [(40, 1), (70, 1)] if device == "cpu" else [(16000, 1), (9000, 1)]
    case = make_case(seqs, block_size=16, num_heads=8, num_kv_heads=1,
                     head_dim=16 if device == "cpu" else 128, dtype=torch.float32,
                     device=device, seed=6)
    check_against_reference(case)
    if device == "cuda":
        assert tk._default_num_splits(case.q, 2 * 1, 16001, 32) > 1


@pytest.mark.parametrize("device", DEVICES)
def test_write_kv_cache_strided_inputs_and_padding_slots(device):
    """k/v sliced out of a fused QKV row (row stride > Hkv*D) land at their slots; a negative
    slot (padding token) writes nothing; every other slot is untouched."""
    num_tokens, num_kv_heads, head_dim, block_size = 6, 2, 16, 4
    gen = torch.Generator().manual_seed(7)
    qkv = torch.randn(num_tokens, 3 * num_kv_heads * head_dim, generator=gen).to(device)
    k = qkv[:, num_kv_heads * head_dim:2 * num_kv_heads * head_dim].view(num_tokens,
                                                                         num_kv_heads, head_dim)
    v = qkv[:, 2 * num_kv_heads * head_dim:].view(num_tokens, num_kv_heads, head_dim)
    cache = torch.randn(2, 5, block_size, num_kv_heads, head_dim, generator=gen).to(device)
    slots = torch.tensor([17, 3, -1, 8, 19, 0], device=device)
    expected = cache.clone()
    keep = slots >= 0
    reference.write_kv(expected, k[keep], v[keep], slots[keep])
    tk.write_kv_cache(k, v, cache, slots)
    assert torch.equal(cache, expected)


def test_inputs_that_break_the_contract_explain_themselves():
    case = make_case([(3, 2)], block_size=4, num_heads=4, num_kv_heads=2, head_dim=16)
    m = case.meta
    with pytest.raises(ValueError, match="share one dtype.*kv_cache torch.float16"):
        tk.paged_attention_triton(*case.op_args()[:3], case.kv_cache.half(), *case.op_args()[4:],
                                  m.max_query_len, m.max_seq_len)
    with pytest.raises(ValueError, match=r"Hq a multiple of Hkv"):
        tk.paged_attention_triton(case.q[:, :3], *case.op_args()[1:], m.max_query_len,
                                  m.max_seq_len)
    with pytest.raises(ValueError, match="num_kv_splits must be >= 1 .*got 0"):
        tk.paged_attention_triton(*case.op_args(), m.max_query_len, m.max_seq_len,
                                  num_kv_splits=0)


def test_kernels_compile_for_h200():
    """Compile every kernel variant to sm_90 cubin with triton's bundled ptxas (no GPU needed):
    catches compiler-only errors that the interpreter never sees. Own process, because the
    kernels must be decorated without TRITON_INTERPRET."""
    script = Path(__file__).resolve().parents[2] / "scripts" / "gpu" / "compile_kernels.py"
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("ok  ") == 6, proc.stdout


@pytest.mark.skipif(not INTERPRETED, reason="interpreter only: with CUDA the kernels are compiled")
def test_interpreter_works_when_triton_was_imported_first():
    """torch._dynamo imports triton before our module can set TRITON_INTERPRET, so triton's own
    @jit library helpers end up compiled; the kernels must not depend on any of them."""
    code = (
        "import os, torch, torch._dynamo, sys\n"
        "assert 'triton' in sys.modules and 'TRITON_INTERPRET' not in os.environ\n"
        "from trtforge.plugins.paged_attention import reference, triton_kernels as tk\n"
        "from trtforge.plugins.paged_attention.testing import make_case\n"
        "c = make_case([(20, 3), (9, 1)])\n"
        "a, b = c.clone(), c.clone()\n"
        "out = tk.paged_attention_triton(*a.op_args(), 3, 21, num_kv_splits=2)\n"
        "torch.testing.assert_close(out, reference.paged_attention(*b.op_args()))\n")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
