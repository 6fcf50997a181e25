#!/usr/bin/env bash
# Issue 23's table on a lent GPU (after TensorFlow was carried there): keras_beyond_memory.py
# for the models, which outlasts one call of the device tool, in the background; later calls wait:
#   MODELS="vgg16 resnet50" bash benchmarks/keras_beyond_memory_gpu.sh start [options ...]
#   bash benchmarks/keras_beyond_memory_gpu.sh wait SECONDS     (until it says "finished")
# With PROBE set, benchmarks/xla_recompute_probe.py runs after the table.
# Each call copies the log and the results so far to $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
. benchmarks/background_run.sh
run=/tmp/keras_beyond_memory_run
out=${OUT:-gpu-logs}
mkdir -p "$out"

case ${1:-} in
  start)
    shift
    background_start "$run" bash -c 'python3 benchmarks/keras_beyond_memory.py --models $0 \
      --out "$run/results.json" "$@"; [ -n "${PROBE:-}" ] && python3 \
      benchmarks/xla_recompute_probe.py --out "$run/probe.json"' "${MODELS:-vgg16 resnet50 resnet152}" "$@"
    ;;
  wait)
    background_wait "$run" "${2:-500}"
    cp "$run"/log "$run"/*.json "$out"/ 2>/dev/null
    grep -E "Keras fit|callback|probe" "$run"/log | cut -c1-400 | tail -20
    ;;
  *)
    echo "usage: $0 start [options ...] | wait SECONDS"; exit 2 ;;
esac
