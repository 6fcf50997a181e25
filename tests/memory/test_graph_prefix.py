"""The micro-batched prefix on a graph: the same step, one micro-batch's activations at a time."""

import re

import numpy as np
import pytest
import tensorflow as tf
from training_steps import (
    SLOW_LINK,
    assert_same_step,
    conv_training_step,
    gradient_step,
    pooled_conv_model,
)

import tf_ucudnn
from tf_ucudnn.core.errors import PrefixError
from tf_ucudnn.core.plan import KernelPlan, LayerPlan
from tf_ucudnn.keras.planned_step import keras_training_step
from tf_ucudnn.memory.analysis.liveness import analyze
from tf_ucudnn.memory.passes.graph_prefix import micro_batched_prefix, prefix_cuts
from tf_ucudnn.memory.passes.prefix_analysis import POOLINGS
from tf_ucudnn.memory.search.greedy import BudgetError
from tf_ucudnn.memory.search.step_plan import plan_step_memory

layers = tf.keras.layers


def _cut(step, layer: str) -> str:
    """The output of the pooling layer `layer` in the step's graph."""
    (name,) = [op.outputs[0].name for op in step.graph.get_operations()
               if op.type in POOLINGS and f"/{layer}_" in op.name]
    return name


def _op(graph, suffix: str) -> tf.Operation:
    (op,) = [op for op in graph.get_operations() if op.name.endswith(suffix)]
    return op


@pytest.mark.parametrize("layer, micro_batches", [("pool1", 2), ("pool1", 3), ("pool2", 2),
                                                  ("pool2", 3)])
def test_the_step_in_micro_batches_gives_the_same_loss_and_gradients(layer, micro_batches):
    step = gradient_step(pooled_conv_model(), 8)
    micro = micro_batched_prefix(step, _cut(step, layer), micro_batches)
    assert_same_step(step, micro, rtol=1e-5, atol=1e-6)
    sizes = sorted(op.outputs[0].shape[0] for op in micro.get_concrete_function().graph
                   .get_operations() if op.type == "Conv2D" and op.inputs[0].shape[-1] == 3)
    # The first convolution, once per micro-batch forward and once again backward (8 = 3+3+2).
    assert sizes == sorted([8 // micro_batches + (i < 8 % micro_batches)
                            for i in range(micro_batches)] * 2)


@pytest.mark.parametrize("layer", ["pool1", "pool2"])
def test_an_sgd_step_updates_the_weights_as_the_original_does(layer):
    model = pooled_conv_model()
    step = keras_training_step(model, 8)
    micro = micro_batched_prefix(step, _cut(step, layer), 3)
    x = tf.random.stateless_normal([8, 32, 32, 3], seed=[1, 2])
    y = tf.range(8) % 4
    before = [w.numpy() for w in model.trainable_variables]
    expected_loss = step(x, y).numpy()
    expected = [w.numpy() for w in model.trainable_variables]
    assert max(np.abs(a - b).max() for a, b in zip(before, expected)) > 1e-5  # a real update
    for w, value in zip(model.trainable_variables, before):
        w.assign(value)
    np.testing.assert_allclose(micro(x, y).numpy(), expected_loss, rtol=1e-5)
    for w, value in zip(model.trainable_variables, expected):
        np.testing.assert_allclose(w.numpy(), value, rtol=1e-4, atol=1e-6)


def test_a_conv3d_model_in_uneven_micro_batches():
    tf.keras.utils.set_random_seed(5)
    inputs = tf.keras.Input((8, 8, 8, 2))
    h = layers.Conv3D(4, 3, padding="same", activation="relu", name="c1")(inputs)
    h = layers.MaxPooling3D(2, name="pool1")(h)
    h = layers.Conv3D(4, 3, padding="same", activation="relu", name="c2")(h)
    model = tf.keras.Model(inputs, layers.Dense(2)(layers.GlobalAveragePooling3D()(h)))
    step = gradient_step(model, 5)
    assert prefix_cuts(step) == ([_cut(step, "pool1")], [])
    assert_same_step(step, micro_batched_prefix(step, _cut(step, "pool1"), 3))


def test_an_average_pooling_cut_divides_its_gradient_too():
    tf.keras.utils.set_random_seed(4)
    inputs = tf.keras.Input((8, 8, 3))
    h = layers.Conv2D(4, 3, padding="same", activation="relu", name="c1")(inputs)
    h = layers.AveragePooling2D(2, name="pool1")(h)
    model = tf.keras.Model(inputs, layers.Dense(2)(layers.Flatten()(h)))
    step = gradient_step(model, 6)
    micro = micro_batched_prefix(step, _cut(step, "pool1"), 4)
    assert_same_step(step, micro)
    # The pooling's gradient reads a constant shape of the whole batch; each micro-batch's copy
    # has its own, and reads its piece of the cut's gradient.
    gradients = [op for op in micro.get_concrete_function().graph.get_operations()
                 if op.type == "AvgPoolGrad"]
    assert sorted(op.outputs[0].shape[0] for op in gradients) == [1, 1, 2, 2]


