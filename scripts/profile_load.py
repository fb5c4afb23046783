"""Where the 64-request load's time goes: every engine step of `bench offline`'s workload (the one
`scripts/bench_peers.py` compares with vLLM) timed and classified by what it computed.

    .venv/bin/python scripts/profile_load.py ENGINE_DIR [--requests 64] [--threads 2]
        [--kv-cache-memory 2GiB] [--speculative-config JSON]

Each step is put in one class: "decode only" (every chunk a one-token decode), "prefill only" or
"mixed" (decodes and prefill chunks together). Printed per class: steps, seconds, the decode rows
and prefill tokens it computed, and the C kernels' share of it (the CPU decode plan's linears,
attention and fused norms when the step ran through the plan); then the whole run's output
tokens per second, which is the figure the vLLM comparison reports. Not a test: a measurement to
read, with the machine's CPU model, ISA and load printed beside it.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

from trtforge.bench.offline import machine_info
from trtforge.bench.offline_config import OfflineBenchConfig
from trtforge.bench.workload import make_workload
from trtforge.config.runtime import RuntimeConfig
from trtforge.config.sampling import SamplingParams
from trtforge.plugins import native
from trtforge.serving.engine import LLMEngine

sys.path.insert(0, str(Path(__file__).parent))
from profile_decode import _TimedLibrary  # a script beside this one


def _classify(chunks) -> str:
    decodes = sum(c.is_decode for c in chunks)
    if decodes == len(chunks):
        return "decode only"
    return "prefill only" if decodes == 0 else "mixed"


def _print_speculation(engine: LLMEngine) -> None:
    st = engine.stats()
    print(f"  speculative: {st.spec_decode_num_draft_tokens} draft tokens, {st.spec_decode_num_accepted_tokens} "
          f"accepted, in {st.spec_decode_num_drafts} verifications")


def _args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("engine_dir")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--kv-cache-memory", default="2GiB", help="the vLLM comparison's (2 GiB, as vLLM's)")
    ap.add_argument("--speculative-config", default=None, help="RuntimeConfig.speculative_config (JSON)")
    return ap.parse_args()


def main() -> None:
    a = _args()
    torch.set_num_threads(a.threads)
    print(f"machine: {machine_info()['cpu']}, ISA {native.isa()}, load {os.getloadavg()[0]:.2f}")
    engine = LLMEngine.from_engine_dir(a.engine_dir, RuntimeConfig(kv_cache_memory=a.kv_cache_memory,
                                                                     speculative_config=a.speculative_config),
                                       enable_prefix_caching=False)
    c = OfflineBenchConfig()
    reqs = make_workload(a.requests, (c.prompt_len_min, c.prompt_len_max), (c.output_len_min, c.output_len_max),
                         engine.engine_config.model.vocab_size, c.seed)
    engine.generate([list(range(10, 42))], SamplingParams(max_tokens=4))  # warm-up
    last: dict[str, list] = {}
    schedule = engine.scheduler.schedule

    def schedule_and_keep(*args, **kwargs):
        out = schedule(*args, **kwargs)
        last["chunks"] = list(out.chunks)
        return out

    engine.scheduler.schedule = schedule_and_keep
    parts: dict[str, list[float]] = defaultdict(list)
    plan = getattr(engine.executor, "cpu_plan", None)
    if plan is not None:
        plan.fused = _TimedLibrary(plan.fused, parts, "plan norms/RoPE/SiLU")
        plan.linear = _TimedLibrary(plan.linear, parts, "plan linears")
        plan.attention = _TimedLibrary(plan.attention, parts, "plan attention")
        plan._prepared.clear()
    for r in reqs:
        engine.add_request(r.prompt_token_ids, SamplingParams(max_tokens=r.output_len, ignore_eos=True))
    stats: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    t_start = time.perf_counter()
    out_tokens = 0
    while engine.has_unfinished():
        parts.clear()
        last["chunks"] = []
        t0 = time.perf_counter()
        outs = engine.step()
        dt = time.perf_counter() - t0
        chunks = last["chunks"]
        if not chunks:
            continue
        s = stats[_classify(chunks)]
        s["steps"] += 1
        s["seconds"] += dt
        s["decode rows"] += sum(ch.is_decode for ch in chunks)
        s["prefill tokens"] += sum(ch.num_tokens for ch in chunks if not ch.is_decode)
        for name, ts in parts.items():
            s[name] += sum(ts)
        out_tokens += sum(ch.sample for ch in chunks)
        del outs
    total = time.perf_counter() - t_start
    print(f"{a.requests} requests: {total:.1f} s, {out_tokens} tokens sampled, {out_tokens / total:.1f} tok/s; "
          f"load {os.getloadavg()[0]:.2f}")
    if a.speculative_config:
        _print_speculation(engine)
    for kind, s in sorted(stats.items()):
        line = ", ".join(f"{k} {v:.1f}" if isinstance(v, float) and k not in ("steps",) else f"{k} {int(v)}"
                         for k, v in s.items())
        print(f"  {kind:13s} {100 * s['seconds'] / total:5.1f} %: {line}")


if __name__ == "__main__":
    main()
