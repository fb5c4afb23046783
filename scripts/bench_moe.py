"""Mixture-of-Experts decode on CPU: a decode step's time against the bandwidth bound of the bytes it actually
reads — the attention weights, the router, the LM head, the KV and only the experts its tokens selected (not
the whole model) — for float32 and int8_wo engines of one random MoE checkpoint (Mixtral-shaped by default:
8 experts, top-2). Not run in CI; a measurement to read.

    flock /tmp/bench.lock .venv/bin/python scripts/bench_moe.py [--arch mixtral|qwen3_moe] [--batch 1 --batch 4]

Bytes read per step are counted, not assumed: one extra decode step runs with a forward hook on every linear
layer, which adds the bytes of the weights (packed layouts, int8 codes and scales, biases) of each layer that
ran; an expert no token chose never runs and is not counted. The bound is those bytes plus the KV read by
attention, divided by the machine's copy bandwidth measured just before (bytes read + written per second,
STREAM's counting, as scripts/bench_quant.py). Times are the median decode step of the best of --repeats
runs (the machine may be shared: the least disturbed run). Decode steps run the CPU decode plan
(serving/worker/cpu_decode_plan.py: MoE layers as C calls) where the engine has one; the same steps through
the network's modules (the plan switched off) are measured in the same run as the baseline ("modules"). The
hooks count bytes on a step through the modules (the plan calls no module); both paths route alike.
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
from torch import nn

from trtforge.bench.offline import copy_bandwidth
from trtforge.builder.build import build_engine
from trtforge.builder.build_config import BuildConfig
from trtforge.config.sampling import SamplingParams
from trtforge.models.kv_sizing import kv_bytes_per_token
from trtforge.models.layers import TiedLMHead
from trtforge.models.quantized_layers import QuantLinear
from trtforge.plugins import native
from trtforge.plugins.cpu.linear import CpuLinear
from trtforge.serving.engine import LLMEngine

SHAPES = {  # hidden 1024, 4 layers: the experts dominate the bytes, as in the real models
    "mixtral": dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=4, num_attention_heads=16,
                    num_key_value_heads=4, num_local_experts=8, num_experts_per_tok=2, sliding_window=None),
    "qwen3_moe": dict(hidden_size=1024, intermediate_size=2816, moe_intermediate_size=704, num_hidden_layers=4,
                      num_attention_heads=16, num_key_value_heads=4, head_dim=64, num_experts=32,
                      num_experts_per_tok=4, norm_topk_prob=True),
}
ARCHITECTURES = {"mixtral": "MixtralForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}
PROMPT_LEN, STEPS = 16, 24


def make_checkpoint(directory: Path, arch: str) -> Path:
    from transformers import AutoConfig, AutoModelForCausalLM

    from trtforge.builder.tokenizer_training import train_tiny_tokenizer

    tok = train_tiny_tokenizer(vocab_size=512)
    tok.save_pretrained(str(directory))
    cfg = AutoConfig.for_model(arch, vocab_size=len(tok), max_position_embeddings=512, **SHAPES[arch],
                               bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                               pad_token_id=tok.pad_token_id)
    cfg.architectures = [ARCHITECTURES[arch]]
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():  # routers spread out, so tokens choose different experts
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.normal_(0, 0.5)
    model.save_pretrained(str(directory), safe_serialization=True)
    return directory


def _tensor_bytes(module: nn.Module) -> int:
    """Bytes of the weights a linear layer reads when it runs (whatever layout the kernels packed them in)."""
    tensors = [t for t in (*module._parameters.values(), *module._buffers.values()) if t is not None]
    tensors += list(getattr(module, "vnni", None) or ())
    if isinstance(module, TiedLMHead) and module.packed is None:
        tensors.append(module.weight)
    return sum(t.numel() * t.element_size() for t in tensors)


def _prompts(batch: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(5, vocab, (PROMPT_LEN,), generator=g).tolist() for _ in range(batch)]


def _submit(engine: LLMEngine, batch: int, seed: int) -> None:
    """`batch` requests at once: the first step prefills them all (batch x 16 tokens fit one step), every
    later step is a pure decode of all of them (they finish together)."""
    for p in _prompts(batch, engine.engine_config.model.vocab_size, seed):
        engine.add_request(p, SamplingParams(max_tokens=STEPS + 1, ignore_eos=True))


def decode_steps(engine: LLMEngine, batch: int, seed: int) -> list[float]:
    """Seconds of each pure decode step of `batch` requests generated together (the prefill step excluded)."""
    _submit(engine, batch, seed)
    times = []
    while engine.has_unfinished():
        t = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t)
    return times[1:]


def bytes_read_per_step(engine: LLMEngine, batch: int, seed: int) -> tuple[float, int, list]:
    """(mean weight bytes a decode step reads, bytes of every linear layer's weights, the (layer, input) calls of
    the last decode step): counted by hooks."""
    ex = engine.executor
    net = ex.network
    linears = [m for m in net.modules() if isinstance(m, (CpuLinear, QuantLinear, TiedLMHead, nn.Linear))]
    read, calls = [0], []

    def count(module, args, _out):
        read[0] += _tensor_bytes(module)
        calls.append((module, args[0].clone()))
    hooks = [m.register_forward_hook(count) for m in linears]
    per_step, plan, ex.cpu_plan = [], ex.cpu_plan, None  # the modules' path: the hooks see every linear
    try:
        _submit(engine, batch, seed)
        while engine.has_unfinished():
            read[0] = 0
            calls.clear()
            engine.step()
            per_step.append(read[0])
    finally:
        ex.cpu_plan = plan
        for h in hooks:
            h.remove()
    return statistics.mean(per_step[1:]), sum(_tensor_bytes(m) for m in linears), list(calls)


def linears_alone(calls: list) -> float:
    """Median seconds of one decode step's linear layers (the experts chosen, attention, router, head) run back
    to back on their recorded inputs, nothing else: what the kernels take, apart from the step's other work."""
    times = []
    with torch.inference_mode():
        for _ in range(7):
            t = time.perf_counter()
            for module, x in calls:
                module(x)
            times.append(time.perf_counter() - t)
    return statistics.median(times)


