#!/usr/bin/env bash
# cuDNN's engine configurations on a lent GPU (after TensorFlow was carried there, with the op
# library built with cudnn-frontend in tf_ucudnn/ or built there by .ci/gpu-env.sh): the GPU
# tests of the cuDNN paths first (TESTS, default: engines, forms, profiler, fused op, self-check,
# ops; set it empty to skip them), then microbatch_speedup.py (MODELS at batch 256, LIMITS MiB per
# kernel) with legacy algorithms and engine configurations, side by side with TensorFlow's own
# ops. DATABASE names a profile database to measure into (default: a new one in the run's folder);
# GPU_TIMES=1 adds each kernel's GPU time from TensorFlow's profiler; DATA_FORMAT=channels_last
# measures the models in NHWC.
# It outlasts one call of the device tool, so it runs in the background and later calls wait:
#   bash benchmarks/engines_gpu.sh start
#   bash benchmarks/engines_gpu.sh wait SECONDS        (until it says "finished")
# Each call copies the logs and the results so far to $OUT, as one archive.
set -uo pipefail
cd "$(dirname "$0")/.."
. benchmarks/background_run.sh
run=${RUN_DIR:-/tmp/engines_run}
out=${OUT:-gpu-logs}
mkdir -p "$out"

session() {
  { nvidia-smi -L; python3 -c "import tf_ucudnn.kernels.library as l; \
print('engines available:', l.engines_available())"; } > "$run/device.txt" 2>&1
  local tests=${TESTS-tests/kernels/test_cudnn_engines.py tests/kernels/test_forms.py \
    tests/profiling/test_profiler.py tests/kernels/test_fused_conv.py \
    tests/kernels/test_self_check.py tests/kernels/test_ops.py}
  [ -n "$tests" ] && timeout "${TEST_TIMEOUT_S:-900}" python3 -m pytest $tests -m gpu -q -rs \
    -p no:cacheprovider > "$run/tests.log" 2>&1
  python3 benchmarks/microbatch_speedup.py --models ${MODELS:-alexnet resnet50 mobilenet_v2} \
    --batch "${BATCH:-256}" --limits-mib ${LIMITS:-64} ${GPU_TIMES:+--gpu-times} \
    --data-format "${DATA_FORMAT:-channels_first}" \
    --database "${DATABASE:-$run/profiles.sqlite}" --out "$run/microbatch_speedup.json" 2>&1 \
    | grep --line-buffered -v "^W0000\|^I0000" > "$run/microbatch_speedup.log"
}

case ${1:-} in
  start)
    export -f session
    background_start "$run" bash -c session
    ;;
  wait)
    background_wait "$run" "${2:-500}"
    # One archive: the device tool brings back only a few files a call.
    (cd "$run" && tar czf "$out/engines_run.tgz" $(ls *.txt *.log *.json *.sqlite 2>/dev/null))
    grep -E "passed|failed|error" "$run/tests.log" 2>/dev/null | tail -3
    grep -v "^W0000\|^I0000\|^WARNING" "$run/microbatch_speedup.log" 2>/dev/null | tail -12
    ;;
  *)
    echo "usage: $0 start | wait SECONDS"; exit 2 ;;
esac
