#!/usr/bin/env bash
# Sourced by the serving benchmarks (bench_serve.sh, bench_disagg.sh): the random-weight
# Qwen2.5-0.5B-shaped float32 engine they share, built into $OUT/engine unless it is there
# (max_num_tokens >= max_seq_len, so an unchunked scheduler is valid too). Sets PY, BIN, start.
PY=${PYTHON:-.venv/bin/python}
BIN=$(dirname "$PY")
mkdir -p "$OUT"
export TOKENIZERS_PARALLELISM=false
echo "machine: $(lscpu | sed -n 's/^Model name: *//p'), $(nproc) cores, load average $(cut -d' ' -f1-3 /proc/loadavg)"
start=$(date +%s)
if [[ ! -f "$OUT/engine/engine.json" ]]; then
  "$BIN/trtforge" demo-checkpoint "$OUT/checkpoint" --arch qwen2 --size 0.5b
  "$BIN/build-engine" "$OUT/checkpoint" --output "$OUT/engine" --force -q --dtype float32 \
    --max-seq-len 4096 --max-num-tokens 4096 --max-batch-size 16 --kv-block-size 16 \
    --kv-cache-memory 512MiB
fi
echo "engine ready after $(( $(date +%s) - start )) s"
