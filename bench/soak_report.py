"""Summaries of a soak run: outcomes by kind, refusals by status, memory per checkpoint, latency.

Pure functions of the records the run collected, so they are testable without a server.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from typing import Any

import numpy as np

from trtforge.bench.soak_clients import Outcome

FAILURES = ("mismatch", "error", "accepted_unexpectedly")
"""Outcomes that fail the soak (a wrong text, an unexpected error, a malformed request served)."""


def outcome_counts(outcomes: list[Outcome]) -> dict[str, dict[str, int]]:
    """{kind: {outcome: count}}."""
    table: dict[str, Counter] = defaultdict(Counter)
    for o in outcomes:
        table[o.kind][o.outcome] += 1
    return {k: dict(sorted(v.items())) for k, v in sorted(table.items())}


def refusals(outcomes: list[Outcome]) -> dict[str, Any]:
    """Malformed requests: how they were refused, overall and per variant (status or gRPC)."""
    malformed = [o for o in outcomes if o.kind == "malformed"]
    per_variant: dict[str, Counter] = defaultdict(Counter)
    for o in malformed:
        per_variant[o.variant][str(o.status) if o.status is not None else o.outcome] += 1
    return {"total": len(malformed), "by_outcome": dict(Counter(o.outcome for o in malformed)),
            "by_variant": {v: dict(c) for v, c in sorted(per_variant.items())}}


def latency(outcomes: list[Outcome], first: int, last: int, window: int) -> dict[str, Any]:
    """p50/p99 end-to-end latency (ms) of the checked requests among the first and the last
    `window` request indices (they overlap when fewer than 2 × window requests ran)."""
    checked = [o for o in outcomes if o.kind in ("grpc_stream", "http_stream", "http_generate")
               and o.outcome == "ok"]

    def stats(lo: int, hi: int) -> dict[str, Any]:
        ms = np.array([o.latency_s * 1e3 for o in checked if lo <= o.index < hi])
        if not ms.size:
            return {"range": [lo, hi], "n": 0}
        return {"range": [lo, hi], "n": int(ms.size), "p50_ms": float(np.percentile(ms, 50)),
                "p99_ms": float(np.percentile(ms, 99))}

    return {"first": stats(first, min(last, first + window)), "last": stats(max(first, last - window), last)}


def memory_row(cp: dict[str, Any]) -> dict[str, Any]:
    """One checkpoint flattened: requests done, idle gauges, RSS of the server and of the stubs."""
    procs = cp["memory"]["processes"]
    server = [p for p in procs if p["name"].startswith("tritonserver")]
    stubs = [p for p in procs if not p["name"].startswith("tritonserver")]
    m = cp["metrics"]
    return {"requests": cp["requests"], "elapsed_s": round(cp["elapsed_s"], 1), "idle": cp["idle"],
            "kv_blocks_used": m.get("trtforge_kv_blocks_used"),
            "running": m.get("trtforge_requests_running"),
            "waiting": m.get("trtforge_requests_waiting"),
            "server_rss_mib": round(sum(p["rss_mib"] for p in server), 1),
            "stub_rss_mib": round(sum(p["rss_mib"] for p in stubs), 1),
            "stub_uss_mib": round(sum(p["uss_mib"] for p in stubs), 1),
            "tree_rss_mib": round(cp["memory"]["rss_mib"], 1),
            "tree_pss_mib": round(cp["memory"]["pss_mib"], 1),
            "fds": sum(p["fds"] for p in procs), "threads": sum(p["threads"] for p in procs)}


def growth(rows: list[dict[str, Any]]) -> dict[str, float] | None:
    """RSS growth per 1,000 requests between the first measured checkpoint after the baseline
    and the last (the first thousand includes one-time warm-up growth, so it is left out)."""
    measured = [r for r in rows if r["requests"] > 0]
    if len(measured) < 2:
        return None
    a, b = measured[0], measured[-1]
    per_k = 1000 / max(1, b["requests"] - a["requests"])
    return {k: round((b[k] - a[k]) * per_k, 2) for k in
            ("server_rss_mib", "stub_rss_mib", "stub_uss_mib", "tree_rss_mib", "tree_pss_mib", "fds", "threads")}


def _row(cells: list[Any], widths: list[int]) -> str:
    return "  ".join(str(c).rjust(w) for c, w in zip(cells, widths))


def format_text(report: dict[str, Any]) -> str:
    """The human-readable summary printed at the end of a run."""
    planned = report["config"]["num_requests"]
    sent = report["requests_sent"] if report["requests_sent"] == planned else \
        f"{report['requests_sent']} of {planned} (--max-seconds reached)"
    lines = [f"Soak: {sent} requests in {report['wall_s']:.0f} s "
             f"(concurrency {report['config']['concurrency']}; shared machine: timings are noisy)",
             "", "Outcomes by kind:"]
    for kind, counts in report["outcomes"].items():
        lines.append(f"  {kind:16s} " + ", ".join(f"{k}={v}" for k, v in counts.items()))
    ref = report["malformed"]
    lines += ["", f"Malformed: {ref['total']} — " + ", ".join(f"{k}={v}" for k, v in sorted(ref["by_outcome"].items()))]
    for variant, counts in ref["by_variant"].items():
        lines.append(f"  {variant:22s} " + ", ".join(f"{k}: {v}" for k, v in sorted(counts.items())))
    cols = ["requests", "idle", "kv_blocks_used", "running", "waiting", "server_rss_mib", "stub_rss_mib",
            "stub_uss_mib", "tree_rss_mib", "tree_pss_mib", "fds", "threads"]
    widths = [max(len(c), 8) for c in cols]
    lines += ["", "Server after each checkpoint (idle = every request answered, gauges at 0):",
              "  " + _row(cols, widths)]
    lines += ["  " + _row([r[c] for c in cols], widths) for r in report["checkpoints"]]
    if report["growth_per_1k"]:
        lines.append("  growth per 1,000 requests after the first checkpoint: "
                     + ", ".join(f"{k}={v:+}" for k, v in report["growth_per_1k"].items()))
    lat = report["latency"]
    lines += ["", "End-to-end latency of checked requests (ms):"]
    for name in ("first", "last"):
        s = lat[name]
        p = f"p50 {s['p50_ms']:.0f}, p99 {s['p99_ms']:.0f}" if s["n"] else "none"
        lines.append(f"  {name:5s} requests {s['range'][0]}-{s['range'][1] - 1}: n={s['n']}, {p}")
    lines += ["", f"Result: {'PASS' if report['passed'] else 'FAIL'}"]
    lines += [f"  {f}" for f in report["problems"]]
    return "\n".join(lines)
