#!/usr/bin/env bash
# Weight-only quantisation on CPU (docs/benchmarks.md, "## Quantization"): a random-weight
# Qwen2.5-0.5B-shaped checkpoint built float32 / int8_wo / int4_wo, then scripts/bench_quant.py
# (batch-1 decode vs the copy-bandwidth bound, prefill tok/s at 128 and 512 tokens). Not CI.
# WORK_DIR (default $TMPDIR/trtforge-bench-quant) keeps the checkpoint and engines between runs.
# Extra arguments go to bench_quant.py, e.g. --repeats 5.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
WORK=${WORK_DIR:-${TMPDIR:-/tmp}/trtforge-bench-quant}
mkdir -p "$WORK"
[ -f "$WORK/ckpt/config.json" ] || "$PY" -m trtforge.cli.main demo-checkpoint "$WORK/ckpt" --arch qwen2 --size 0.5b
for q in none int8_wo int4_wo; do
  [ -f "$WORK/$q/engine.json" ] || "$PY" -m trtforge.cli.build "$WORK/ckpt" -o "$WORK/$q" --dtype float32 \
      --max-seq-len 4096 --kv-cache-memory 256MiB --quantization "$q"
done
uptime  # the CPU may be shared: the report records the load too
exec "$PY" scripts/bench_quant.py "$WORK/none" "$WORK/int8_wo" "$WORK/int4_wo" --json "$WORK/quant.json" "$@"
