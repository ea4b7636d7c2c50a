#!/usr/bin/env bash
# GPU benchmarks: overhead and communication on one NVIDIA GPU split into 2 and 4 virtual
# GPUs (keras_dist.virtual_devices), with mixed precision (mixed_float16), NCCL all-reduce
# where it applies, else keras_dist's "ring" (ReductionToOneDevice) fallback.
#
#   benchmarks/gpu.sh            # full sizes
#   benchmarks/gpu.sh --quick    # smaller sizes, a few minutes
#
# Without an NVIDIA GPU (no working nvidia-smi, or TensorFlow sees none) it prints
# "no GPU: skipped" and exits 0. Results: benchmarks/results/gpu/gpu_<n>_<impl>.json and
# a bandwidth plot there; the exit code is 1 if every configuration failed.
#
# NCCL applies across physical GPUs; several virtual GPUs on one card are rejected by
# NCCL ("Duplicate GPU detected") on most versions, so each configuration tries "nccl"
# first and falls back to "ring", and the JSON says which ran. Communication runs in one
# process on the virtual GPUs (MirroredStrategy): NCCL cannot span processes that share
# one GPU either.
set -uo pipefail

cd "$(dirname "$0")/.." || exit 1
if [[ -z "${PYTHON:-}" ]]; then
    if [[ -x .venv/bin/python ]]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
MODE_FLAG=()
[[ "${1:-}" == "--quick" ]] && MODE_FLAG=(--quick)

if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1; then
    echo "benchmarks/gpu.sh: no GPU: skipped (nvidia-smi not found or no device)"
    exit 0
fi
export TF_CPP_MIN_LOG_LEVEL=${TF_CPP_MIN_LOG_LEVEL:-2}
if ! "$PYTHON" -c "import sys, tensorflow as tf; sys.exit(0 if tf.config.list_physical_devices('GPU') else 3)"; then
    echo "benchmarks/gpu.sh: no GPU: skipped (TensorFlow sees no GPU; install tensorflow[and-cuda])"
    exit 0
fi
nvidia-smi -L

OUT_DIR=benchmarks/results/gpu
mkdir -p "$OUT_DIR"
succeeded=0
failed=0
for replicas in 2 4; do
    ran=""
    for implementation in nccl ring; do
        output="$OUT_DIR/gpu_${replicas}_${implementation}.json"
        echo "=== $replicas virtual GPUs, implementation=$implementation, mixed precision ==="
        if "$PYTHON" benchmarks/run.py "${MODE_FLAG[@]}" --only overhead,communication \
            --device gpu --replicas "$replicas" --implementation "$implementation" \
            --mixed-precision --output "$output"; then
            ran=$implementation
            break
        fi
        echo "benchmarks/gpu.sh: $replicas GPUs with $implementation failed (see $output)"
    done
    if [[ -n "$ran" ]]; then
        succeeded=$((succeeded + 1))
        echo "benchmarks/gpu.sh: $replicas virtual GPUs: ran with implementation=$ran"
    else
        failed=$((failed + 1))
    fi
done
# Pipeline parallelism (keras_dist.parallel): 2 stages on 2 logical GPUs of one card;
# memory per logical device from tf.config.experimental.get_memory_info.
echo "=== pipeline, 2 stages on 2 virtual GPUs ==="
if "$PYTHON" benchmarks/pipeline.py "${MODE_FLAG[@]}" --output "$OUT_DIR/gpu_pipeline.json"; then
    succeeded=$((succeeded + 1))
else
    failed=$((failed + 1))
    echo "benchmarks/gpu.sh: pipeline failed"
fi
echo "benchmarks/gpu.sh: $succeeded configuration(s) ran, $failed failed; results in $OUT_DIR"
[[ $succeeded -gt 0 ]]
