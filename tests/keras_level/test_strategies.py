"""The callback's decisions, each on its own: chosen from the options and the model, and undoing
what they changed."""

import contextlib

import keras
import numpy as np
import pytest
import tensorflow as tf

from tf_ucudnn.keras.input_prefetch import InputPrefetch
from tf_ucudnn.keras.strategies import choice as choice_module
from tf_ucudnn.keras.strategies.accumulation import AccumulatedSteps
from tf_ucudnn.keras.strategies.batch_norm import TRIAL_BATCH_NORM_KERNEL, choose_batch_norm
from tf_ucudnn.keras.strategies.choice import choose_strategies, memory_kind
from tf_ucudnn.keras.strategies.convolutions import ConvolutionPlanning
from tf_ucudnn.keras.strategies.memory import MemoryStrategy, NoMemoryPlan
from tf_ucudnn.keras.strategies.prefetch import choose_input_prefetch
from tf_ucudnn.keras.strategies.profiling_budget import ESTIMATE_STEPS, ProfilingBudget
from tf_ucudnn.keras.strategies.step_trial import RunningTrial, choose_step_trials, keras_own
from tf_ucudnn.keras.strategies.swaps import SwapsAndRecomputations
from tf_ucudnn.options import KerasOptions
from tf_ucudnn.report import RewriteReport, StepTrial, StrategyChoice

from keras_level.fake_planners import PendingPlanner, halving_planner


def compiled(model, jit_compile=False, **compile_options):
    model.compile(keras.optimizers.SGD(0.1),
                  keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  jit_compile=jit_compile, **compile_options)
    return model


def per_sample_model():
    return compiled(keras.Sequential([
        keras.Input((8, 8, 3)), keras.layers.Conv2D(4, 3, activation="relu"),
        keras.layers.Conv2DTranspose(2, 3), keras.layers.GlobalAveragePooling2D(),
        keras.layers.Dense(3)]))


def normalized_model(jit_compile=False):
    return compiled(keras.Sequential([
        keras.Input((8, 8, 3)), keras.layers.Conv2D(4, 3), keras.layers.BatchNormalization(),
        keras.layers.GlobalAveragePooling2D(), keras.layers.Dense(3)]), jit_compile)


# Profiling budget.

def test_a_planner_without_pending_work_takes_no_budget_and_plans_after_the_first_step():
    budget = ProfilingBudget.choose(KerasOptions(), halving_planner, 100, False)
    assert budget == ProfilingBudget() and budget.describe() == ""
    assert not budget.ready and not budget.wants_step_time()
    budget.step_ended(None)
    assert budget.ready and budget.seconds is None and budget.planner_settings(None) == {}


def test_the_budget_is_a_share_of_the_first_epoch_estimated_from_its_first_steps():
    budget = ProfilingBudget.choose(KerasOptions(profiling_share=0.5), PendingPlanner(), 100,
                                    plans_at_first_batch=False)
    assert budget.timed_steps == ESTIMATE_STEPS and budget.measures_later
    assert budget.wants_step_time() and not budget.ready
    budget.step_ended(10.0)  # the first step traces and compiles, as Keras's first epoch does
    times = [0.03, 0.01, 0.02]
    for seconds in times:
        assert budget.wants_step_time() and not budget.ready and budget.seconds is None
        budget.step_ended(seconds)
    assert budget.ready and not budget.wants_step_time()
    assert budget.seconds == pytest.approx(0.5 * (10.0 + 99 * 0.02))
    assert budget.later_seconds == pytest.approx(0.5 * 100 * 0.02)  # a later epoch's share
    # A planner given plans by its own settings; the options' own is given the budget.
    assert budget.planner_settings(PendingPlanner()) == {}
    assert budget.planner_settings(None) == {"profiling_seconds": pytest.approx(5.99)}
    assert "50% of the first epoch's time" in budget.describe()


def test_short_epochs_time_fewer_steps_and_unknown_ones_none():
    assert ProfilingBudget.choose(KerasOptions(), PendingPlanner(), 3, False).timed_steps == 2
    assert ProfilingBudget.choose(KerasOptions(), PendingPlanner(), None, False).share is None
    assert ProfilingBudget.choose(KerasOptions(profiling_share=None), PendingPlanner(), 100,
                                  False).share is None


def test_under_a_memory_budget_nothing_is_timed_and_nothing_measured_later():
    budget = ProfilingBudget.choose(KerasOptions(), PendingPlanner(), 100, True)
    assert budget.timed_steps == 0 and not budget.measures_later


