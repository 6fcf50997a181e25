"""Out-of-core convolution: one layer whose tensors exceed the device's memory, computed in chunks.

The input and output stay in host memory. The batch is divided into chunks and the output channels
into groups (ooc_cuDNN's division along batch and channels); each chunk's input goes to the device,
is convolved with each filter group, and its output comes back. Chunks are independent ops, so
TensorFlow's executor overlaps one chunk's copies (on the GPU's copy streams) with another's
convolution; control edges keep at most `in_flight` chunks on the device at once, which bounds the
device memory to the filters plus `in_flight` chunks of input and output.

The gradient is computed the same way: the output gradient chunk by chunk, the input gradient
summed over the filter groups, the filter gradient summed over the batch chunks.
"""

from __future__ import annotations

from typing import Optional

import tensorflow as tf

from tf_ucudnn.core.plan import even_sizes
from tf_ucudnn.kernels import ops


def _splits(total: int, parts: int, what: str) -> list[int]:
    if not 1 <= parts <= total:
        raise ValueError(f"cannot divide {total} {what} into {parts} chunks")
    return even_sizes(total, parts)


def out_of_core_conv2d(x, filters, strides, padding, data_format: str = "NHWC",
                       dilations=None, *, batch_chunks: int = 1, channel_chunks: int = 1,
                       compute_device: str = "/GPU:0", host_device: str = "/CPU:0",
                       in_flight: int = 2, name: Optional[str] = None):
    """tf.nn.conv2d with `x` and the result in host memory, computed in chunks on the device.

    `batch_chunks` divides the batch, `channel_chunks` the output channels (the filter's last
    dimension). At most `in_flight` batch chunks are on the device at once.
    """
    if in_flight < 1:
        raise ValueError(f"in_flight must be at least 1, got {in_flight}")
    channels_last = data_format.endswith("C")
    channel_axis = -1 if channels_last else 1
    batch_sizes = _splits(int(x.shape[0]), batch_chunks, "samples")
    group_sizes = _splits(int(filters.shape[-1]), channel_chunks, "output channels")
    conv_args = dict(strides=strides, padding=padding, data_format=data_format,
                     dilations=dilations)

    @tf.custom_gradient
    def convolve(x, filters):
        with tf.device(compute_device):
            groups = tf.split(filters, group_sizes, axis=-1)
        chunks = tf.split(x, batch_sizes, axis=0)
        outputs = _chunked(chunks, in_flight, compute_device, host_device,
                           lambda chunk: tf.concat([ops.conv2d(chunk, g, **conv_args)
                                                    for g in groups], axis=channel_axis))
        y = tf.concat(outputs, axis=0)

        def grad(dy):
            dy_chunks = tf.split(dy, batch_sizes, axis=0)
            filter_shape = [*filters.shape[:-1]]
            dw_parts = []

            def backward(index):
                def run(dy_chunk):
                    x_chunk = tf.identity(chunks[index])
                    dy_groups = tf.split(dy_chunk, group_sizes, axis=channel_axis)
                    dx = tf.add_n([ops.conv2d_backprop_input(tf.shape(x_chunk), g, d, **conv_args)
                                   for g, d in zip(groups, dy_groups)])
                    dw_parts.append(tf.concat([
                        ops.conv2d_backprop_filter(x_chunk, [*filter_shape, size], d, **conv_args)
                        for size, d in zip(group_sizes, dy_groups)], axis=-1))
                    return dx
                return run

            dx_chunks = _chunked(dy_chunks, in_flight, compute_device, host_device,
                                 [backward(i) for i in range(len(dy_chunks))])
            with tf.device(compute_device):
                dw = tf.add_n(dw_parts)
            return tf.concat(dx_chunks, axis=0), dw

        return y, grad

    with tf.name_scope(name or "out_of_core_conv2d"):
        with tf.device(host_device):
            x = tf.identity(x)
        return convolve(x, filters)


def _chunked(chunks, in_flight, compute_device, host_device, compute):
    """Each chunk to the device, computed, and back to the host; chunk i starts its copy once
    chunk i - in_flight is back."""
    results = []
    for i, chunk in enumerate(chunks):
        run = compute[i] if isinstance(compute, list) else compute
        waits = [results[i - in_flight]] if i >= in_flight else []
        with tf.control_dependencies(waits):
            with tf.device(compute_device):
                result = run(tf.identity(chunk))
        with tf.device(host_device):
            results.append(tf.identity(result))
    return results