def _batch_norm_model():
    tf.keras.utils.set_random_seed(5)
    inputs = tf.keras.Input((8, 8, 3))
    h = layers.Conv2D(4, 3, padding="same", name="c1")(inputs)
    h = layers.BatchNormalization(name="bn")(h)
    h = layers.MaxPooling2D(name="pool1")(h)
    h = layers.Conv2D(4, 3, padding="same", name="c2")(h)
    return tf.keras.Model(inputs, layers.Dense(2)(layers.GlobalAveragePooling2D()(h)))


def _skip_model():
    tf.keras.utils.set_random_seed(5)
    inputs = tf.keras.Input((8, 8, 3))
    before = layers.Conv2D(4, 3, padding="same", name="c1")(inputs)
    h = layers.MaxPooling2D(name="pool1")(before)
    h = layers.UpSampling2D()(layers.Conv2D(4, 3, padding="same", name="c2")(h))
    h = layers.Add(name="skip")([h, before])
    return tf.keras.Model(inputs, layers.Dense(2)(layers.GlobalAveragePooling2D()(h)))


@pytest.mark.parametrize("model, message", [
    (_batch_norm_model, r"/bn_1/moments/mean: it reduces over the batch, mixing the samples, so "
                        r"the ops up to .*pool1.* cannot run in micro-batches"),
    (_skip_model, r"/skip_1/Add reads .*/c1_1/BiasAdd:0, made before .*pool1.*: the step's "
                  r"inputs must reach the rest of it only through"),
])
def test_cuts_the_step_does_not_allow_are_refused_with_the_op_and_reason(model, message):
    step = gradient_step(model(), 4)
    cut = _cut(step, "pool1")
    possible, refused = prefix_cuts(step)
    assert possible == [] and [item[0] for item in refused] == [cut]
    assert re.search(message, refused[0][1])
    with pytest.raises(PrefixError, match=message):
        micro_batched_prefix(step, cut, 2)


def test_more_micro_batches_than_samples_and_an_input_gradient_are_refused():
    model = pooled_conv_model()
    step = gradient_step(model, 4)
    with pytest.raises(PrefixError, match="cannot divide a batch of 4 into 5 micro-batches"):
        micro_batched_prefix(step, _cut(step, "pool1"), 5)

    @tf.function
    def with_input_gradient(x, y):
        with tf.GradientTape() as tape:
            tape.watch(x)
            loss = tf.reduce_sum(model(x, training=True))
        return loss, tape.gradient(loss, [x, *model.trainable_variables])

    step = with_input_gradient.get_concrete_function(tf.TensorSpec([4, 32, 32, 3]),
                                                     tf.TensorSpec([4], tf.int32))
    with pytest.raises(PrefixError, match=r"\(shape \(4, 32, 32, 3\)\) of the prefix's backward "
                                          "is returned by the step, but only sums over the batch"):
        micro_batched_prefix(step, _cut(step, "pool1"), 2)


def test_micro_batches_run_one_after_another_and_the_backward_waits_for_the_cut_gradient():
    step = gradient_step(pooled_conv_model(), 8)
    cut = _cut(step, "pool1")
    original = step.graph
    cut_op = cut.split(":")[0]
    first = next(op for op in original.get_operations()
                 if op.type == "Conv2D" and op.inputs[0].name == "x:0").name
    filter_gradient = next(op for op in original.get_operations()
                           if op.type == "Conv2DBackpropFilter" and op.inputs[0].name == "x:0")
    (pool_gradient,) = [op for op in original.get_operations()
                        if op.type == "MaxPoolGrad" and op.inputs[1].name == cut]
    graph = micro_batched_prefix(step, cut, 3).get_concrete_function().graph

    def waits(name):
        return {op.name for op in _op(graph, name).control_inputs}

    for i in (1, 2):  # each forward micro-batch starts once the one before made its cut
        assert waits(f"{first}/ucudnn_micro_batch_{i}") == \
            {_op(graph, f"{cut_op}/ucudnn_micro_batch_{i - 1}").name}
    # The first recomputation waits for the cut's gradient (the pooling gradient's input).
    (split,) = _op(graph, f"{first}/ucudnn_micro_batch_0/recomputed").control_inputs
    assert split.type == "SplitV" and \
        split.inputs[0].name.endswith(pool_gradient.inputs[2].name)
    # The next ones for the weights' gradients summed so far.
    assert _op(graph, f"{filter_gradient.name}/ucudnn_micro_batch_0").name in \
        waits(f"{first}/ucudnn_micro_batch_1/recomputed")
    assert _op(graph, f"{filter_gradient.name}/ucudnn_micro_batch_1/sum").name in \
        waits(f"{first}/ucudnn_micro_batch_2/recomputed")
    assert not [op for op in graph.get_operations() if op.name.endswith(first)]


