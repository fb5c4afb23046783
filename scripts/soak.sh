#!/usr/bin/env bash
# Bounded soak of a real tritonserver on loopback (docs/serving.md "## Reliability"): builds the
# tiny demo engine once in the work dir, serves it on free ports, sends good, cancelled and
# malformed requests from concurrent clients, checks every complete answer against the engine
# run in-process, and reads the server's memory and engine gauges at checkpoints.
#
#   scripts/soak.sh [OPTIONS]     e.g. --num-requests 1000 --checkpoints 200,500
#                                 --server-env MALLOC_ARENA_MAX=2 --json out/soak.json
#
# Options: .venv/bin/python -m trtforge.cli.bench_soak --help. Defaults: 10,000 requests,
# 24 clients, work dir $TMPDIR/trtforge-soak, at most --max-seconds 3600 of sending.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
export TOKENIZERS_PARALLELISM=false
echo "machine: $(nproc) cores, load average $(cut -d' ' -f1-3 /proc/loadavg) (timings are noisy when it is shared)"
start=$(date +%s)
status=0
"$PY" -m trtforge.cli.bench_soak "$@" || status=$?
echo "total wall time: $(( $(date +%s) - start )) s; load average now $(cut -d' ' -f1-3 /proc/loadavg)"
exit "$status"
