"""Where a batched decode step's time goes: scheduler, input preparation, the network (its linear
layers measured on their own, attention + norms + RoPE the rest), sampler, token bookkeeping.

    .venv/bin/python scripts/profile_decode.py ENGINE_DIR [--batch 16 --batch 64] [--context 256]
        [--attention-source OLD_cpu_decode.c] [--fused-source OLD_fused.c]

For each batch size: that many requests with `--context`-token prompts are prefilled, then
`--steps` pure decode steps are timed part by part (the engine's own methods, wrapped on this
instance); after them the step's linears run alone on `batch` rows (the same modules, the same
order) so the network's time splits into linears and the rest. Medians over the steps; the
machine's CPU model, ISA and load are printed with them. Not a test: a measurement to read.
`--attention-source` / `--fused-source` run the decode attention kernel / the fused norm, RoPE and
SiLU kernels built from another version of cpu_decode.c / fused.c (same flags), to compare two
versions on one engine in one session.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections import defaultdict
from pathlib import Path

import torch

from trtforge.bench.offline import _linear_calls
from trtforge.config.runtime import RuntimeConfig
from trtforge.config.sampling import SamplingParams
from trtforge.plugins import kernels, native
from trtforge.plugins.cpu import fused as cpu_fused
from trtforge.plugins.paged_attention import cpu_native
from trtforge.serving import engine as engine_module
from trtforge.serving.engine import LLMEngine


def _timed(parts: dict[str, list[float]], name: str, fn):
    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            parts[name].append(time.perf_counter() - t0)
    return wrapper


class _TimedLibrary:
    """A C library whose every function call is timed into parts[name] (the CPU decode plan's
    kernels: linear, fused ops, attention)."""

    def __init__(self, lib, parts: dict[str, list[float]], name: str):
        self._lib, self._parts, self._name = lib, parts, name

    def __getattr__(self, fn: str):
        return _timed(self._parts, self._name, getattr(self._lib, fn))


def _linears_alone(calls: list, batch: int) -> float:
    """Median seconds of the step's linear layers run back to back on `batch` rows."""
    xs = [torch.randn(batch, n_in) for _, n_in, _ in calls]
    times = []
    with torch.inference_mode():
        for _ in range(5):
            t0 = time.perf_counter()
            for (fn, _, _), x in zip(calls, xs):
                fn(x)
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def profile(engine: LLMEngine, batch: int, context: int, steps: int) -> dict[str, float]:
    vocab = engine.engine_config.model.vocab_size
    reqs = [engine.add_request([(7 + 31 * i + j) % vocab for j in range(context)],
                               SamplingParams(max_tokens=steps + 8, ignore_eos=True)) for i in range(batch)]
    while any(len(engine._requests[r].sampling.output_token_ids) == 0 for r in reqs):
        engine.step()  # the prefills
    parts: dict[str, list[float]] = defaultdict(list)
    originals = {"schedule": engine.scheduler.schedule, "update": engine.scheduler.update,
                 "execute": engine.executor.execute, "sample": engine.sampler.sample,
                 "tokens": engine._on_token_or_fail}
    engine.scheduler.schedule = _timed(parts, "scheduler", originals["schedule"])
    engine.scheduler.update = _timed(parts, "scheduler", originals["update"])
    engine.executor.execute = _timed(parts, "network", originals["execute"])
    engine.sampler.sample = _timed(parts, "sampler", originals["sample"])
    engine._on_token_or_fail = _timed(parts, "tokens (detokenize, stop, outputs)", originals["tokens"])
    plan = getattr(engine.executor, "cpu_plan", None)
    plan_libs = None
    if plan is not None:
        plan_libs = plan.fused, plan.linear, plan.attention
        plan.fused = _TimedLibrary(plan.fused, parts, "  plan: norms, RoPE, SiLU (C)")
        plan.linear = _TimedLibrary(plan.linear, parts, "  plan: linears (C)")
        plan.attention = _TimedLibrary(plan.attention, parts, "  plan: attention (C)")
        plan._prepared.clear()  # its call tuples hold the functions
    prepare = engine_module.prepare_inputs
    engine_module.prepare_inputs = _timed(parts, "prepare inputs", prepare)
    step_times = []
    try:
        for _ in range(steps):
            t0 = time.perf_counter()
            engine.step()
            step_times.append(time.perf_counter() - t0)
    finally:
        engine_module.prepare_inputs = prepare
        for name in ("schedule", "update"):
            setattr(engine.scheduler, name, originals[name])
        engine.executor.execute, engine.sampler.sample = originals["execute"], originals["sample"]
        engine._on_token_or_fail = originals["tokens"]
        if plan_libs is not None:
            plan.fused, plan.linear, plan.attention = plan_libs
            plan._prepared.clear()
    for r in reqs:
        engine.abort(r)
    while engine.has_unfinished():
        engine.step()
    # per step: the parts called several times a step (scheduler, tokens) summed
    per_step = {name: sum(ts) / steps for name, ts in parts.items()}
    calls = _linear_calls(engine)
    step = sum(step_times) / steps
    linears = min(_linears_alone(calls, batch), per_step["network"])
    out = {"step": step, "network": per_step["network"], "  linears": linears,
           "  attention, norms, RoPE, embed (rest)": per_step["network"] - linears}
    out.update({k: v for k, v in per_step.items() if k != "network"})
    out["other Python in step()"] = step - sum(v for k, v in per_step.items() if not k.startswith("  "))
    flops = 2 * batch * sum(n_in * n_out for _, n_in, n_out in calls)
    out["linear GFLOP/s"] = flops / linears / 1e9
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("engine_dir")
    ap.add_argument("--batch", type=int, action="append", help="decode rows per step (repeatable; default 16, 64)")
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--attention-source", help="build the decode attention kernel from this C file instead")
    ap.add_argument("--fused-source", help="build the fused norm/RoPE/SiLU kernels from this C file instead")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    for source, module in ((args.attention_source, cpu_native), (args.fused_source, cpu_fused)):
        if source:  # before the engine's decode plan takes the library
            lib = native.NativeLibrary(Path(source), module._SIGNATURES, module.LIBRARY.extra_flags).get()
            if lib is None:
                raise SystemExit(f"{source} does not build (see the log)")
            module.LIBRARY.lib = lib
            print(f"{module.LIBRARY.source.name} built from {source}")
    engine = LLMEngine.from_engine_dir(args.engine_dir, RuntimeConfig(kv_cache_memory="1GiB"))
    cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), "?")
    print(f"CPU: {cpu}; ISA: {kernels.detect_isa()}; threads: {args.threads}; load: {os.getloadavg()[0]:.2f}")
    print(f"kernels: {engine.executor.describe() if hasattr(engine.executor, 'describe') else ''}")
    engine.generate([list(range(10, 42))], SamplingParams(max_tokens=4))  # warm-up
    for batch in args.batch or [16, 64]:
        result = profile(engine, batch, args.context, args.steps)
        print(f"\nbatch {batch}, context {args.context}: {batch / result['step']:.1f} tok/s")
        for name, value in result.items():
            if name.endswith("GFLOP/s"):
                print(f"  {name:<42} {value:8.1f}")
            else:
                print(f"  {name:<42} {value * 1e3:8.1f} ms  {100 * value / result['step']:5.1f} %")


if __name__ == "__main__":
    main()
