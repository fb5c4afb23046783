"""`trtforge bench offline`: throughput of in-flight batching against Hugging Face `generate`,
plus the per-request latency and KV-memory experiments, all measured in ONE run on one machine.

    workload (random ids, fixed output lengths, EOS ignored)
      ├─ (a) HF generate, one request at a time        ┐ on the first `baseline_requests`
      ├─ (b) HF generate, static padded batches         ┘ requests (same distribution)
      ├─ (c) trtforge LLMEngine, all requests at once   — on all requests, and on the baseline subset
      ├─ seed experiment: TTFT vs per-token decode time for prompt lengths 10..2000 (alone)
      ├─ KV waste (allocated-but-unused slots) and concurrency vs a max_seq_len reservation
      └─ batch-1 decode step vs the memory-bandwidth bound (copy bandwidth measured here)

A benchmark is a script with a report, not a timed test.
"""

from __future__ import annotations

import gc
import os
import platform
import statistics
from dataclasses import asdict
from typing import Any, Callable

import torch

from trtforge.bench import baselines
from trtforge.bench.offline_config import OfflineBenchConfig
from trtforge.bench.workload import BenchRequest, Stopwatch, SystemResult, make_workload
from trtforge.config.runtime import RuntimeConfig
from trtforge.config.sampling import SamplingParams
from trtforge.models.kv_sizing import kv_bytes_per_token
from trtforge.serving.engine import LLMEngine


# ---- machine ---------------------------------------------------------------------------------
def copy_bandwidth(num_bytes: int = 1 << 30, reps: int = 5) -> dict[str, float]:
    """Large torch tensor copy: bytes read + written per second (STREAM's 'copy' counting)."""
    src = torch.ones(num_bytes // 4, dtype=torch.float32)
    dst = torch.empty_like(src)
    dst.copy_(src)  # touch the pages first: page faults are not bandwidth
    rates = []
    for _ in range(reps):
        with Stopwatch() as sw:
            dst.copy_(src)
        rates.append(2 * num_bytes / sw.elapsed)
    del src, dst
    return {"median_bytes_per_s": statistics.median(rates), "best_bytes_per_s": max(rates)}


def machine_info() -> dict[str, Any]:
    model = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            model = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), model)
    except OSError:
        pass
    return {"cpu": model, "cpus": os.cpu_count(), "torch": torch.__version__,
            "threads": torch.get_num_threads(), "loadavg_1m": os.getloadavg()[0]}


# ---- trtforge ------------------------------------------------------------------------------
def weight_bytes_per_decode_step(engine: LLMEngine) -> int:
    """Bytes of weights one decode step must read: every converted weight once (engine.json's
    report; a tied LM head is the embedding, read whole), except embedding tables that are only
    gathered row by row. Read from the engine, not the module: a CPU engine's linear layers hold
    oneDNN-packed buffers rather than parameters. An MoE engine's every expert is counted, though a
    step reads only those its tokens chose: for MoE the bound is scripts/bench_moe.py's (it counts
    the bytes of the experts that ran)."""
    from trtforge.models.dtypes import DTYPE_BYTES

    cfg = engine.engine_config
    total = int(cfg.report["weight_bytes"])  # quantized engines: the packed weights and their scales
    per = DTYPE_BYTES[cfg.dtype]  # embeddings stay in the engine dtype, quantized or not
    m = cfg.model
    gathered = 0 if m.tie_word_embeddings else m.vocab_size * m.hidden_size
    gathered += m.max_position_embeddings * m.hidden_size if m.position == "learned" else 0
    return total - gathered * per


def _kv_slots_in_use(engine: LLMEngine) -> int:
    return engine.scheduler.kv_manager.num_stored_tokens


