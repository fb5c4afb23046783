"""Print aiperf's figures (OpenAI endpoint) beside `trtforge bench serve`'s (gRPC to Triton).

    python scripts/bench_openai_compare.py TRTFORGE_JSON AIPERF_JSON

TRTFORGE_JSON is `trtforge bench serve --json`'s report, AIPERF_JSON aiperf's
profile_export_aiperf.json. Latencies in ms; aiperf's ITL is its inter-token latency
((request latency - TTFT) / (output tokens - 1), per request), the trtforge column shows both its
per-request TPOT (the same definition) and its ITL (every gap between streamed responses).
"""

from __future__ import annotations

import json
import sys


def _trtforge(path: str) -> dict[str, dict[str, float]]:
    with open(path) as f:
        main = json.load(f)["metrics"]["main"]

    def dist(name: str) -> dict[str, float]:
        d = main[name]
        return {"avg": d["mean"], "p50": d["percentiles"]["50"], "p99": d["percentiles"]["99"]}

    return {"TTFT": dist("ttft_ms"), "ITL (per request, = TPOT)": dist("tpot_ms"),
            "ITL (every gap)": dist("itl_ms"), "E2E latency": dist("e2el_ms"),
            "output tokens/s": {"avg": main["output_throughput"]},
            "requests completed": {"n": main["completed"]}, "requests failed": {"n": main["failed"]}}


def _aiperf(path: str) -> dict[str, dict[str, float]]:
    with open(path) as f:
        data = json.load(f)

    def dist(name: str) -> dict[str, float]:
        d = data.get(name) or {}
        return {k: d.get(k, float("nan")) for k in ("avg", "p50", "p99")}

    errors = sum(e.get("count", 0) for e in data.get("error_summary") or [])
    return {"TTFT": dist("time_to_first_token"),
            "ITL (per request, = TPOT)": dist("inter_token_latency"),
            "ITL (every gap)": dist("inter_chunk_latency"), "E2E latency": dist("request_latency"),
            "output tokens/s": {"avg": (data.get("output_token_throughput") or {}).get("avg")},
            "requests completed": {"n": (data.get("request_count") or {}).get("avg")},
            "requests failed": {"n": errors}}


def main(trtforge_json: str, aiperf_json: str) -> None:
    ours, theirs = _trtforge(trtforge_json), _aiperf(aiperf_json)
    print(f"{'metric':<28}{'stat':>6}{'trtforge bench (gRPC)':>24}{'aiperf (OpenAI API)':>22}")
    for metric, stats in ours.items():
        for stat, value in stats.items():
            other = theirs[metric].get(stat)
            print(f"{metric:<28}{stat:>6}{_fmt(value):>24}{_fmt(other):>22}")


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


if __name__ == "__main__":
    main(*sys.argv[1:3])
