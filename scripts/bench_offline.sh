#!/usr/bin/env bash
# Offline benchmark (docs/benchmarks.md, "## Offline"): a random-weight Qwen2.5-0.5B-shaped
# checkpoint, built float32 for CPU, then `trtforge bench offline`. Extra arguments go to the
# benchmark, e.g. a quick run on a 2-core machine:
#   scripts/bench_offline.sh --num-requests 24 --baseline-requests 8 --kv-cache-memory 192MiB --threads 1
# WORK_DIR (default $TMPDIR/trtforge-bench-offline, outside the tree) keeps the checkpoint and engine between runs.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
WORK=${WORK_DIR:-${TMPDIR:-/tmp}/trtforge-bench-offline}
mkdir -p "$WORK"
[ -f "$WORK/ckpt/config.json" ] || "$PY" -m trtforge.cli.main demo-checkpoint "$WORK/ckpt" --arch qwen2 --size 0.5b
[ -f "$WORK/engine/engine.json" ] || "$PY" -m trtforge.cli.build "$WORK/ckpt" -o "$WORK/engine" \
    --dtype float32 --max-batch-size 64 --max-num-tokens 2048 --max-seq-len 4096 -q
uptime  # the CPU may be shared: the report records the load too
exec "$PY" -m trtforge.cli.main bench offline "$WORK/ckpt" "$WORK/engine" \
    --json "$WORK/offline.json" --plot "$WORK/offline_seed.png" "$@"