def run_inflight(engine: LLMEngine, requests: list[BenchRequest], name: str) -> SystemResult:
    """All requests submitted at once; KV use sampled after every step."""
    block = engine.scheduler_config.block_size
    rids = [engine.add_request(r.prompt_token_ids, SamplingParams(max_tokens=r.output_len, ignore_eos=True))
            for r in requests]
    waste, running_while_waiting, peak_running, steps, finals = [], [], 0, 0, {}
    preempt0 = engine.stats().num_preemptions
    with Stopwatch() as sw:
        while engine.has_unfinished():
            for out in engine.step():
                if out.finished:
                    finals[out.request_id] = out
            steps += 1
            st = engine.stats()
            allocated = st.kv_blocks_used * block
            if allocated:
                waste.append(1 - _kv_slots_in_use(engine) / allocated)
            peak_running = max(peak_running, st.num_running)
            if st.num_waiting:
                running_while_waiting.append(st.num_running)
    outs = [finals[r] for r in rids]
    generated = sum(len(o.output_token_ids) for o in outs)
    useful = sum(r.output_len for r in requests)
    if generated != useful or any(o.finish_reason != "length" for o in outs):
        raise RuntimeError(f"trtforge generated {generated} tokens, expected {useful}")
    sc = engine.scheduler_config
    extra = {"steps": steps, "preemptions": engine.stats().num_preemptions - preempt0,
             "kv_waste_mean": statistics.fmean(waste) if waste else 0.0,
             "peak_running": peak_running,
             "mean_running_while_waiting": statistics.fmean(running_while_waiting) if running_while_waiting else None,
             "kv_blocks": sc.num_blocks, "block_size": block, "max_seq_len": sc.max_seq_len,
             "ttft_p50_s": statistics.median(o.metrics.ttft for o in outs),
             "tpot_p50_s": statistics.median(o.metrics.tpot for o in outs if o.metrics.tpot is not None)}
    return SystemResult(name, len(requests), sw.elapsed, useful, generated,
                        sum(r.prompt_len for r in requests), extra)


