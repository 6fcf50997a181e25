"""Every legacy cuDNN algorithm of every kernel, on the GPU: each one either computes the same
convolution as TensorFlow or is refused with an error naming it — never a wrong result or a
crash. Layouts and dtypes matter to cuDNN's support, so both are swept."""

import pytest
import reference
import tensorflow as tf

import tf_ucudnn
from tf_ucudnn.core.plan import ALGORITHM_COUNTS, KERNELS

pytestmark = pytest.mark.gpu

CONFIGS = {
    "NCHW": reference.Conv((5, 3, 9, 10), (3, 3, 3, 4), padding="SAME", data_format="NCHW"),
    "NHWC": reference.Conv((5, 9, 10, 3), (3, 3, 3, 4), padding="SAME", data_format="NHWC"),
    "NCHW-stride2": reference.Conv((5, 3, 9, 10), (3, 3, 3, 4), strides=(2, 2), padding="SAME",
                                   data_format="NCHW"),
}


@pytest.mark.parametrize("dtype", [tf.float32, tf.float16], ids=["float32", "float16"])
@pytest.mark.parametrize("config", sorted(CONFIGS))
@pytest.mark.parametrize("kernel", KERNELS)
def test_every_algorithm_is_right_or_refused(gpu_device, kernel, config, dtype, rng):
    cfg = CONFIGS[config]
    x = reference.random(cfg.input_shape, dtype, rng)
    w = reference.random(cfg.filter_shape, dtype, rng)
    dy = reference.random(cfg.output_shape, dtype, rng)
    expected = reference.kernel_result(kernel, cfg, x, w, dy)
    scale = reference.kernel_result(kernel, cfg, tf.abs(x), tf.abs(w), tf.abs(dy))
    ran, refused = [], []
    for algo in range(ALGORITHM_COUNTS[kernel]):
        plan = tf_ucudnn.KernelPlan.of((2, algo), (3, algo))
        try:
            with tf.device(gpu_device):
                result = reference.run_kernel(kernel, cfg, x, w, dy, plan)
        except tf.errors.InvalidArgumentError as error:
            assert f"does not support algorithm {algo} " in error.message, error.message
            assert "[2@algo=" in error.message  # names the plan
            refused.append(algo)
            continue
        reference.assert_close(result, expected, scale, dtype, f"{kernel} algorithm {algo}",
                               roundings=reference.algorithm_roundings(kernel, algo))
        ran.append(algo)
    print(f"{kernel} {config} {dtype.name}: ran {ran}, refused {refused}")
    assert ran, f"cuDNN ran no {kernel} algorithm at all for {cfg}"
