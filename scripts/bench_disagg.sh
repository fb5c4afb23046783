#!/usr/bin/env bash
# Disaggregated vs co-located serving (docs/benchmarks.md "Disaggregated serving"), in ONE run:
# the same 0.5B-shaped float32 engine and the same workload (8 short decoding streams while
# 2,000-token prompts arrive) on a co-located repository (chunked prefill) and on a
# disaggregated one (context model on core 0, generation model on core 1), one server after
# the other. Builds what it needs, starts and stops the servers itself (loopback, free ports),
# writes $OUT/report.json, $OUT/disaggregated.png and the server logs.
#
#   scripts/bench_disagg.sh [OUT_DIR]      (default out/bench_disagg; ~8 min on 2 cores)
#
# Extra options of `trtforge bench disaggregated` go in $BENCH_DISAGG_ARGS.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-out/bench_disagg}
# shellcheck source=scripts/bench_engine.sh
source scripts/bench_engine.sh
# shellcheck disable=SC2086 # BENCH_DISAGG_ARGS is a list of options on purpose
"$BIN/trtforge" bench disaggregated --engine "$OUT/engine" --out "$OUT" ${BENCH_DISAGG_ARGS:-} | tee "$OUT/report.txt"
echo "total wall time: $(( $(date +%s) - start )) s; load average now $(cut -d' ' -f1-3 /proc/loadavg)"