def kv_capacity(result: SystemResult, workload_max_len: int) -> dict[str, Any]:
    """Concurrent sequences the KV budget held vs reserving max_seq_len (or the workload's
    longest prompt + output) per sequence, as a static-batching system must."""
    e = result.extra
    slots = e["kv_blocks"] * e["block_size"]
    measured = e["mean_running_while_waiting"] or e["peak_running"]
    static = max(slots // e["max_seq_len"], 1)
    static_workload = max(slots // workload_max_len, 1)
    return {"kv_slots": slots, "paged_concurrent_mean_while_waiting": e["mean_running_while_waiting"],
            "paged_concurrent_peak": e["peak_running"], "kv_was_binding": e["mean_running_while_waiting"] is not None,
            "static_max_seq_len": static, "ratio_vs_max_seq_len": measured / static,
            "static_workload_max": static_workload, "ratio_vs_workload_max": measured / static_workload}


def seed_experiment(engine: LLMEngine, prompt_lens: list[int], output_len: int, vocab: int,
                    weight_bytes: int, probe: Callable[[], float]) -> list[dict[str, Any]]:
    """Each prompt alone: TTFT (prefill) vs mean decode step, and the decode step's bound =
    (weights + mean KV read per step) / copy bandwidth.

    The copy bandwidth of a shared VM drifts by tens of percent over minutes, so it is probed
    right before and right after each prompt's generation (`probe` returns bytes/s) and the bound
    uses their mean: the bound and the decode steps are measured under the same conditions."""
    cfg = engine.engine_config
    kv_per_token = kv_bytes_per_token(cfg.model, cfg.dtype, cfg.kv_cache_dtype)
    rows = []
    for n in prompt_lens:
        (req,) = make_workload(1, (n, n), (output_len, output_len), vocab, seed=n)
        before = probe()
        (out,) = engine.generate([req.prompt_token_ids], SamplingParams(max_tokens=output_len, ignore_eos=True))
        after = probe()
        bandwidth = (before + after) / 2
        m = out.metrics
        mean_context = n + output_len / 2
        bound = (weight_bytes + mean_context * kv_per_token) / bandwidth
        rows.append({"prompt_len": n, "output_len": output_len, "ttft_s": m.ttft,
                     "prefill_tokens_per_s": n / m.ttft, "decode_s_per_token": m.tpot,
                     "copy_bandwidth_before": before, "copy_bandwidth_after": after,
                     "decode_bound_s": bound, "decode_vs_bound": m.tpot / bound})
    return rows


def _linear_calls(engine: LLMEngine) -> list[tuple[Callable[[torch.Tensor], torch.Tensor], int, int]]:
    """The network's matrix products in the order a step calls them: (module, in, out features)."""
    net, m = engine.executor.network, engine.engine_config.model
    calls: list[tuple[Callable[[torch.Tensor], torch.Tensor], int, int]] = []
    for layer in net.layers:
        up = layer.mlp.gate_up if layer.mlp.gated else layer.mlp.up
        up_out = m.intermediate_size * (2 if layer.mlp.gated else 1)
        calls += [(layer.attn.qkv, m.hidden_size, m.q_size + 2 * m.kv_size),
                  (layer.attn.o_proj, m.q_size, m.hidden_size),
                  (up, m.hidden_size, up_out), (layer.mlp.down, m.intermediate_size, m.hidden_size)]
    head = net.head
    calls.append((head, m.hidden_size, m.vocab_size))
    return calls


def decode_breakdown(engine: LLMEngine, probe: Callable[[], float], rounds: int = 3, steps: int = 10,
                     context: int = 32) -> dict[str, Any]:
    """Where a batch-1 decode step's time goes: the same engine's linear layers run back to back on
    one row (the weight-streaming floor of a step) vs whole engine steps, interleaved with copy
    bandwidth probes so all three see the same machine state. Torch engines only."""
    calls = _linear_calls(engine)
    dtype = getattr(torch, engine.engine_config.dtype)  # the activations' (an int8 KV pool's is not)
    device = engine.executor.device
    inputs = [torch.randn(1, n_in, dtype=dtype, device=device) for _, n_in, _ in calls]
    linear_bytes = sum(n_in * n_out for _, n_in, n_out in calls) * torch.finfo(dtype).bits // 8
    request = engine.add_request(list(range(10, 10 + context)),
                                 SamplingParams(max_tokens=rounds * steps + 4, ignore_eos=True))
    engine.step()  # the prefill
    step_times, linear_times, bandwidths = [], [], []
    with torch.inference_mode():
        for _ in range(rounds):
            bandwidths.append(probe())
            for _ in range(steps):
                with Stopwatch() as sw:
                    engine.step()
                step_times.append(sw.elapsed)
            for _ in range(3):
                with Stopwatch() as sw:
                    for (fn, _, _), x in zip(calls, inputs):
                        fn(x)
                linear_times.append(sw.elapsed)
    engine.abort(request)
    while engine.has_unfinished():
        engine.step()
    step, linears = statistics.median(step_times), statistics.median(linear_times)
    bandwidth = statistics.median(bandwidths)
    return {"step_s": step, "linears_s": linears, "other_s": step - linears,
            "linear_bytes": linear_bytes, "linear_bytes_per_s": linear_bytes / linears,
            "copy_bandwidth": bandwidth, "num_linear_calls": len(calls)}


# ---- the whole run -------------------------------------------------------------------------
def run_offline(checkpoint: str, engine_dir: str, cfg: OfflineBenchConfig, log: Any = print) -> dict[str, Any]:
    torch.set_num_threads(cfg.threads)
    engine = LLMEngine.from_engine_dir(engine_dir, RuntimeConfig(kv_cache_memory=cfg.kv_cache_memory))
    model_cfg = engine.engine_config.model
    workload = make_workload(cfg.num_requests, (cfg.prompt_len_min, cfg.prompt_len_max),
                             (cfg.output_len_min, cfg.output_len_max), model_cfg.vocab_size, cfg.seed)
    subset = workload[:cfg.baseline_requests or len(workload)]
    report: dict[str, Any] = {"config": asdict(cfg), "machine": machine_info(),
                              "model": {"architecture": model_cfg.architecture, "layers": model_cfg.num_layers,
                                        "hidden": model_cfg.hidden_size, "dtype": engine.engine_config.dtype}}
    log(f"machine: {report['machine']}")
    probe_bytes = cfg.copy_probe_mib << 20

    def probe() -> float:
        return copy_bandwidth(probe_bytes)["median_bytes_per_s"]

    report["copy_bandwidth"] = copy_bandwidth(probe_bytes)
    log(f"copy bandwidth: {report['copy_bandwidth']['median_bytes_per_s'] / 1e9:.1f} GB/s (read+write)")
    systems: list[SystemResult] = []
    if not cfg.skip_hf:
        del engine  # one model in memory at a time
        gc.collect()
        systems += _run_hf(checkpoint, subset, cfg, model_cfg.pad_token_id, log)
        engine = LLMEngine.from_engine_dir(engine_dir, RuntimeConfig(kv_cache_memory=cfg.kv_cache_memory))
    engine.generate([list(range(10, 42))], SamplingParams(max_tokens=4))  # warm-up, untimed
    for name, reqs in (("trtforge_inflight", workload), ("trtforge_inflight_baseline_subset", subset)):
        if name.endswith("subset") and len(subset) == len(workload):
            continue
        systems.append(run_inflight(engine, reqs, name))
        log(_one_line(systems[-1]))
    report["systems"] = [s.to_dict() for s in systems]
    report["ratios"] = _ratios(systems)
    ours = _get(systems, "trtforge_inflight")
    report["kv"] = {"waste_mean": ours.extra["kv_waste_mean"],
                    **kv_capacity(ours, cfg.prompt_len_max + cfg.output_len_max)}
    weights = weight_bytes_per_decode_step(engine)
    report["decode_weight_bytes"] = weights
    report["seed_experiment"] = seed_experiment(engine, cfg.prompt_lens(), cfg.seed_output_len,
                                                model_cfg.vocab_size, weights, probe)
    torch_network = getattr(getattr(engine.executor, "network", None), "layers", None) is not None
    report["decode_breakdown"] = decode_breakdown(engine, probe) if torch_network else None
    report["machine"]["loadavg_1m_end"] = os.getloadavg()[0]
    return report


def _run_hf(checkpoint: str, subset: list[BenchRequest], cfg: OfflineBenchConfig, pad_id: int | None,
            log: Any) -> list[SystemResult]:
    pad = pad_id if pad_id is not None else 0
    model = baselines.load_hf_model(checkpoint)
    baselines.warm_up(model, pad)
    out = [baselines.hf_one_at_a_time(model, subset, pad)]
    log(_one_line(out[-1]))
    out.append(baselines.hf_static_batches(model, subset, cfg.static_batch_size, pad))
    log(_one_line(out[-1]))
    del model
    gc.collect()
    return out


def _get(systems: list[SystemResult], name: str) -> SystemResult:
    return next(s for s in systems if s.name == name)


def _ratios(systems: list[SystemResult]) -> dict[str, float]:
    rate = {s.name: s.output_tokens_per_s for s in systems}
    ours = rate.get("trtforge_inflight")
    out = {}
    for base in ("hf_one_at_a_time", "hf_static_batch"):
        if base in rate and ours:
            out[f"inflight_vs_{base}"] = ours / rate[base]
            sub = rate.get("trtforge_inflight_baseline_subset", ours)
            out[f"inflight_subset_vs_{base}"] = sub / rate[base]
    return out


def _one_line(s: SystemResult) -> str:
    return (f"{s.name}: {s.num_requests} requests, {s.useful_output_tokens} output tokens in "
            f"{s.elapsed_s:.1f} s = {s.output_tokens_per_s:.1f} tok/s")
