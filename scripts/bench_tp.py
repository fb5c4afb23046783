"""Tensor parallelism on one host: decode tokens/s at tp 1 and tp 2, and what the all-reduces cost.

Builds a random-weight Qwen2-shaped checkpoint (the demo tokenizer; --hidden/--layers/--heads set
its size), converts it with --tp-size 1 and 2, and for each runs a decode batch of --batch
sequences: median decode step, decode tokens/s, and on rank 0 the all-reduces of those steps
(2 per layer: count, bytes = tokens × hidden × 4, seconds; rank 0's time includes waiting for rank 1
to reach the same point, so it is an upper bound of the transfer) and the logits' all-gather.
Not run in CI. On a 2-core machine expect no speed-up: two ranks share the cores tp 1 had.

    .venv/bin/python scripts/bench_tp.py [--hidden 1024 --layers 8 --heads 16 --kv-heads 4 --batch 8]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from trtforge.builder.build import build_engine
from trtforge.builder.build_config import BuildConfig
from trtforge.config.sampling import SamplingParams
from trtforge.serving.engine import LLMEngine


def make_checkpoint(out: Path, hidden: int, layers: int, heads: int, kv_heads: int) -> Path:
    from transformers import AutoConfig, AutoModelForCausalLM

    from trtforge.builder.tokenizer_training import train_tiny_tokenizer

    tok = train_tiny_tokenizer(vocab_size=512)
    tok.save_pretrained(str(out))
    cfg = AutoConfig.for_model("qwen2", hidden_size=hidden, intermediate_size=hidden * 11 // 4 // 64 * 64,
                               num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                               max_position_embeddings=1024, vocab_size=len(tok), bos_token_id=tok.bos_token_id,
                               eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    cfg.architectures = ["Qwen2ForCausalLM"]
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(str(out), safe_serialization=True)
    return out


def measure(engine_dir: Path, batch: int, prompt_len: int, steps: int) -> dict[str, float]:
    engine = LLMEngine.from_engine_dir(engine_dir)
    vocab = engine.engine_config.model.vocab_size
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(5, vocab, (prompt_len,), generator=g).tolist() for _ in range(batch)]
    engine.generate(prompts[:1], SamplingParams(max_tokens=4))  # warm-up
    for p in prompts:
        engine.add_request(p, SamplingParams(max_tokens=steps + 1, ignore_eos=True))
    while engine.scheduler.num_waiting:  # the prefills (and the first tokens)
        engine.step()
    comm = getattr(engine.executor, "collectives", None)
    if comm is not None:
        comm.reset()
    times = []
    while engine.has_unfinished():
        t = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t)
    step = statistics.median(times)
    result = {"decode_step_ms": 1e3 * step, "decode_tok_s": batch / step, "steps": len(times),
              "threads": torch.get_num_threads()}
    if comm is not None:
        n = len(times)
        result.update(allreduce_per_step=comm.reduce_calls / n,
                      allreduce_bytes_per_call=comm.reduce_bytes / comm.reduce_calls,
                      allreduce_ms_per_step=1e3 * comm.reduce_seconds / n,
                      allreduce_us_per_call=1e6 * comm.reduce_seconds / comm.reduce_calls,
                      gather_bytes_per_step=comm.gather_bytes / n, gather_ms_per_step=1e3 * comm.gather_seconds / n)
        engine.executor.close()
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--steps", type=int, default=48)
    args = ap.parse_args()
    cores = len(os.sched_getaffinity(0))
    with tempfile.TemporaryDirectory(prefix="bench-tp-") as tmp:
        root = Path(tmp)
        ckpt = make_checkpoint(root / "ckpt", args.hidden, args.layers, args.heads, args.kv_heads)
        print(f"qwen2-shaped: hidden {args.hidden}, {args.layers} layers, {args.heads}/{args.kv_heads} heads, float32; "
              f"decode batch {args.batch}; {cores} cores")
        for tp, threads in ((1, cores), (1, 1), (2, cores)):  # tp 2 divides the cores among its ranks
            torch.set_num_threads(threads)
            eng = build_engine(str(ckpt), root / f"tp{tp}", BuildConfig(dtype="float32", max_batch_size=args.batch,
                                                                       max_num_tokens=512, kv_cache_memory="64MiB",
                                                                       tp_size=tp), progress=False, force=True)[0]
            r = measure(eng, args.batch, args.prompt_len, args.steps)
            line = (f"tp {tp}: decode step {r['decode_step_ms']:.2f} ms (median of {r['steps']}), "
                    f"{r['decode_tok_s']:.0f} tokens/s, {r['threads']} torch threads/rank")
            if tp > 1:
                line += (f"\n      all-reduce: {r['allreduce_per_step']:.0f}/step × "
                         f"{r['allreduce_bytes_per_call'] / 1024:.0f} KiB, "
                         f"{r['allreduce_us_per_call']:.0f} µs each = {r['allreduce_ms_per_step']:.2f} ms/step "
                         f"({100 * r['allreduce_ms_per_step'] / r['decode_step_ms']:.0f} % of the step); "
                         f"logits all-gather {r['gather_bytes_per_step'] / 1024:.0f} KiB, "
                         f"{r['gather_ms_per_step']:.2f} ms/step")
            print(line, flush=True)


if __name__ == "__main__":
    main()
