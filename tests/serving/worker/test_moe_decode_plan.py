"""Mixture-of-Experts layers inside the CPU decode plan (serving/worker/cpu_decode_plan.py): a decode step of
Mixtral, Qwen2-MoE (shared expert, a dense layer, qkv bias, tied head) and Qwen3-MoE (q/k norms) gives the
network's logits up to float32 rounding and writes the same KV, in float32 and int8_wo, with the tokens of a
batch routed to different experts exactly as the network routes them; greedy tokens through the plan equal
transformers' own. Dense Qwen3 (q/k norms, no experts) runs the plan too."""

from __future__ import annotations

import pytest
import torch

from tests.builder.moe_checkpoints import make_moe_checkpoint
from tests.builder.test_moe import _assert_same_greedy, _hf
from tests.builder.test_parity import _prompts
from tests.helpers.checkpoints import make_variant
from tests.serving.worker.test_cpu_decode_plan import _compare_plan_with_network
from trtforge.builder.build import build_engine
from trtforge.builder.build_config import BuildConfig
from trtforge.config.sampling import SamplingParams
from trtforge.models.moe import SparseMoE, route
from trtforge.serving.engine import LLMEngine

pytestmark = pytest.mark.usefixtures("one_thread")

KV_ATOL = 1e-5
"""The KV written agrees to float32 rounding, not bit for bit: the plan's router exponentials (C expf), weighted
sum and q/k head norms round otherwise than torch's, and the K/V are computed from those hidden states."""

PLAN_SHAPES = {"qwen3_moe": {"head_dim": 24}}
"""The test checkpoints' Qwen3-MoE has head_dim 20; the plan's kernels take multiples of 8."""


def _engine(tmp_path, arch: str, quantization: str = "none", batch: int = 8) -> tuple[LLMEngine, object]:
    ckpt = make_moe_checkpoint(tmp_path / "ckpt", arch, **PLAN_SHAPES.get(arch, {}))
    out, _ = build_engine(str(ckpt), tmp_path / quantization,
                          BuildConfig(dtype="float32", max_batch_size=batch, max_num_tokens=256,
                                      kv_cache_memory="16MiB", quantization=quantization), progress=False)
    return LLMEngine.from_engine_dir(out), ckpt


def _generate(engine: LLMEngine, prompts: list[list[int]], tokens: int) -> None:
    """Generate; a failed assertion inside a step fails its requests (the engine's rule), so check them."""
    for out in engine.generate(prompts, SamplingParams(max_tokens=tokens, ignore_eos=True)):
        assert out.error is None and len(out.output_token_ids) == tokens, out.error


def _watch_routes(engine: LLMEngine, monkeypatch) -> list[torch.Tensor]:
    """After each step the plan ran (and the network beside it, `_compare_plan_with_network`), assert the plan's
    routing of the last MoE layer is the network's; returns the expert ids [tokens, k] of those steps."""
    ex = engine.executor
    moe = [layer.mlp for layer in ex.network.layers if isinstance(layer.mlp, SparseMoE)][-1]
    network_ids: list[torch.Tensor] = []
    moe.router.register_forward_hook(lambda _m, _a, logits: network_ids.append(route(logits, moe.top_k,
                                                                                     moe.normalize)[1]))
    seen = _compare_plan_with_network(engine, monkeypatch, kv_atol=KV_ATOL)
    compared, planned = ex.execute, []

    def step(inputs):
        network_ids.clear()
        ran = len(seen)
        out = compared(inputs)
        if len(seen) > ran:  # the plan ran this step: its last MoE layer's expert ids are in its buffer
            ids = ex.cpu_plan._buffers["moe_ids"][:inputs.num_tokens].clone()
            assert torch.equal(ids, network_ids[-1]), "the plan routed otherwise than the network"
            planned.append(ids)
        return out

    monkeypatch.setattr(ex, "execute", step)
    return planned


@pytest.mark.parametrize("quantization", ["none", "int8_wo"])
@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe", "qwen3_moe"])
def test_moe_plan_matches_the_network(tmp_path, monkeypatch, arch, quantization):
    engine, _ = _engine(tmp_path, arch, quantization)
    assert engine.executor.cpu_plan is not None, f"{arch} {quantization}: no decode plan"
    planned = _watch_routes(engine, monkeypatch)
    prompts = [[5, 9, 13, 200, 7], list(range(20, 57)), [3] * 16, [400, 11, 60]]
    _generate(engine, prompts[:1], 5)
    _generate(engine, prompts, 6)
    assert [len(ids) for ids in planned].count(1) >= 4 and [len(ids) for ids in planned].count(4) >= 4
    # the batch's tokens went to different experts, and over the steps most experts were chosen
    assert any(len({tuple(sorted(row)) for row in ids.tolist()}) > 1 for ids in planned)
    experts = len(engine.executor.network.layers[0].mlp.experts)
    assert len(torch.cat(planned).unique()) > experts // 2


@pytest.mark.parametrize("quantization", ["none", "int8_wo"])
def test_moe_plan_takes_big_decode_batches(tmp_path, monkeypatch, quantization):
    """More sequences than experts (every expert a run of several rows); the buffers grow and earlier batch
    sizes' calls are rebuilt."""
    engine, _ = _engine(tmp_path, "mixtral", quantization, batch=64)
    planned = _watch_routes(engine, monkeypatch)
    _generate(engine, [[5, 9]], 3)
    n = min(40, engine.executor.cpu_plan.max_rows)  # int8_wo: a float-activation GEMV's row limit, maybe
    many = [[7 + i, 8, 9] for i in range(n)]
    _generate(engine, many, 3)
    _generate(engine, many[:2], 3)
    counts = torch.stack([torch.bincount(ids.flatten(), minlength=6) for ids in planned if len(ids) == n])
    assert len(counts) >= 2 and (counts >= 2).all(), counts  # every expert took several rows at once
    assert {1, 2, n} <= {len(ids) for ids in planned} and n > 16  # 16: the buffers' first size


def test_greedy_through_the_plan_equals_transformers(tmp_path, monkeypatch):
    """Qwen3-MoE (q/k norms, 8 experts top-3) through the plan: HF transformers is the oracle."""
    engine, ckpt = _engine(tmp_path, "qwen3_moe")
    ex, ran = engine.executor, []
    run = ex.cpu_plan.run
    monkeypatch.setattr(ex.cpu_plan, "run", lambda inputs: ran.append(inputs.num_tokens) or run(inputs))
    _assert_same_greedy(_hf(ckpt), engine, _prompts(engine.engine_config.model.vocab_size), "qwen3_moe plan")
    assert len(ran) > 10


def test_dense_qwen3_runs_the_plan(tmp_path, monkeypatch):
    """q/k norms (per-head RMSNorm before RoPE) are plan calls: dense Qwen3 decodes through it too."""
    ckpt = make_variant(tmp_path / "ckpt", "qwen3-headdim-qknorm")
    out, _ = build_engine(str(ckpt), tmp_path / "engine", BuildConfig(dtype="float32", kv_cache_memory="8MiB"),
                          progress=False)
    engine = LLMEngine.from_engine_dir(out)
    assert engine.executor.cpu_plan is not None
    seen = _compare_plan_with_network(engine, monkeypatch, kv_atol=KV_ATOL)  # C head norm vs F.rms_norm: rounding
    _generate(engine, [[5, 9, 13, 200, 7], list(range(20, 57))], 5)
    assert seen.count(2) >= 4, seen
