"""Every architecture family against Hugging Face transformers on the same random checkpoint:
greedy tokens identical (prompts batched together on the paged KV cache) and prompt logits close.

TRTFORGE_TEST_DEVICE=cuda runs the engine and HF on the GPU (scripts/device_check.sh)."""

from __future__ import annotations

import os

import pytest
import torch

from tests.helpers.checkpoints import VARIANTS, make_variant
from trtforge.builder.build import build_engine
from trtforge.builder.build_config import BuildConfig
from trtforge.config.runtime import RuntimeConfig
from trtforge.config.sampling import SamplingParams
from trtforge.serving.core.scheduler import ScheduledChunk, SchedulerOutput
from trtforge.serving.engine import LLMEngine
from trtforge.serving.worker.model_inputs import prepare_inputs

DEVICE = os.environ.get("TRTFORGE_TEST_DEVICE", "cpu")
PROMPT_LENGTHS = (3, 17, 33, 50)  # cross 16-token block boundaries; one shorter than a block
MAX_NEW = 32


def _prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(5, min(vocab, 500), (n,), generator=g).tolist() for n in PROMPT_LENGTHS]


def _hf(ckpt, dtype=torch.float32):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=dtype).to(DEVICE).eval()


def _engine(tmp_path, ckpt, dtype="float32") -> LLMEngine:
    out, _ = build_engine(str(ckpt), tmp_path / f"engine-{dtype}",
                          BuildConfig(dtype=dtype, max_batch_size=8, max_num_tokens=256, kv_cache_memory="16MiB"),
                          progress=False)
    return LLMEngine.from_engine_dir(out, RuntimeConfig(device=DEVICE))


def _prompt_logits(engine: LLMEngine, prompts: list[list[int]]) -> list[torch.Tensor]:
    """All prompt positions' logits, prompts packed in one batch (no padding)."""
    bs = engine.scheduler_config.block_size
    chunks, next_block = [], 0
    for i, p in enumerate(prompts):
        n_blocks = -(-len(p) // bs)
        table = list(range(next_block + n_blocks - 1, next_block - 1, -1))  # scattered order
        next_block += n_blocks
        chunks.append(ScheduledChunk(seq_id=i, start=0, num_tokens=len(p), sample=True,
                                     is_decode=False, token_ids=list(p), block_table=table))
    inputs = prepare_inputs(SchedulerOutput(chunks=chunks, preempted=[], num_batched_tokens=0), bs,
                            engine.executor.device)
    inputs.logits_indices = torch.arange(inputs.num_tokens, device=engine.executor.device)
    logits = engine.executor.execute(inputs)
    return list(logits.split([len(p) for p in prompts]))


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def variant(request, tmp_path_factory):
    tmp = tmp_path_factory.mktemp(request.param)
    ckpt = make_variant(tmp / "ckpt", request.param)
    return request.param, tmp, ckpt


def test_greedy_tokens_and_logits_match_transformers(variant):
    name, tmp, ckpt = variant
    hf = _hf(ckpt)
    engine = _engine(tmp, ckpt)
    prompts = _prompts(engine.engine_config.model.vocab_size)

    ours = _prompt_logits(engine, prompts)
    with torch.no_grad():
        for p, got in zip(prompts, ours):
            ref = hf(torch.tensor([p], device=DEVICE)).logits[0].float()
            assert (got - ref).abs().max().item() < 1e-4, f"{name}: prompt logits differ"

    outs = engine.generate(prompts, SamplingParams(max_tokens=MAX_NEW))
    for p, out in zip(prompts, outs):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([p], device=DEVICE), attention_mask=torch.ones(1, len(p), device=DEVICE,
                              dtype=torch.long), max_new_tokens=MAX_NEW, do_sample=False,
                              pad_token_id=hf.config.pad_token_id)[0, len(p):].tolist()
        assert out.output_token_ids == ref, f"{name}: greedy tokens differ for a {len(p)}-token prompt"
        assert len(ref) == MAX_NEW or out.finish_reason == "stop"
    assert sum(len(o.output_token_ids) for o in outs) >= 4 * 8, "too few tokens compared to mean anything"


# bfloat16 keeps 8 bits of mantissa. Measured on these random 2-layer models (logits |max| ≈ 6):
# against HF transformers *in bfloat16* our engine is within 0.05 (bit-identical for Llama/Qwen2);
# against float32 the rounding grows with position up to ≈ 0.35 (≈ 5% of the largest logit).
BF16_VS_HF_BF16 = 0.1
BF16_VS_FP32 = 0.5


@pytest.mark.parametrize("name", ["qwen2-gqa-bias-tied", "gpt2-untied", "gemma2-softcap", "gemma3-local-rope"])
def test_bfloat16_engine_close_to_float32(tmp_path, name):
    ckpt = make_variant(tmp_path / "ckpt", name)
    hf32, hf16 = _hf(ckpt), _hf(ckpt, torch.bfloat16)
    engine = _engine(tmp_path, ckpt, dtype="bfloat16")
    assert engine.engine_config.dtype == "bfloat16"
    prompts = _prompts(engine.engine_config.model.vocab_size)
    with torch.no_grad():
        for p, got in zip(prompts, _prompt_logits(engine, prompts)):
            ids = torch.tensor([p], device=DEVICE)
            assert (got - hf16(ids).logits[0].float()).abs().max().item() < BF16_VS_HF_BF16
            assert (got - hf32(ids).logits[0]).abs().max().item() < BF16_VS_FP32
    outs = engine.generate(prompts, SamplingParams(max_tokens=8, ignore_eos=True))
    assert [len(o.output_token_ids) for o in outs] == [8] * len(prompts)


@pytest.mark.skipif(DEVICE != "cpu", reason="the oneDNN linear path is the CPU engine's")
def test_cpu_onednn_linears_match_plain_torch(tmp_path, monkeypatch):
    ckpt = make_variant(tmp_path / "ckpt", "llama-gqa-llama3rope")
    from trtforge.plugins.cpu.linear import CpuLinear

    packed = _engine(tmp_path, ckpt)
    net = packed.executor.network
    assert isinstance(net.head, CpuLinear) and isinstance(net.layers[0].attn.qkv, CpuLinear), \
        "float32 CPU engines are built with their own CPU linears"
    monkeypatch.setenv("TRTFORGE_CPU_ONEDNN", "0")
    plain = LLMEngine.from_engine_dir(tmp_path / "engine-float32")
    assert type(plain.executor.network.head) is torch.nn.Linear
    prompts = _prompts(packed.engine_config.model.vocab_size)
    for a, b in zip(_prompt_logits(packed, prompts), _prompt_logits(plain, prompts)):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
