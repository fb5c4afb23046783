"""End-to-end generation throughput: trtforge's torch engine vs HF transformers `generate`.

Same random-weight checkpoint (Qwen2.5-0.5B shapes by default), same GPU, same prompts (random
token ids of --prompt-len), greedy, exactly --new-tokens per request (EOS ignored). Throughput =
generated tokens / wall time of the whole call (prefill included), at each batch size; HF gets
the whole batch at once (equal-length prompts, so no padding). Writes e2e_decode.json and .txt.

    python scripts/gpu/bench_e2e_decode.py --out OUT_DIR --work /tmp/w           # GPU, 0.5b bf16
    python scripts/gpu/bench_e2e_decode.py --out /tmp/x --work /tmp/w --dry-run  # CPU, tiny
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from gpu_common import build_demo_engine, hf_greedy, wall_timer, write_json

TARGET_SPEEDUP = 3.0
TARGET_BATCH = 32


def prompts_for(batch: int, prompt_len: int, vocab: int, seed: int) -> torch.Tensor:
    """[batch, prompt_len] random ids, clear of the low ids where special tokens live."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(16, vocab, (batch, prompt_len), generator=gen)


def run_hf(ckpt: Path, ids: torch.Tensor, args, device: str) -> tuple[float, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=getattr(torch, args.dtype))
    model = model.to(device).eval()
    pad = model.config.pad_token_id or 0
    hf_greedy(model, ids[:1, :8].to(device), 2, pad)  # warm up kernels / allocator
    with wall_timer(device) as t:
        out = hf_greedy(model, ids.to(device), args.new_tokens, pad)
    del model
    return t["s"], out.cpu()


def run_trtforge(engine_dir: Path, ids: torch.Tensor, args, device: str) -> tuple[float, list]:
    from trtforge.config.runtime import RuntimeConfig
    from trtforge.config.sampling import SamplingParams
    from trtforge.serving.engine import LLMEngine

    engine = LLMEngine.from_engine_dir(engine_dir, RuntimeConfig(device=device))
    prompts = ids.tolist()
    params = SamplingParams(max_tokens=args.new_tokens, ignore_eos=True)
    engine.generate(prompts[:1], SamplingParams(max_tokens=4, ignore_eos=True))  # warm up
    with wall_timer(device) as t:
        outs = engine.generate(prompts, params)
    return t["s"], [o.output_token_ids for o in outs]


def bench_batch(ckpt, engine_dir, batch: int, vocab: int, args, device: str) -> dict:
    ids = prompts_for(batch, args.prompt_len, vocab, seed=batch)
    hf_s, hf_tokens = run_hf(ckpt, ids, args, device)
    tf_s, tf_tokens = run_trtforge(engine_dir, ids, args, device)
    generated = sum(len(t) for t in tf_tokens)
    expected = batch * args.new_tokens
    same = sum(int(a == b) for row_a, row_b in zip(hf_tokens.tolist(), tf_tokens)
               for a, b in zip(row_a, row_b))
    row = dict(batch=batch, prompt_len=args.prompt_len, new_tokens=args.new_tokens,
               hf_s=hf_s, trtforge_s=tf_s, hf_tok_s=expected / hf_s,
               trtforge_tok_s=generated / tf_s, speedup=(generated / tf_s) / (expected / hf_s),
               trtforge_generated=generated,
               # Informational: random weights give near-tied logits, so bf16 runs may diverge.
               greedy_token_agreement=same / expected)
    print(_fmt(row), flush=True)
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    return row


def _fmt(r: dict) -> str:
    return (f"batch={r['batch']:3d} HF {r['hf_tok_s']:9.1f} tok/s  trtforge "
            f"{r['trtforge_tok_s']:9.1f} tok/s  speedup {r['speedup']:5.2f}x  "
            f"greedy agreement {100 * r['greedy_token_agreement']:5.1f}%")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True, help="directory for the JSON/text report")
    p.add_argument("--work", type=Path, required=True, help="scratch dir for checkpoint + engine")
    p.add_argument("--size", default="0.5b", help="demo checkpoint size (tiny | 0.5b)")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--batches", type=lambda s: [int(x) for x in s.split(",")], default=[1, 32])
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--kv-cache-memory", default="8GiB")
    p.add_argument("--dry-run", action="store_true", help="CPU, tiny model: checks the script")
    args = p.parse_args(argv)
    if args.dry_run:
        args.size, args.dtype, args.batches = "tiny", "float32", [1, 4]
        args.prompt_len, args.new_tokens, args.kv_cache_memory = 12, 6, "16MiB"
    elif not torch.cuda.is_available():
        p.error("needs a CUDA GPU (use --dry-run to check the script on CPU)")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    device = "cpu" if args.dry_run else "cuda"
    max_batch = max(args.batches)
    seq_len = args.prompt_len + args.new_tokens + 16
    build_args = ["--max-batch-size", str(max_batch),
                  "--max-num-tokens", str(max(2048, max_batch * args.prompt_len)),
                  "--max-seq-len", str(seq_len), "--kv-cache-memory", args.kv_cache_memory]
    args.work.mkdir(parents=True, exist_ok=True)
    ckpt, engine_dir = build_demo_engine(args.work, args.size, args.dtype, build_args)
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(str(ckpt)).vocab_size
    rows = [bench_batch(ckpt, engine_dir, b, vocab, args, device) for b in args.batches]
    at_target = [r for r in rows if r["batch"] == TARGET_BATCH]
    result = dict(size=args.size, dtype=args.dtype, device=device, rows=rows,
                  target=f">= {TARGET_SPEEDUP}x HF at batch {TARGET_BATCH}",
                  meets_target=bool(at_target) and at_target[0]["speedup"] >= TARGET_SPEEDUP,
                  dry_run=args.dry_run)
    args.out.mkdir(parents=True, exist_ok=True)
    write_json(args.out / "e2e_decode.json", result)
    lines = [f"{args.size} {args.dtype} on {device}; target {result['target']}: "
             f"{'MET' if result['meets_target'] else 'NOT MET'}"] + [_fmt(r) for r in rows]
    (args.out / "e2e_decode.txt").write_text("\n".join(lines) + "\n")
    print(lines[0])
    return 0


if __name__ == "__main__":
    sys.exit(main())
