#!/usr/bin/env bash
# Issue 5's table on a lent GPU (after TensorFlow was carried there): ResNet-50, VGG16 and
# ResNet-152 side by side in one run of beyond_memory.py, which outlasts one 10-minute call of the
# device tool, so it runs in the background on the machine and later calls wait for it:
#   bash benchmarks/beyond_memory_gpu.sh start [beyond_memory.py options ...]
#   (MODELS="vgg16 resnet152" bash ... start ...   for some of the models)
#   bash benchmarks/beyond_memory_gpu.sh wait SECONDS    (repeat until it says "finished")
# Each call copies the log and the results so far to $OUT. The run's own directory is
# /tmp/beyond_memory_run, which lives as long as the machine is held.
set -uo pipefail
cd "$(dirname "$0")/.."
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
    [ -e "$run/pid" ] && kill -0 "$(cat "$run/pid")" 2>/dev/null && {
      echo "a run is already going (pid $(cat "$run/pid"))"; exit 2; }
    rm -rf "$run" && mkdir -p "$run"
    . .ci/gpu-env.sh > "$run/env.log" 2>&1
    # Copied, so later calls' fresh copies of the tree cannot change the running code.
    cp -r benchmarks tf_ucudnn "$run"/
    # The pid is written from inside the new session: setsid forks, so $! would be setsid's
    # own, gone while the run goes on.
    (cd "$run" && CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0} PYTHONPATH="$run:$PYTHONPATH" \
      setsid nohup bash -c 'echo $$ > pid; exec python3 "$@"' bash \
        benchmarks/beyond_memory.py --models ${MODELS:-resnet50 vgg16 resnet152} \
        --memory-limit-gib 16 "$@" --out "$run/results.json" > "$run/log" 2>&1 &)
    for _ in $(seq 50); do [ -s "$run/pid" ] && break; sleep 0.1; done
    echo "started pid $(cat "$run/pid")"
    ;;
  wait)
    deadline=$((SECONDS + ${2:-500}))
    while kill -0 "$(cat "$run/pid")" 2>/dev/null && [ $SECONDS -lt $deadline ]; do sleep 5; done
    kill -0 "$(cat "$run/pid")" 2>/dev/null && echo "still running" || echo "finished"
    copy_back
    ;;
  *)
    echo "usage: $0 start [beyond_memory.py options ...] | wait SECONDS"; exit 2 ;;
esac
