"""Weight-only quantisation on CPU: batch-1 decode ms/token against the copy-bandwidth bound, and
prefill tokens/s, for engines of one checkpoint (float32 / int8_wo / int4_wo). Not run in CI;
scripts/bench_quant.sh builds the engines and calls this. Every number is the best of --repeats
runs (the machine may be shared: best-of is the least disturbed run); the copy bandwidth is
measured right before each engine's decode runs.

    python scripts/bench_quant.py ENGINE_DIR... [--repeats 3] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch

from trtforge.bench.offline import copy_bandwidth, weight_bytes_per_decode_step
from trtforge.config.sampling import SamplingParams
from trtforge.models.kv_sizing import kv_bytes_per_token
from trtforge.serving.engine import LLMEngine


def _prompt(n: int, vocab: int, seed: int) -> list[int]:
    return torch.randint(5, min(vocab, 30000), (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def decode_ms(engine: LLMEngine, vocab: int, prompt_len: int = 16, steps: int = 32) -> float:
    """Median batch-1 decode step (ms) of one generation (the prefill step excluded)."""
    engine.add_request(_prompt(prompt_len, vocab, 1), SamplingParams(max_tokens=steps + 1, ignore_eos=True))
    times = []
    while engine.has_unfinished():
        t = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t)
    decode = sorted(times[1:])
    return 1e3 * decode[len(decode) // 2]


def prefill_tok_s(engine: LLMEngine, vocab: int, n: int, seed: int) -> float:
    """Tokens/s of one n-token prompt's prefill step (one chunk; includes sampling one token). A new
    prompt each run: a repeated one would hit the prefix cache and compute nothing."""
    engine.add_request(_prompt(n, vocab, 1000 + seed), SamplingParams(max_tokens=1, ignore_eos=True))
    t = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
    return n / (time.perf_counter() - t)


def bench(engine_dir: str, repeats: int) -> dict:
    engine = LLMEngine.from_engine_dir(engine_dir)
    cfg = engine.engine_config
    vocab = cfg.model.vocab_size
    weights = weight_bytes_per_decode_step(engine)
    decode_ms(engine, vocab, steps=4)  # warm-up: kernels built, pages mapped
    best_decode, best_bw = float("inf"), 0.0
    for _ in range(repeats):
        bw = copy_bandwidth(512 << 20)["best_bytes_per_s"]
        ms = decode_ms(engine, vocab)
        if ms < best_decode:
            best_decode, best_bw = ms, bw
    # x 32: the mean context of the decode steps (16 + 32/2)
    kv = kv_bytes_per_token(cfg.model, cfg.dtype, cfg.kv_cache_dtype) * 32
    bound_ms = 1e3 * (weights + kv) / best_bw
    prefill = {n: max(prefill_tok_s(engine, vocab, n, seed) for seed in range(repeats)) for n in (128, 512)}
    q = cfg.quantization or {}
    return {"engine": engine_dir, "scheme": q.get("scheme", cfg.dtype), "group_size": q.get("group_size"),
            "describe": engine.executor.describe(), "weight_bytes_read_per_step": weights,
            "file_weight_bytes": cfg.report["weight_bytes"], "copy_GBps_at_best": best_bw / 1e9,
            "decode_ms_per_token": best_decode, "decode_bound_ms": bound_ms, "decode_vs_bound": best_decode / bound_ms,
            "prefill_tok_s": prefill, "threads": torch.get_num_threads(), "loadavg_1m": os.getloadavg()[0]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("engines", nargs="+")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json")
    args = ap.parse_args()
    rows = []
    for e in args.engines:
        r = bench(e, args.repeats)
        rows.append(r)
        print(f"{r['scheme']:>8}  weights read/step {r['weight_bytes_read_per_step'] / 1e9:.3f} GB  "
              f"decode {r['decode_ms_per_token']:.1f} ms/token  bound {r['decode_bound_ms']:.1f} ms "
              f"(copy {r['copy_GBps_at_best']:.1f} GB/s)  ratio {r['decode_vs_bound']:.2f}x  "
              f"prefill 128: {r['prefill_tok_s'][128]:.0f} tok/s, 512: {r['prefill_tok_s'][512]:.0f} tok/s  "
              f"load {r['loadavg_1m']:.1f}\n          {r['describe']}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
