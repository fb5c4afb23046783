"""Hugging Face transformers `generate` baselines for the offline benchmark.

(a) one request at a time — what a naive server does;
(b) static batches — requests grouped in arrival order, left-padded to the longest prompt, and
    every row decoded until the batch's longest output is done (max_new_tokens = the batch's max).
    Only each request's own output length counts as useful output: the extra tokens of rows that
    finished early are the waste that in-flight batching removes.
Greedy, EOS ignored (min_new_tokens = max_new_tokens), KV cache on, HF's default (SDPA) attention.
"""

from __future__ import annotations

from typing import Any

import torch

from trtforge.bench.workload import BenchRequest, Stopwatch, SystemResult


def load_hf_model(checkpoint: str, dtype: torch.dtype = torch.float32) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(checkpoint, dtype=dtype).eval()


def _generate(model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor, new_tokens: int,
              pad_id: int) -> torch.Tensor:
    with torch.inference_mode():
        return model.generate(input_ids=input_ids, attention_mask=attention_mask, do_sample=False,
                              max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                              pad_token_id=pad_id)


def warm_up(model: Any, pad_id: int) -> None:
    """One short untimed generate: first calls pay one-off allocation and dispatch costs."""
    ids = torch.arange(10, 42)[None]
    _generate(model, ids, torch.ones_like(ids), 4, pad_id)


def hf_one_at_a_time(model: Any, requests: list[BenchRequest], pad_id: int) -> SystemResult:
    generated = 0
    with Stopwatch() as sw:
        for req in requests:
            ids = torch.tensor([req.prompt_token_ids])
            out = _generate(model, ids, torch.ones_like(ids), req.output_len, pad_id)
            generated += out.shape[1] - ids.shape[1]
    useful = sum(r.output_len for r in requests)
    if generated != useful:
        raise RuntimeError(f"HF generated {generated} tokens, expected {useful}: EOS not ignored?")
    return SystemResult("hf_one_at_a_time", len(requests), sw.elapsed, useful, generated,
                        sum(r.prompt_len for r in requests))


def left_padded(batch: list[BenchRequest], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """input_ids and attention_mask [B, longest prompt], prompts right-aligned (left padding)."""
    width = max(r.prompt_len for r in batch)
    ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    for row, req in enumerate(batch):
        ids[row, width - req.prompt_len:] = torch.tensor(req.prompt_token_ids)
        mask[row, width - req.prompt_len:] = 1
    return ids, mask


def hf_static_batches(model: Any, requests: list[BenchRequest], batch_size: int, pad_id: int) -> SystemResult:
    generated = padded_prompt_tokens = 0
    with Stopwatch() as sw:
        for i in range(0, len(requests), batch_size):
            batch = requests[i:i + batch_size]
            ids, mask = left_padded(batch, pad_id)
            new_tokens = max(r.output_len for r in batch)
            out = _generate(model, ids, mask, new_tokens, pad_id)
            generated += (out.shape[1] - ids.shape[1]) * len(batch)
            padded_prompt_tokens += ids.numel()
    return SystemResult("hf_static_batch", len(requests), sw.elapsed, sum(r.output_len for r in requests),
                        generated, sum(r.prompt_len for r in requests),
                        extra={"batch_size": batch_size, "padded_prompt_tokens": padded_prompt_tokens})
