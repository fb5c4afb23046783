"""Speculative decoding (ngram) vs plain decoding, batch 1, in the same run (docs/speculative-decoding.md).

A random-weight model predicts nothing, so this script trains its own small model first: a
Qwen2-family decoder (HF transformers, random init) fitted to the bundled demo text
(builder/demo_text.py) with the demo checkpoint's tokenizer and trainer, long enough to know
the text by heart. Two workloads, each prompt run by both engines in turn:

* copy-heavy: the prompt quotes a passage of the text, then starts it again; the answer repeats
  the passage (what "rewrite / continue this passage" prompts do), so prompt lookup predicts it;
* control (no overlap): the prompt is the first words of a line; the answer goes on with text the
  prompt does not contain.

Printed: output tok/s of each engine, the ratio, acceptance, whether greedy outputs are identical;
then the adaptive rule (the control workload with the rule switched off) and a batch of 16 copy
requests (the batch-size rule). Run it under the benchmark lock:

    flock /tmp/bench.lock python scripts/bench_speculative.py [--work out/bench_speculative] [--json f]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from trtforge.builder.build import build_engine
from trtforge.builder.build_config import BuildConfig
from trtforge.builder.demo_text import corpus_lines, train_briefly
from trtforge.builder.tokenizer_training import train_tiny_tokenizer
from trtforge.config.runtime import RuntimeConfig
from trtforge.config.sampling import SamplingParams
from trtforge.config.speculative import SpeculativeConfig
from trtforge.serving.engine import LLMEngine

DIMS = dict(hidden_size=128, intermediate_size=384, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=2048)


def trained_checkpoint(out: Path, seconds: float, seed: int = 0) -> Path:
    """A Qwen2 model of DIMS trained `seconds` on the demo text (the demo checkpoint's trainer);
    kept and reused by later runs."""
    if (out / "config.json").exists():
        return out
    from transformers import Qwen2Config, Qwen2ForCausalLM

    tokenizer = train_tiny_tokenizer(vocab_size=4096, texts=corpus_lines())
    cfg = Qwen2Config(vocab_size=len(tokenizer), **DIMS, bos_token_id=tokenizer.bos_token_id,
                      eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                      tie_word_embeddings=False)
    cfg.architectures = ["Qwen2ForCausalLM"]
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(cfg)
    steps = train_briefly(model, tokenizer, seconds, seed)
    print(f"trained {steps} steps in {seconds:g} s")
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out), safe_serialization=True)
    tokenizer.save_pretrained(str(out))
    return out


def engine_dir(work: Path, seconds: float) -> Path:
    out = work / "engine"
    if not (out / "engine.json").exists():
        ckpt = trained_checkpoint(work / "checkpoint", seconds)
        build_engine(str(ckpt), out, BuildConfig(dtype="float32", max_batch_size=16, max_num_tokens=1024,
                                                 max_seq_len=1024, kv_cache_memory="64MiB"), progress=False)
    return out


def workloads(n: int) -> dict[str, list[str]]:
    """copy-heavy: three lines of the text, then the first words of the first again (the answer
    repeats the passage); control: the first words of a line (nothing to repeat)."""
    lines = [line for line in corpus_lines() if line.strip()]  # each ends with its newline
    copy, control = [], []
    for i in range(n):
        passage = "".join(lines[3 * i:3 * i + 3])
        copy.append(passage + " ".join(passage.split()[:4]))
        control.append(" ".join(lines[(3 * i + 40) % len(lines)].split()[:4]))
    return {"copy-heavy": copy, "control": control}


def run_one(engine: LLMEngine, prompt: str, params: SamplingParams) -> tuple[float, list[int], int, int]:
    start = time.perf_counter()
    out = engine.generate([prompt], params)[0]
    return time.perf_counter() - start, out.output_token_ids, out.num_draft_tokens, out.num_accepted_tokens


def compare(engines: dict[str, LLMEngine], prompts: list[str], params: SamplingParams,
            rounds: int) -> dict[str, dict]:
    """Each prompt through each engine in turn, `rounds` times; tok/s = the median round's."""
    results = {name: {"rates": [], "drafts": 0, "accepted": 0, "outputs": []} for name in engines}
    before = {name: engine.stats().spec_decode_num_drafts for name, engine in engines.items()}
    for _ in range(rounds):
        totals = {name: [0.0, 0] for name in engines}
        for prompt in prompts:
            for name, engine in engines.items():
                seconds, ids, drafts, accepted = run_one(engine, prompt, params)
                totals[name][0] += seconds
                totals[name][1] += len(ids)
                r = results[name]
                r["drafts"] += drafts
                r["accepted"] += accepted
                if len(r["outputs"]) < len(prompts):
                    r["outputs"].append(ids)
        for name, (seconds, tokens) in totals.items():
            results[name]["rates"].append(tokens / seconds)
    for name, r in results.items():
        r["tok_s"] = statistics.median(r["rates"])
        r["acceptance"] = r["accepted"] / r["drafts"] if r["drafts"] else 0.0
        verifications = engines[name].stats().spec_decode_num_drafts - before[name]
        r["tokens_per_verification"] = 1 + r["accepted"] / verifications if verifications else 0.0
    return results


def batch_rate(engine: LLMEngine, prompts: list[str], params: SamplingParams) -> float:
    start = time.perf_counter()
    outs = engine.generate(prompts, params)
    return sum(len(o.output_token_ids) for o in outs) / (time.perf_counter() - start)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--work", type=Path, default=Path("out/bench_speculative"))
    ap.add_argument("--train-seconds", type=float, default=420.0)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    path = engine_dir(args.work, args.train_seconds)
    spec = SpeculativeConfig(num_speculative_tokens=args.k, prompt_lookup_max=4, prompt_lookup_min=2)
    no_rule = SpeculativeConfig(num_speculative_tokens=args.k, prompt_lookup_max=4, prompt_lookup_min=2,
                                disable_by_batch_size=None, backoff_after_rejections=0)
    engines = {"plain": LLMEngine.from_engine_dir(path),
               "ngram": LLMEngine.from_engine_dir(path, RuntimeConfig(speculative_config=spec)),
               "ngram, no adaptive rule": LLMEngine.from_engine_dir(path, RuntimeConfig(speculative_config=no_rule))}
    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
    report: dict = {"config": spec.to_json(), "max_tokens": args.max_tokens, "threads": args.threads}
    print(f"{'workload':<12} {'engine':<24} {'tok/s':>8} {'vs plain':>9} {'acceptance':>11} "
          f"{'tok/verify':>11} {'identical':>10}")
    for workload, prompts in workloads(args.prompts).items():
        res = compare(engines, prompts, params, args.rounds)
        base = res["plain"]
        report[workload] = {}
        for name, r in res.items():
            same = r["outputs"] == base["outputs"]
            per_verify = r["tokens_per_verification"]
            print(f"{workload:<12} {name:<24} {r['tok_s']:8.1f} {r['tok_s'] / base['tok_s']:8.2f}x "
                  f"{r['acceptance']:11.2f} {per_verify:11.2f} {str(same):>10}")
            report[workload][name] = {"tok_s": r["tok_s"], "ratio": r["tok_s"] / base["tok_s"],
                                      "acceptance": r["acceptance"], "draft_tokens": r["drafts"],
                                      "accepted_tokens": r["accepted"], "tokens_per_verification": per_verify,
                                      "identical": same}
    batch = workloads(16)["copy-heavy"]
    rates = {name: batch_rate(engines[name], batch, params) for name in ("plain", "ngram", "ngram, no adaptive rule")}
    print(f"\nbatch of 16 copy-heavy requests (disable_by_batch_size={spec.disable_by_batch_size}):")
    for name, rate in rates.items():
        print(f"  {name:<24} {rate:8.1f} tok/s  {rate / rates['plain']:.2f}x")
    report["batch16"] = rates
    for name, engine in engines.items():
        s = engine.stats()
        print(f"stats {name}: drafts={s.spec_decode_num_drafts} draft_tokens={s.spec_decode_num_draft_tokens} "
              f"accepted={s.spec_decode_num_accepted_tokens} kv_blocks_used={s.kv_blocks_used}")
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