def bench(engine_dir: Path, batch: int, repeats: int) -> dict:
    engine = LLMEngine.from_engine_dir(engine_dir)
    cfg, ex = engine.engine_config, engine.executor
    plan = ex.cpu_plan
    decode_steps(engine, batch, seed=99)  # warm-up: kernels built, pages mapped
    weights, all_weights, calls = bytes_read_per_step(engine, batch, seed=1)
    best, best_bw, modules = float("inf"), 0.0, float("inf")
    for _ in range(repeats):
        bw = copy_bandwidth(512 << 20)["best_bytes_per_s"]
        step = statistics.median(decode_steps(engine, batch, seed=1))  # the same tokens as counted
        if step < best:
            best, best_bw = step, bw
        if plan is not None:  # the baseline: the same steps through the network's modules
            ex.cpu_plan = None
            try:
                modules = min(modules, statistics.median(decode_steps(engine, batch, seed=1)))
            finally:
                ex.cpu_plan = plan
    modules = best if plan is None else modules
    alone = linears_alone(calls)
    kv = kv_bytes_per_token(cfg.model, cfg.dtype, cfg.kv_cache_dtype) * (PROMPT_LEN + STEPS // 2) * batch
    bound = (weights + kv) / best_bw
    q = cfg.quantization or {}
    return {"engine": str(engine_dir), "scheme": q.get("scheme", cfg.dtype), "batch": batch,
            "experts": cfg.model.num_experts, "top_k": cfg.model.num_experts_per_tok,
            "weight_bytes_read_per_step": weights, "kv_bytes_read_per_step": kv,
            "weight_bytes_all_experts": all_weights, "copy_GBps_at_best": best_bw / 1e9,
            "decode_ms": 1e3 * best, "bound_ms": 1e3 * bound, "ratio": best / bound, "plan": plan is not None,
            "modules_ms": 1e3 * modules, "modules_ratio": modules / bound,
            "linear_calls_per_step": len(calls), "linears_alone_ms": 1e3 * alone,
            "threads": torch.get_num_threads(), "loadavg_1m": os.getloadavg()[0]}


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        import platform

        return platform.processor() or "unknown"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", choices=sorted(SHAPES), default="mixtral")
    ap.add_argument("--batch", type=int, action="append")
    ap.add_argument("--schemes", default="float32,int8_wo")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json")
    args = ap.parse_args()
    rows = []
    print(f"CPU: {_cpu_model()}; kernels built for {native.isa()}; torch threads {torch.get_num_threads()}",
          flush=True)
    with tempfile.TemporaryDirectory(prefix="bench-moe-") as tmp:
        ckpt = make_checkpoint(Path(tmp) / "ckpt", args.arch)
        for scheme in args.schemes.split(","):
            out = Path(tmp) / scheme
            build_engine(str(ckpt), out, BuildConfig(dtype="float32", max_batch_size=16, max_num_tokens=512,
                                                     kv_cache_memory="64MiB",
                                                     quantization="none" if scheme == "float32" else scheme),
                         progress=False)
            for batch in args.batch or [1, 4]:
                r = bench(out, batch, args.repeats)
                rows.append(r)
                print(f"{args.arch} {r['scheme']:>8} batch {batch:>2}: decode {r['decode_ms']:.2f} ms/step "
                      f"({'decode plan' if r['plan'] else 'modules, no plan'}; modules {r['modules_ms']:.2f} ms = "
                      f"{r['modules_ratio']:.2f}x), reads "
                      f"{r['weight_bytes_read_per_step'] / 1e6:.1f} MB weights (all experts: "
                      f"{r['weight_bytes_all_experts'] / 1e6:.1f} MB) + {r['kv_bytes_read_per_step'] / 1e6:.2f} MB "
                      f"KV; bound {r['bound_ms']:.2f} ms at {r['copy_GBps_at_best']:.1f} GB/s copy -> ratio "
                      f"{r['ratio']:.2f}x; its {r['linear_calls_per_step']} linear calls alone "
                      f"{r['linears_alone_ms']:.2f} ms (threads {r['threads']}, load {r['loadavg_1m']:.1f})",
                      flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
