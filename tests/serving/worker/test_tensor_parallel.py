"""Tensor parallelism on two real gloo ranks (rank 0 here, rank 1 a process it starts): the same
engine built with --tp-size 2 gives the tokens and logits of --tp-size 1, and HF transformers'
logits, for the Llama, Qwen2 (tied embeddings, one KV head replicated on both ranks) and GPT-2
(fused c_attn, learned positions, tied head, odd vocabulary) families; a rank that dies is an
error naming it, not a hang; close() stops rank 1 cleanly."""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch

from tests.helpers.checkpoints import make_checkpoint
from trtforge.builder.build import build_engine
from trtforge.builder.build_config import BuildConfig
from trtforge.config.sampling import SamplingParams
from trtforge.serving.core.scheduler import ScheduledChunk, SchedulerOutput
from trtforge.serving.engine import LLMEngine
from trtforge.serving.worker.model_inputs import prepare_inputs
from trtforge.serving.worker.tp_executor import TensorParallelError, TensorParallelExecutor

FAMILIES = {
    "llama-gqa-untied": dict(arch="llama", num_attention_heads=8, num_key_value_heads=2, vocab_size=517,
                             tie_word_embeddings=False),
    "qwen2-mqa-tied": dict(arch="qwen2", num_attention_heads=4, num_key_value_heads=1, tie_word_embeddings=True),
    "gpt2-tied": dict(arch="gpt2", n_head=4, vocab_size=519),
}
PROMPT_LENGTHS = (3, 17, 40)
MAX_NEW = 16

pytestmark = pytest.mark.usefixtures("one_thread")


def build(ckpt, out, tp: int):
    return build_engine(str(ckpt), out, BuildConfig(dtype="float32", max_batch_size=8, max_num_tokens=256,
                                                    kv_cache_memory="16MiB", tp_size=tp), progress=False)[0]


def prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(5, min(vocab, 500), (n,), generator=g).tolist() for n in PROMPT_LENGTHS]


def prompt_logits(engine: LLMEngine, batch: list[list[int]]) -> list[torch.Tensor]:
    """Every prompt position's logits, the prompts packed in one step."""
    bs = engine.scheduler_config.block_size
    chunks, next_block = [], 0
    for i, p in enumerate(batch):
        n = -(-len(p) // bs)
        chunks.append(ScheduledChunk(seq_id=i, start=0, num_tokens=len(p), sample=True, is_decode=False,
                                     token_ids=list(p), block_table=list(range(next_block, next_block + n))))
        next_block += n
    inputs = prepare_inputs(SchedulerOutput(chunks=chunks, preempted=[], num_batched_tokens=0), bs)
    inputs.logits_indices = torch.arange(inputs.num_tokens)
    return list(engine.executor.execute(inputs).split([len(p) for p in batch]))


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def engines(request, tmp_path_factory):
    tmp = tmp_path_factory.mktemp(request.param)
    ckpt = make_checkpoint(tmp / "ckpt", **FAMILIES[request.param])
    return request.param, ckpt, build(ckpt, tmp / "tp1", 1), build(ckpt, tmp / "tp2", 2)


def test_tp2_matches_tp1_and_transformers(engines):
    from transformers import AutoModelForCausalLM

    name, ckpt, tp1_dir, tp2_dir = engines
    tp1 = LLMEngine.from_engine_dir(tp1_dir)
    tp2 = LLMEngine.from_engine_dir(tp2_dir)
    try:
        assert isinstance(tp2.executor, TensorParallelExecutor)
        batch = prompts(tp1.engine_config.model.vocab_size)
        hf = AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=torch.float32).eval()
        for p, a, b in zip(batch, prompt_logits(tp1, batch), prompt_logits(tp2, batch)):
            assert b.shape == a.shape == (len(p), tp1.engine_config.model.vocab_size)
            assert (a - b).abs().max().item() < 1e-4, f"{name}: tp2 logits differ from tp1's"
            with torch.no_grad():
                ref = hf(torch.tensor([p])).logits[0]
            assert (b - ref).abs().max().item() < 1e-4, f"{name}: tp2 logits differ from transformers'"
        params = SamplingParams(max_tokens=MAX_NEW, ignore_eos=True)
        want = [o.output_token_ids for o in tp1.generate(batch, params)]
        got = tp2.generate(batch, params)
        assert [o.error for o in got] == [None] * len(batch)
        assert [o.output_token_ids for o in got] == want, f"{name}: greedy tokens differ between tp2 and tp1"
        assert sum(map(len, want)) == MAX_NEW * len(batch)
        assert tp2.executor.collectives.reduce_calls > 0 and tp2.executor.collectives.gather_calls > 0
    finally:
        child = tp2.executor.children[0].process
        tp2.executor.close()
    assert child.wait(timeout=10) == 0, "rank 1 did not stop cleanly on close()"


def test_a_dying_rank_is_an_error_not_a_hang(tmp_path):
    ckpt = make_checkpoint(tmp_path / "ckpt", **FAMILIES["qwen2-mqa-tied"])
    engine = LLMEngine.from_engine_dir(build(ckpt, tmp_path / "tp2", 2))
    try:
        assert engine.generate([[5, 6, 7]], SamplingParams(max_tokens=2))[0].error is None
        child = engine.executor.children[0].process
        os.kill(child.pid, signal.SIGKILL)
        child.wait(timeout=10)
        start = time.monotonic()
        out = engine.generate([[5, 6, 7]], SamplingParams(max_tokens=2))[0]
        assert time.monotonic() - start < 30
        assert out.finish_reason == "error" and "rank 1 exited with code -9" in out.error, out.error
        with pytest.raises(TensorParallelError, match="Restart the engine"):  # and it stays broken, saying so
            engine.executor.execute(prepare_inputs(SchedulerOutput(
                chunks=[ScheduledChunk(seq_id=0, start=0, num_tokens=1, sample=True, is_decode=False,
                                       token_ids=[5], block_table=[0])], preempted=[], num_batched_tokens=1), 16))
    finally:
        engine.executor.close()
