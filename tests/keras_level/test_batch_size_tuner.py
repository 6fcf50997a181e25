"""The batch-size tuner: the best predicted images per second that fits, and why others do not."""

import tensorflow as tf

from tf_ucudnn.keras.batch_size_tuner import tune_batch_size
from tf_ucudnn.keras.planned_step import keras_training_step
from tf_ucudnn.memory.cost.device_model import DeviceModel
from tf_ucudnn.memory.search.step_plan import plan_step_memory

LINK = DeviceModel("test", device_to_host=1e10, host_to_device=1e10, memory_bandwidth=1e11,
                   peak_flops=1e12, launch_ms=0.01)


def _model():
    tf.keras.utils.set_random_seed(2)
    layers = tf.keras.layers
    return tf.keras.Sequential([
        tf.keras.Input((12, 12, 3)),
        layers.Conv2D(8, 3, padding="same", activation="relu"),
        layers.Conv2D(8, 3, padding="same", activation="relu"),
        layers.GlobalAveragePooling2D(), layers.Dense(3),
    ])


def test_the_largest_batch_that_fits_wins_when_launches_dominate():
    model = _model()
    steps = {batch: keras_training_step(model, batch) for batch in (4, 8, 16, 64)}
    # A budget between the unplanned peaks of batch 16 and 64.
    peaks = {batch: plan_step_memory(step, 1 << 40, LINK).decisions.prediction.peak_bytes
             for batch, step in steps.items()}
    assert peaks[4] < peaks[8] < peaks[16] < peaks[64]
    budget = (peaks[16] + peaks[64]) // 2
    report = tune_batch_size(steps.__getitem__, steps, budget, LINK)
    assert [t.batch_size for t in report.trials] == [4, 8, 16, 64]
    fitting = [t for t in report.trials if t.images_per_second]
    assert all(t.peak_bytes <= budget for t in fitting)
    # Per-op launch costs dominate these tiny steps: more images per step, more per second.
    rates = [t.images_per_second for t in fitting]
    assert rates == sorted(rates)
    assert report.best == max(fitting, key=lambda t: t.images_per_second)
    assert report.plan is not None and "best: batch" in report.to_text()
    report.to_json()


def test_batches_that_cannot_fit_say_so():
    model = _model()
    steps = {batch: keras_training_step(model, batch) for batch in (4, 8)}
    report = tune_batch_size(steps.__getitem__, steps, 1 << 10, LINK)
    assert report.best is None and report.plan is None
    assert all("cannot be met" in t.reason for t in report.trials)
    assert "no batch size fits" in report.to_text()


def test_a_keras_model_tunes_with_micro_batched_first_layers_where_they_are_needed():
    from training_steps import SLOW_LINK, pooled_conv_model

    from tf_ucudnn.keras.batch_size_tuner import tune_keras_batch_size

    model = pooled_conv_model()
    budget = plan_step_memory(keras_training_step(model, 16), 1 << 40,
                              SLOW_LINK).decisions.prediction.peak_bytes
    report = tune_keras_batch_size(model, (8, 16, 32), budget, SLOW_LINK)
    by_batch = {t.batch_size: t for t in report.trials}
    # 16 fits as it is; 32 fits only with its first layers in micro-batches, and says so.
    assert by_batch[16].prefix_end is None and by_batch[16].micro_batches == 1
    assert by_batch[32].prefix_end == "pool1" and by_batch[32].micro_batches > 1
    assert all(t.peak_bytes <= budget for t in report.trials)
    assert report.best == max(report.trials, key=lambda t: t.images_per_second)
    assert "up to pool1 in" in report.to_text()
    assert report.accumulation_refused == "the model is not compiled with an optimizer"


