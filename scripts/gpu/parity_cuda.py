"""Greedy parity of trtforge's torch engine with HF transformers, both on the same device.

Tiny random-weight checkpoints (qwen2 and llama shapes) in float32; prompts of different lengths
run together through `LLMEngine.generate` (so prefill, chunked prefill and batched decode all
happen in one in-flight batch); HF generates each prompt alone (no padding effects). The token
ids must match exactly. Writes parity_<device>.json; exits 1 on any mismatch.

    python scripts/gpu/parity_cuda.py --out OUT_DIR --work /tmp/w [--device cpu]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from gpu_common import build_demo_engine, hf_greedy, write_json

PROMPT_LENS = (1, 7, 33, 70)


def check_arch(arch: str, args) -> dict:
    from transformers import AutoModelForCausalLM

    from trtforge.config.runtime import RuntimeConfig
    from trtforge.config.sampling import SamplingParams
    from trtforge.serving.engine import LLMEngine

    # A small prefill chunk forces chunked prefill of the longer prompts.
    build_args = ["--max-batch-size", "8", "--max-num-tokens", "64", "--max-seq-len", "256",
                  "--kv-block-size", "16", "--kv-cache-memory", "32MiB"]
    ckpt, engine_dir = build_demo_engine(args.work, "tiny", "float32", build_args, arch=arch,
                                         seed=3)
    model = AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=torch.float32)
    model = model.to(args.device).eval()
    vocab, pad = model.config.vocab_size, model.config.pad_token_id or 0
    gen = torch.Generator().manual_seed(11)
    prompts = [torch.randint(16, vocab, (n,), generator=gen).tolist() for n in PROMPT_LENS]
    expected = [hf_greedy(model, torch.tensor([p], device=args.device), args.new_tokens, pad)[0]
                .tolist() for p in prompts]
    engine = LLMEngine.from_engine_dir(engine_dir, RuntimeConfig(device=args.device), prefill_chunk_size=32)
    outs = engine.generate(prompts, SamplingParams(max_tokens=args.new_tokens, ignore_eos=True))
    got = [o.output_token_ids for o in outs]
    mismatches = []
    for n, want, have in zip(PROMPT_LENS, expected, got):
        if want != have:
            first = next((i for i, (a, b) in enumerate(zip(want, have)) if a != b),
                         min(len(want), len(have)))
            mismatches.append(dict(prompt_len=n, first_diff=first, hf=want, trtforge=have))
    print(f"{arch}: {len(PROMPT_LENS) - len(mismatches)}/{len(PROMPT_LENS)} prompts identical",
          flush=True)
    return dict(arch=arch, prompts=len(PROMPT_LENS), mismatches=mismatches)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--work", type=Path, required=True)
    p.add_argument("--device", default="cuda")
    p.add_argument("--new-tokens", type=int, default=24)
    p.add_argument("--archs", default="qwen2,llama")
    args = p.parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        p.error("needs a CUDA GPU (pass --device cpu to check the script)")
    args.work.mkdir(parents=True, exist_ok=True)
    results = [check_arch(a, args) for a in args.archs.split(",")]
    ok = all(not r["mismatches"] for r in results)
    write_json(args.out / f"parity_{args.device.split(':')[0]}.json",
               dict(device=args.device, passed=ok, results=results))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
