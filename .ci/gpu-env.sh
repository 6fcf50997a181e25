# Sourced on a lent GPU machine after TensorFlow was carried there (../shared/gpu/README.md):
# the test wheels from .whl/, TensorFlow's environment, this checkout on PYTHONPATH, and the op
# library built with its cuDNN kernels for Hopper (sm_90) unless TF_UCUDNN_CUDA_ARCHS says other.
out=${OUT:-gpu-logs}
mkdir -p "$out"
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
# Once per shell: sourced again, its PYTHONPATH would shadow the CUDA 13 libraries it links to,
# and TensorFlow would see no GPU.
if [ -z "${TF_UCUDNN_GPU_ENV:-}" ] && [ -f /tmp/tfstage/tools/tf-gpu-env.sh ]; then
  . /tmp/tfstage/tools/tf-gpu-env.sh && export TF_UCUDNN_GPU_ENV=1
fi
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
# A library built elsewhere for this machine (.ci/gpu-library-here), carried in .dev/.
if [ -f .dev/_ucudnn_ops.so ] && [ -z "${TF_UCUDNN_REBUILD:-}" ]; then
  cp .dev/_ucudnn_ops.so tf_ucudnn/_ucudnn_ops.so
fi
if ! ls tf_ucudnn/_ucudnn_ops*.so >/dev/null 2>&1 || [ -n "${TF_UCUDNN_REBUILD:-}" ]; then
  TF_UCUDNN_CUDA_ARCHS=${TF_UCUDNN_CUDA_ARCHS:-90} python3 setup.py -q build_ext --inplace 2>&1 \
    | tee "$out/build.log"
fi