def test_only_one_micro_batch_of_the_prefix_is_held_at_a_time():
    step = gradient_step(pooled_conv_model(), 16)
    micro = micro_batched_prefix(step, _cut(step, "pool1"), 4).get_concrete_function()
    report, whole = analyze(micro), analyze(step)
    # The prefix's activations are made again, not kept: only its output is.
    assert report.kept() and not any("ucudnn_micro_batch_" in t.name for t in report.kept())
    assert report.peak_bytes < 0.6 * whole.peak_bytes


def _lowest_peak(step) -> int:
    """The lowest peak any plan of swaps and recomputations reaches for the step."""
    with pytest.raises(BudgetError) as error:
        plan_step_memory(step, 1 << 10, SLOW_LINK)
    return error.value.prediction.peak_bytes


def _unplanned_peak(step) -> int:
    return plan_step_memory(step, 1 << 40, SLOW_LINK).decisions.prediction.peak_bytes


def test_rewrite_runs_the_first_ops_in_micro_batches_where_only_that_fits():
    step = gradient_step(pooled_conv_model(), 16)
    cut = _cut(step, "pool1")
    lowest = _lowest_peak(step)
    prefixed = _unplanned_peak(micro_batched_prefix(step, cut, 4).get_concrete_function())
    assert prefixed < lowest
    budget = (prefixed + lowest) // 2
    rewritten, report = tf_ucudnn.rewrite(step, memory_budget=budget, device_model=SLOW_LINK)
    assert report.memory_prefix.cut == cut and report.memory_prefix.micro_batches in (4, 8)
    assert report.memory_prefix.passed_over[0].startswith("whole batches: ")
    assert report.memory.decisions.prediction.peak_bytes <= budget
    assert f"the ops up to {cut} run in {report.memory_prefix.micro_batches} micro-batches" in \
        report.to_text()
    assert report.to_json()["memory_prefix"]["cut"] == cut
    assert_same_step(step, rewritten)
    # Enough room: whole batches, and nothing said of micro-batches.
    _, roomy = tf_ucudnn.rewrite(step, memory_budget=lowest, device_model=SLOW_LINK)
    assert roomy.memory_prefix.cut is None and "micro-batches" not in roomy.to_text()
    pool2 = re.escape(_cut(step, "pool2"))
    with pytest.raises(BudgetError, match=f"tried: whole batches: .* MiB over; up to "
                                          f"{re.escape(cut)} in 4 micro-batches: .* MiB over; "
                                          f".*up to {pool2} in 8 micro-batches"):
        tf_ucudnn.rewrite(step, memory_budget="1KiB", device_model=SLOW_LINK)


def _halves(layer):
    batch = layer.batch_size
    halves = KernelPlan.of((batch // 2, 0), (batch - batch // 2, 1))
    return LayerPlan(halves, halves, halves)


@pytest.mark.usefixtures("no_tf32")
def test_planned_convolutions_in_the_prefix_run_their_plans_on_micro_batches():
    step = conv_training_step()
    convolutions, _ = tf_ucudnn.rewrite(step, _halves)
    planned = convolutions.get_concrete_function()
    prefixed = micro_batched_prefix(planned, prefix_cuts(planned)[0][0], 4)
    budget = (_unplanned_peak(prefixed.get_concrete_function()) + _lowest_peak(planned)) // 2
    rewritten, report = tf_ucudnn.rewrite(step, _halves, memory_budget=budget,
                                          device_model=SLOW_LINK, micro_batches=(4,))
    assert len(report.layers) == 4 and report.memory_prefix.micro_batches == 4
    kernels = [op for op in rewritten.get_concrete_function().graph.get_operations()
               if op.type.startswith("UcudnnConv2D") and op.outputs[0].shape[0] == 2]
    # A plan of 4 + 4 samples, on a micro-batch of 2: its first 2.
    assert kernels and all(op.get_attr("micro_batches") == [2] for op in kernels)
    assert_same_step(step, rewritten, rtol=1e-4, atol=1e-6)
