"""Accuracy of a weight-only quantized engine against the float32 engine of the same checkpoint.

Both engines are teacher-forced on the same token sequences (one prefill each, every position's
logits kept); per position: KL(float32 ‖ quantized) of the next-token distributions and whether
their greedy (top-1) tokens agree. Used by tests/builder/test_quant_accuracy.py and, on a bigger
random model, by scripts/bench_quant.sh.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from trtforge.builder.build import build_engine
from trtforge.builder.build_config import BuildConfig
from trtforge.serving.core.scheduler import ScheduledChunk, SchedulerOutput
from trtforge.serving.engine import LLMEngine
from trtforge.serving.worker.model_inputs import prepare_inputs


def all_position_logits(engine: LLMEngine, sequences: list[list[int]]) -> torch.Tensor:
    """float32 logits [sum of lengths, vocab]: every position of each sequence, one packed prefill."""
    bs = engine.scheduler_config.block_size
    chunks, next_block = [], 0
    for i, seq in enumerate(sequences):
        n_blocks = -(-len(seq) // bs)
        chunks.append(ScheduledChunk(seq_id=i, start=0, num_tokens=len(seq), sample=True, is_decode=False,
                                     token_ids=list(seq), block_table=list(range(next_block, next_block + n_blocks))))
        next_block += n_blocks
    inputs = prepare_inputs(SchedulerOutput(chunks=chunks, preempted=[], num_batched_tokens=0), bs,
                            engine.executor.device)
    inputs.logits_indices = torch.arange(inputs.num_tokens, device=engine.executor.device)
    return engine.executor.execute(inputs).float()


def decode_position_logits(engine: LLMEngine, sequences: list[list[int]]) -> torch.Tensor:
    """As all_position_logits, but computed the way generation computes them: the sequences teacher-
    forced one token per step, all together (a batch of len(sequences) decode steps, which the CPU
    decode plan and the ≤ 32-row GEMVs take). Rows ordered like all_position_logits (sequence by
    sequence). The sequences must have equal lengths."""
    bs = engine.scheduler_config.block_size
    length = len(sequences[0])
    assert all(len(s) == length for s in sequences)
    n_blocks = -(-length // bs)
    tables = [list(range(i * n_blocks, (i + 1) * n_blocks)) for i in range(len(sequences))]
    steps = []
    for pos in range(length):
        chunks = [ScheduledChunk(seq_id=i, start=pos, num_tokens=1, sample=True, is_decode=pos > 0,
                                 token_ids=[seq[pos]], block_table=tables[i]) for i, seq in enumerate(sequences)]
        inputs = prepare_inputs(SchedulerOutput(chunks=chunks, preempted=[], num_batched_tokens=0), bs,
                                engine.executor.device)
        steps.append(engine.executor.execute(inputs).float())
    return torch.stack(steps, dim=1).reshape(len(sequences) * length, -1)


def compare(reference: torch.Tensor, quantized: torch.Tensor) -> dict[str, float]:
    """Mean KL(reference ‖ quantized) in nats and top-1 agreement over positions."""
    logp, logq = reference.log_softmax(-1), quantized.log_softmax(-1)
    kl = (logp.exp() * (logp - logq)).sum(-1)
    agree = (reference.argmax(-1) == quantized.argmax(-1)).float()
    return {"positions": reference.shape[0], "mean_kl": kl.mean().item(), "top1_agreement": agree.mean().item()}


def measure(ckpt: Path, work: Path, schemes: dict[str, int | None], sequences: list[list[int]],
            kv_cache_memory: str = "64MiB", **options: Any) -> dict[str, dict[str, float]]:
    """{scheme: compare(...)} of each quantized engine (scheme → group size) against float32.
    options: more BuildConfig fields for the quantized builds (e.g. lm_head_quantization)."""
    def logits(name: str, **options) -> torch.Tensor:
        out, _ = build_engine(str(ckpt), work / name, BuildConfig(dtype="float32", kv_cache_memory=kv_cache_memory,
                                                                  max_num_tokens=4096, **options),
                              progress=False, force=True)
        engine = LLMEngine.from_engine_dir(out)
        with torch.inference_mode():
            return all_position_logits(engine, sequences)

    base = logits("float32")
    return {s: compare(base, logits(s, quantization=s, **({"group_size": g} if g else {}), **options))
            for s, g in schemes.items()}


def random_sequences(vocab: int, count: int, length: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(5, vocab, (length,), generator=g).tolist() for _ in range(count)]
