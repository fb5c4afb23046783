#!/usr/bin/env bash
# trtforge vs llama.cpp vs ONNX Runtime GenAI on the CPU, same checkpoint, same run, 2 threads each
# (docs/benchmarks.md, "## CPU peers (llama.cpp, ONNX Runtime GenAI)"). Not CI.
#
# Setup (idempotent, cached under WORK_DIR, default out/bench_peers; ~25 min the first time):
#   - llama.cpp from the llama-cpp-python 0.3.36 sdist (vendor/llama.cpp), only llama-bench,
#     llama-server and llama-quantize, -DGGML_NATIVE=ON, -j2;
#   - a separate venv WORK_DIR/peers-venv with onnxruntime-genai 0.18 (+ its model builder's needs)
#     and gguf for llama.cpp's converter: nothing is installed into the project's .venv;
#   - the random-weight Qwen2.5-0.5B-shaped checkpoint and trtforge float32 / int8_wo / int4_wo
#     engines (scripts/bench_quant.sh's recipe, with the offline benchmark's batch limits).
# The GGUF / ONNX conversions and all measurements are in scripts/bench_peers.py; extra arguments
# go there (e.g. --load-requests 32 --repeats 3).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
WORK=${WORK_DIR:-out/bench_peers}
mkdir -p "$WORK"
WORK=$(cd "$WORK" && pwd)
export OMP_NUM_THREADS=2

# ---- llama.cpp (source from PyPI's sdist, built here) ----------------------------------------
LLAMA_SRC="$WORK/src/llama_cpp_python-0.3.36/vendor/llama.cpp"
LLAMA_BUILD="$WORK/llama-build"
if [ ! -d "$LLAMA_SRC" ]; then
  "$PY" -m pip download --no-deps --no-binary :all: llama-cpp-python==0.3.36 -d "$WORK/src"
  tar xzf "$WORK/src/llama_cpp_python-0.3.36.tar.gz" -C "$WORK/src"
fi
if [ ! -x "$LLAMA_BUILD/bin/llama-server" ] || [ ! -x "$LLAMA_BUILD/bin/llama-bench" ] || [ ! -x "$LLAMA_BUILD/bin/llama-quantize" ]; then
  echo "building llama.cpp (~20 min on 2 cores; log: $WORK/llama-build.log)"
  # a failed build is reported by bench_peers.py (missing binaries), not hidden
  { cmake -S "$LLAMA_SRC" -B "$LLAMA_BUILD" -DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DCMAKE_BUILD_TYPE=Release &&
    cmake --build "$LLAMA_BUILD" -j2 --target llama-bench llama-server llama-quantize; } > "$WORK/llama-build.log" 2>&1 ||
    echo "llama.cpp BUILD FAILED: see $WORK/llama-build.log" >&2
fi

# ---- the peers' Python: a separate venv (CPU torch 2.13.0 pinned: unpinned pulls a CUDA build) -
PEERS_PY="$WORK/peers-venv/bin/python"
if [ ! -f "$WORK/peers-venv/.ok" ]; then
  BASE=$("$PY" -c "import sys; print(sys._base_executable)")
  "$BASE" -m venv "$WORK/peers-venv"
  "$PEERS_PY" -m pip install -q "onnxruntime-genai==0.18.*" "torch==2.13.0" transformers onnx onnx_ir \
      gguf sentencepiece numpy
  touch "$WORK/peers-venv/.ok"
fi

# ---- checkpoint and trtforge engines -----------------------------------------------------------
[ -f "$WORK/ckpt/config.json" ] || "$PY" -m trtforge.cli.main demo-checkpoint "$WORK/ckpt" --arch qwen2 --size 0.5b
for q in none int8_wo int4_wo; do
  [ -f "$WORK/trt_$q/engine.json" ] || "$PY" -m trtforge.cli.build "$WORK/ckpt" -o "$WORK/trt_$q" --dtype float32 \
      --max-seq-len 4096 --max-batch-size 64 --max-num-tokens 2048 --kv-cache-memory 384MiB --quantization "$q" -q
done

[ -f "$WORK/trt_int4_wo_h4/engine.json" ] || "$PY" -m trtforge.cli.build "$WORK/ckpt" -o "$WORK/trt_int4_wo_h4" \
    --dtype float32 --max-seq-len 4096 --max-batch-size 64 --max-num-tokens 2048 --kv-cache-memory 384MiB \
    --quantization int4_wo --lm-head-quantization int4_wo -q  # --precisions ...,int4h4
for q in int8_wo int4_wo; do  # int8 KV twins for --trt-load-int8-kv
  [ -f "$WORK/trt_${q}_kv8/engine.json" ] || "$PY" -m trtforge.cli.build "$WORK/ckpt" -o "$WORK/trt_${q}_kv8" --dtype float32 \
      --max-seq-len 4096 --max-batch-size 64 --max-num-tokens 2048 --kv-cache-memory 192MiB --quantization "$q" \
      --kv-cache-dtype int8 -q
done

uptime  # the CPU may be shared: the report records the load at every measurement too
exec "$PY" scripts/bench_peers.py --work "$WORK" --llama-src "$LLAMA_SRC" --llama-bin "$LLAMA_BUILD/bin" \
    --peers-python "$PEERS_PY" --json "$WORK/peers.json" --plot docs/img/peers.png "$@"
