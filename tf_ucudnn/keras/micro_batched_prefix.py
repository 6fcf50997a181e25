"""A model's first layers run in micro-batches and made again for the backward pass.

The first layers of a VGG-style network hold the largest activations: at large batches one of
its first feature maps can alone come near the device's memory, and a convolution's backward
pass needs three of them at once, more than any swap or recomputation of whole tensors can
bring under the budget. Cut the model after those layers (the prefix), and run the prefix
on one micro-batch at a time, keeping only its output; the backward pass makes each micro-batch's
activations again and backpropagates through them, summing the weights' gradients (ooc_cuDNN's
division along the batch, with SuperNeurons' recomputation). The device then holds one
micro-batch's activations of the prefix, at the cost of running the prefix's forward pass twice.

Control edges chain the micro-batches, so that TensorFlow's executor does not run them side by
side (which would hold them all at once). Only layers whose result for a sample does not depend
on the rest of the batch may be in the prefix, but for one batch normalization, such as a
ResNet's stem (convolution, normalization, ReLU, padding, max pooling): its statistics are made
first, one micro-batch after another (the micro-batches' means and squared deviations combined
as Chan et al. combine them), then each micro-batch is made through the normalization with the
whole batch's statistics. Its backward pass goes over the micro-batches twice: once for the
whole batch's sums of the normalization's output gradient, dy and dy * x_hat (the offset's and
scale's gradients), then for the input gradient dz = scale * inv_std * (dy - sum(dy) / n -
x_hat * sum(dy * x_hat) / n) and the gradients of the layers before it. So the layers before the
normalization run four times and those after it three. In return, a stem's full-batch tensors
never exist on the device: at large batches they are what the BFC allocator fails to place once
its free space is split into smaller chunks, though a memory plan fits the budget.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Optional

import tensorflow as tf

from tf_ucudnn.core.errors import PrefixError
from tf_ucudnn.core.plan import even_sizes
from tf_ucudnn.keras.batch_norm_forms import (
    gradient_sums,
    normalization_gradient,
    normalized_axis,
    update_moving_statistics,
)

# Group normalization is not among them: it normalizes each sample by its own statistics.
_BATCH_DEPENDENT = ("BatchNormalization", "SyncBatchNormalization")


@dataclasses.dataclass(frozen=True)
class Prefix:
    """The model cut after `layer`: its first layers, and the layers after them; where the
    first layers hold a batch normalization, the layers before it and after it."""

    layer: str
    head: tf.keras.Model
    tail: tf.keras.Model
    normalization: Optional[tf.keras.layers.BatchNormalization] = None
    before_normalization: Optional[tf.keras.Model] = None
    after_normalization: Optional[tf.keras.Model] = None  # None: the cut is the normalization


def cut(model: tf.keras.Model, layer: str) -> Prefix:
    """`model` cut after `layer`: every path from the input to the output must pass through that
    layer's output, and the layers before it must treat each sample on its own."""
    try:
        boundary = model.get_layer(layer)
    except ValueError as error:
        raise PrefixError(f"{model.name} has no layer {layer!r}") from error
    head = tf.keras.Model(model.inputs, boundary.output, name=f"{model.name}_to_{layer}")
    dependent = batch_dependent_layers(head)
    normalization = before = after = None
    if dependent:
        normalization = dependent[0]
        reason = _unsplittable_normalization(dependent)
        if reason is None:
            try:
                before = tf.keras.Model(model.inputs, normalization.input,
                                        name=f"{model.name}_before_{normalization.name}")
                after = None if normalization is boundary else tf.keras.Model(
                    normalization.output, boundary.output,
                    name=f"{model.name}_after_{normalization.name}")
            except ValueError as error:
                reason = f"the layers after it read more than its output ({error})"
        if reason is not None:
            raise PrefixError(f"{normalization.name}: {type(normalization).__name__} depends on "
                              f"the whole batch, and {reason}, so the layers up to {layer} "
                              "cannot run in micro-batches")
    try:
        tail = tf.keras.Model(boundary.output, model.outputs, name=f"{model.name}_from_{layer}")
    except ValueError as error:
        raise PrefixError(f"{layer}: the layers after it read more than its output "
                          f"({error})") from error
    prefix_weights = {id(v) for v in head.weights}
    tail_weights = {id(v) for v in tail.weights}
    if len(prefix_weights) + len(tail_weights) != len({id(v) for v in model.weights}):
        raise PrefixError(f"{layer}: the layers before and after it do not divide the "
                          "model's weights between them")
    return Prefix(layer, head, tail, normalization, before, after)


