#!/usr/bin/env bash
# GPU device check for trtforge: kernel tests, greedy parity with HF, decode-attention bandwidth
# and end-to-end decode throughput, each step guarded, results as files in OUT_DIR.
#
#   scripts/device_check.sh [--dry-run] [OUT_DIR]        (default OUT_DIR: ./device_check_out)
#
# Runs from the repository checkout as it is: no pip, no network. trtforge's sub-packages are
# made importable through a temporary PYTHONPATH shim (trtforge/<stage> ->
# the repo's top-level dirs), which is what the pyproject package-dir mapping does when installed.
# --dry-run runs every step on CPU with tiny shapes (Triton interpreter): checks the script itself.
# Each step has a timeout; one step failing leaves the others' results. Where neither TensorRT
# nor TensorRT-LLM is installed (the H200 of docs/gpu.md), the timeouts of the steps that run sum
# to 8 minutes (480 s; the tensorrt and trtllm steps say "skipped" in a second); where TensorRT
# is, to 10.5 (tensorrt: 150 s); in the TensorRT-LLM image, which has TensorRT too, to 13.5
# (trtllm: 180 s). One device command gets at most 10 minutes, so there split the run in two:
#   ONLY_STEPS="tensorrt trtllm" scripts/device_check.sh OUT_A                       (350 s)
#   ONLY_STEPS="kernel_tests parity_tests parity_script decode_bandwidth e2e_throughput" \
#       scripts/device_check.sh OUT_B                                                (480 s)
# Environment: PYTHON (default python3), TIMEOUT_SCALE (multiplies every timeout), ONLY_STEPS
# (steps to run, space- or comma-separated; environment always runs, the others are SKIPPED).
set -u -o pipefail

DRY_RUN=0
if [[ "${1:-}" == "--dry-run" ]]; then
    DRY_RUN=1
    shift
fi
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="${1:-$PWD/device_check_out}"
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
PY="${PYTHON:-python3}"
SCALE="${TIMEOUT_SCALE:-1}"
WORK="$(mktemp -d "${TMPDIR:-/tmp}/trtforge-device-check.XXXXXX")"
trap 'rm -rf "$WORK"' EXIT

mkdir -p "$WORK/pythonpath/trtforge"
for pkg in config plugins models builder serving model_repo frontend bench cli; do
    ln -s "$REPO/$pkg" "$WORK/pythonpath/trtforge/$pkg"
done
export PYTHONPATH="$WORK/pythonpath:$REPO/scripts/gpu${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PIP_NO_INDEX=1 TOKENIZERS_PARALLELISM=false
export TRITON_DEFAULT_FP_FUSION=1
if [[ "$DRY_RUN" == 1 ]]; then
    DEVICE=cpu
    BENCH_FLAG=(--dry-run)
else
    DEVICE=cuda
    BENCH_FLAG=()
fi
export TRTFORGE_TEST_DEVICE="$DEVICE"

STEPS="$OUT/steps.tsv"
printf 'step\tstatus\tseconds\tlog\n' > "$STEPS"

# run_step NAME TIMEOUT_S CMD...: run CMD with a timeout, log to OUT/NAME.log, record the outcome.
run_step() {
    local name="$1" limit="$2"
    shift 2
    local log="$OUT/$name.log" start rc status
    if [[ -n "${ONLY_STEPS:-}" && "$name" != environment && " ${ONLY_STEPS//,/ } " != *" $name "* ]]; then
        printf '%s\t%s\t%s\t%s\n' "$name" SKIPPED 0 "-" >> "$STEPS"
        echo "== $name: not in ONLY_STEPS, skipped"
        return 0
    fi
    limit="$(awk -v t="$limit" -v s="$SCALE" 'BEGIN { printf "%d", t * s }')"
    echo "== $name (timeout ${limit}s)"
    start="$(date +%s)"
    (cd "$REPO" && timeout --kill-after=10 "$limit" "$@") > "$log" 2>&1
    rc=$?
    case "$rc" in
        0) status=PASS ;;
        124 | 137) status=TIMEOUT ;;
        *) status="FAIL(rc=$rc)" ;;
    esac
    printf '%s\t%s\t%s\t%s\n' "$name" "$status" "$(($(date +%s) - start))" "$name.log" >> "$STEPS"
    echo "   $status; last lines of $log:"
    tail -n 5 "$log" | sed 's/^/     /'
}

