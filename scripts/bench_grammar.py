"""What structured output costs per decode step: the grammar bitmask (fill + apply) alone, and the
engine's decode step with every row constrained by a JSON Schema against the same batch unconstrained.

    python scripts/bench_grammar.py [--engine DIR] [--batch 1 64] [--steps 16] [--threads N]

Without --engine, a tiny demo engine (`trtforge demo-checkpoint`: random weights, its real 4,096-token
byte-level tokenizer) is built in a temporary directory. "mask" is the sampler's own call
(serving/structured_output.apply_grammar_masks: allocate the bitmask, fill each constrained row
from its matcher, apply it to the logits) on random logits of the engine's vocabulary, each matcher
advanced by the token the masked argmax picks, as the engine does. "step" is LLMEngine.step() over
decode-only steps where all rows are running (the first steps after the prefill; each JSON document
is long enough to keep every row constrained throughout). Medians, in milliseconds; the CPU model and
the load average are printed because the numbers depend on both.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from trtforge.config.sampling import SamplingParams
from trtforge.serving.engine import LLMEngine
from trtforge.serving.sampler import SamplingState
from trtforge.serving.structured_output import apply_grammar_masks

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["title", "year", "tags", "notes"],
          "properties": {"title": {"type": "string", "minLength": 8, "maxLength": 24},
                         "year": {"type": "integer", "minimum": 1900, "maximum": 2100},
                         "tags": {"type": "array", "minItems": 2, "maxItems": 4,
                                  "items": {"enum": ["red", "green", "blue", "cyan"]}},
                         "notes": {"type": "string", "minLength": 60, "maxLength": 80}}}


def demo_engine(directory: Path) -> Path:
    from trtforge.builder.build import build_engine
    from trtforge.builder.build_config import BuildConfig
    from trtforge.builder.demo_checkpoint import write_demo_checkpoint

    ckpt = write_demo_checkpoint(directory / "ckpt", arch="qwen2", size="tiny")
    out, _ = build_engine(str(ckpt), directory / "engine",
                          BuildConfig(dtype="float32", max_batch_size=64, max_num_tokens=1024, max_seq_len=256,
                                      kv_block_size=16, kv_cache_memory="64MiB"), progress=False)
    return out


def guided(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.8, seed=1, guided_decoding_guide_type="json_schema",
                          guided_decoding_guide=json.dumps(SCHEMA))


def time_masks(engine: LLMEngine, batch: int, steps: int) -> float:
    """Median ms of apply_grammar_masks over `steps` steps of `batch` constrained rows."""
    vocab = engine.engine_config.model.vocab_size
    compiler = engine.grammar_compiler()
    states = [SamplingState(guided(steps), [1]) for _ in range(batch)]
    for s in states:
        s.grammar = compiler.matcher(s.params)
    times = []
    gen = torch.Generator().manual_seed(0)
    for _ in range(steps):
        logits = torch.randn(batch, vocab, generator=gen)
        start = time.perf_counter()
        apply_grammar_masks(logits, states)
        times.append(time.perf_counter() - start)
        for s, token in zip(states, logits.argmax(dim=-1).tolist()):
            s.grammar.accept(token)
            if s.grammar.is_terminated:
                s.grammar = compiler.matcher(s.params)
    return statistics.median(times) * 1e3


def time_decode_steps(engine_dir: Path, batch: int, steps: int, constrained: bool) -> float:
    """Median ms of the engine's decode steps with `batch` rows, all (un)constrained."""
    engine = LLMEngine.from_engine_dir(engine_dir)
    prompts = [f"Item {i}: a short description of the thing" for i in range(batch)]
    params = guided(steps + 4) if constrained else SamplingParams(max_tokens=steps + 4, temperature=0.8, seed=1,
                                                                  ignore_eos=True)
    for prompt in prompts:
        engine.add_request(prompt, params)
    while engine.stats().num_waiting or any(  # the prefill steps (and admission) are not timed
            s.num_computed_tokens < s.num_prompt_tokens for s in engine.scheduler._running):
        engine.step()
    times = []
    for _ in range(steps):
        if engine.stats().num_running != batch:
            break
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    while engine.has_unfinished():
        engine.step()
    return statistics.median(times) * 1e3


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown CPU"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engine", type=Path, help="engine directory (default: build a tiny demo engine)")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 64])
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory(prefix="bench-grammar-") as tmp:
        engine_dir = args.engine or demo_engine(Path(tmp))
        engine = LLMEngine.from_engine_dir(engine_dir)
        start = time.perf_counter()
        engine.grammar_compiler().compile("json_schema", json.dumps(SCHEMA))
        compile_ms = (time.perf_counter() - start) * 1e3  # tokenizer info + first compile
        print(f"# {cpu_model()}, {os.cpu_count()} CPUs, torch threads {torch.get_num_threads()}, "
              f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
        print(f"# engine {engine_dir}: vocab {engine.engine_config.model.vocab_size}; "
              f"tokenizer info + first schema compile {compile_ms:.1f} ms")
        print(f"{'batch':>5} {'mask ms/step':>13} {'step ms free':>13} {'step ms json':>13} {'overhead':>9}")
        for batch in args.batch:
            mask = time_masks(engine, batch, args.steps)
            free = time_decode_steps(engine_dir, batch, args.steps, constrained=False)
            json_ = time_decode_steps(engine_dir, batch, args.steps, constrained=True)
            print(f"{batch:5d} {mask:13.3f} {free:13.3f} {json_:13.3f} {100 * (json_ / free - 1):8.1f}%")


if __name__ == "__main__":
    main()
