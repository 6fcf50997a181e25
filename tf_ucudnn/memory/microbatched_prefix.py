"""A model's first layers run in micro-batches and made again for the backward pass.

The first layers of a VGG-style network hold the largest activations: at four times the batch
that fits a 16 GiB GPU, one of VGG16's first feature maps alone is 12 GB, and a convolution's
backward pass needs three of them at once, more than any swap or recomputation of whole tensors
can bring under the budget. Cut the model after those layers (the prefix), and run the prefix
on one micro-batch at a time, keeping only its output; the backward pass makes each micro-batch's
activations again and backpropagates through them, summing the weights' gradients (ooc_cuDNN's
division along the batch, with SuperNeurons' recomputation). The device then holds one
micro-batch's activations of the prefix, at the cost of running the prefix's forward pass twice.

Control edges chain the micro-batches, so that TensorFlow's executor does not run them side by
side (which would hold them all at once). Only layers whose result for a sample does not depend
on the rest of the batch may be in the prefix: batch normalization in training is refused.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Optional

import tensorflow as tf

from tf_ucudnn.plan import even_sizes

_BATCH_DEPENDENT = ("BatchNormalization", "SyncBatchNormalization", "GroupNormalization")


@dataclasses.dataclass(frozen=True)
class Prefix:
    """The model cut after `layer`: its first layers, and the layers after them."""

    layer: str
    head: tf.keras.Model
    tail: tf.keras.Model


class PrefixError(ValueError):
    """A cut the model does not allow; names the layer and the reason."""


def cut(model: tf.keras.Model, layer: str) -> Prefix:
    """`model` cut after `layer`: every path from the input to the output must pass through that
    layer's output, and the layers before it must treat each sample on its own."""
    try:
        boundary = model.get_layer(layer)
    except ValueError as error:
        raise PrefixError(f"{model.name} has no layer {layer!r}") from error
    head = tf.keras.Model(model.inputs, boundary.output, name=f"{model.name}_to_{layer}")
    for inner in head.layers:
        if type(inner).__name__ in _BATCH_DEPENDENT:
            raise PrefixError(f"{inner.name}: {type(inner).__name__} depends on the whole "
                              f"batch, so the layers up to {layer} cannot run in micro-batches")
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
    return Prefix(layer, head, tail)


def run_in_micro_batches(head: tf.keras.Model, x, micro_batches: int,
                         input_gradient: bool = False):
    """`head(x, training=True)`, computed one micro-batch at a time and only the output kept;
    its gradient makes each micro-batch's activations again. `input_gradient` says whether x
    needs a gradient (not for the model's own input)."""
    batch = int(x.shape[0])
    if not 1 <= micro_batches <= batch:
        raise ValueError(f"cannot divide a batch of {batch} into {micro_batches} micro-batches")
    sizes = even_sizes(batch, micro_batches)

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


def microbatched_model_call(prefix: Prefix, micro_batches: int):
    """A call `f(x)` of the whole model, its prefix run in micro-batches."""
    def call(x, training: Optional[bool] = True):
        return prefix.tail(run_in_micro_batches(prefix.head, x, micro_batches), training=training)
    return call


@contextlib.contextmanager
def micro_batched_calls(model: tf.keras.Model, layer: str, micro_batches: int):
    """Within the block, calling `model` (as its own train_step does) runs the layers up to
    `layer` in micro-batches; for tracing a step the model's owner wrote."""
    call = microbatched_model_call(cut(model, layer), micro_batches)
    model.__dict__["call"] = lambda inputs, training=None, **kwargs: call(inputs, training)
    try:
        yield
    finally:
        model.__dict__.pop("call", None)
