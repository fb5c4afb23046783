"""The network's fused float32 CPU kernels (plugins/cpu/fused.c) against their torch references,
when they run and when they must not, and the whole network with and without them."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.helpers.checkpoints import make_variant
from trtforge.models.rope import apply_rotary
from trtforge.plugins.cpu import fused as cpu_fused

EXACTISH = dict(atol=2e-6, rtol=2e-6)  # float32, another summation order


@pytest.fixture(autouse=True)
def _inference():
    with torch.inference_mode():
        yield


def test_kernels_build_here():
    """Where a compiler exists the kernels must build: a silent fallback would hide a broken build."""
    assert cpu_fused.library() is not None


@pytest.mark.parametrize("rows,dim", [(1, 896), (3, 64), (17, 8)])
@pytest.mark.usefixtures("each_isa")
def test_rms_norm(rows, dim):
    g = torch.Generator().manual_seed(rows)
    x, w = torch.randn(rows, dim, generator=g), torch.randn(dim, generator=g)
    out, same = cpu_fused.rms_norm(x, w, 1e-6)
    assert same is x
    torch.testing.assert_close(out, F.rms_norm(x, (dim,), w, 1e-6), **EXACTISH)


@pytest.mark.usefixtures("each_isa")
def test_rms_norm_adds_the_residual_in_place():
    g = torch.Generator().manual_seed(0)
    x, residual, w = torch.randn(5, 64, generator=g), torch.randn(5, 64, generator=g), torch.randn(64, generator=g)
    expected_sum = x + residual
    buffer = residual
    out, new_residual = cpu_fused.rms_norm(x, w, 1e-5, residual)
    assert new_residual is buffer
    assert torch.equal(new_residual, expected_sum)  # the same float32 additions, bit for bit
    torch.testing.assert_close(out, F.rms_norm(expected_sum, (64,), w, 1e-5), **EXACTISH)


@pytest.mark.usefixtures("each_isa")
def test_silu_mul_including_extreme_gates():
    g = torch.Generator().manual_seed(1)
    gate_up = torch.randn(3, 2 * 40, generator=g) * 4
    gate_up[0, :6] = torch.tensor([-200.0, -88.0, -20.0, 0.0, 20.0, 200.0])
    gate, up = gate_up.chunk(2, dim=-1)
    out = cpu_fused.silu_mul(gate_up)
    torch.testing.assert_close(out, F.silu(gate) * up, atol=1e-6, rtol=1e-6)
    gate_up[1, 0] = float("nan")
    assert cpu_fused.silu_mul(gate_up)[1, 0].isnan(), "a NaN must not be hidden"


@pytest.mark.parametrize("head_dim", [16, 64, 24])
@pytest.mark.usefixtures("each_isa")
def test_rope_rotates_only_the_given_heads(head_dim):
    g = torch.Generator().manual_seed(head_dim)
    tokens, hq, hkv = 4, 6, 2
    qkv = torch.randn(tokens, hq + 2 * hkv, head_dim, generator=g)
    angles = torch.randn(tokens, 1, head_dim // 2, generator=g)
    cos, sin = torch.cat((angles, angles), -1).cos() * 1.1, torch.cat((angles, angles), -1).sin() * 1.1
    expected = apply_rotary(qkv[:, :hq + hkv], cos, sin)
    v_before = qkv[:, hq + hkv:].clone()
    assert cpu_fused.rope_heads_(qkv, cos, sin, hq + hkv)
    torch.testing.assert_close(qkv[:, :hq + hkv], expected, **EXACTISH)
    assert torch.equal(qkv[:, hq + hkv:], v_before)


@pytest.mark.usefixtures("each_isa")
def test_big_batches_split_over_threads_and_row_tails():
    """64 rows (a 64-sequence decode step: the kernels split the rows over the threads) and rows of
    an odd number of 8 floats (the AVX-512 build's last 8-float step), against the references."""
    g = torch.Generator().manual_seed(7)
    for rows, dim in ((64, 896), (64, 1000), (40, 24)):
        x, residual, w = (torch.randn(rows, dim, generator=g), torch.randn(rows, dim, generator=g),
                          torch.randn(dim, generator=g))
        expected_sum = x + residual
        out, new_residual = cpu_fused.rms_norm(x, w, 1e-6, residual)
        assert torch.equal(new_residual, expected_sum)
        torch.testing.assert_close(out, F.rms_norm(expected_sum, (dim,), w, 1e-6), **EXACTISH)
        gate_up = torch.randn(rows, 2 * dim, generator=g) * 4
        gate, up = gate_up.chunk(2, dim=-1)
        torch.testing.assert_close(cpu_fused.silu_mul(gate_up), F.silu(gate) * up, atol=1e-6, rtol=1e-6)
    qkv = torch.randn(64, 18, 80, generator=g)  # half = 40: a 16-float step (AVX-512) or 8s, then 8
    angles = torch.randn(64, 1, 40, generator=g)
    cos, sin = torch.cat((angles, angles), -1).cos(), torch.cat((angles, angles), -1).sin()
    expected = apply_rotary(qkv[:, :16], cos, sin)
    assert cpu_fused.rope_heads_(qkv, cos, sin, 16)
    torch.testing.assert_close(qkv[:, :16], expected, **EXACTISH)


def test_kernels_stand_aside_outside_plain_float32_inference():
    x = torch.randn(2, 64)
    assert cpu_fused.native_ok(x)
    assert not cpu_fused.native_ok(x.to(torch.bfloat16))
    assert not cpu_fused.native_ok(torch.randn(64, 2).t())  # not contiguous
    assert not cpu_fused.native_ok(torch.randn(2, 12))  # last dim not a multiple of 8
    with torch.inference_mode(False), torch.enable_grad():
        assert not cpu_fused.native_ok(torch.randn(2, 64))  # autograd would not see the C code
        w = torch.randn(64)
        assert cpu_fused.rms_norm(torch.randn(2, 64), w, 1e-6) is None
        assert not cpu_fused.rope_heads_(torch.randn(1, 3, 64), torch.ones(1, 1, 64), torch.zeros(1, 1, 64), 2)


def test_network_with_and_without_the_kernels(tmp_path, monkeypatch):
    """A whole engine (fused norms, RoPE, SiLU·mul and the C decode attention) against the same
    engine on the torch references: same greedy tokens, logprobs within float32 rounding."""
    from trtforge.builder.build import build_engine
    from trtforge.builder.build_config import BuildConfig
    from trtforge.config.sampling import SamplingParams
    from trtforge.plugins.paged_attention import cpu_native
    from trtforge.serving.engine import LLMEngine

    ckpt = make_variant(tmp_path / "ckpt", "qwen2-gqa-bias-tied")
    out, _ = build_engine(str(ckpt), tmp_path / "engine", BuildConfig(dtype="float32", kv_cache_memory="8MiB"),
                          progress=False)
    prompts = [[5, 9, 13, 200, 7], list(range(20, 57))]
    params = SamplingParams(max_tokens=24, logprobs=0, ignore_eos=True)

    def run():
        engine = LLMEngine.from_engine_dir(out)
        return engine.generate(prompts, params)

    calls = {"fused": 0, "attention": 0}
    lib, attn = cpu_fused.library(), cpu_native.library()
    assert attn is not None

    class Counting:
        def __init__(self, inner, key):
            self.inner, self.key = inner, key

        def __getattr__(self, name):
            calls[self.key] += 1
            return getattr(self.inner, name)

    monkeypatch.setattr(cpu_fused.LIBRARY, "lib", Counting(lib, "fused"))
    monkeypatch.setattr(cpu_native.LIBRARY, "lib", Counting(attn, "attention"))
    fused = run()
    assert calls["fused"] > 0 and calls["attention"] > 0, "the engine did not use the kernels"
    monkeypatch.setattr(cpu_fused.LIBRARY, "lib", None)
    monkeypatch.setattr(cpu_native.LIBRARY, "lib", None)
    plain = run()
    for a, b in zip(fused, plain):
        assert a.output_token_ids == b.output_token_ids
        assert a.cum_logprob == pytest.approx(b.cum_logprob, abs=1e-4)
