"""SpatialCosmoFlow: split over devices (and data groups), it computes and trains as on one."""

import numpy as np
import pytest
import tensorflow as tf

from tf_ucudnn.parallel import SpatialSplitError
from tf_ucudnn.parallel.cosmoflow import SpatialCosmoFlow

SMALL = dict(input_size=16, channels=2, filters=(4, 8), dense=(16,), outputs=3)


def _data(samples=8):
    rng = np.random.RandomState(0)
    return (rng.rand(samples, 16, 16, 16, 2).astype("float32"),
            rng.rand(samples, 3).astype("float32"))


def _twin(reference, **options):
    model = SpatialCosmoFlow(**SMALL, **options)
    model.set_weights(reference.get_weights())
    return model


@pytest.mark.parametrize("split", [2, 4])
def test_outputs_and_gradients_equal_the_unsplit_model(split):
    tf.keras.utils.set_random_seed(1)
    whole = SpatialCosmoFlow(**SMALL)
    parted = _twin(whole, spatial_split=split)
    x, y = _data(4)

    def gradients(model):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(x) - y))
        return loss, tape.gradient(loss, model.trainable_variables)

    loss, grads = gradients(whole)
    parted_loss, parted_grads = gradients(parted)
    np.testing.assert_allclose(parted_loss.numpy(), loss.numpy(), rtol=1e-5)
    for a, b in zip(parted_grads, grads):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-4, atol=1e-6)


def test_a_deeper_than_wide_volume_splits_along_its_depth():
    tf.keras.utils.set_random_seed(4)
    shape = dict(SMALL, input_size=(32, 16, 16))
    whole = SpatialCosmoFlow(**shape)
    parted = SpatialCosmoFlow(**shape, spatial_split=4)
    parted.set_weights(whole.get_weights())
    x = np.random.RandomState(5).rand(2, 32, 16, 16, 2).astype("float32")
    np.testing.assert_allclose(parted(x).numpy(), whole(x).numpy(), rtol=1e-5, atol=1e-6)
    assert whole.dense_layers[0].kernel.shape[0] == 8 * 4 * 4 * 8  # 32x16x16 pooled twice, 8 ch


def _fit(model, epochs=2):
    _fit_with(model, [], epochs)
    return model.get_weights()


def _fit_with(model, callbacks, epochs=2):
    """The losses of each epoch."""
    x, y = _data()
    model.compile(tf.keras.optimizers.SGD(0.05), "mse")
    return model.fit(x, y, batch_size=4, epochs=epochs, shuffle=False, verbose=0,
                     callbacks=callbacks).history["loss"]


