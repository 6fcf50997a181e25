"""A convolution and the batch normalization after it trained as one op, its backward streamed in
micro-batches.

Why: trained as two layers, a batch normalization's gradient dz (the size of the convolution's
output) is made whole and held until the convolution's backward has read it. Where a block's last
convolution widens the channels (as in ResNet-50's first stage), its batch normalization's
gradient holds its input z, the output's gradient dy and dz, all of the widened size, while the
projection shortcut's dz waits for its convolution: four such tensors at once, which at large
batches set the floor of every memory plan.

Here the backward first sums dy and dy * x_hat over the whole batch (per channel, one XLA
computation, so no full-size temporary), then, one micro-batch after another (control edges
chain them, so TensorFlow's executor does not run them side by side), makes that micro-batch's
dz, the convolution's input gradient and filter gradient from it (the filter's and the bias's
summed as they go). Only one micro-batch of dz exists at a time; the input gradients are
concatenated at the end. The forward is the two layers' own: z = conv(x) + bias, then the batch
normalization's XLA forward (`tf_ucudnn.keras.batch_norm_forms`); x and z are kept for the backward,
as the two layers kept them.

Memory, as `tf_ucudnn.memory.analysis.liveness` counts it: each micro-batch's slices of x, z and dy
are buffers of their own there, though TensorFlow slices the first dimension in place (pessimistic
by three micro-batches' slices); slices rather than a split, which the analysis takes as an alias,
because the planner recomputes only tensors that their backward readers read directly. The
concatenation of the input gradients holds the pieces and the whole: twice the input's gradient, for
that op. And a pair's backward runs whole when the tape reaches it: a projection shortcut's
convolution reads its input (the block's) at the start of the block's backward, not at its end.

`streamed_conv_batch_norm(model, micro_batches)` switches a Keras model's convolution and batch
normalization pairs while a training step is traced, and says which layers it left unpaired, and
why. Only convolutions that widen the channels are paired (ResNet-50's stem, its blocks' last
convolutions and their projection shortcuts): streaming every pair barely lowers the lowest peak
a plan reaches, the narrowing pairs' slices and concatenations costing about what the widening
ones save; streaming the widening ones alone lowers it further. It composes with
`tf_ucudnn.keras.batch_norm_forms.fused_batch_norm`: open inside it, the batch normalizations
not paired keep the fused kernel it chose (Keras's ops without it).
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import types
from typing import Iterator, Optional

import keras
import tensorflow as tf

from tf_ucudnn.core.plan import even_sizes
from tf_ucudnn.keras.batch_norm_forms import (
    UnfusedLayer,
    gradient_sums,
    normalization_gradient,
    unfusable_because,
    update_moving_statistics,
    xla_forward,
)


def micro_batch_sizes(batch: int, micro_batches: int) -> list[int]:
    """`batch` split into `micro_batches` (at most `batch`) sizes differing by one at most."""
    return even_sizes(batch, max(1, min(micro_batches, batch)))


def _pair(value, name: str) -> list[int]:
    value = (value, value) if isinstance(value, int) else tuple(value)
    if len(value) != 2:
        raise ValueError(f"{name}={value}: a 2-D convolution takes one or two values")
    return [1, *value, 1]


def conv_batch_norm(x, kernel, bias, scale, offset, *, strides=1, padding="VALID", dilations=1,
                    epsilon=1e-3, micro_batches=4, z=None):
    """y = batch_norm(conv2d(x, kernel) + bias), channels-last, with the batch's mean and biased
    variance (no gradient: they feed moving averages only); the gradient is streamed in
    `micro_batches` (see the module's docstring). `bias` may be None. Dilation needs a GPU
    (TensorFlow's CPU kernels of the convolution's gradients refuse it). `z`, if given, is the
    convolution's output already made (a Keras Conv2D layer's): it is used as it is, and no
    gradient flows back through the ops that made it."""
    strides, dilations = _pair(strides, "strides"), _pair(dilations, "dilations")
    padding = padding.upper()
    if z is None:
        z = tf.nn.conv2d(x, kernel, strides, padding, dilations=dilations)
        z = z if bias is None else tf.nn.bias_add(z, bias)
    if not (x.shape.is_fully_defined() and z.shape.is_fully_defined()):
        raise ValueError(f"conv_batch_norm needs static shapes to split the batch, got "
                         f"x {x.shape} and z {z.shape}")
    sizes = micro_batch_sizes(x.shape[0], micro_batches)
    count = float(z.shape[0] * z.shape[1] * z.shape[2])
    with_bias = bias is not None

    # z is taken from the closure, not as an input: the tape then sees no path through the
    # convolution's own ops (this gradient is theirs) and makes no zeros of z's size for it.
    @tf.custom_gradient
    def fused(x, kernel, scale, offset, *bias):
        y, mean, variance, inv_std = xla_forward(z, scale, offset, epsilon)

        def gradient(dy, *_statistics_gradients):  # the statistics feed moving averages only
            d_offset, d_scale = gradient_sums(dy, z, mean, inv_std)
            dx, d_kernel, d_bias = [], None, None
            # Each micro-batch after the last one's gradients (the first after the sums): one
            # dz at a time, and its slices of x and z counted as backward ops (reading forward
            # tensors only, they would count as forward ops in the middle of the backward
            # pass, tf_ucudnn.memory.analysis.liveness.backward_ops, and no plan could swap x or z).
            previous = [d_offset, d_scale]
            for start, size in zip(itertools.accumulate([0, *sizes]), sizes):
                # The bounds made outside the control block, so the slices take its edges.
                begin, extent = tf.constant([start, 0, 0, 0]), tf.constant([size, -1, -1, -1])
                with tf.control_dependencies(previous):
                    # Slices, not a split: the planner recomputes only tensors its backward
                    # readers read directly, not through an alias
                    # (tf_ucudnn.memory.search.step_plan).
                    x_i, z_i, dy_i = (t if size == t.shape[0] else tf.slice(t, begin, extent)
                                      for t in (x, z, dy))
                    dz_i, d_bias_i = normalization_gradient(
                        dy_i, z_i, mean, inv_std, scale, d_offset, d_scale, count)
                dx.append(tf.raw_ops.Conv2DBackpropInput(
                    input_sizes=x_i.shape.as_list(), filter=kernel, out_backprop=dz_i,
                    strides=strides, padding=padding, dilations=dilations))
                d_kernel_i = tf.raw_ops.Conv2DBackpropFilter(
                    input=x_i, filter_sizes=kernel.shape.as_list(), out_backprop=dz_i,
                    strides=strides, padding=padding, dilations=dilations)
                d_kernel = d_kernel_i if d_kernel is None else d_kernel + d_kernel_i
                d_bias = d_bias_i if d_bias is None else d_bias + d_bias_i
                previous = [dx[-1], d_kernel, d_bias]
            dx = dx[0] if len(dx) == 1 else tf.concat(dx, 0)
            return [dx, d_kernel, d_scale, d_offset] + ([d_bias] if with_bias else [])
        return (y, tf.stop_gradient(mean), tf.stop_gradient(variance)), gradient
    return fused(x, kernel, scale, offset, *([bias] if with_bias else []))


def _graphs(model) -> Iterator:
    """The functional graphs of the model and of the models nested in it."""
    graph = getattr(model, "_functional", None) or model  # a Sequential's graph
    if not hasattr(graph, "_nodes"):
        return
    yield graph
    for layer in graph.layers:
        if isinstance(layer, keras.Model):
            yield from _graphs(layer)


def _unpairable_conv(conv) -> Optional[str]:
    if type(conv).call is not keras.layers.Conv2D.call:
        return f"{type(conv).__name__} has a call of its own"
    if conv.data_format != "channels_last":
        return f"data format {conv.data_format}: the streamed backward takes channels-last"
    if conv.groups != 1:
        return f"{conv.groups} groups"
    if tuple(conv.dilation_rate) != (1, 1):
        # TensorFlow's CPU kernels of the convolution's gradients refuse dilation; untested.
        return f"dilation rate {conv.dilation_rate}: the streamed op is tested undilated only"
    if conv.activation not in (None, keras.activations.linear):
        return f"activation {conv.activation.__name__} between convolution and normalization"
    inputs, outputs = conv.kernel.shape[-2:]
    if outputs <= inputs:
        # Streaming pays where the normalization's gradient outweighs the convolution's input
        # gradient; elsewhere its slices and concatenation only add to the plan.
        return (f"it does not widen the channels ({inputs} to {outputs}): streaming saves "
                "memory only where the normalization's gradient is the larger")
    if conv.compute_dtype != "float32":
        return f"computes in {conv.compute_dtype}: the streamed op takes float32"
    return None


def conv_batch_norm_pairs(model: keras.Model) -> tuple[list[tuple], list[UnfusedLayer]]:
    """The (Conv2D, BatchNormalization) pairs of a functional (or Sequential) model and its
    nested models whose convolution widens the channels and whose output only that
    normalization reads, and the Conv2D and BatchNormalization layers not paired, with the
    reason."""
    pairs, unpaired, graphs = [], [], list(_graphs(model))
    if not graphs:
        return [], [UnfusedLayer(layer.path, "not in a functional model's graph")
                    for layer in model._flatten_layers(include_self=False)
                    if isinstance(layer, (keras.layers.Conv2D, keras.layers.BatchNormalization))]
    for graph in graphs:
        nodes = [node for layer in graph.layers for i, node in enumerate(layer._inbound_nodes)
                 if f"{id(layer)}_ib-{i}" in graph._nodes]
        readers: dict[int, list] = {}
        for node in nodes:
            for tensor in node.input_tensors:
                readers.setdefault(id(tensor), []).append(node.operation)
        returned = {id(tensor) for tensor in graph.outputs}
        called = {}
        for node in nodes:
            called.setdefault(id(node.operation), []).append(node)
        paired_norms = set()
        for conv in graph.layers:
            if not isinstance(conv, keras.layers.Conv2D):
                continue
            reason, own = _unpairable_conv(conv), called.get(id(conv), [])
            if reason is None and len(own) != 1:
                reason = f"called {len(own)} times in the model"
            if reason is None:
                output = own[0].output_tensors[0]
                after = readers.get(id(output), [])
                if id(output) in returned:
                    reason = "its output is the model's output"
                elif len(after) != 1:
                    reason = (f"its output is read by {len(after)} layers "
                              f"({', '.join(layer.name for layer in after)})")
                elif not isinstance(after[0], keras.layers.BatchNormalization):
                    reason = f"its output is read by {after[0].name}, not a batch normalization"
                elif len(called.get(id(after[0]), [])) != 1:
                    reason = f"{after[0].name} is called more than once"
                else:
                    reason = unfusable_because(after[0], 4)
                    if reason is not None:
                        reason = f"{after[0].name}: {reason}"
            if reason is None:
                pairs.append((conv, after[0]))
                paired_norms.add(id(after[0]))
            else:
                unpaired.append(UnfusedLayer(conv.path, reason))
        unpaired += [UnfusedLayer(layer.path, "its input is not a paired convolution's output")
                     for layer in graph.layers
                     if isinstance(layer, keras.layers.BatchNormalization)
                     and id(layer) not in paired_norms]
    return pairs, unpaired


def _remembering_call(self, inputs, *, previous, remembered):
    outputs = previous(inputs)
    remembered[id(outputs)] = (inputs, outputs)  # the tensor is held, so its id stays its own
    return outputs


def _streamed_call(self, inputs, training=None, mask=None, *, previous, conv, remembered,
                   micro_batches):
    pair = remembered.get(id(inputs))
    if pair is None or pair[1] is not inputs or not (training and self.trainable) or \
            mask is not None or inputs.dtype != tf.float32 or \
            not inputs.shape.is_fully_defined():
        return previous(inputs, training=training, mask=mask)
    channels = inputs.shape[-1]
    scale = tf.convert_to_tensor(self.gamma) if self.scale else tf.ones([channels])
    offset = tf.convert_to_tensor(self.beta) if self.center else tf.zeros([channels])
    y, mean, variance = conv_batch_norm(
        pair[0], tf.convert_to_tensor(conv.kernel),
        tf.convert_to_tensor(conv.bias) if conv.use_bias else None, scale, offset,
        strides=conv.strides, padding=conv.padding, dilations=conv.dilation_rate,
        epsilon=self.epsilon, micro_batches=micro_batches, z=inputs)
    update_moving_statistics(self, mean, variance)
    return y


@contextlib.contextmanager
def streamed_conv_batch_norm(model: keras.Model,
                             micro_batches: int) -> Iterator[list[UnfusedLayer]]:
    """While open, each pair `conv_batch_norm_pairs` finds trains as `conv_batch_norm`, its
    backward in `micro_batches`; yields the Conv2D and BatchNormalization layers not paired,
    with the reason. Open it inside `fused_batch_norm`
    to give the others a fused kernel. A paired layer called otherwise (inference, a mask,
    unknown shapes) calls what it called before."""
    if micro_batches < 1:
        raise ValueError(f"micro_batches={micro_batches}: at least 1")
    pairs, unpaired = conv_batch_norm_pairs(model)
    remembered: dict[int, tuple] = {}
    switched = []
    for conv, norm in pairs:
        for layer in (conv, norm):
            switched.append((layer, vars(layer).get("call")))
        conv.call = types.MethodType(functools.partial(
            _remembering_call, previous=conv.call, remembered=remembered), conv)
        norm.call = types.MethodType(functools.partial(
            _streamed_call, previous=norm.call, conv=conv, remembered=remembered,
            micro_batches=micro_batches), norm)
    try:
        yield unpaired
    finally:
        remembered.clear()
        for layer, call in reversed(switched):
            if call is None:
                del layer.call
            else:
                layer.call = call