environment() {
    "$PY" - <<'PYEOF'
import platform, torch
print("python", platform.python_version(), "torch", torch.__version__, "cuda", torch.version.cuda)
for name in ("triton", "transformers", "trtforge.plugins.paged_attention.op"):
    try:
        mod = __import__(name, fromlist=["_"])
        print(name, getattr(mod, "__version__", "importable"), getattr(mod, "__file__", ""))
    except Exception as exc:  # report, do not stop: the other steps say more
        print(name, "NOT IMPORTABLE:", exc)
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print("device", p.name, f"{p.total_memory / 2**30:.0f} GiB", p.multi_processor_count, "SMs")
PYEOF
    if command -v nvidia-smi > /dev/null; then nvidia-smi; fi
}

kernel_tests() {
    # The sm_90 compile test is for machines without a GPU; here the kernels really compile.
    "$PY" -m pytest -q -rs -p no:cacheprovider tests/plugins/test_triton_kernels.py \
        tests/plugins/test_paged_attention.py -k "not compile_for_h200" \
        --junitxml "$OUT/kernel_tests.xml"
}

parity_tests() {
    if [[ ! -f tests/builder/test_parity.py ]]; then
        echo "tests/builder/test_parity.py not in this checkout; parity_script covers parity"
        return 0
    fi
    "$PY" -m pytest -q -rs -p no:cacheprovider tests/builder/test_parity.py \
        --junitxml "$OUT/parity_tests.xml"
}

# --backend trtllm: build a tiny engine with TensorRT-LLM and emit its Triton repository (the
# NGC trtllm image has it); elsewhere the step says it was skipped and why.
trtllm_tests() {
    if ! "$PY" -c "import tensorrt_llm" > /dev/null 2>&1; then
        echo "skipped: no tensorrt_llm"
        return 0
    fi
    "$PY" -m pytest -q -rs -p no:cacheprovider tests/builder/trtllm tests/model_repo/trtllm \
        --junitxml "$OUT/trtllm_tests.xml"
}

# --backend tensorrt: build TensorRT plans and run them against the torch engine, a lone prompt
# longer than prefill_chunk_size (a step that samples no token) included; elsewhere the step says
# it was skipped and why.
tensorrt_tests() {
    if ! "$PY" -c "import tensorrt" > /dev/null 2>&1; then
        echo "skipped: no TensorRT"
        return 0
    fi
    "$PY" -m pytest -q -rs -p no:cacheprovider tests/builder/tensorrt/test_tensorrt_backend.py \
        tests/builder/tensorrt/test_zero_row_step.py --junitxml "$OUT/tensorrt_tests.xml"
}

# `timeout` runs programs, not shell functions: export them (and what they read) to a child bash.
export OUT PY
export -f environment kernel_tests parity_tests tensorrt_tests trtllm_tests
run_step environment 20 bash -c environment
run_step kernel_tests 110 bash -c kernel_tests
run_step parity_tests 70 bash -c parity_tests
run_step parity_script 60 "$PY" scripts/gpu/parity_cuda.py --out "$OUT" --work "$WORK/parity" \
    --device "$DEVICE"
run_step decode_bandwidth 80 "$PY" scripts/gpu/bench_decode_attention.py --out "$OUT" \
    "${BENCH_FLAG[@]}"
run_step e2e_throughput 140 "$PY" scripts/gpu/bench_e2e_decode.py --out "$OUT" \
    --work "$WORK/e2e" "${BENCH_FLAG[@]}"
run_step tensorrt 150 bash -c tensorrt_tests
run_step trtllm 180 bash -c trtllm_tests

if ! "$PY" "$REPO/scripts/gpu/summarize.py" "$OUT" > "$OUT/summary.txt" 2> "$OUT/summarize.log"; then
    { echo "summarize.py failed (see summarize.log); raw step table:"; cat "$STEPS"; } \
        > "$OUT/summary.txt"
fi
cat "$OUT/summary.txt"
