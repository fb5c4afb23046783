"""The CPU decode plan (serving/worker/cpu_decode_plan.py) on pre-quantized checkpoints' layers
(tests/builder/prequantized_checkpoints.py): zero points and GPTQ act-order run inside the plan — the
input gather, the GEMV on the codes, the zero-point correction (quant_linear.c's helpers) — and give the
network's logits up to float32 rounding. (QuantLinear.forward calls the same correction helper, so the KV
written is the network's bit for bit; tests/plugins/cpu/test_quant_linear_zero_points.py checks the helper
against its torch reference and the layer against float64.)"""

from __future__ import annotations

import pytest

from tests.builder.prequantized_checkpoints import make_prequantized
from tests.serving.worker.test_cpu_decode_plan import _compare_plan_with_network
from trtforge.builder.build import build_engine
from trtforge.builder.build_config import BuildConfig
from trtforge.config.sampling import SamplingParams
from trtforge.models.quantized_layers import QuantLinear
from trtforge.plugins.cpu.quant_linear import GEMV_MAX_ROWS
from trtforge.serving.engine import LLMEngine


@pytest.mark.parametrize("case", ["gptq-qwen2-asym", "gptq-llama-actorder", "awq-qwen2", "ct-qwen2-w4a16-asym",
                                  "gptq-llama-sym", "gptq-qwen2-int8"])
def test_plan_runs_zero_points_and_act_order(tmp_path, monkeypatch, case):
    """Every decode step is the plan's and equals the network's; decode batches past GEMV_MAX_ROWS too
    where every linear has int8 activations. (A failed comparison surfaces as finish_reason "error":
    every output must finish by length.)"""
    ckpt = make_prequantized(tmp_path / "ckpt", case)
    out, _ = build_engine(str(ckpt), tmp_path / "engine", BuildConfig(dtype="float32", max_batch_size=64,
                                                                      kv_cache_memory="8MiB"), progress=False)
    engine = LLMEngine.from_engine_dir(out)
    layers = [m for m in engine.executor.network.modules() if isinstance(m, QuantLinear)]
    sym = case in ("gptq-llama-sym", "gptq-qwen2-int8")
    assert layers and all((m.zeros is None) == sym for m in layers)
    assert all((m.perm is not None) == ("actorder" in case) for m in layers)
    described = engine.executor.describe()
    assert "quantized GEMV on" in described and ("zero points" in described) != sym, described
    seen = _compare_plan_with_network(engine, monkeypatch)  # the same KV, bit for bit
    outs = engine.generate([[5, 9, 13, 200, 7]], SamplingParams(max_tokens=4, ignore_eos=True))
    prompts = [[5, 9, 13], list(range(20, 57)), [3] * 16]
    outs += engine.generate(prompts, SamplingParams(max_tokens=4, ignore_eos=True))
    many = [[7 + i, 8, 9] for i in range(GEMV_MAX_ROWS + 9)]
    outs += engine.generate(many, SamplingParams(max_tokens=3, ignore_eos=True))
    assert all(o.finish_reason.value == "length" for o in outs), [o.error for o in outs if o.error][:1]
    assert seen.count(1) >= 3 and seen.count(3) >= 3, seen
    assert (len(many) in seen) == (engine.executor.cpu_plan.max_rows > GEMV_MAX_ROWS), seen