def test_profiling_seconds_asked_for_is_the_budget():
    options = KerasOptions(profiling_seconds=30)
    # The options' own planner, a DatabasePlanner, measures later what the budget leaves.
    budget = ProfilingBudget.choose(options, None, 100, False)
    assert budget.timed_steps == 0 and budget.ready is False and budget.seconds == 30
    assert budget.planner_settings(None) == {"profiling_seconds": 30}
    assert ProfilingBudget.choose(KerasOptions(workspace_limit=None), None, 100,
                                  False) == ProfilingBudget()


# Step trial.

def test_the_trial_takes_turns_and_keeps_the_faster_step_by_the_margin():
    trials = choose_step_trials(KerasOptions(trial_steps=2))
    assert trials.choice() == StrategyChoice("timed", "2 step(s) each way in turns; the plans "
                                                      "kept if 1% faster")
    trial = trials.start("planned", "unplanned", keras_own(True, False))
    assert trials.result is trial.result and trial.result.own == "XLA's own convolutions"
    # The first step each way is not timed; then they alternate.
    assert [trial.step_timed(s) for s in (9.0, 9.0, 0.005, 0.010, 0.005)] == [
        "unplanned", "planned", "unplanned", "planned", "unplanned"]
    assert trial.step_timed(0.010) is None and trial.result.kept == "plans"
    assert trial.result.planned_ms == pytest.approx([5.0, 5.0])


def test_a_trial_the_plans_do_not_win_by_the_margin_says_why():
    trial = RunningTrial(StepTrial(1, keras_own(False, True)), "unplanned", "planned")
    for seconds in (1.0, 1.0, 0.00995):
        trial.step_timed(seconds)
    assert trial.step_timed(0.010) is None
    assert trial.result.kept == "TensorFlow's own convolutions and Keras's batch normalization"
    assert trial.rejection() == (
        "measured: the step with the plans took 9.95 ms, with TensorFlow's own convolutions "
        "and Keras's batch normalization 10.00 ms (the plans must gain 1%)")


@pytest.mark.parametrize("options, reason", [
    ({"trial_steps": 0}, "trial_steps=0: the plans kept untimed"),
    ({"memory_budget": "1GiB"}, "under a memory budget the planned step is the one that fits")])
def test_no_trial_where_untimed_or_under_a_memory_budget(options, reason):
    trials = choose_step_trials(KerasOptions(**options))
    assert trials.choice() == StrategyChoice("untimed", reason)
    assert trials.start("planned", "unplanned", "own") is None and trials.result is None


# Batch normalization.

@pytest.mark.parametrize("options, jit_compile, name", [
    ({"fuse_batch_norm": True}, True, "fused"), ({"fuse_batch_norm": False}, False, "keras"),
    ({"trial_steps": 0}, False, "keras"), ({"memory_budget": "1GiB"}, False, "keras"),
    ({}, True, "keras"), ({}, False, "left_to_trial")])
def test_the_batch_norm_kernel_is_asked_for_left_to_keras_or_to_the_trial(options, jit_compile,
                                                                           name):
    assert choose_batch_norm(normalized_model(jit_compile), KerasOptions(**options)).name == name


def test_a_model_without_batch_normalization_leaves_nothing_to_the_trial():
    assert choose_batch_norm(per_sample_model(), KerasOptions()).choice() == StrategyChoice(
        "keras", "no BatchNormalization layer")


def test_the_trials_kernel_is_switched_in_and_out_and_undone_at_the_end():
    model = normalized_model()
    (normalization,) = [layer for layer in model.layers
                        if isinstance(layer, keras.layers.BatchNormalization)]
    batch_norm = choose_batch_norm(model, KerasOptions(verbose=0))
    batch_norm.begin()
    assert batch_norm.kernel is None and "call" not in vars(normalization)
    assert batch_norm.try_trial_kernel() and batch_norm.kernel == TRIAL_BATCH_NORM_KERNEL
    assert "call" in vars(normalization) and batch_norm.summary_lines() == [
        "  0 batch normalization layer(s) left unfused"]
    batch_norm.drop_trial_kernel()
    assert batch_norm.kernel is None and "call" not in vars(normalization)
    assert batch_norm.try_trial_kernel()
    batch_norm.close()
    assert "call" not in vars(normalization)
    assert batch_norm.kernel == TRIAL_BATCH_NORM_KERNEL  # what the step trained with


# Input prefetch.

@pytest.mark.parametrize("device, options, reason", [
    (None, {}, "batches not copied ahead: no GPU"),
    ("/device:CPU:0", {"prefetch_batches": 0}, "batches not copied ahead: prefetch_batches=0"),
    ("/device:CPU:0", {"memory_budget": "1GiB"},
     "batches not copied ahead: under a memory budget (each batch ahead holds GPU memory)"),
    ("/device:CPU:0", {}, "batches copied to /device:CPU:0 up to 2 step(s) ahead")])
