"""The CPU decode plan (serving/cpu_decode_plan.py) against the network it replaces for small
decode steps: same logits up to float32 rounding, the same KV written, and it stands aside for
everything it does not cover."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.checkpoints import make_variant
from trtforge.builder.build import build_engine
from trtforge.builder.build_config import BuildConfig
from trtforge.config.sampling import SamplingParams
from trtforge.plugins.cpu.quant_linear import GEMV_MAX_ROWS
from trtforge.serving.engine import LLMEngine


def _engine(tmp_path, variant: str, quantization: str = "none", lm_head: str = "int8_wo") -> LLMEngine:
    ckpt = make_variant(tmp_path / "ckpt", variant)
    out, _ = build_engine(str(ckpt), tmp_path / "engine",
                          BuildConfig(dtype="float32", max_batch_size=64, kv_cache_memory="8MiB",
                                      quantization=quantization, group_size=32, lm_head_quantization=lm_head),
                          progress=False)
    return LLMEngine.from_engine_dir(out)


@pytest.mark.parametrize("variant,quantization", [
    ("qwen2-gqa-bias-tied", "none"), ("llama-gqa-llama3rope", "none"), ("mistral-mqa", "none"),
    ("qwen2-gqa-bias-tied", "int8_wo"), ("llama-gqa-llama3rope", "int4_wo")])  # quantized: the plan's quantized GEMV
def test_plan_matches_the_network(tmp_path, monkeypatch, variant, quantization):
    engine = _engine(tmp_path, variant, quantization)
    seen = _compare_plan_with_network(engine, monkeypatch)
    prompts = [[5, 9, 13, 200, 7], list(range(20, 57)), [3] * 16]
    engine.generate(prompts[:1], SamplingParams(max_tokens=5, ignore_eos=True))
    engine.generate(prompts, SamplingParams(max_tokens=5, ignore_eos=True))
    assert seen.count(1) >= 4 and seen.count(3) >= 4, seen


@pytest.mark.parametrize("variant,quantization,lm_head", [("qwen2-gqa-bias-tied", "int8_wo", "int8_wo"),
                                                          ("llama-gqa-llama3rope", "int4_wo", "int8_wo"),
                                                          ("qwen2-gqa-bias-tied", "int4_wo", "int4_wo")])
def test_quantized_plan_takes_big_decode_batches(tmp_path, monkeypatch, variant, quantization, lm_head):
    """All linears int8-activation kernels: decode batches past GEMV_MAX_ROWS run the plan too (its
    buffers grow, earlier batch sizes' calls are rebuilt), still equal to the network."""
    from trtforge.serving.worker.cpu_decode_plan import MAX_ROWS

    engine = _engine(tmp_path, variant, quantization, lm_head)
    assert engine.executor.cpu_plan.max_rows == MAX_ROWS and engine.executor.network.head_linear.scheme == lm_head
    seen = _compare_plan_with_network(engine, monkeypatch)
    engine.generate([[5, 9, 13]], SamplingParams(max_tokens=3, ignore_eos=True))
    many = [[7 + i, 8, 9] for i in range(GEMV_MAX_ROWS + 9)]
    engine.generate(many, SamplingParams(max_tokens=3, ignore_eos=True))
    engine.generate([[5, 9, 13]] * 2, SamplingParams(max_tokens=3, ignore_eos=True))
    assert 1 in seen and len(many) in seen and 2 in seen, seen


def _compare_plan_with_network(engine, monkeypatch, kv_atol: float = 0.0) -> list[int]:
    """Make every step the plan takes run the network too, on the same KV, and compare; returns the
    list of token counts the plan ran (filled as the engine steps). kv_atol > 0: the KV written may
    differ by float32 rounding (the network's multi-token path computes it with other kernels)."""
    ex = engine.executor
    assert ex.cpu_plan is not None, "a float32 Llama-style CPU engine gets a decode plan"
    seen, real = [], ex.execute

    def both(inputs):
        if not ex.cpu_plan.can_run(inputs):
            return real(inputs)
        before = [kv.clone() for kv in ex.kv_caches]
        with torch.inference_mode():
            planned = ex.cpu_plan.run(inputs)
            written = [kv.clone() for kv in ex.kv_caches]
            for kv, b in zip(ex.kv_caches, before):
                kv.copy_(b)
            reference = ex.network(inputs.input_ids, inputs.positions, ex.kv_caches, inputs.meta,
                                   inputs.logits_indices)
        torch.testing.assert_close(planned, reference, atol=1e-5, rtol=0)
        if kv_atol:
            for a, b in zip(written, ex.kv_caches):
                torch.testing.assert_close(a, b, atol=kv_atol, rtol=0)
        else:
            assert all(torch.equal(a, b) for a, b in zip(written, ex.kv_caches)), "the plan wrote other KV"
        assert not any(torch.equal(a, b) for a, b in zip(written, before)), "the plan wrote no KV"
        seen.append(inputs.num_tokens)
        return planned

    monkeypatch.setattr(ex, "execute", both)
    return seen


def test_plan_stands_aside(tmp_path):
    """Prefill steps are the network's; decode batches past 32 rows (the old GEMV's limit) are the
    plan's now (the packed GEMM takes any row count), past `max_rows` the network's again."""
    from trtforge.serving.worker.cpu_decode_plan import MAX_ROWS

    engine = _engine(tmp_path, "qwen2-gqa-bias-tied")
    plan, seen = engine.executor.cpu_plan, []
    assert plan.max_rows == MAX_ROWS  # float32: the packed GEMM's
    real = plan.can_run
    plan.can_run = lambda inputs: seen.append((inputs.num_tokens, real(inputs))) or seen[-1][1]
    many = [[7 + i, 8, 9] for i in range(GEMV_MAX_ROWS + 1)]
    engine.generate(many, SamplingParams(max_tokens=3, ignore_eos=True))
    assert (3 * len(many), False) in seen, "a prefill step is the network's"
    assert (len(many), True) in seen, f"{len(many)} decode rows are the plan's"
    seen.clear()
    plan.max_rows = 8
    engine.generate(many[:9], SamplingParams(max_tokens=3, ignore_eos=True))
    assert (9, False) in seen, "more decode rows than max_rows are the network's"


@pytest.mark.parametrize("variant", ["gpt2-untied"])  # dense Qwen3 takes the plan (test_moe_decode_plan.py)
def test_other_families_keep_the_network_path(tmp_path, variant):
    assert _engine(tmp_path, variant).executor.cpu_plan is None


@pytest.mark.parametrize("variant,quantization", [("qwen2-gqa-bias-tied", "none"), ("llama-gqa-llama3rope", "int8_wo")])
def test_plan_takes_speculative_verification_steps(tmp_path, monkeypatch, variant, quantization):
    """Verification steps (a decode token + drafts per sequence, logits at every one) run the plan
    and equal the network's multi-token (prefill-path) attention on the same KV.

    Quantized layers run their float-activation kernels here: the two attentions (the plan's C kernel,
    the network's SDPA) differ by float32 rounding, and int8 activations (the default) round such a
    difference to a whole quantisation step now and then (seen: one row 0.013 off on an AMD EPYC, exact
    on an Intel Xeon). The int8-activation plan is checked exactly by test_plan_matches_the_network,
    where both sides run the same attention kernel."""
    from trtforge.config.runtime import RuntimeConfig
    from trtforge.config.speculative import SpeculativeConfig

    monkeypatch.setenv("TRTFORGE_QUANT_ACTIVATIONS", "float")
    base = _engine(tmp_path, variant, quantization)
    spec = SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_min=1, disable_by_batch_size=None,
                             backoff_after_rejections=0)
    engine = LLMEngine.from_engine_dir(tmp_path / "engine", RuntimeConfig(speculative_config=spec))
    seen = _compare_plan_with_network(engine, monkeypatch, kv_atol=1e-5)
    prompts = [[5, 9, 13, 5, 9, 13, 5, 9], list(range(20, 40)) * 2, [3, 4] * 8]
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    outs = engine.generate(prompts, params)
    assert [o.output_token_ids for o in outs] == [o.output_token_ids for o in base.generate(prompts, params)]
    assert engine.stats().spec_decode_num_draft_tokens > 0
    assert any(n > len(prompts) for n in seen), f"no verification step ran the plan: {seen}"
