#!/usr/bin/env bash
# Start-up times (docs/benchmarks.md "## Start-up"): `trtforge --help`, `trtforge generate` of the
# tiny demo engine, `trtforge serve` of its repository to ready, and loading the 0.5B-shaped
# float32 engine against reading its weight file from the page cache. Each beside its target
# (MET/MISSED; a benchmark, so it exits 0 either way).
#
#   scripts/startup_times.sh [WORK_DIR]   (default $TMPDIR/trtforge-startup; builds the engines once,
#                                          ~2 min and ~4 GB the first time)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
BIN=$(dirname "$PY")
WORK=${1:-${TMPDIR:-/tmp}/trtforge-startup}
mkdir -p "$WORK"

if [[ ! -f "$WORK/tiny/engine/engine.json" ]]; then
  "$BIN/trtforge" demo-checkpoint "$WORK/tiny/checkpoint" --arch qwen2 --size tiny
  "$BIN/build-engine" "$WORK/tiny/checkpoint" --output "$WORK/tiny/engine" --dtype float32 --force -q \
    --triton-repo "$WORK/tiny/repo"
fi
if [[ ! -f "$WORK/05b/engine/engine.json" ]]; then
  "$BIN/trtforge" demo-checkpoint "$WORK/05b/checkpoint" --arch qwen2 --size 0.5b
  "$BIN/build-engine" "$WORK/05b/checkpoint" --output "$WORK/05b/engine" --dtype float32 --force -q
  rm -rf "$WORK/05b/checkpoint"  # 2 GB the measurement does not need
fi
"$PY" scripts/startup_times.py "$WORK" --repeats "${REPEATS:-3}"