def test_batches_are_copied_ahead_or_not_with_why(monkeypatch, device, options, reason):
    monkeypatch.setattr(InputPrefetch, "default_device", staticmethod(lambda: device))
    copies = choose_input_prefetch(per_sample_model(), KerasOptions(**options))
    assert copies.report_text == reason
    assert copies.train(lambda batches: list(batches), [1]) == [1]  # a list passes through
    copies.close()


def test_several_steps_a_call_are_not_copied_ahead(monkeypatch):
    monkeypatch.setattr(InputPrefetch, "default_device", staticmethod(lambda: "/device:CPU:0"))
    model = compiled(keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)]),
                     steps_per_execution=4)
    assert choose_input_prefetch(model, KerasOptions()).report_text.startswith(
        "batches not copied ahead: steps_per_execution=4")


# Memory.

def test_the_memory_kind_follows_the_budget_and_the_model():
    assert memory_kind(per_sample_model(), KerasOptions()) == (NoMemoryPlan, {})
    budget = KerasOptions(memory_budget="1GiB")
    assert memory_kind(per_sample_model(), budget) == (AccumulatedSteps, {})
    kind, passed_over = memory_kind(normalized_model(), budget)
    assert kind is SwapsAndRecomputations
    assert "normalizes each sample with statistics of the whole batch" in \
        passed_over[AccumulatedSteps.NAME]
    assert memory_kind(normalized_model(), KerasOptions(
        memory_budget="1GiB", batch_norm_statistics="micro_batch"))[0] is AccumulatedSteps
    assert memory_kind(per_sample_model(), KerasOptions(
        memory_budget="1GiB", accumulate_gradients=False)) == (
        SwapsAndRecomputations, {AccumulatedSteps.NAME: "accumulate_gradients=False"})


def test_a_memory_budget_needs_one_step_a_call():
    model = compiled(keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)]),
                     steps_per_execution=2)
    with pytest.raises(ValueError, match="steps_per_execution=1, not 2"):
        memory_kind(model, KerasOptions(memory_budget="1GiB"))


def test_a_new_memory_kind_is_one_class_listed(monkeypatch):
    class Everything(MemoryStrategy):
        NAME = "everything"

        def __init__(self, model, options, convolutions, device_model=None, passed_over=None):
            super().__init__("a test's kind", model, options, convolutions, device_model,
                             passed_over)

        @classmethod
        def refusal(cls, model, options):
            return None if len(model.layers) > 3 else "too small for this test"

    monkeypatch.setattr(choice_module, "MEMORY_KINDS", (Everything, SwapsAndRecomputations))
    options = KerasOptions(memory_budget="1GiB", verbose=0)
    assert memory_kind(per_sample_model(), options) == (Everything, {})
    small = compiled(keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)]))
    assert memory_kind(small, options) == (
        SwapsAndRecomputations, {"everything": "too small for this test"})
    strategies = choose_strategies(per_sample_model(), options, None, None, 10)
    assert strategies.report().strategies["memory"] == StrategyChoice("everything",
                                                                     "a test's kind")


def test_swaps_turn_xla_off_while_training_and_back_after():
    model = normalized_model(jit_compile=True)
    swaps = SwapsAndRecomputations(model, KerasOptions(memory_budget="1GiB"), None)
    assert "XLA off" in swaps.reason
    swaps.begin()
    assert model.jit_compile is False
    swaps.close()
    assert model.jit_compile is True


# Convolutions.

def test_convolutions_are_patched_planned_and_given_back():
    model = per_sample_model()
    conv, transposed = model.layers[:2]
    planning = ConvolutionPlanning(model, KerasOptions(verbose=0), halving_planner,
                                   ProfilingBudget())
    assert planning.choice() == StrategyChoice(
        "planned", "64 MiB of workspace per kernel, by the planner given")
    before = tf.config.optimizer.get_experimental_options().get("layout_optimizer")
    planning.begin()
    assert [p.layer for p in planning.patched] == [conv]
    assert "Conv2DTranspose is not a Keras Conv2D" in planning.left_alone[0].reason
    assert "convolution_op" in vars(conv)  # recording its input's shape
    planning.plan(lambda patched: (4, 8, 8, 3))
    assert [item.layer.input_shape for item in planning.layers] == [(4, 8, 8, 3)]
    assert [item.activation for item in planning.fused] == ["relu"]
    assert tf.config.optimizer.get_experimental_options()["layout_optimizer"] is False
    planning.drop_plans("a test's reason")
    assert planning.layers == [] and planning.left_alone[-1].reason == "a test's reason"
    assert "convolution_op" not in vars(conv) and "call" not in vars(conv)
    # Back as it was (unset reads back as its default, on).
    assert tf.config.optimizer.get_experimental_options().get("layout_optimizer") in (before, True)
    planning.plan(lambda patched: None)
    assert planning.left_alone[-1].reason == "not called by the first training step"
    planning.close()
    assert "convolution_op" not in vars(conv)


