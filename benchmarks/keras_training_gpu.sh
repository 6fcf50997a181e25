#!/usr/bin/env bash
# Issue 4's table on a lent GPU (after TensorFlow was carried there): Keras VGG16 and ResNet-50,
# fp32, batch 128, trained by model.fit with TensorFlow's default workspace limit, with 64 MiB,
# and with tf_ucudnn's callback at 64 MiB; with and without XLA for TensorFlow's own runs.
#   bash benchmarks/keras_training_gpu.sh [configuration ...]     (default: all; results in $OUT)
# then, wherever the JSON files are:
#   python benchmarks/keras_training.py combine *.json --out benchmarks/results/keras_training.json
set -uo pipefail
cd "$(dirname "$0")/.."
. .ci/gpu-env.sh
configs=${*:-tf_ucudnn_64mib tf_64mib tf_64mib_noxla tf_default tf_default_noxla}
for config in $configs; do
  limit=64 options=()
  case $config in
    tf_ucudnn_64mib) options=(--callback 64MiB) ;;
    tf_64mib) ;;
    tf_64mib_noxla) options=(--jit-compile off) ;;
    tf_default) limit= ;;
    tf_default_noxla) limit= options=(--jit-compile off) ;;
    *) echo "unknown configuration $config"; exit 2 ;;
  esac
  env ${limit:+TF_CUDNN_WORKSPACE_LIMIT_IN_MB=$limit} python3 benchmarks/keras_training.py run \
    --models ${MODELS:-vgg16 resnet50} --batch "${BATCH:-128}" --steps "${STEPS:-15}" --epochs 3 \
    --database "${DATABASE:-/tmp/tf_ucudnn_profiles.sqlite}" \
    --profiles benchmarks/results/h100-cudnn9.14-fp32-nhwc-vgg16-resnet50-b128.jsonl.gz \
    "${options[@]}" --label "$config" \
    --out "$out/$config.json" \
    2>&1 | grep -v "^W0000\|^I0000" | tee "$out/$config.log"
done
