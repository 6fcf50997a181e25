#!/usr/bin/env bash
# Issue 21's table on a lent GPU (after TensorFlow was carried there): Keras VGG16 and ResNet-50,
# fp32, batch 128, trained by model.fit, one process per configuration, side by side with Keras's
# default step (XLA):
#   tf_default        Keras's defaults (XLA on a GPU)             the baseline
#   tf_default_noxla  XLA off
#   tf_64mib_noxla    XLA off, TF_CUDNN_WORKSPACE_LIMIT_IN_MB=64
#   tf_64mib          XLA on,  TF_CUDNN_WORKSPACE_LIMIT_IN_MB=64
#   tf_ucudnn_64mib   MicroBatchCallback("64MiB"), Keras's defaults otherwise (what a user adds)
#   tf_ucudnn_64mib_noxla  the same with XLA off and TF_CUDNN_WORKSPACE_LIMIT_IN_MB=64 (the layers
#                     the callback leaves to TensorFlow held to the limit too)
#   tf_ucudnn_64mib_bn_xla  (only when named) the callback with fuse_batch_norm="xla": batch
#                     normalization with its gradient written out, inside Keras's XLA step,
#                     from the first step (left to it, the callback tries it in its step trial
#                     where XLA does not compile the step)
#   tf_ucudnn_64mib_bn_keras  (only when named) the callback with Keras's batch normalization
#   tf_ucudnn_64mib_no_prefetch  (only when named) the callback copying no batch ahead
#   tf_default_prefetch_to_device  (only when named) Keras's defaults, fed through tf.data's
#                     prefetch_to_device: what a user could write instead of the callback's copies
#   tf_ucudnn_64mib_rerun  (only when named, after tf_ucudnn_64mib) the callback again, in a new
#                     process over the profile database tf_ucudnn_64mib left: a second run
# It outlasts one call of the device tool, so it runs in the background and later calls wait:
#   bash benchmarks/keras_training_gpu.sh start [configuration ...]   (default: all)
#   bash benchmarks/keras_training_gpu.sh wait SECONDS                (until it says "finished")
# PROFILES names the profile records (JSONL, absolute paths) the runs import (default: the NHWC
# legacy records at batch 128); what they lack, the callback measures on the GPU. With
# FRESH_DATABASE=1 each configuration starts from an empty database of its own instead, importing
# nothing (what a new user has). PRECISION=mixed_bfloat16 trains in Keras's bf16 policy. STEPS and
# EPOCHS set each run's length (30 steps, 3 epochs, the first not timed). REPEATS=N runs the whole list N
# times in turn (the runs after the first labelled _r2, _r3, ...), as XLA's autotuner may choose
# differently in each process.
# The two rows without XLA at 64 MiB also profile one step after the timed epochs, to say what is
# alive at each one's peak. With TESTS set (test paths, "tests" for all), the GPU tests there run
# after the table.
# Each call copies the logs and the combined table so far to $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
. benchmarks/background_run.sh
run=${RUN_DIR:-/tmp/keras_training_run}
out=${OUT:-gpu-logs}
mkdir -p "$out"

copy_back() {
  # One archive: the device tool brings back only a few files a call.
  (cd "$run" && tar czf "$out/$(basename "$run").tgz" $(ls *.log *.json table.txt 2>/dev/null))
  grep -h " img/s" "$run"/*.log 2>/dev/null | tail -20
  [ -f "$run/table.txt" ] && cat "$run/table.txt"
}

configurations() {
  local default=benchmarks/results/h100-cudnn9.14-fp32-nhwc-vgg16-resnet50-b128.jsonl.gz
  local profiles=${PROFILES:-$default}
  local list=${*:-tf_default tf_default_noxla tf_64mib_noxla tf_64mib tf_ucudnn_64mib \
                  tf_ucudnn_64mib_noxla}
  for repeat in $(seq "${REPEATS:-1}"); do
    for config in $list; do
      limit=64 options=() label=$config
      [ "$repeat" -gt 1 ] && label=${config}_r$repeat
      database=$run/profiles.sqlite imports=(--profiles $profiles)
      if [ -n "${FRESH_DATABASE:-}" ]; then
        database=$run/$label.sqlite imports=()
        [ "$config" = tf_ucudnn_64mib_rerun ] && database=$run/tf_ucudnn_64mib.sqlite
      fi
      case $config in
        tf_default) limit= ;;
        tf_default_noxla) limit= options=(--jit-compile off) ;;
        tf_64mib_noxla) options=(--jit-compile off --trace-peak) ;;
        tf_64mib) ;;
        tf_ucudnn_64mib) limit= options=(--callback 64MiB) ;;
        tf_ucudnn_64mib_noxla) options=(--callback 64MiB --jit-compile off --trace-peak) ;;
        tf_ucudnn_64mib_bn_xla) limit= options=(--callback 64MiB --fuse-batch-norm xla) ;;
        tf_ucudnn_64mib_bn_keras) limit= options=(--callback 64MiB --fuse-batch-norm keras) ;;
        tf_ucudnn_64mib_no_prefetch) limit= options=(--callback 64MiB --prefetch-batches 0) ;;
        tf_default_prefetch_to_device) limit= options=(--prefetch-to-device) ;;
        tf_ucudnn_64mib_rerun) limit= options=(--callback 64MiB) ;;
        *) echo "unknown configuration $config"; exit 2 ;;
      esac
      env ${limit:+TF_CUDNN_WORKSPACE_LIMIT_IN_MB=$limit} \
        python3 benchmarks/keras_training.py run \
        --models ${MODELS:-vgg16 resnet50} --batch "${BATCH:-128}" --steps "${STEPS:-30}" \
        --epochs "${EPOCHS:-3}" --precision "${PRECISION:-float32}" --database "$database" \
        "${imports[@]}" "${options[@]}" --label "$label" --out "$run/$label.json" \
        2>&1 | grep --line-buffered -v "^W0000\|^I0000" > "$run/$label.log"
    done
  done
  python3 benchmarks/keras_training.py combine "$run"/tf_default.json \
    $(ls "$run"/*.json | grep -v "tf_default.json\|keras_training.json") \
    --out "$run/keras_training.json" > "$run/table.txt" 2>&1
  if [ -n "${TESTS:-}" ]; then
    timeout 600 python3 -m pytest $TESTS -m gpu -q -p no:cacheprovider > "$run/tests.log" 2>&1
  fi
}

case ${1:-} in
  start)
    shift
    export -f configurations
    background_start "$run" bash -c 'configurations "$@"' bash "$@"
    ;;
  wait)
    background_wait "$run" "${2:-500}"
    copy_back
    ;;
  *)
    echo "usage: $0 start [configuration ...] | wait SECONDS"; exit 2 ;;
esac
