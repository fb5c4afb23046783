"""Print the offline benchmark's report as tables, write it as JSON, plot the seed experiment."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

# Targets of the offline benchmark (the brief; vLLM's published KV-waste figure).
TARGETS = {"inflight_vs_hf_one_at_a_time": 5.0, "inflight_vs_hf_static_batch": 2.0,
           "kv_waste_max": 0.04, "concurrency_ratio": 3.0, "decode_vs_bound_max": 1.5}


def table(headers: list[str], rows: list[list[Any]]) -> str:
    cells = [[_fmt(c) for c in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(headers)]

    def line(items: list[Any]) -> str:
        return "  ".join(str(x).rjust(w) for x, w in zip(items, widths))

    return "\n".join([line(headers), line(["-" * w for w in widths]), *map(line, cells)])


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 1000 else f"{value:.0f}"
    return "-" if value is None else str(value)


def _verdict(ok: bool) -> str:
    return "met" if ok else "MISSED"


def render(report: dict[str, Any]) -> str:
    out = [f"machine: {report['machine']['cpu']}, {report['machine']['cpus']} CPUs, "
           f"{report['machine']['threads']} torch threads, load {report['machine']['loadavg_1m']:.1f} → "
           f"{report['machine'].get('loadavg_1m_end', float('nan')):.1f}"]
    rows = [[s["name"], s["num_requests"], s["prompt_tokens"], s["useful_output_tokens"], s["generated_tokens"],
             s["elapsed_s"], s["output_tokens_per_s"]] for s in report["systems"]]
    out += ["", "Throughput (useful output tokens / s)",
            table(["system", "requests", "prompt tok", "output tok", "computed tok", "seconds", "tok/s"], rows)]
    ratios = report["ratios"]
    if ratios:
        out += ["", "Ratios (in-flight batching vs baseline; 'subset' = same requests as the baseline)"]
        for key, value in ratios.items():
            target = TARGETS.get(key.replace("_subset", ""))
            out.append(f"  {key}: {value:.2f}x" + (f"  (target >= {target}x: {_verdict(value >= target)})"
                                                    if target else ""))
    kv = report["kv"]
    out += ["", f"KV waste (allocated but unused slots, mean over steps): {kv['waste_mean']:.2%}  "
                f"(target < {TARGETS['kv_waste_max']:.0%}: {_verdict(kv['waste_mean'] < TARGETS['kv_waste_max'])})",
            f"Concurrent sequences in {kv['kv_slots']} KV slots: "
            f"paged {_fmt(kv['paged_concurrent_mean_while_waiting'])} "
            f"(mean while requests waited; peak {kv['paged_concurrent_peak']}) vs {kv['static_max_seq_len']} "
            f"reserving max_seq_len → {kv['ratio_vs_max_seq_len']:.1f}x (target >= {TARGETS['concurrency_ratio']}x: "
            f"{_verdict(kv['ratio_vs_max_seq_len'] >= TARGETS['concurrency_ratio'])}); vs "
            f"{kv['static_workload_max']} reserving the workload's longest prompt+output → "
            f"{kv['ratio_vs_workload_max']:.1f}x" + ("" if kv["kv_was_binding"] else
                                                     "  [KV never limited admission: a lower bound]")]
    seed_rows = [[r["prompt_len"], r["ttft_s"], r["prefill_tokens_per_s"], r["decode_s_per_token"] * 1e3,
                  (r["copy_bandwidth_before"] + r["copy_bandwidth_after"]) / 2e9, r["decode_bound_s"] * 1e3,
                  r["decode_vs_bound"]] for r in report["seed_experiment"]]
    out += ["", f"Seed experiment (each prompt alone, {report['seed_experiment'][0]['output_len']} output tokens; "
                f"decode bound = (weights {report['decode_weight_bytes'] / 1e9:.2f} GB + KV) / copy bandwidth, "
                "probed right before and after each prompt)",
            table(["prompt", "TTFT s", "prefill tok/s", "decode ms/tok", "copy GB/s", "bound ms", "decode/bound"],
                  seed_rows)]
    b = report.get("decode_breakdown")
    if b:
        out.append(f"  batch-1 decode step {b['step_s'] * 1e3:.0f} ms = {b['num_linear_calls']} linear layers alone "
                   f"{b['linears_s'] * 1e3:.0f} ms ({b['linear_bytes'] / 1e9:.2f} GB at "
                   f"{b['linear_bytes_per_s'] / 1e9:.1f} GB/s; copy {b['copy_bandwidth'] / 1e9:.1f} GB/s) "
                   f"+ {b['other_s'] * 1e3:.0f} ms everything else (attention, norms, RoPE, sampling, Python"
                   + ("; negative: below this machine's run-to-run noise" if b["other_s"] < 0 else "") + ")")
    first = report["seed_experiment"][0]
    out.append(f"  batch-1 decode at prompt {first['prompt_len']}: {first['decode_vs_bound']:.2f}x the bandwidth "
               f"bound (target <= {TARGETS['decode_vs_bound_max']}x: "
               f"{_verdict(first['decode_vs_bound'] <= TARGETS['decode_vs_bound_max'])})")
    return "\n".join(out)


def write_json(report: dict[str, Any], path: str | Path) -> None:
    Path(path).write_text(json.dumps(report, indent=2) + "\n")


def plot_seed_experiment(report: dict[str, Any], path: str | Path) -> None:
    """TTFT and per-token decode time against prompt length (log-log)."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on servers
    import matplotlib.pyplot as plt

    rows = report["seed_experiment"]
    lens = [r["prompt_len"] for r in rows]
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    ax.plot(lens, [r["ttft_s"] * 1e3 for r in rows], "o-", label="TTFT (prefill)")
    ax.plot(lens, [r["decode_s_per_token"] * 1e3 for r in rows], "s-", label="decode, per token")
    ax.plot(lens, [r["decode_bound_s"] * 1e3 for r in rows], ":", label="decode bandwidth bound")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("prompt length (tokens)")
    ax.set_ylabel("milliseconds")
    ax.set_title(f"{report['model']['architecture']} {report['model']['dtype']}, batch 1, "
                 f"{report['machine']['threads']} threads")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
