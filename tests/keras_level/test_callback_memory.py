"""MicroBatchCallback under a memory budget: for models whose layers treat each sample on its own,
the whole step in micro-batches with the gradients summed, compiled by XLA as the model asks,
trains to the weights of the whole batch; on the graph path, the planned kernels' workspaces
are chosen with the memory plan."""

from typing import Optional

import keras
import numpy as np
import pytest
import tensorflow as tf

from tf_ucudnn.core.plan import KERNELS, KernelPlan, LayerPlan
from tf_ucudnn.keras.accumulated_step import AccumulationError, AccumulationPlan
from tf_ucudnn.keras.callback import MicroBatchCallback

pytestmark = pytest.mark.usefixtures("no_tf32")


class HalvingPlanner:
    """Splits every kernel in two, and notes the batch sizes it plans for."""

    def __init__(self):
        self.batches = []

    def __call__(self, layer):
        self.batches.append(layer.batch_size)
        half = layer.batch_size // 2
        halves = KernelPlan.of((half, 0), (layer.batch_size - half, 1))
        return LayerPlan(halves, halves, halves)


def per_sample_model():
    layers = keras.layers
    return keras.Sequential([
        keras.Input((12, 12, 3)),
        layers.Conv2D(8, 3, padding="same", activation="relu"),
        layers.MaxPooling2D(),
        layers.Conv2D(16, 3, padding="same", activation="relu"),
        layers.GlobalAveragePooling2D(),
        layers.Dense(4)])


def normalized_model():
    layers = keras.layers
    return keras.Sequential([
        keras.Input((12, 12, 3)), layers.Conv2D(8, 3), layers.BatchNormalization(name="bn"),
        layers.GlobalAveragePooling2D(), layers.Dense(4)])


