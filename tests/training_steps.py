"""A small training step and a device model, shared by the memory planner's and rewrite's tests."""

import numpy as np
import tensorflow as tf

from tf_ucudnn.conv_planning.kernel_dp import KernelConfiguration
from tf_ucudnn.core.plan import KERNELS, Algorithm, KernelPlan, LayerPlan, MicroBatch
from tf_ucudnn.memory.cost.device_model import DeviceModel

# A slow link and fast compute: swaps show their cost, recomputation is cheap.
SLOW_LINK = DeviceModel("test", device_to_host=1e9, host_to_device=1e9, memory_bandwidth=1e11,
                        peak_flops=1e12, launch_ms=0.001)


def gradient_step(model: tf.keras.Model, batch: int, input_shape=None):
    """The loss and gradients of a model for one batch size, as a ConcreteFunction; a
    subclassed model, which has no `input_shape`, needs one given (without the batch)."""
    loss_fn = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    @tf.function
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        return loss, tape.gradient(loss, model.trainable_variables)

    shape = input_shape or model.input_shape[1:]
    return step.get_concrete_function(tf.TensorSpec([batch, *shape]),
                                      tf.TensorSpec([batch], tf.int32))


def conv_training_step():
    """Four convolutions with ReLUs and a pooling, batch 8, as a ConcreteFunction with gradients."""
    tf.keras.utils.set_random_seed(11)
    layers = tf.keras.layers
    model = tf.keras.Sequential([
        tf.keras.Input((16, 16, 3)),
        layers.Conv2D(16, 3, padding="same"), layers.ReLU(),
        layers.Conv2D(16, 3, padding="same"), layers.ReLU(),
        layers.Conv2D(16, 3, padding="same"), layers.ReLU(),
        layers.MaxPooling2D(), layers.Conv2D(8, 3, padding="same", activation="relu"),
        layers.GlobalAveragePooling2D(), layers.Dense(5),
    ])
    return gradient_step(model, 8)


def assert_same_step(original, changed, rtol=1e-5, atol=1e-6, seed=(1, 2)):
    """Both steps give the same loss and gradients on one random batch."""
    x_spec, y_spec = [t for t in original.inputs if t.dtype != tf.resource][:2]
    x = tf.random.stateless_normal(x_spec.shape, seed=seed)
    y = tf.range(y_spec.shape[0]) % 2
    loss, grads = original(x, y)
    new_loss, new_grads = changed(x, y)
    np.testing.assert_allclose(new_loss.numpy(), loss.numpy(), rtol=rtol)
    for a, b in zip(new_grads, grads):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=rtol, atol=atol)


def pooled_conv_model():
    """Two convolutions, a pooling, a convolution, a pooling, a convolution and a dense head,
    on 32x32x3 inputs: poolings to cut a VGG-style model after."""
    tf.keras.utils.set_random_seed(3)
    layers = tf.keras.layers
    inputs = tf.keras.Input((32, 32, 3))
    h = layers.Conv2D(16, 3, padding="same", activation="relu", name="c1")(inputs)
    h = layers.Conv2D(16, 3, padding="same", activation="relu", name="c2")(h)
    h = layers.MaxPooling2D(name="pool1")(h)
    h = layers.Conv2D(16, 3, padding="same", activation="relu", name="c3")(h)
    h = layers.MaxPooling2D(name="pool2")(h)
    h = layers.Conv2D(16, 3, padding="same", activation="relu", name="c4")(h)
    h = layers.GlobalAveragePooling2D()(h)
    return tf.keras.Model(inputs, layers.Dense(4)(h))


def assert_anchors_cannot_merge_into_a_cycle(planned):
    """No op that waits, through a swap-in or recomputation, for the op that starts it (its
    anchor) shares a data input with that anchor: a backend merging the two (oneDNN fuses a
    filter gradient with the bias gradient beside it) would close a cycle."""
    from tf_ucudnn.memory.passes.recompute import CLONE

    nodes = {node.name: node for node in planned.get_concrete_function().graph.as_graph_def().node}

    def source(text):
        return text.lstrip("^").split(":")[0]

    consumers: dict[str, list[str]] = {}
    for node in nodes.values():
        for text in node.input:
            consumers.setdefault(source(text), []).append(node.name)

    def data_inputs(node):
        return {text if ":" in text else f"{text}:0" for text in node.input
                if not text.startswith("^") and nodes[source(text)].op != "Const"}

    def waiting_for(start):
        seen, frontier = {start}, [start]
        while frontier:
            for name in consumers.get(frontier.pop(), ()):
                if name not in seen:
                    seen.add(name)
                    frontier.append(name)
        return seen

    checked = 0
    for node in nodes.values():
        if CLONE not in node.name and not node.name.endswith("/held"):
            continue
        for anchor in (nodes[text[1:]] for text in node.input if text.startswith("^")):
            merging = [name for name in waiting_for(node.name)
                       if name != anchor.name and data_inputs(nodes[name]) & data_inputs(anchor)]
            assert not merging, f"{anchor.name} shares an input with {merging[:3]}, which wait for it"
            checked += 1
    assert checked, "the plan has no anchored swap-in or recomputation"


class WorkspaceFrontPlanner:
    """Plans each kernel undivided with 64 MiB of workspace, and offers halves with none, as
    its Pareto front (for choosing workspaces with the memory plan). Notes the batch sizes it
    plans for."""

    BIG = 64 << 20

    def __init__(self):
        self.batches = []

    def options(self, layer):
        size = layer.batch_size
        halves = KernelPlan((MicroBatch(size // 2, Algorithm(0), 0),
                             MicroBatch(size - size // 2, Algorithm(0), 0)))
        whole = KernelPlan((MicroBatch(size, Algorithm(1), self.BIG),))
        return [KernelConfiguration(halves, 1.0, 0), KernelConfiguration(whole, 0.5, self.BIG)]

    def __call__(self, layer):
        self.batches.append(layer.batch_size)
        whole = self.options(layer)[1].plan
        return LayerPlan(whole, whole, whole)

    def workspace_front(self, layer):
        return {kernel: self.options(layer) for kernel in KERNELS}
