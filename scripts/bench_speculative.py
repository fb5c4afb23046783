"""Speculative decoding (ngram, draft_model) vs plain decoding, batch 1, in the same run
(docs/speculative-decoding.md).

A random-weight model predicts nothing, so this script trains its own models first: two
Qwen2-family decoders (HF transformers, random init) fitted to the bundled demo text
(builder/demo_text.py) with the demo checkpoint's tokenizer and trainer, long enough to know the
text by heart — the target (TARGET_DIMS, ~13 M parameters) and a small model (DIMS, ~25x fewer)
that is the draft of draft_model, with the same tokenizer files. Two workloads, each prompt run by
every engine in turn:

* copy-heavy: the prompt quotes a passage of the text, then starts it again; the answer repeats
  the passage (what "rewrite / continue this passage" prompts do), so prompt lookup predicts it,
  and so does a draft model that knows the text;
* control (no overlap): the prompt is the first words of a line; the answer goes on with text the
  prompt does not contain (prompt lookup has nothing; a draft model still may).

Printed: output tok/s of each engine, the ratio, acceptance, whether greedy outputs are identical;
then the adaptive rule (ngram with the rule switched off) and a batch of 16 copy requests (the
batch-size rule). Run it under the benchmark lock:

    flock /tmp/bench.lock python scripts/bench_speculative.py [--work out/bench_speculative] [--json f]
"""

from __future__ import annotations

import argparse
import json
import shutil
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
"""The small model: the target of the ngram rows of earlier runs, the draft of draft_model."""
TARGET_DIMS = dict(hidden_size=384, intermediate_size=1152, num_hidden_layers=6, num_attention_heads=6,
                   num_key_value_heads=2, max_position_embeddings=2048)
"""The target: ~13 M parameters (a decode step reads ~54 MB of float32 weights), ~25x the draft."""


def trained_checkpoint(out: Path, seconds: float, dims: dict, seed: int = 0, tokenizer_from: Path | None = None,
                       lr: float = 3e-3) -> Path:
    """A Qwen2 model of `dims` trained `seconds` on the demo text (the demo checkpoint's trainer);
    kept and reused by later runs. `tokenizer_from`: a checkpoint whose tokenizer files are copied
    (byte for byte: a draft and its target must share the vocabulary)."""
    if (out / "config.json").exists():
        return out
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    out.mkdir(parents=True, exist_ok=True)
    if tokenizer_from is not None:
        for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
            if (tokenizer_from / name).is_file():
                shutil.copyfile(tokenizer_from / name, out / name)
        tokenizer = AutoTokenizer.from_pretrained(str(out))
    else:
        tokenizer = train_tiny_tokenizer(vocab_size=4096, texts=corpus_lines())
    cfg = Qwen2Config(vocab_size=len(tokenizer), **dims, bos_token_id=tokenizer.bos_token_id,
                      eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                      tie_word_embeddings=False)
    cfg.architectures = ["Qwen2ForCausalLM"]
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(cfg)
    steps = train_briefly(model, tokenizer, seconds, seed, lr=lr)
    print(f"trained {out.name}: {steps} steps in {seconds:g} s")
    model.save_pretrained(str(out), safe_serialization=True)
    if tokenizer_from is None:
        tokenizer.save_pretrained(str(out))
    return out


def build(ckpt: Path, out: Path) -> Path:
    if not (out / "engine.json").exists():
        build_engine(str(ckpt), out, BuildConfig(dtype="float32", max_batch_size=16, max_num_tokens=1024,
                                                 max_seq_len=1024, kv_cache_memory="64MiB"), progress=False)
    return out


def engine_dirs(work: Path, seconds: float, target_seconds: float) -> tuple[Path, Path]:
    """(target engine, draft engine): the draft is the small model (work/engine, as earlier runs
    built it), the target the larger one trained with the same tokenizer files."""
    small = trained_checkpoint(work / "checkpoint", seconds, DIMS)
    large = trained_checkpoint(work / "target-checkpoint", target_seconds, TARGET_DIMS, seed=1,
                               tokenizer_from=small, lr=2e-3)
    return build(large, work / "target-engine"), build(small, work / "engine")


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
    ap.add_argument("--train-seconds", type=float, default=420.0, help="training of the draft (the small model)")
    ap.add_argument("--target-train-seconds", type=float, default=600.0, help="training of the target")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    path, draft = engine_dirs(args.work, args.train_seconds, args.target_train_seconds)
    spec = SpeculativeConfig(num_speculative_tokens=args.k, prompt_lookup_max=4, prompt_lookup_min=2)
    no_rule = SpeculativeConfig(num_speculative_tokens=args.k, prompt_lookup_max=4, prompt_lookup_min=2,
                                disable_by_batch_size=None, backoff_after_rejections=0)
    drafting = SpeculativeConfig(method="draft_model", model=str(draft), num_speculative_tokens=args.k)
    engines = {"plain": LLMEngine.from_engine_dir(path),
               "ngram": LLMEngine.from_engine_dir(path, RuntimeConfig(speculative_config=spec)),
               "ngram, no adaptive rule": LLMEngine.from_engine_dir(path, RuntimeConfig(speculative_config=no_rule)),
               "draft_model": LLMEngine.from_engine_dir(path, RuntimeConfig(speculative_config=drafting))}
    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
    report: dict = {"config": spec.to_json(), "draft_model_config": drafting.to_json(), "target": TARGET_DIMS,
                    "draft": DIMS, "max_tokens": args.max_tokens, "threads": args.threads}
    print(f"target {TARGET_DIMS['num_hidden_layers']} layers x {TARGET_DIMS['hidden_size']}, draft "
          f"{DIMS['num_hidden_layers']} layers x {DIMS['hidden_size']} (same tokenizer files), k={args.k}")
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
    rates = {name: batch_rate(engine, batch, params) for name, engine in engines.items()}
    print(f"\nbatch of 16 copy-heavy requests (disable_by_batch_size={spec.disable_by_batch_size}):")
    for name, rate in rates.items():
        print(f"  {name:<24} {rate:8.1f} tok/s  {rate / rates['plain']:.2f}x")
    report["batch16"] = rates
    for name, engine in engines.items():
        s = engine.stats()
        print(f"stats {name}: drafts={s.spec_decode_num_drafts} draft_tokens={s.spec_decode_num_draft_tokens} "
              f"accepted={s.spec_decode_num_accepted_tokens} kv_blocks_used={s.kv_blocks_used}")
    print(f"draft_model: draft KV blocks still held {engines['draft_model'].spec.proposer.kv.num_used_blocks}")
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
