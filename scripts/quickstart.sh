#!/usr/bin/env bash
# The main job end to end on a fresh machine: install, make a demo checkpoint (random weights saying
# random words, real tokenizer), build an engine + Triton model repository, serve it with a real
# tritonserver, stream a completion through tritonclient (gRPC), then ask the OpenAI-compatible API
# beside it with the openai SDK and curl. Everything lands in $OUT (default out/quickstart).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export PATH="$PWD/.venv/bin:$PATH"
OUT=${OUT:-out/quickstart}
mkdir -p "$OUT"

trtforge demo-checkpoint "$OUT/checkpoint" --arch qwen2 --size tiny
build-engine "$OUT/checkpoint" --output "$OUT/engine" --dtype float32 --force --triton-repo "$OUT/repo"
trtforge generate "$OUT/engine" --prompt "The quick brown fox" --max-tokens 16

rm -f "$OUT/serve.out"
trtforge serve "$OUT/repo" --http-port 0 --grpc-port 0 --metrics-port 0 --log-file "$OUT/triton.log" \
  --openai-port 0 --served-model-name demo > "$OUT/serve.out" 2>&1 &
server=$!
trap 'kill -INT $server 2>/dev/null || true; wait $server 2>/dev/null || true' EXIT
for _ in $(seq 1 300); do
  grep -q "OpenAI-compatible API" "$OUT/serve.out" 2>/dev/null && break
  kill -0 $server 2>/dev/null || { cat "$OUT/serve.out"; exit 1; }
  sleep 1
done
grpc=$(sed -n 's/.*gRPC \([^ ]*\).*/\1/p' "$OUT/serve.out" | head -n 1)
http=$(sed -n 's/.*HTTP http:\/\/\([^ ]*\).*/\1/p' "$OUT/serve.out" | head -n 1)
openai=$(sed -n 's/.*OpenAI-compatible API: \(http:[^ ]*\).*/\1/p' "$OUT/serve.out" | head -n 1)
echo "tritonserver ready: gRPC $grpc, HTTP $http"
echo "--- streamed over gRPC (tritonclient):"
trtforge client --url "$grpc" --prompt "The quick brown fox" --max-tokens 24 --stream
echo
echo "--- curl $http/v2/models/ensemble/generate:"
curl -s -X POST "http://$http/v2/models/ensemble/generate" \
  -d '{"text_input": "The quick brown fox", "max_tokens": 8, "bad_words": "", "stop_words": ""}'
echo
echo "--- OpenAI SDK, $openai/completions:"
python - "$openai" <<'PY'
import sys

from openai import OpenAI

client = OpenAI(base_url=sys.argv[1], api_key="unused")
reply = client.completions.create(model="demo", prompt="The quick brown fox", max_tokens=16, temperature=0)
print(repr(reply.choices[0].text), reply.choices[0].finish_reason, reply.usage)
PY
echo "--- curl $openai/chat/completions:"
curl -s "$openai/chat/completions" -H 'Content-Type: application/json' \
  -d '{"model": "demo", "messages": [{"role": "user", "content": "Tell me about the fox"}], "max_tokens": 16, "temperature": 0}'
echo
echo "(random weights, so random words; \`trtforge demo-checkpoint DIR --train-seconds 10\` fits the demo"
echo " model to a bundled English text for 10 s, after which it continues a prompt with that text's"
echo " phrases: the more steps the machine manages in 10 s, the better)"
