"""The whole step in micro-batches: the same update and metrics as the whole batch, for models
whose layers treat each sample on its own, and a micro-batch size planned under a budget."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from tf_ucudnn.keras.accumulated_step import (
    AccumulationError,
    AccumulationPlan,
    accumulating,
    accumulation_refusal,
    micro_batch_count,
    plan_accumulation,
    smaller_after_measuring,
    smaller_after_running_out,
)

pytestmark = pytest.mark.usefixtures("no_tf32")


class _SeenBatches(keras.layers.Layer):
    """An identity that counts the calls it runs (micro-batches) and the largest batch."""

    def build(self, input_shape):
        self.calls = self.add_weight(shape=(), dtype="int32", initializer="zeros",
                                     trainable=False)
        self.largest = self.add_weight(shape=(), dtype="int32", initializer="zeros",
                                       trainable=False)

    def call(self, x):
        self.calls.assign_add(1)
        self.largest.assign(tf.maximum(self.largest, tf.shape(x)[0]))
        return x


def _per_sample_model(seed=0):
    keras.utils.set_random_seed(seed)
    layers = keras.layers
    model = keras.Sequential([
        keras.Input((10, 10, 3)),
        _SeenBatches(),
        layers.Conv2D(6, 3, padding="same", activation="relu"),
        layers.MaxPooling2D(),
        layers.Conv2D(8, 3, activation="relu"),
        layers.Flatten(),
        layers.Dense(5)])
    return model


def _compiled(model, jit_compile=False, loss=None):
    model.compile(keras.optimizers.SGD(0.1, momentum=0.9),
                  loss or keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"], jit_compile=jit_compile)
    return model


def _data(batch=12, seed=3):
    rng = np.random.default_rng(seed)
    return (rng.normal(size=(batch, 10, 10, 3)).astype("float32"),
            rng.integers(0, 5, size=batch).astype("int32"))


@pytest.mark.parametrize("jit_compile", [False, True])
@pytest.mark.parametrize("micro_batch_size", [4, 5])
def test_micro_batches_train_to_the_whole_batchs_weights_and_metrics(jit_compile,
                                                                     micro_batch_size):
    x, y = _data()
    whole = _compiled(_per_sample_model(), jit_compile)
    whole_history = whole.fit(x, y, batch_size=12, epochs=2, shuffle=False, verbose=0)
    split = _compiled(_per_sample_model(), jit_compile)
    with accumulating(split, micro_batch_size):
        split_history = split.fit(x, y, batch_size=12, epochs=2, shuffle=False, verbose=0)
    for expected, got in zip(whole.trainable_weights, split.trainable_weights):
        np.testing.assert_allclose(got.numpy(), expected.numpy(), rtol=2e-5, atol=2e-6)
    for name in ("loss", "accuracy"):
        np.testing.assert_allclose(split_history.history[name], whole_history.history[name],
                                   rtol=2e-5)
    # The step ran in micro-batches, and the block gave the model its own step back.
    count = micro_batch_count(12, micro_batch_size)
    assert (int(split.layers[0].calls), int(split.layers[0].largest)) == (2 * count, 12 // count)
    assert (int(whole.layers[0].calls), int(whole.layers[0].largest)) == (2, 12)
    assert "train_step" not in split.__dict__


def test_sample_weights_and_a_last_partial_batch_count_as_in_the_whole_batch():
    x, y = _data(batch=14)
    weights = np.linspace(0.5, 2.0, 14).astype("float32")
    whole = _compiled(_per_sample_model())
    whole.fit(x, y, sample_weight=weights, batch_size=8, epochs=1, shuffle=False, verbose=0)
    split = _compiled(_per_sample_model())
    with accumulating(split, 3):  # 8 in 4 micro-batches of 2, the last 6 in 2 of 3
        split.fit(x, y, sample_weight=weights, batch_size=8, epochs=1, shuffle=False, verbose=0)
    assert (int(split.layers[0].calls), int(split.layers[0].largest)) == (4 + 2, 3)
    for expected, got in zip(whole.trainable_weights, split.trainable_weights):
        np.testing.assert_allclose(got.numpy(), expected.numpy(), rtol=2e-5, atol=2e-6)


def test_micro_batches_differ_from_the_whole_batch_where_a_layer_mixes_samples():
    # The reason accumulation is refused for batch normalization: the result is not the same.
    def model():
        keras.utils.set_random_seed(0)
        return _compiled(keras.Sequential([
            keras.Input((10, 10, 3)), keras.layers.Conv2D(4, 3),
            keras.layers.BatchNormalization(), keras.layers.Flatten(), keras.layers.Dense(5)]))
    x, y = _data()
    whole, split = model(), model()
    whole.fit(x, y, batch_size=12, epochs=1, verbose=0, shuffle=False)
    with accumulating(split, 4):
        split.fit(x, y, batch_size=12, epochs=1, verbose=0, shuffle=False)
    assert not np.allclose(whole.get_weights()[0], split.get_weights()[0], rtol=1e-4)
    reason = accumulation_refusal(split)
    assert reason.startswith("batch_normalization") and "whole batch" in reason


def test_refusals_name_the_reason():
    model = _per_sample_model()
    assert accumulation_refusal(model) == "the model is not compiled with an optimizer"
    _compiled(model, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True,
                                                                     reduction="sum"))
    assert "reduced by 'sum'" in accumulation_refusal(model)
    assert accumulation_refusal(_compiled(_per_sample_model())) is None
    nested = keras.Sequential([keras.Input((10, 10, 3)), keras.Sequential([
        keras.layers.Conv2D(4, 3), keras.layers.BatchNormalization(name="inner_bn")])])
    nested.compile("sgd", "mse")
    assert accumulation_refusal(nested).startswith("inner_bn")
    frozen = keras.layers.BatchNormalization(name="frozen_bn")
    frozen.trainable = False
    held = keras.Sequential([keras.Input((10, 10, 3)), frozen])
    held.compile("sgd", "mse")
    assert accumulation_refusal(held) is None  # it normalizes with its moving statistics
    grouped = keras.Sequential([keras.Input((10, 10, 4)), keras.layers.GroupNormalization(2)])
    grouped.compile("sgd", "mse")
    assert accumulation_refusal(grouped) is None  # each sample by its own statistics


def test_batch_norm_by_micro_batch_statistics_is_accepted_only_when_asked_for():
    model = keras.Sequential([keras.Input((10, 10, 3)), keras.layers.Conv2D(4, 3),
                              keras.layers.BatchNormalization(name="bn"), keras.layers.Flatten(),
                              keras.layers.Dense(5)])
    model.compile("sgd", "mse")
    assert "batch_norm_statistics='micro_batch'" in accumulation_refusal(model)
    assert accumulation_refusal(model, "micro_batch") is None
    with pytest.raises(ValueError, match="one of"):
        accumulation_refusal(model, "ghost")
    plan = plan_accumulation(model, 8, 1 << 40, lambda size: tf.function(
        model.train_step).get_concrete_function(
            (tf.TensorSpec([size, 10, 10, 3]), tf.TensorSpec([size, 5]))), "micro_batch")
    assert plan.normalized_per_micro_batch == ["bn"] and plan.micro_batches == 1


def test_micro_batch_count_is_the_fewest_equal_parts_within_the_size():
    assert micro_batch_count(768, 768) == 1
    assert micro_batch_count(768, 200) == 4
    assert micro_batch_count(768, 150) == 6
    assert micro_batch_count(13, 12) == 13  # a prime batch: one sample at a time
    assert micro_batch_count(512, 100) == 8


def _traced_at(model):
    def trace(size):
        x = tf.TensorSpec([size, 10, 10, 3])
        y = tf.TensorSpec([size], tf.int32)
        return tf.function(model.train_step).get_concrete_function((x, y))
    return trace


def test_the_plan_takes_the_largest_micro_batch_the_liveness_analysis_fits():
    from tf_ucudnn.memory.analysis.liveness import analyze

    model = _compiled(_per_sample_model())
    trace = _traced_at(model)
    whole = analyze(trace(64))
    whole_bytes = whole.peak_bytes + whole.persistent_bytes
    assert plan_accumulation(model, 64, whole_bytes, trace).micro_batch_size == 64
    plan = plan_accumulation(model, 64, whole_bytes * 2 // 5, trace)
    assert 1 <= plan.micro_batch_size < 64 and 64 % plan.micro_batch_size == 0
    assert plan.predicted_peak_bytes <= plan.budget_bytes
    # The next larger size that divides the batch was predicted over the budget.
    larger = next(s for s in range(plan.micro_batch_size + 1, 65) if 64 % s == 0)
    report = analyze(trace(larger))
    sums = sum(int(np.prod(w.shape)) * 4 for w in model.trainable_weights)
    assert report.peak_bytes + report.persistent_bytes + sums > plan.budget_bytes
    assert plan.passed_over and "micro-batches of 64" in plan.passed_over[0]
    with pytest.raises(AccumulationError, match="even one sample"):
        plan_accumulation(model, 64, whole.persistent_bytes, trace)


def test_xla_buffers_over_the_budget_ask_for_smaller_micro_batches():
    from tf_ucudnn.memory.analysis.liveness import analyze

    model = _compiled(_per_sample_model())
    trace = _traced_at(model)
    whole = analyze(trace(64))
    budget = whole.peak_bytes + whole.persistent_bytes  # the liveness analysis fits 64
    per_sample = budget // 20
    asked = []

    def compiled_peak(size):  # XLA holding more than the analysis says: 15 samples fit
        asked.append(size)
        return budget // 4 + per_sample * size
    plan = plan_accumulation(model, 64, budget, trace, compiled_peak=compiled_peak)
    # Each size scaled by the budget over XLA's peak, to the next that divides the batch:
    # 64 at 3.45x the budget -> 18 -> 16; 16 at 1.05x -> 15 -> 8.
    assert asked == [64, 16, 8]
    assert plan.micro_batch_size == 8
    assert plan.compiled_peak_bytes == compiled_peak(plan.micro_batch_size) <= budget
    assert plan.passed_over[0].startswith("micro-batches of 64: predicted")
    assert "XLA's buffers" in plan.passed_over[0] and "XLA's buffers" in plan.to_text()
    with pytest.raises(AccumulationError, match="one sample at a time .* in XLA's buffers"):
        plan_accumulation(model, 64, budget, trace, compiled_peak=lambda size: budget + 1)


def test_the_compiled_peak_is_xla_own_for_a_model_xla_compiles():
    from tf_ucudnn.keras.accumulated_step import compiled_step_peak

    specs = (tf.TensorSpec([32, 10, 10, 3]), tf.TensorSpec([32], tf.int32))
    assert compiled_step_peak(_compiled(_per_sample_model()), specs) is None  # no XLA
    # Without _SeenBatches, whose int32 counters a GPU keeps in host memory, out of XLA's reach.
    model = _compiled(keras.Sequential(_per_sample_model().layers[1:]), jit_compile=True)
    model.build((None, 10, 10, 3))
    peak = compiled_step_peak(model, specs)
    weights = sum(w.numpy().nbytes for w in model.weights)
    batch = 32 * 10 * 10 * 3 * 4 + 32 * 4
    # The variables and the batch are held beside the step; the activations grow with the
    # micro-batch, and micro-batches add the gradients' sums.
    assert peak(32) > weights + batch
    assert peak(4) < peak(16) < peak(32)


def test_a_step_xla_cannot_compile_is_planned_by_the_liveness_analysis_and_says_why():
    from tf_ucudnn.memory.analysis.compiled_buffers import CompiledBuffersError

    model = _compiled(_per_sample_model())
    trace = _traced_at(model)

    def unreadable(size):
        raise CompiledBuffersError("XLA could not compile 'train_step': a resource on the host")
    plan = plan_accumulation(model, 64, 1 << 40, trace, compiled_peak=unreadable)
    assert plan.micro_batch_size == 64 and plan.compiled_peak_bytes is None
    assert plan.compiled_peak_unread.endswith("a resource on the host")
    assert "XLA's buffers not read: XLA could not compile" in plan.to_text()


def test_a_measured_peak_over_the_budget_asks_for_smaller_micro_batches():
    plan = AccumulationPlan(batch=96, micro_batch_size=48, budget_bytes=1000,
                            predicted_peak_bytes=900)
    assert smaller_after_measuring(plan, 990) is None
    assert plan.measured_peak_bytes == 990
    assert smaller_after_measuring(plan, 1500) == 32  # 48 * 1000 / 1500 = 32, divides 96
    assert plan.micro_batch_size == 32 and plan.measured_peak_bytes is None
    assert "measured" in plan.passed_over[-1] and "48" in plan.passed_over[-1]
    assert smaller_after_measuring(plan, 1100) == 24  # 29 does not divide 96: 4 parts of 24
    one = AccumulationPlan(batch=4, micro_batch_size=1, budget_bytes=10, predicted_peak_bytes=9)
    with pytest.raises(AccumulationError, match="one sample"):
        smaller_after_measuring(one, 11)


def test_running_out_of_memory_halves_the_micro_batch():
    plan = AccumulationPlan(batch=512, micro_batch_size=128, budget_bytes=1000,
                            predicted_peak_bytes=900)
    assert smaller_after_running_out(plan, "out of memory: 14.69GiB") == 64
    assert plan.passed_over == ["micro-batches of 128: out of memory: 14.69GiB"]
    assert plan.micro_batches == 8