def test_training_steps_equal_the_unsplit_model():
    tf.keras.utils.set_random_seed(2)
    whole = SpatialCosmoFlow(**SMALL)
    parted = _twin(whole, spatial_split=2)
    for a, b in zip(_fit(parted), _fit(whole)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


def test_hybrid_data_and_spatial_parallel_training_equals_one_device():
    tf.keras.utils.set_random_seed(3)
    whole = SpatialCosmoFlow(**SMALL)
    initial = whole.get_weights()
    reference = _fit(whole)
    mesh = [["/CPU:0", "/CPU:1"], ["/CPU:2", "/CPU:3"]]
    strategy = tf.distribute.MirroredStrategy(["/CPU:0", "/CPU:2"])
    with strategy.scope():
        hybrid = SpatialCosmoFlow(**SMALL, mesh=mesh)
        hybrid.set_weights(initial)
        trained = _fit(hybrid)
    for a, b in zip(trained, reference):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


def test_bad_shapes_and_splits_are_refused():
    with pytest.raises(SpatialSplitError, match="an edge of 5 does not halve"):
        SpatialCosmoFlow(input_size=10, channels=1, filters=(2, 2))
    model = SpatialCosmoFlow(**SMALL, spatial_split=4)
    deeper = SpatialCosmoFlow(input_size=16, channels=2, filters=(2, 2, 2), dense=(4,),
                              outputs=1, spatial_split=4)
    model(_data(1)[0])  # 16 / 4 = 4 rows: two halvings fit
    with pytest.raises(SpatialSplitError, match="do not hold whole 2-row pooling windows"):
        deeper(_data(1)[0])  # a third halving of 1 row does not
    with pytest.raises(SpatialSplitError, match="needs 5 GPUs or logical CPUs"):
        SpatialCosmoFlow(**SMALL, spatial_split=5)


def test_a_memory_budget_is_met_on_each_device_of_the_split():
    from training_steps import SLOW_LINK, assert_same_step, gradient_step

    from tf_ucudnn.memory import BudgetError, analyze
    from tf_ucudnn.memory.search.step_plan import apply_memory_plan, plan_step_memory

    tf.keras.utils.set_random_seed(7)
    model = SpatialCosmoFlow(**SMALL, spatial_split=2)
    model(tf.zeros([2, 16, 16, 16, 2]))
    step = gradient_step(model, 2, (16, 16, 16, 2))  # three logits, labels 0 and 1
    peaks = analyze(step).device_peaks()
    # Each slab stays on its device from layer to layer; the dense head is on the first.
    assert set(peaks) == {"/device:CPU:0", "/device:CPU:1"}
    assert peaks["/device:CPU:1"] < peaks["/device:CPU:0"]
    unplanned = plan_step_memory(step, 1 << 40, SLOW_LINK).decisions.prediction
    assert unplanned.peak_device == "/device:CPU:0"
    # Per device, not summed over the devices: only the first device's tensors need a decision.
    budget = int(unplanned.peak_bytes * 0.95)
    assert budget < sum(peaks.values())
    plan = plan_step_memory(step, budget, SLOW_LINK)
    assert plan.decisions.prediction.peak_bytes <= budget
    chosen = {d.tensor for d in (*plan.decisions.swaps, *plan.decisions.recomputes)}
    assert chosen and {t.device for t in plan.liveness.tensors if t.name in chosen} == \
        {"/device:CPU:0"}
    assert_same_step(step, apply_memory_plan(step, plan), rtol=1e-5, atol=1e-6)
    # Each device runs its own backward pass, so either may hold the last unmovable peak.
    with pytest.raises(BudgetError, match=r"at op \d+ on /device:CPU:[01], "):
        plan_step_memory(step, 1 << 10, SLOW_LINK)


def test_the_callbacks_memory_budget_is_met_on_each_device_of_the_split():
    from training_steps import SLOW_LINK

    from tf_ucudnn import MicroBatchCallback

    def callback(budget):
        return MicroBatchCallback(planner=lambda layer: "left alone in this test",
                                  accumulate_gradients=False,  # the swaps' per-device plan
                                  memory_budget=budget, device_model=SLOW_LINK,
                                  micro_batches=(), verbose=0)

    def fit(callbacks):
        tf.keras.utils.set_random_seed(2)
        model = SpatialCosmoFlow(**SMALL, spatial_split=2)
        return model, _fit_with(model, callbacks)

    probe = callback(1 << 40)
    fit([probe])
    unplanned = probe.memory_plan.plan
    assert set(unplanned.liveness.device_peaks()) == {"/device:CPU:0", "/device:CPU:1"}
    # With each device's backward pass on it the two peaks are close, and the first device's
    # forward convolution (its pieces and their concatenation) sets a floor about 6% below its peak.
    budget = int(unplanned.decisions.prediction.peak_bytes * 0.95)
    plain, plain_losses = fit([])
    planner = callback(budget)
    planned, losses = fit([planner])
    memory = planner.memory_plan.plan
    assert memory.swaps or memory.recomputes
    assert memory.decisions.prediction.peak_bytes <= budget
    np.testing.assert_allclose(losses, plain_losses, rtol=1e-5)
    for a, b in zip(planned.get_weights(), plain.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


class RowsPerReplica(SpatialCosmoFlow):
    """Notes the rows each replica's step takes, when Keras traces it."""

    def call(self, x, training=False):
        replica = tf.distribute.get_replica_context()
        if replica is not None:  # not Keras's symbolic build
            self.rows[int(tf.get_static_value(replica.replica_id_in_sync_group))] = x.shape[0]
        return super().call(x, training)


def test_on_batch_calls_share_the_batch_out_over_the_replicas():
    # Keras 3 hands a train_on_batch batch to every replica whole: each trained on all of it
    # (twice one device's work, for the same update) and predict_on_batch answered twice.
    tf.keras.utils.set_random_seed(8)
    whole = SpatialCosmoFlow(**SMALL)
    whole.compile(tf.keras.optimizers.SGD(0.05), "mse")
    x, y = _data(4)
    # The hybrid test's replica devices: a process's strategies share their collectives' group.
    strategy = tf.distribute.MirroredStrategy(["/CPU:0", "/CPU:2"])
    with strategy.scope():
        shared = RowsPerReplica(**SMALL, mesh=[["/CPU:0"], ["/CPU:2"]])
        shared.rows = {}
        shared.set_weights(whole.get_weights())
        shared.compile(tf.keras.optimizers.SGD(0.05), "mse")
    for _ in range(2):
        np.testing.assert_allclose(shared.train_on_batch(x, y), whole.train_on_batch(x, y),
                                   rtol=1e-5)
    assert shared.rows == {0: 2, 1: 2}
    for a, b in zip(shared.get_weights(), whole.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(shared.test_on_batch(x, y), whole.test_on_batch(x, y), rtol=1e-5)
    predicted = shared.predict_on_batch(x)
    assert predicted.shape == (4, 3)
    np.testing.assert_allclose(predicted, whole.predict_on_batch(x), rtol=1e-5, atol=1e-6)
    # A batch already per replica is each replica's as it is.
    halves = strategy.experimental_distribute_values_from_function(
        lambda context: (x[2 * context.replica_id_in_sync_group:][:2],
                         y[2 * context.replica_id_in_sync_group:][:2], None))
    shared.rows = {}
    shared.make_train_function(force=True)
    shared.train_function([halves])
    assert shared.rows == {0: 2, 1: 2}
    with pytest.raises(SpatialSplitError, match="a batch of 1 sample.* 2 replicas"):
        shared.train_on_batch(x[:1], y[:1])
