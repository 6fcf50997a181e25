"""Out-of-core convolution: chunked on the device, equal to tf.nn.conv2d and its gradients."""

import numpy as np
import pytest
import tensorflow as tf

from tf_ucudnn.kernels.out_of_core import out_of_core_conv2d


@pytest.mark.parametrize("batch_chunks, channel_chunks, in_flight", [
    (1, 1, 1), (3, 1, 2), (5, 2, 1), (2, 3, 3)])
@pytest.mark.parametrize("padding, strides", [("SAME", 1), ("VALID", 2)])
def test_equals_tf_conv2d_and_its_gradients(batch_chunks, channel_chunks, in_flight, padding,
                                            strides):
    rng = np.random.RandomState(batch_chunks * 10 + channel_chunks)
    x = tf.constant(rng.randn(5, 9, 8, 3), tf.float64)
    w = tf.constant(rng.randn(3, 3, 3, 6), tf.float64)

    @tf.function
    def both(x, w):
        with tf.GradientTape(persistent=True) as tape:
            tape.watch([x, w])
            y = out_of_core_conv2d(x, w, strides, padding, batch_chunks=batch_chunks,
                                   channel_chunks=channel_chunks, in_flight=in_flight,
                                   compute_device="/CPU:0")
            reference = tf.nn.conv2d(x, w, strides, padding)
            weights = tf.cast(tf.range(tf.size(y)), tf.float64)
            loss = tf.reduce_sum(tf.reshape(y, [-1]) * weights)
            reference_loss = tf.reduce_sum(tf.reshape(reference, [-1]) * weights)
        return (y, reference, tape.gradient(loss, [x, w]),
                tape.gradient(reference_loss, [x, w]))

    y, reference, grads, reference_grads = both(x, w)
    np.testing.assert_allclose(y.numpy(), reference.numpy(), rtol=1e-12)
    for got, expected in zip(grads, reference_grads):
        np.testing.assert_allclose(got.numpy(), expected.numpy(), rtol=1e-10)


def test_chunks_are_bounded_by_in_flight():
    @tf.function
    def f(x, w):
        return out_of_core_conv2d(x, w, 1, "SAME", batch_chunks=4, in_flight=2,
                                  compute_device="/CPU:0")

    graph = f.get_concrete_function(tf.TensorSpec([8, 4, 4, 2]),
                                    tf.TensorSpec([1, 1, 2, 2])).graph
    convs = [op for op in graph.get_operations() if op.type == "UcudnnConv2D"]
    assert len(convs) == 4
    # The input copies of chunks 2 and 3 wait for the results of chunks 0 and 1.
    copies = [op for op in graph.get_operations() if op.type == "Identity" and op.control_inputs]
    assert len(copies) == 2


def test_bad_divisions_are_named():
    x, w = tf.zeros([2, 4, 4, 1]), tf.zeros([1, 1, 1, 3])
    with pytest.raises(ValueError, match="cannot divide 2 samples into 3 chunks"):
        out_of_core_conv2d(x, w, 1, "SAME", batch_chunks=3, compute_device="/CPU:0")
    with pytest.raises(ValueError, match="cannot divide 3 output channels into 4 chunks"):
        out_of_core_conv2d(x, w, 1, "SAME", channel_chunks=4, compute_device="/CPU:0")