def batch_dependent_layers(model: tf.keras.Model) -> list:
    """The layers of `model` whose training output for a sample depends on the rest of the
    batch (normalizations by batch statistics), in the model's order."""
    found = []
    for layer in model.layers:
        if isinstance(layer, tf.keras.Model):  # a model used as a layer: its own layers
            found += batch_dependent_layers(layer)
        # A batch normalization that is not trainable normalizes with its moving statistics.
        elif type(layer).__name__ in _BATCH_DEPENDENT and not (
                isinstance(layer, tf.keras.layers.BatchNormalization) and not layer.trainable):
            found.append(layer)
    return found


def _unsplittable_normalization(dependent: list) -> Optional[str]:
    """Why the first layers' batch-dependent layers cannot have their statistics made apart,
    or None."""
    if len(dependent) > 1:
        return (f"so do {', '.join(layer.name for layer in dependent[1:])}: only one "
                "normalization's statistics can be made in a pass of their own")
    layer = dependent[0]
    if not isinstance(layer, tf.keras.layers.BatchNormalization):
        return "only a BatchNormalization's statistics can be made in a pass of their own"
    axis = normalized_axis(layer)
    rank = len(layer.input.shape)
    if axis is None or axis % rank != rank - 1:
        return f"it normalizes axis {layer.axis}, not the last (channels) one"
    if layer.renorm or layer.synchronized:
        return "it is a batch renormalization" if layer.renorm else "it is synchronized"
    if layer.input.dtype != "float32":
        return f"its input is {layer.input.dtype}, not float32"
    return None


def _micro_batch_sizes(x, micro_batches: int) -> list[int]:
    batch = int(x.shape[0])
    if not 1 <= micro_batches <= batch:
        raise ValueError(f"cannot divide a batch of {batch} into {micro_batches} micro-batches")
    return even_sizes(batch, micro_batches)


def run_in_micro_batches(head: tf.keras.Model, x, micro_batches: int,
                         input_gradient: bool = False):
    """`head(x, training=True)`, computed one micro-batch at a time and only the output kept;
    its gradient makes each micro-batch's activations again. `input_gradient` says whether x
    needs a gradient (not for the model's own input)."""
    sizes = _micro_batch_sizes(x, micro_batches)

    @tf.custom_gradient
    def forward(x):
        chunks = tf.split(x, sizes, axis=0)
        outputs = []
        for chunk in chunks:
            with tf.control_dependencies(outputs[-1:]):
                outputs.append(head(tf.identity(chunk), training=True))

        def backward(dy, variables=None):
            weights = list(variables or ())  # those the forward pass read, as the tape saw them
            dy_chunks = tf.split(dy, sizes, axis=0)
            # The first micro-batch waits for the output's gradient: made any sooner, its
            # activations would be held through the rest of the backward pass.
            sums, dx_chunks, previous = None, [], [dy]
            for chunk, dy_chunk in zip(chunks, dy_chunks):
                with tf.control_dependencies(previous):
                    chunk = tf.identity(chunk)
                    with tf.GradientTape() as tape:
                        tape.watch(chunk)
                        out = head(chunk, training=True)
                    grads = tape.gradient(out, [chunk, *weights], output_gradients=dy_chunk)
                dx_chunks.append(grads[0])
                parts = [tf.zeros_like(w) if g is None else g for w, g in zip(weights, grads[1:])]
                sums = parts if sums is None else [a + b for a, b in zip(sums, parts)]
                previous = sums or [grads[0]]
            dx = tf.concat(dx_chunks, axis=0) if input_gradient else None
            return dx, sums or []

        return tf.concat(outputs, axis=0), backward

    return forward(x)


@tf.function(jit_compile=True, autograph=False)
def _moments(z):
    """Per channel: the mean and the sum of squared deviations from it."""
    axes = list(range(len(z.shape) - 1))
    mean = tf.reduce_mean(z, axes)
    return mean, tf.reduce_sum(tf.math.squared_difference(z, mean), axes)


@tf.function(jit_compile=True, autograph=False)
def _normalized(z, mean, inv_std, scale, offset):
    return (z - mean) * (inv_std * scale) + offset


