"""tf_ucudnn's batch normalization op against TensorFlow's FusedBatchNormV3: outputs, statistics
and gradients, on the CPU and, where its cuDNN kernels are, the GPU; bad shapes refused."""

import numpy as np
import pytest
import tensorflow as tf
from reference import assert_on_device

from tf_ucudnn.kernels import ops

EPSILON = 1e-3


def _fused_reference(x, scale, offset, dy):
    """y, mean and the gradients by FusedBatchNormV3 (4-D NHWC; 5-D seen as NDHWC), and
    1/sqrt(biased variance + epsilon) by numpy: FusedBatchNormV3 returns the unbiased variance,
    which for one value per channel is 0 on the CPU and NaN on the GPU."""
    with tf.GradientTape() as tape:
        tape.watch([x, scale, offset])
        y, mean, _, _, _, _ = tf.raw_ops.FusedBatchNormV3(
            x=x, scale=scale, offset=offset, mean=tf.zeros([0]), variance=tf.zeros([0]),
            epsilon=EPSILON, data_format="NHWC" if len(x.shape) == 4 else "NDHWC",
            is_training=True)
    values = x.numpy().reshape(-1, x.shape[-1]).astype(np.float64)
    inv_std = 1 / np.sqrt(values.var(axis=0) + EPSILON)
    return (y, mean, tf.constant(inv_std, tf.float32),
            *tape.gradient(y, [x, scale, offset], output_gradients=dy))


@pytest.mark.parametrize("shape", [[4, 5, 6, 3], [2, 3, 4, 5, 8], [1, 1, 1, 7]])
def test_outputs_statistics_and_gradients_match_fused_batch_norm(device, shape, rng):
    x = tf.constant(rng.normal(1.5, 2.0, shape), tf.float32)
    dy = tf.constant(rng.normal(size=shape), tf.float32)
    scale = tf.constant(rng.uniform(0.5, 2.0, shape[-1]), tf.float32)
    offset = tf.constant(rng.normal(size=shape[-1]), tf.float32)
    expected = _fused_reference(x, scale, offset, dy)
    with tf.device(device):
        with tf.GradientTape() as tape:
            tape.watch([x, scale, offset])
            y, mean, inv_std = ops.batch_norm(x, scale, offset, EPSILON)
        got = (y, mean, inv_std, *tape.gradient(y, [x, scale, offset], output_gradients=dy))
    assert_on_device(y, device)
    for name, a, b in zip(["y", "mean", "inv_std", "dx", "d_scale", "d_offset"], got, expected):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=2e-4, atol=2e-4, err_msg=name)


def test_bad_shapes_are_refused_with_the_reason():
    with pytest.raises(tf.errors.InvalidArgumentError, match="x must be 4-D or 5-D"):
        ops.batch_norm(tf.zeros([4, 3]), tf.ones([3]), tf.zeros([3]))
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"must have shape \[3\], got \[2\]"):
        ops.batch_norm(tf.zeros([2, 2, 2, 3]), tf.ones([2]), tf.zeros([3]))
    with pytest.raises(tf.errors.InvalidArgumentError, match="needs values to normalize"):
        ops.batch_norm(tf.zeros([0, 2, 2, 3]), tf.ones([3]), tf.zeros([3]))
    # Traced, the shape function says it before anything runs.
    with pytest.raises(ValueError, match="must be at least rank 4"):
        tf.function(ops.batch_norm).get_concrete_function(
            tf.TensorSpec([4, 3]), tf.TensorSpec([3]), tf.TensorSpec([3]))
