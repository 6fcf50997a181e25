#!/usr/bin/env bash
# Issue 5's table on a lent GPU (after TensorFlow was carried there): ResNet-50, VGG16 and
# ResNet-152 side by side in one run of beyond_memory.py, which outlasts one 10-minute call of the
# device tool, so it runs in the background on the machine and later calls wait for it:
#   bash benchmarks/beyond_memory_gpu.sh start [beyond_memory.py options ...]
#   (MODELS="vgg16 resnet152" bash ... start ...   for some of the models)
#   bash benchmarks/beyond_memory_gpu.sh wait SECONDS    (repeat until it says "finished")
# Each call copies the log and the results so far to $OUT. The run's own directory is
# /tmp/beyond_memory_run, which lives as long as the machine is held (background_run.sh).
set -uo pipefail
cd "$(dirname "$0")/.."
. benchmarks/background_run.sh
run=/tmp/beyond_memory_run
out=${OUT:-gpu-logs}
mkdir -p "$out"

copy_back() {
  cp "$run"/log "$run"/results.json "$out"/ 2>/dev/null
  grep -E "^(resnet|vgg)" "$run"/log | cut -c1-300 | tail -20
}

case ${1:-} in
  start)
    shift
    background_start "$run" python3 benchmarks/beyond_memory.py \
      --models ${MODELS:-resnet50 vgg16 resnet152} --memory-limit-gib 16 "$@" \
      --out "$run/results.json"
    ;;
  wait)
    background_wait "$run" "${2:-500}"
    copy_back
    ;;
  *)
    echo "usage: $0 start [beyond_memory.py options ...] | wait SECONDS"; exit 2 ;;
esac
