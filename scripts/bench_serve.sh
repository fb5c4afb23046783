#!/usr/bin/env bash
# Serving benchmark report (docs/benchmarks.md "## Serving"), in ONE run on this machine:
#   1. serving overhead: the same requests through Triton (gRPC streaming) vs LLMEngine in-process;
#   2. prefill/decode interference: 8 short decoding streams (24 tokens each) while 2,000-token prompts arrive,
#      chunked prefill on vs off (two tritonservers, one after the other).
# Builds what it needs (random-weight Qwen2.5-0.5B-shaped checkpoint, float32 engine with
# max_num_tokens >= max_seq_len so prefill_chunk_size=0 is valid), starts and stops the servers
# itself (loopback, free ports), writes $OUT/report.json and server logs.
#
#   scripts/bench_serve.sh [OUT_DIR]          (default out/bench_serve; ~15-20 min on 2 cores)
#
# Extra options of `python -m trtforge.bench.serve_report` can be passed in
# $BENCH_SERVE_ARGS (e.g. "--long-num 1 --short-output-len 16" to shrink it).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-out/bench_serve}
# shellcheck source=scripts/bench_engine.sh
source scripts/bench_engine.sh
# shellcheck disable=SC2086 # BENCH_SERVE_ARGS is a list of options on purpose
"$PY" -m trtforge.bench.serve_report --engine "$OUT/engine" --out "$OUT" ${BENCH_SERVE_ARGS:-} \
  | tee "$OUT/report.txt"
echo "total wall time: $(( $(date +%s) - start )) s; load average now $(cut -d' ' -f1-3 /proc/loadavg)"