def run_with_batch_statistics(prefix: Prefix, x, micro_batches: int,
                              input_gradient: bool = False):
    """`prefix.head(x, training=True)` for a head that holds one batch normalization, one
    micro-batch at a time with the whole batch's statistics (see the module's docstring), and
    the normalization's moving statistics updated as Keras updates them."""
    norm, before, after = (prefix.normalization, prefix.before_normalization,
                           prefix.after_normalization)
    sizes = _micro_batch_sizes(x, micro_batches)
    channels = norm.input.shape[-1]
    scale = tf.convert_to_tensor(norm.gamma) if norm.scale else tf.ones([channels])
    offset = tf.convert_to_tensor(norm.beta) if norm.center else tf.zeros([channels])

    def normalized_then_after(z, mean, inv_std, scale, offset):
        a = _normalized(z, mean, inv_std, scale, offset)
        return a if after is None else after(a, training=True)

    @tf.custom_gradient
    def forward(x, scale, offset):
        chunks = tf.split(x, sizes, axis=0)
        count, mean, squares, previous = 0.0, None, None, []
        for chunk in chunks:
            with tf.control_dependencies(previous):
                z = before(tf.identity(chunk), training=True)
                chunk_mean, chunk_squares = _moments(z)
            chunk_count = float(z.shape.num_elements() // channels)
            if mean is None:
                mean, squares = chunk_mean, chunk_squares
            else:  # Chan, Golub and LeVeque's pairwise combination
                delta, total = chunk_mean - mean, count + chunk_count
                mean = mean + delta * (chunk_count / total)
                squares = squares + chunk_squares + tf.square(delta) * (count * chunk_count / total)
            count += chunk_count
            previous = [mean, squares]
        variance = squares / count
        inv_std = tf.math.rsqrt(variance + norm.epsilon)
        outputs = []
        for chunk in chunks:
            with tf.control_dependencies(outputs[-1:] or previous):
                z = before(tf.identity(chunk), training=True)
                outputs.append(normalized_then_after(z, mean, inv_std, scale, offset))

        def backward(dy, *_statistics_gradients, variables=None):
            weights = list(variables or ())
            dy_chunks = tf.split(dy, sizes, axis=0)
            sums = [None] * len(weights)

            def add(gradients):
                for i, g in enumerate(gradients):
                    if g is not None:
                        sums[i] = g if sums[i] is None else sums[i] + g

            def normalization_output_gradient(z, dy_chunk, with_weights):
                if after is None:
                    return dy_chunk
                a = _normalized(z, mean, inv_std, scale, offset)
                with tf.GradientTape() as tape:
                    tape.watch(a)
                    out = after(a, training=True)
                grads = tape.gradient(out, [a, *(weights if with_weights else [])],
                                      output_gradients=dy_chunk)
                add(grads[1:])
                return grads[0]

            # Over the micro-batches once for the normalization's sums (and the weights after
            # it), once more for its input gradient (and the weights before it). The first
            # waits for the output's gradient, lest its activations be made in the forward pass.
            d_offset = d_scale = None
            previous = [dy]
            for chunk, dy_chunk in zip(chunks, dy_chunks):
                with tf.control_dependencies(previous):
                    z = before(tf.identity(chunk), training=True)
                    da = normalization_output_gradient(z, dy_chunk, with_weights=True)
                    chunk_offset, chunk_scale = gradient_sums(da, z, mean, inv_std)
                d_offset = chunk_offset if d_offset is None else d_offset + chunk_offset
                d_scale = chunk_scale if d_scale is None else d_scale + chunk_scale
                previous = [d_offset, d_scale, *(g for g in sums if g is not None)]
            dx_chunks = []
            for chunk, dy_chunk in zip(chunks, dy_chunks):
                with tf.control_dependencies(previous):
                    chunk = tf.identity(chunk)
                    with tf.GradientTape() as tape:
                        tape.watch(chunk)
                        z = before(chunk, training=True)
                    da = normalization_output_gradient(z, dy_chunk, with_weights=False)
                    dz, _ = normalization_gradient(da, z, mean, inv_std, scale, d_offset,
                                                    d_scale, count)
                    grads = tape.gradient(z, [chunk, *weights], output_gradients=dz)
                dx_chunks.append(grads[0])
                add(grads[1:])
                previous = [grads[0], *(g for g in sums if g is not None)]
            dx = tf.concat(dx_chunks, axis=0) if input_gradient else None
            return ([dx, d_scale, d_offset],
                    [tf.zeros_like(w) if g is None else g for w, g in zip(weights, sums)])

        return (tf.concat(outputs, axis=0), tf.stop_gradient(mean),
                tf.stop_gradient(variance)), backward

    output, mean, variance = forward(x, scale, offset)
    update_moving_statistics(norm, mean, variance)
    return output


def micro_batched_model_call(prefix: Prefix, micro_batches: int):
    """A call `f(x)` of the whole model, its prefix run in micro-batches."""
    run = run_with_batch_statistics if prefix.normalization is not None else (
        lambda prefix, x, count: run_in_micro_batches(prefix.head, x, count))

    def call(x, training: Optional[bool] = True):
        return prefix.tail(run(prefix, x, micro_batches), training=training)
    return call


@contextlib.contextmanager
def micro_batched_calls(model: tf.keras.Model, layer: str, micro_batches: int):
    """Within the block, calling `model` (as its own train_step does) runs the layers up to
    `layer` in micro-batches; for tracing a step the model's owner wrote."""
    call = micro_batched_model_call(cut(model, layer), micro_batches)
    model.__dict__["call"] = lambda inputs, training=None, **kwargs: call(inputs, training)
    try:
        yield
    finally:
        model.__dict__.pop("call", None)
