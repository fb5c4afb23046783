#!/usr/bin/env bash
# The OpenAI-compatible endpoint under load, measured by NVIDIA's aiperf (from PyPI), beside
# `trtforge bench serve` (gRPC straight to Triton) for the same load on the same server: same
# engine, prompt and output lengths (exact: ignore_eos / min_tokens), concurrency and request
# count. The difference between the two is what the HTTP/SSE layer costs, plus the client's own
# cost: aiperf runs several worker processes, which on a 2-core machine compete with the server,
# so read the gap there as an upper bound. Not run in CI.
#
#   scripts/bench_openai.sh [OUT_DIR]           (default out/bench_openai; a few minutes)
#
# Environment: ENGINE=DIR (default: a tiny random-weight demo engine built here), CONCURRENCY (8),
# REQUESTS (64), ISL (128 prompt tokens), OSL (64 output tokens). aiperf pins versions that
# disagree with .venv's (rich, psutil, pyzmq, ...), so it gets its own venv: $AIPERF_VENV
# (default OUT_DIR/aiperf-venv, created on first use).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
BIN=$(dirname "$PY")
OUT=${1:-out/bench_openai}
CONCURRENCY=${CONCURRENCY:-8}
REQUESTS=${REQUESTS:-64}
ISL=${ISL:-128}
OSL=${OSL:-64}
AIPERF_VERSION=0.13.0
AIPERF_VENV=${AIPERF_VENV:-$OUT/aiperf-venv}
mkdir -p "$OUT"
export TOKENIZERS_PARALLELISM=false

if [[ ! -x "$AIPERF_VENV/bin/aiperf" ]]; then
  echo "installing aiperf $AIPERF_VERSION into $AIPERF_VENV ..."
  python3 -m venv "$AIPERF_VENV"
  "$AIPERF_VENV/bin/python" -m pip install --quiet --disable-pip-version-check "aiperf==$AIPERF_VERSION"
fi
ENGINE=${ENGINE:-$OUT/engine}
if [[ ! -f "$ENGINE/engine.json" ]]; then
  "$BIN/trtforge" demo-checkpoint "$OUT/checkpoint" --arch qwen2 --size tiny
  "$BIN/build-engine" "$OUT/checkpoint" --output "$ENGINE" --force -q --dtype float32 \
    --max-seq-len 2048 --max-num-tokens 512 --max-batch-size 32 --kv-block-size 16 \
    --kv-cache-memory 64MiB
fi
"$BIN/trtforge" emit-repo "$ENGINE" "$OUT/repo" >/dev/null

"$BIN/trtforge" serve "$OUT/repo" --http-port 0 --grpc-port 0 --metrics-port 0 --openai-port 0 \
  --log-file "$OUT/tritonserver.log" >"$OUT/serve.out" 2>&1 &
serve_pid=$!
trap 'kill -TERM "$serve_pid" 2>/dev/null; wait "$serve_pid" || true' EXIT
for _ in $(seq 600); do
  grep -q "OpenAI-compatible API" "$OUT/serve.out" && break
  kill -0 "$serve_pid" 2>/dev/null || { cat "$OUT/serve.out"; exit 1; }
  sleep 1
done
grpc=$(sed -n 's/.*gRPC \([^ ]*\) .*/\1/p' "$OUT/serve.out")
api=$(sed -n 's/^OpenAI-compatible API: \(http:[^ ]*\)\/v1 .*/\1/p' "$OUT/serve.out")
model=$(sed -n "s/^OpenAI-compatible API: .* model '\(.*\)'$/\1/p" "$OUT/serve.out")
echo "machine: $(nproc) cores, load average $(cut -d' ' -f1-3 /proc/loadavg); Triton $grpc, API $api"
echo "load: $REQUESTS requests, concurrency $CONCURRENCY, $ISL prompt tokens, $OSL output tokens"

"$BIN/trtforge" bench serve --url "$grpc" --tokenizer "$ENGINE" --num-prompts "$REQUESTS" \
  --concurrency "$CONCURRENCY" --input-len "$ISL" --output-len "$OSL" --json "$OUT/trtforge.json" \
  >"$OUT/trtforge.txt"
# --use-server-token-count: aiperf would otherwise count output tokens by re-tokenizing the text,
# which for a random-weight model's text differs from the tokens generated.
"$AIPERF_VENV/bin/aiperf" profile --model "$model" --url "$api" --endpoint-type completions \
  --streaming --tokenizer "$ENGINE" --isl "$ISL" --isl-stddev 0 --osl "$OSL" --osl-stddev 0 \
  --extra-inputs ignore_eos:true --concurrency "$CONCURRENCY" --request-count "$REQUESTS" \
  --warmup-request-count 1 --use-server-token-count --random-seed 0 --ui none \
  --no-gpu-telemetry --artifact-dir "$OUT/aiperf" >"$OUT/aiperf.txt" 2>&1
"$PY" scripts/bench_openai_compare.py "$OUT/trtforge.json" "$OUT/aiperf/profile_export_aiperf.json" \
  | tee "$OUT/report.txt"