def test_a_compiled_keras_model_tunes_its_whole_step_in_micro_batches_as_the_callback_would():
    from training_steps import SLOW_LINK, pooled_conv_model

    from tf_ucudnn.keras.accumulated_step import AccumulationPlan
    from tf_ucudnn.keras.batch_size_tuner import tune_keras_batch_size

    model = pooled_conv_model()
    model.compile(tf.keras.optimizers.SGD(0.01),
                  tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    whole_16 = tf.function(model.train_step).get_concrete_function(
        (tf.TensorSpec([16, *model.input_shape[1:]]), tf.TensorSpec([16], tf.int32)))
    budget = plan_step_memory(whole_16, 1 << 40, SLOW_LINK).decisions.prediction.peak_bytes
    measured_ms = {}

    def step_ms(batch, size):  # a made-up measurement: one update per step, a cost per sample
        measured_ms[batch, size] = 2.0 + (batch // size) * (1.0 + 0.25 * size)
        return measured_ms[batch, size]
    report = tune_keras_batch_size(model, (8, 16, 64), budget, SLOW_LINK, step_ms=step_ms)
    by_batch = {t.batch_size: t for t in report.trials}
    assert report.accumulation_refused is None
    assert by_batch[16].accumulated_micro_batch == 16 and by_batch[16].micro_batches == 1
    big = by_batch[64]
    assert big.accumulated_micro_batch < 64 and big.micro_batches > 1
    assert big.accumulated_micro_batch * big.micro_batches == 64
    # Each batch's step measured as the callback trains it: in its micro-batches, one update.
    assert set(measured_ms) == {(t.batch_size, t.accumulated_micro_batch) for t in report.trials}
    assert big.step_ms == measured_ms[64, big.accumulated_micro_batch]
    assert big.images_per_second == 64 / big.step_ms * 1e3
    assert all(t.peak_bytes <= budget for t in report.trials)
    # The update is paid once per batch: the batch in micro-batches outruns the whole ones.
    assert report.best is big
    assert isinstance(report.plan, AccumulationPlan)
    assert "micro-batches of" in report.to_text() and report.to_json()["plan"]["batch"] > 0


def test_a_measured_step_that_runs_out_of_memory_is_a_trial_that_does_not_fit():
    from training_steps import SLOW_LINK, pooled_conv_model

    from tf_ucudnn.keras.batch_size_tuner import tune_keras_batch_size

    model = pooled_conv_model()
    model.compile(tf.keras.optimizers.SGD(0.01),
                  tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))

    def step_ms(batch, size):
        if batch == 64:
            raise tf.errors.ResourceExhaustedError(None, None, "OOM when allocating tensor\nmore")
        return 1.0 + batch

    report = tune_keras_batch_size(model, (8, 64), 1 << 40, SLOW_LINK, step_ms=step_ms)
    small, big = report.trials
    assert small.images_per_second == 8 / 9.0 * 1e3
    assert big.images_per_second is None and big.step_ms is None
    assert big.reason.startswith("its step, measured in micro-batches of 64, ran out of memory")
    assert "OOM when allocating tensor" in big.reason and "more" not in big.reason
    assert report.best is small and "does not fit: its step" in report.to_text()


def test_the_tuner_takes_the_callbacks_options_and_overrides():
    import pytest

    from tf_ucudnn.keras.batch_size_tuner import tune_keras_batch_size
    from tf_ucudnn.options import KerasOptions, OptionsError

    model = _model()
    model.compile(tf.keras.optimizers.SGD(0.01),
                  tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    options = KerasOptions(memory_budget=1 << 40, accumulate_gradients=False)
    by_options = tune_keras_batch_size(model, (4, 8), device_model=LINK, options=options)
    by_overrides = tune_keras_batch_size(model, (4, 8), 1 << 40, LINK,
                                         accumulate_gradients=False)
    assert by_options.accumulation_refused == "accumulate_gradients=False"
    assert by_options.to_json() == by_overrides.to_json()
    # Planned as the callback would: the whole step in micro-batches where it may.
    assert tune_keras_batch_size(model, (4,), options=KerasOptions(
        memory_budget=1 << 40), device_model=LINK).accumulation_refused is None
    with pytest.raises(OptionsError, match="memory_budget: the tuner plans each batch under"):
        tune_keras_batch_size(model, (4,), device_model=LINK)
    with pytest.raises(OptionsError, match="batch_norm_statistics must be one of"):
        tune_keras_batch_size(model, (4,), 1 << 40, LINK, batch_norm_statistics="ghost")