def fit(build, callbacks, jit_compile, epochs=2):
    keras.utils.set_random_seed(1)
    model = build()
    model.compile(keras.optimizers.SGD(0.1),
                  keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"], jit_compile=jit_compile)
    rng = np.random.RandomState(0)
    x, y = rng.rand(40, 12, 12, 3).astype("float32"), np.arange(40) % 4
    history = model.fit(x, y, batch_size=16, epochs=epochs, verbose=0, shuffle=False,
                        callbacks=callbacks)
    return model, history.history


def whole_batch_peak(jit_compile) -> int:
    probe = MicroBatchCallback(None, memory_budget=1 << 40, verbose=0)
    fit(per_sample_model, [probe], jit_compile, epochs=1)
    assert probe.accumulation.micro_batches == 1  # the whole batch fits: one micro-batch
    return probe.accumulation.predicted_peak_bytes


@pytest.mark.parametrize("jit_compile", [False, True], ids=["graph", "xla"])
def test_micro_batches_under_the_budget_train_to_the_whole_batchs_weights(jit_compile):
    plain, plain_history = fit(per_sample_model, [], jit_compile)
    budget = int(whole_batch_peak(jit_compile) * 0.75)
    planner = HalvingPlanner()
    callback = MicroBatchCallback(planner=planner, memory_budget=budget, trial_steps=0,
                                  verbose=0)
    planned, history = fit(per_sample_model, [callback], jit_compile)
    plan = callback.accumulation
    assert isinstance(plan, AccumulationPlan) and callback.report.memory is plan
    assert plan.batch == 16 and plan.micro_batches > 1
    assert plan.predicted_peak_bytes <= budget
    assert plan.passed_over[0].startswith("micro-batches of 16: predicted")
    # Under XLA, XLA's own buffers for the step were read and, for the size kept, fit the
    # budget (a GPU's measured peak may ask for a smaller size after the first step, unread).
    xla_read = plan.compiled_peak_bytes is not None or any(
        "XLA's buffers" in why for why in plan.passed_over)
    assert xla_read is jit_compile and plan.compiled_peak_unread is None
    assert (plan.compiled_peak_bytes or 0) <= budget
    assert callback.accumulation_refused is None and callback.memory_plan is None
    # XLA stays as the model asked; the convolutions are planned for the micro-batch.
    assert planned.jit_compile is jit_compile
    assert set(planner.batches) == {plan.micro_batch_size}
    assert len(callback.report.layers) == 2
    np.testing.assert_allclose(history["loss"], plain_history["loss"], rtol=1e-5)
    np.testing.assert_allclose(history["accuracy"], plain_history["accuracy"])
    for a, b in zip(planned.get_weights(), plain.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
    assert "train_step" not in vars(planned)


def test_a_model_normalizing_by_batch_statistics_is_planned_with_swaps_and_recomputations():
    from training_steps import SLOW_LINK

    callback = MicroBatchCallback(None, memory_budget=1 << 40, device_model=SLOW_LINK,
                                  verbose=0)
    model, _ = fit(normalized_model, [callback], jit_compile=True, epochs=1)
    assert callback.accumulation is None
    assert callback.accumulation_refused == (
        "bn: BatchNormalization normalizes each sample with statistics of the whole batch; "
        "batch_norm_statistics='micro_batch' normalizes each micro-batch by its own statistics "
        "instead")
    assert callback.memory_plan is not None
    assert model.jit_compile is True  # given back at the end


def ghost_batch_norm_fit(micro_batch_size: int, first_micro_batch_size: Optional[int] = None):
    """What `fit` does to `normalized_model` when each batch (16, 16, then 8 samples) trains
    in equal micro-batches of at most `micro_batch_size` (the first batch's at most
    `first_micro_batch_size`, if given), each normalized by its own statistics and moving the
    moving statistics, the gradients averaged into one SGD update."""
    keras.utils.set_random_seed(1)
    model = normalized_model()
    optimizer = keras.optimizers.SGD(0.1)
    loss_of = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    rng = np.random.RandomState(0)
    x, y = rng.rand(40, 12, 12, 3).astype("float32"), np.arange(40) % 4
    for start in range(0, 40, 16):
        xb, yb = x[start:start + 16], y[start:start + 16]
        largest = first_micro_batch_size if start == 0 and first_micro_batch_size else \
            micro_batch_size
        size = max(d for d in range(1, largest + 1) if len(xb) % d == 0)
        count = len(xb) // size
        sums = [tf.zeros_like(w) for w in model.trainable_weights]
        for i in range(count):
            with tf.GradientTape() as tape:
                loss = loss_of(yb[i * size:(i + 1) * size],
                               model(xb[i * size:(i + 1) * size], training=True))
            grads = tape.gradient(loss, model.trainable_weights)
            sums = [s + g / count for s, g in zip(sums, grads)]
        optimizer.apply_gradients(zip(sums, model.trainable_weights))
    return model


@pytest.mark.parametrize("jit_compile", [False, True], ids=["graph", "xla"])
def test_batch_norm_by_micro_batch_statistics_is_asked_for_and_trains_as_ghost_batches(
        jit_compile):
    probe = MicroBatchCallback(None, memory_budget=1 << 40, batch_norm_statistics="micro_batch",
                               verbose=0)
    fit(normalized_model, [probe], jit_compile, epochs=1)
    assert probe.accumulation.micro_batches == 1
    budget = int(probe.accumulation.predicted_peak_bytes * 0.75)
    callback = MicroBatchCallback(None, memory_budget=budget, batch_norm_statistics="micro_batch",
                                  verbose=0)
    model, _ = fit(normalized_model, [callback], jit_compile, epochs=1)
    plan = callback.accumulation
    assert callback.accumulation_refused is None and plan.micro_batches > 1
    assert plan.normalized_per_micro_batch == ["bn"]
    assert "batch normalization by each micro-batch's statistics: bn" in plan.to_text()
    assert model.jit_compile is jit_compile  # XLA kept
    # On a GPU, the first step's measured peak may have made the later steps' micro-batches
    # smaller; the first batch trained in the size the plan passed over.
    measured = [int(why.split(":")[0].split()[-1]) for why in plan.passed_over
                if ": measured" in why]
    expected = ghost_batch_norm_fit(plan.micro_batch_size,
                                    measured[-1] if measured else None)
    # The moving statistics too: each micro-batch moved them.
    for got, want in zip(model.get_weights(), expected.get_weights()):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def test_batch_norm_statistics_must_be_batch_or_micro_batch():
    with pytest.raises(ValueError, match="batch_norm_statistics must be one of"):
        MicroBatchCallback(None, memory_budget="1GiB", batch_norm_statistics="ghost")


def test_accumulation_can_be_turned_off():
    from training_steps import SLOW_LINK

    callback = MicroBatchCallback(None, memory_budget=1 << 40, device_model=SLOW_LINK,
                                  accumulate_gradients=False, verbose=0)
    fit(per_sample_model, [callback], jit_compile=False, epochs=1)
    assert callback.accumulation is None and callback.memory_plan is not None
    assert callback.accumulation_refused == "accumulate_gradients=False"


def test_a_budget_even_one_sample_misses_stops_training_with_the_reason():
    callback = MicroBatchCallback(None, memory_budget="1KiB", verbose=0)
    with pytest.raises(AccumulationError, match="even one sample at a time"):
        fit(per_sample_model, [callback], jit_compile=False, epochs=1)
    assert "train_step" not in vars(callback.model)  # the model's own step is back


def test_a_first_step_out_of_memory_trains_again_in_halves(monkeypatch):
    import tf_ucudnn.keras.strategies.accumulation as accumulation_module

    own = accumulation_module.accumulated_train_step

    def running_out_above_four(model, size):
        step = own(model, size)

        def train_step(data):
            # In Keras's own step only (which XLA would compile and run), not in a trace that
            # notes the layers' shapes.
            keras_step = "one_step_on_data" in tf.compat.v1.get_default_graph().name
            if size > 4 and keras_step:
                raise tf.errors.ResourceExhaustedError(None, None, f"out of memory at {size}")
            return step(data)
        return train_step
    plain, plain_history = fit(per_sample_model, [], jit_compile=False)
    budget = int(whole_batch_peak(False) * 0.75)
    monkeypatch.setattr(accumulation_module, "accumulated_train_step", running_out_above_four)
    planner = HalvingPlanner()
    callback = MicroBatchCallback(planner=planner, memory_budget=budget, trial_steps=0,
                                  verbose=0)
    planned, history = fit(per_sample_model, [callback], jit_compile=False)
    plan = callback.accumulation
    assert plan.micro_batch_size == 4
    assert plan.passed_over[-1].startswith("micro-batches of 8: out of memory at 8")
    # The layers were planned again for the smaller micro-batch (planned for 8 first), so
    # their plans run rather than TensorFlow's own convolutions.
    assert planner.batches[:2] == [8, 8] and planner.batches[-2:] == [4, 4]
    assert [layer.layer.batch_size for layer in callback.report.layers] == [4, 4]
    assert callback.report.memory is plan
    np.testing.assert_allclose(history["loss"], plain_history["loss"], rtol=1e-5)
    for a, b in zip(planned.get_weights(), plain.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


def test_on_the_graph_path_the_kernels_workspaces_are_chosen_with_the_memory_plan():
    from training_steps import SLOW_LINK, WorkspaceFrontPlanner

    plain, plain_history = fit(normalized_model, [], jit_compile=False)
    callback = MicroBatchCallback(planner=WorkspaceFrontPlanner(), memory_budget=32 << 20,
                                  device_model=SLOW_LINK, trial_steps=0, verbose=0)
    planned, history = fit(normalized_model, [callback], jit_compile=False)
    # The one convolution's three kernels each held 64 MiB: all give it up, nothing else.
    lowered = callback.report.memory_workspaces.lowered
    assert sorted(k.node.split("|")[1] for k in lowered) == sorted(KERNELS)
    assert all(k.chosen.workspace_bytes == 0 for k in lowered)
    memory = callback.memory_plan.plan
    assert memory.decisions.prediction.peak_bytes <= 32 << 20
    assert not memory.swaps and not memory.recomputes
    np.testing.assert_allclose(history["loss"], plain_history["loss"], rtol=1e-5)
    for a, b in zip(planned.get_weights(), plain.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
