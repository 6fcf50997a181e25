"""MicroBatchCallback's settings (KerasOptions, keyword overrides) and its profiling budget: layers
a planner leaves waiting are measured at epochs' ends and planned at a later epoch's start."""

import contextlib

import keras
import numpy as np
import pytest

from tf_ucudnn.keras.callback import MicroBatchCallback
from tf_ucudnn.options import KerasOptions, Options, OptionsError

from keras_level.fake_planners import PendingPlanner

pytestmark = pytest.mark.usefixtures("no_tf32")


def test_options_and_overrides_make_the_callbacks_settings():
    base = KerasOptions(workspace_limit=None, memory_budget="1GiB", trial_steps=3)
    assert MicroBatchCallback(options=base).options == base
    overridden = MicroBatchCallback(options=base, trial_steps=0, verbose=0).options
    assert overridden.trial_steps == 0 and overridden.memory_budget == 1 << 30
    assert base.trial_steps == 3
    # The positional workspace limit overrides the options' only where it is given.
    assert MicroBatchCallback("32MiB", options=base).options.workspace_limit == 32 << 20
    assert MicroBatchCallback(None, memory_budget="1GiB").options.workspace_limit is None
    assert MicroBatchCallback().options == KerasOptions()


@pytest.mark.parametrize("arguments, message", [
    ({"trial_stpes": 3}, "trial_stpes: not a setting of KerasOptions"),
    ({"fuse_batch_norm": "fast"}, "fuse_batch_norm='fast': the kernels are cudnn, xla, ucudnn"),
    ({"memory_budget": "lots"}, "memory_budget: cannot read 'lots' as a size"),
    ({"options": Options()}, "options: a KerasOptions is needed, got a Options"),
    ({"planner": lambda layer: "left alone", "database": "mine.sqlite"},
     "database and planner=: those settings are read only by tf_ucudnn's own planner"),
])
def test_a_bad_setting_is_named(arguments, message):
    with pytest.raises(OptionsError, match=message):
        MicroBatchCallback(**arguments)


class FakeClock:
    """perf_counter for the callback: each timed step takes the next of `durations` seconds."""

    def __init__(self, durations):
        self.durations, self.now, self.running = list(durations), 0.0, False

    def perf_counter(self):
        if self.running:
            self.now += self.durations.pop(0)
        self.running = not self.running
        return self.now


def model():
    return keras.Sequential([
        keras.Input((12, 12, 3)), keras.layers.Conv2D(8, 3, padding="same", activation="relu"),
        keras.layers.MaxPooling2D(), keras.layers.Conv2D(8, 3, padding="same"),
        keras.layers.GlobalAveragePooling2D(), keras.layers.Dense(4)])


def fit(callbacks, epochs):
    """3 steps an epoch: 16, 16 and 8 samples."""
    keras.utils.set_random_seed(1)
    built = model()
    built.compile(keras.optimizers.SGD(0.1),
                  keras.losses.SparseCategoricalCrossentropy(from_logits=True), jit_compile=False)
    rng = np.random.RandomState(0)
    x, y = rng.rand(40, 12, 12, 3).astype("float32"), np.arange(40) % 4
    history = built.fit(x, y, batch_size=16, epochs=epochs, verbose=0, shuffle=False,
                        callbacks=callbacks)
    return built, history.history


class PlannedLayersSeen(keras.callbacks.Callback):
    def __init__(self, callback):
        super().__init__()
        self.callback, self.seen = callback, []

    def on_train_batch_end(self, batch, logs=None):
        report = self.callback.report
        self.seen.append(None if report is None else len(report.layers))


def test_layers_waiting_are_measured_at_the_epochs_end_and_planned_at_the_next_ones_start(
        monkeypatch):
    import tf_ucudnn.keras.callback as callback_module

    # The first three steps are timed to estimate the first epoch: the first (compiling) 0.5 s,
    # then a median of 20 ms.
    monkeypatch.setattr(callback_module, "time", FakeClock([0.5, 0.010, 0.030]))
    _, plain = fit([], epochs=3)
    planner = PendingPlanner()
    callback = MicroBatchCallback(planner=planner, profiling_share=0.5, trial_steps=0, verbose=0)
    seen = PlannedLayersSeen(callback)
    _, history = fit([callback, seen], epochs=3)
    # Planned after the timed steps (nothing: every layer waiting), measured at the first
    # epoch's end within half of a later epoch (3 steps of 20 ms; the first epoch's share, with
    # its compile, is the budget of the first planning), planned when the second began.
    assert seen.seen == [None, None, 0, 2, 2, 2, 2, 2, 2]
    assert planner.budgets == [pytest.approx(0.5 * 3 * 0.020)]
    assert [item.layer.batch_size for item in callback.report.layers] == [16, 16]
    assert "profiles measured within 50% of the first epoch's time" in \
        callback.report.strategies["convolutions"].reason
    np.testing.assert_allclose(history["loss"], plain["loss"], rtol=1e-5)


def test_layers_planned_at_a_later_epoch_are_tried_against_keras_step_again(monkeypatch):
    import tf_ucudnn.keras.callback as callback_module

    # Three steps timed for the estimate, then the trial's: one untimed each way, two each way.
    monkeypatch.setattr(callback_module, "time", FakeClock(
        [0.5, 0.010, 0.030] + [1.0, 1.0] + [0.005, 0.010] * 2))
    callback = MicroBatchCallback(planner=PendingPlanner(), trial_steps=2, verbose=0)
    fit([callback], epochs=4)
    trial = callback.report.trial
    assert trial.kept == "plans" and trial.planned_ms == pytest.approx([5.0, 5.0])
    assert len(callback.report.layers) == 2


def test_the_options_own_planner_is_given_the_budget_and_closed(monkeypatch):
    import tf_ucudnn.keras.callback as callback_module
    from tf_ucudnn.conv_planning.database_planner import DatabasePlanner
    from tf_ucudnn.keras.strategies import convolutions as convolutions_module

    monkeypatch.setattr(DatabasePlanner, "measure_pending", PendingPlanner.measure_pending,
                        raising=False)
    monkeypatch.setattr(callback_module, "time", FakeClock([0.5, 0.010, 0.030]))
    planner, opened = PendingPlanner(), []

    @contextlib.contextmanager
    def conv_planner(options, given, **settings):
        opened.append(settings)
        yield planner
        opened.append("closed")
    monkeypatch.setattr(convolutions_module, "conv_planner", conv_planner)
    fit([MicroBatchCallback(trial_steps=0, verbose=0)], epochs=3)
    assert opened == [{"compare_with_xla": False,
                       "profiling_seconds": pytest.approx(0.25 * (0.5 + 2 * 0.020))}, "closed"]
    assert planner.budgets == [pytest.approx(0.25 * 3 * 0.020)]