def test_without_a_workspace_limit_every_convolution_is_left_to_tensorflow():
    planning = ConvolutionPlanning(per_sample_model(), KerasOptions(workspace_limit=None), None,
                                   ProfilingBudget())
    planning.begin()
    assert planning.name == "tensorflow" and planning.patched == []
    assert {item.reason for item in planning.left_alone} == {
        "workspace_limit=None: TensorFlow's own convolution"}
    planning.close()


def test_a_planner_with_layers_waiting_stays_open_and_measures_them_within_the_budget():
    planner = PendingPlanner()
    budget = ProfilingBudget(fixed_seconds=2.5, measures_later=True)
    planning = ConvolutionPlanning(per_sample_model(), KerasOptions(verbose=0), planner, budget)
    planning.begin()
    planning.plan(lambda patched: (4, 8, 8, 3))
    assert planning.layers == [] and planning.planner is planner
    assert planning.left_alone[-1].reason.startswith("not measured yet")
    assert planning.measure_pending() == 1 and planner.budgets == [2.5]
    assert planning.newly_plannable()
    planning.replan()
    assert [item.layer.input_shape for item in planning.layers] == [(4, 8, 8, 3)]
    assert planning.planner is None  # nothing waiting: closed
    assert planning.measure_pending() == 0 and not planning.newly_plannable()
    planning.close()


def test_a_planner_is_closed_after_planning_where_nothing_is_measured_later(monkeypatch):
    from tf_ucudnn.keras.strategies import convolutions as convolutions_module

    closed = []

    @contextlib.contextmanager
    def opened(options, planner, **settings):
        yield planner
        closed.append(planner)
    monkeypatch.setattr(convolutions_module, "conv_planner", opened)
    planner = PendingPlanner()
    planning = ConvolutionPlanning(per_sample_model(), KerasOptions(verbose=0), planner,
                                   ProfilingBudget(fixed_seconds=1.0))  # not measured later
    planning.begin()
    planning.plan(lambda patched: (4, 8, 8, 3))
    assert closed == [planner] and planning.planner is None
    planning.close()


# Together.

def test_the_report_names_each_decision_with_why(monkeypatch):
    monkeypatch.setattr(InputPrefetch, "default_device", staticmethod(lambda: None))
    strategies = choose_strategies(normalized_model(), KerasOptions(
        memory_budget="1GiB", verbose=0), halving_planner, None, 10)
    report = strategies.report()
    assert {decision: choice.name for decision, choice in report.strategies.items()} == {
        "convolutions": "planned", "batch_norm": "keras", "memory": "swaps_and_recomputations",
        "trial": "untimed", "input": "not_copied_ahead"}
    assert report.to_json()["strategies"]["input"] == {"name": "not_copied_ahead",
                                                       "reason": "no GPU"}
    assert "  trial: untimed (under a memory budget the planned step is the one that fits)" in \
        report.to_text().splitlines()
    assert RewriteReport().to_json()["strategies"] == {}


def test_strategies_begun_are_closed_when_a_later_one_fails(monkeypatch):
    model = per_sample_model()
    strategies = choose_strategies(model, KerasOptions(verbose=0), halving_planner, None, 10)

    def failing():
        raise RuntimeError("a test's failure")
    monkeypatch.setattr(strategies.trial, "begin", failing)
    with pytest.raises(RuntimeError, match="a test's failure"):
        strategies.begin()
    assert all("convolution_op" not in vars(layer) for layer in model.layers)


def test_a_planned_layer_trains_its_plans_op():
    model = per_sample_model()
    planning = ConvolutionPlanning(model, KerasOptions(verbose=0), halving_planner,
                                   ProfilingBudget())
    planning.begin()
    planning.plan(lambda patched: (4, 8, 8, 3))
    x = np.random.RandomState(0).rand(4, 8, 8, 3).astype("float32")
    graph = tf.function(lambda x: model(x, training=True)).get_concrete_function(
        tf.TensorSpec(x.shape)).graph
    assert "UcudnnFusedConv2D" in {op.type for op in graph.get_operations()}
    planning.close()
