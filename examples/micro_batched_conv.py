"""A convolution run as micro-batches, checked against tf.nn.conv2d, with its gradient.

    python examples/micro_batched_conv.py

On a GPU (with tf_ucudnn's cuDNN kernels built), TF_UCUDNN_LOG_CALLS=1 logs each cuDNN call, one
per micro-batch.
"""

import numpy as np
import tensorflow as tf

import tf_ucudnn

images = tf.random.stateless_normal([8, 32, 32, 16], seed=[1, 2])
filters = tf.random.stateless_normal([3, 3, 16, 32], seed=[3, 4]) * 0.1

# Forward as 3 + 5 samples with IMPLICIT_PRECOMP_GEMM (cuDNN algorithm 1) and IMPLICIT_GEMM (0);
# the backprop ops of the gradient get plans of their own.
plan = tf_ucudnn.LayerPlan(
    forward=tf_ucudnn.KernelPlan.of((3, 1), (5, 0)),
    backprop_input=tf_ucudnn.KernelPlan.of((4, 1), (4, 1)),
    backprop_filter=tf_ucudnn.KernelPlan.of((2, 1), (2, 1), (4, 1)),
)
print("plan:", plan.dumps())


@tf.function
def loss_and_grads(x, w):
    with tf.GradientTape() as tape:
        tape.watch([x, w])
        y = tf_ucudnn.conv2d(x, w, strides=1, padding="SAME", plan=plan)
        loss = tf.reduce_sum(tf.square(y))
    return y, tape.gradient(loss, [x, w])


y, (dx, dw) = loss_and_grads(images, filters)
with tf.GradientTape() as tape:
    tape.watch([images, filters])
    reference = tf.nn.conv2d(images, filters, strides=1, padding="SAME")
    ref_dx, ref_dw = tape.gradient(tf.reduce_sum(tf.square(reference)), [images, filters])

for name, ours, theirs in (("output", y, reference), ("d input", dx, ref_dx),
                           ("d filter", dw, ref_dw)):
    error = float(np.max(np.abs(ours - theirs)) / np.max(np.abs(theirs)))
    print(f"{name:8s} {str(ours.shape):18s} max relative difference to TensorFlow: {error:.2e}")

graph = loss_and_grads.get_concrete_function(images, filters).graph
for op in graph.get_operations():
    if op.type.startswith("Ucudnn"):
        print(f"{op.type:28s} micro_batches={op.get_attr('micro_batches')} "
              f"algorithms={[a.decode() for a in op.get_attr('algorithms')]}")
print("device:", y.device, "| cuDNN kernels built:", tf_ucudnn.gpu_kernels_available())
