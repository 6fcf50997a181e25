"""planner: layers planned from measured profiles, as the rewrite pass uses them."""

import dataclasses

import pytest
import tensorflow as tf

from tf_ucudnn import rewrite
from tf_ucudnn.conv_planning.database_planner import DatabasePlanner, kernels_run
from tf_ucudnn.core.conv_layer import ConvLayer
from tf_ucudnn.core.plan import (
    BACKPROP_FILTER,
    BACKPROP_INPUT,
    DIRECT,
    FORWARD,
    KERNELS,
    SUBSAMPLED,
    LayerPlan,
)
from tf_ucudnn.graph.conv_layers import find_conv_layers, trace_model
from tf_ucudnn.keras import models
from tf_ucudnn.profiling import ProfileDatabase, ProfileRecord
from tf_ucudnn.profiling.profiler import Machine

H100 = Machine("NVIDIA H100 80GB HBM3", 91400)
MIB = 1 << 20


@pytest.fixture
def database(profiles_dir, tmp_path):
    with ProfileDatabase(tmp_path / "profiles.sqlite") as db:
        db.import_jsonl(profiles_dir / "h100-cudnn9.14-fp32-nchw.jsonl", H100.device,
                        H100.cudnn_version)
        yield db


@pytest.fixture(scope="module")
def alexnet_layers():
    layers, skipped = find_conv_layers(trace_model(models.alexnet("channels_first"), 256))
    assert skipped == []
    return layers


def test_micro_batches_where_they_pay_and_the_best_algorithm_elsewhere(database,
                                                                      alexnet_layers):
    planner = DatabasePlanner(database, 64 * MIB, machine=H100)
    conv1, conv2 = alexnet_layers[0], alexnet_layers[1]
    undivided = planner(conv1)  # every kernel of conv1 is best undivided, with a named algorithm
    assert [plan.sizes for plan in (undivided.forward, undivided.backprop_input,
                                    undivided.backprop_filter)] == [(256,)] * 3
    assert all(plan.micro_batches[0].algorithm.algo is not None
               for plan in (undivided.forward, undivided.backprop_input, undivided.backprop_filter))
    assert DatabasePlanner(database, 64 * MIB, machine=H100,
                           leave_undivided_to_tensorflow=True)(conv1).startswith("no gain")
    plan = planner(conv2)
    assert [mb.size for mb in plan.forward.micro_batches] == [32] * 8
    assert {mb.algorithm.algo for mb in plan.forward.micro_batches} == {1}


def test_missing_profiles_are_named(database, alexnet_layers):
    planner = DatabasePlanner(database, 64 * MIB, machine=Machine("Some GPU", 90000))
    reason = planner(alexnet_layers[1])
    assert "no profile" in reason and "Some GPU" in reason


def test_grouped_layers_are_planned_from_their_own_profiles(database, alexnet_layers):
    """The profile key holds the groups: a grouped layer is planned from its own measurements
    (here: conv2's, as though measured with 2 groups), never from those of the ungrouped layer
    of the same shapes; alone and under a budget for all layers."""
    conv2 = alexnet_layers[1]
    grouped = dataclasses.replace(conv2, name="grouped", groups=2,
                                  filter_shape=(*conv2.filter_shape[:2], 48, 256))
    assert "no profile" in DatabasePlanner(database, 64 * MIB, machine=H100)(grouped)
    database.insert(dataclasses.replace(record, geometry=grouped.cudnn_geometry())
                    for record in database.records()
                    if record.geometry == conv2.cudnn_geometry())
    planner = DatabasePlanner(database, 64 * MIB, machine=H100)
    assert planner(grouped) == planner(conv2)
    shared = DatabasePlanner(database, None, machine=H100, workspace_budget_bytes=100 * MIB)
    shared.prepare([conv2, grouped])
    assert all(isinstance(shared(layer), LayerPlan) for layer in (conv2, grouped))


def test_rewrite_with_the_planner(database):
    model = models.alexnet("channels_first")
    concrete = tf.function(lambda x: model(x, training=False)).get_concrete_function(
        tf.TensorSpec([256, 3, 227, 227]))
    _, report = rewrite(concrete, DatabasePlanner(database, 64 * MIB, machine=H100,
                                                  leave_undivided_to_tensorflow=True))
    assert len(report.layers) == 4
    assert len(report.left_alone) == 1 and report.left_alone[0].reason.startswith("no gain")


def _workspace(database, layer, kernel, plan):
    timings = database.timings(H100.device, H100.cudnn_version, layer.cudnn_geometry(), kernel)
    return max(next(t.workspace_bytes for t in timings[mb.size]
                    if t.algo == mb.algorithm.algo and t.math == mb.algorithm.math)
               for mb in plan.micro_batches)


@pytest.mark.parametrize("budget_mib", [0, 100, 400])
def test_a_workspace_budget_bounds_all_workspaces_together(database, alexnet_layers, budget_mib):
    planner = DatabasePlanner(database, None, machine=H100, workspace_budget_bytes=budget_mib * MIB)
    planner.prepare(alexnet_layers)
    plans = {layer: planner(layer) for layer in alexnet_layers}
    total = sum(_workspace(database, layer, kernel, plan.kernel(kernel))
                for layer, plan in plans.items() for kernel in KERNELS)
    assert total <= budget_mib * MIB
    divided = sum(len(plan.kernel(kernel).micro_batches) > 1
                  for plan in plans.values() for kernel in KERNELS)
    if budget_mib == 0:
        assert total == 0
    else:  # the budget buys micro-batched configurations
        assert total > 0.5 * budget_mib * MIB and divided > 0
    elsewhere = dataclasses.replace(alexnet_layers[0], name="elsewhere")
    assert planner(elsewhere).startswith("not among")


def test_rewrite_builds_its_own_planner_from_a_database(profiles_dir, tmp_path):
    model = models.alexnet("channels_first")
    concrete = tf.function(lambda x: model(x, training=False)).get_concrete_function(
        tf.TensorSpec([256, 3, 227, 227]))
    _, report = rewrite(concrete, workspace_limit="64MiB", database=str(tmp_path / "db.sqlite"),
                        profiles=[str(profiles_dir / "h100-cudnn9.14-fp32-nchw.jsonl")])
    assert len(report.layers) == 5 and not report.left_alone
    conv2 = report.layers[1].plan
    assert conv2.forward.sizes == (32,) * 8
    _, budget_report = rewrite(concrete, workspace_budget="256MiB",
                               database=str(tmp_path / "db.sqlite"))
    assert len(budget_report.layers) == 5
    with pytest.raises(ValueError, match="for the default planner"):
        rewrite(concrete, lambda layer: "x", workspace_budget="64MiB")


def test_compared_with_xla_a_layer_is_planned_only_where_its_plan_is_predicted_faster(
        database, alexnet_layers):
    """At 64 MiB every AlexNet plan is predicted slower than the best undivided algorithm with any
    workspace, which XLA's autotuner may pick: XLA keeps them all, each with both predictions."""
    planner = DatabasePlanner(database, 64 * MIB, machine=H100, compare_with_xla=True)
    alone = DatabasePlanner(database, 64 * MIB, machine=H100)
    # conv1 reads the images: training runs its forward and filter-gradient kernels only.
    assert [kernels_run(layer) for layer in alexnet_layers] == [
        (FORWARD, BACKPROP_FILTER)] + [KERNELS] * 4
    for layer in alexnet_layers:
        prediction = planner.predict(layer, alone(layer))
        # The XLA prediction is the best undivided algorithm with any workspace, kernel by kernel.
        expected = sum(min(t.time_ms for t in database.timings(
            H100.device, H100.cudnn_version, layer.cudnn_geometry(), kernel)[layer.batch_size])
            for kernel in kernels_run(layer))
        assert prediction.xla_ms == pytest.approx(expected)
        assert prediction.plan_ms > prediction.xla_ms
        assert planner(layer) == (
            f"XLA's own convolution is predicted as fast or faster: {prediction.xla_ms:.3f} ms "
            f"undivided with any workspace, against {prediction.plan_ms:.3f} ms planned (a plan "
            f"must gain 10%)")
    # The margin decides: conv2's plan is predicted 2.03 times as slow as XLA's convolution.
    conv2 = alexnet_layers[1]
    prediction = planner.predict(conv2, alone(conv2))
    assert prediction.plan_ms / prediction.xla_ms == pytest.approx(2.03, abs=0.005)
    assert isinstance(DatabasePlanner(database, 64 * MIB, machine=H100, compare_with_xla=True,
                                      xla_margin=-1.0)(conv2), str)
    assert DatabasePlanner(database, 64 * MIB, machine=H100, compare_with_xla=True,
                           xla_margin=-1.1)(conv2) == alone(conv2)


def test_each_kernels_front_runs_from_least_workspace_to_the_plan_chosen(database,
                                                                        alexnet_layers):
    planner = DatabasePlanner(database, 64 * MIB, machine=H100)
    conv2 = alexnet_layers[1]
    fronts = planner.workspace_front(conv2)
    assert set(fronts) == set(KERNELS)
    chosen = planner(conv2)
    for kernel, front in fronts.items():
        workspaces = [c.workspace_bytes for c in front]
        times = [c.time_ms for c in front]
        assert workspaces == sorted(workspaces) and workspaces[-1] <= 64 * MIB
        assert times == sorted(times, reverse=True) and len(set(times)) == len(times)
        assert front[-1].plan == chosen.kernel(kernel)  # the fastest within the limit
    assert len(fronts["fwd"]) > 1  # there is workspace to give up
    assert DatabasePlanner(database, 64 * MIB, machine=Machine("Some GPU", 90000)
                           ).workspace_front(conv2) == {}


def test_a_measured_engine_configuration_is_planned_like_a_legacy_algorithm(database,
                                                                           alexnet_layers):
    conv2 = alexnet_layers[1]
    planner = DatabasePlanner(database, 64 * MIB, machine=H100)
    assert not any(mb.algorithm.is_engine for mb in planner(conv2).forward.micro_batches)
    fast_engine = ProfileRecord(H100.device, H100.cudnn_version, conv2.cudnn_geometry(), "fwd",
                                256, None, None, 0.001, MIB, engine=12,
                                knobs={"SPLIT_K_SLC": 2})
    database.insert([fast_engine, dataclasses.replace(fast_engine, engine=13, time_ms=0.0005,
                                                      workspace_bytes=65 * MIB)])
    plan = DatabasePlanner(database, 64 * MIB, machine=H100)(conv2)
    assert str(plan.forward) == "256@engine=12,knobs=SPLIT_K_SLC:2"  # engine 13 needs too much
    assert LayerPlan.from_json(plan.to_json()) == plan


def test_a_subsampled_plan_is_no_undivided_plan_and_xla_is_predicted_direct(tmp_path):
    """A layer whose best plans are undivided but subsampled gains over TensorFlow's own op, and
    XLA's convolution is predicted from direct runs only (XLA does not subsample)."""
    layer = ConvLayer("shortcut", "Conv2D", (8, 256, 56, 56), (1, 1, 256, 512),
                      strides=(1, 1, 2, 2), dilations=(1, 1, 1, 1), padding="VALID",
                      explicit_paddings=(), data_format="NCHW", dtype="float32")
    geometry = layer.cudnn_geometry()
    assert geometry.can_subsample
    records = [ProfileRecord(H100.device, H100.cudnn_version, geometry, kernel, 8, 1, "default",
                             time_ms, 0, form=form)
               for kernel in KERNELS for time_ms, form in ((2.0, DIRECT), (1.0, SUBSAMPLED))]
    with ProfileDatabase(tmp_path / "profiles.sqlite") as database:
        database.insert(records)
        plan = DatabasePlanner(database, 64 * MIB, machine=H100,
                               leave_undivided_to_tensorflow=True)(layer)
        assert isinstance(plan, LayerPlan)
        assert all(plan.kernel(kernel).form == SUBSAMPLED and plan.kernel(kernel).sizes == (8,)
                   for kernel in KERNELS)
        prediction = DatabasePlanner(database, 64 * MIB, machine=H100).predict(layer, plan)
        assert (prediction.xla_ms, prediction.plan_ms) == (6.0, 3.0)


def test_a_layer_the_images_feed_is_judged_by_the_kernels_training_runs(tmp_path):
    """Its input gradient never runs: a plan that gains there only is no gain, against TensorFlow
    or XLA."""
    layer = ConvLayer("first", "Conv2D", (8, 256, 56, 56), (1, 1, 256, 512),
                      strides=(1, 1, 2, 2), dilations=(1, 1, 1, 1), padding="VALID",
                      explicit_paddings=(), data_format="NCHW", dtype="float32")
    # Subsampled, the input gradient runs four times as fast; the other kernels do not gain.
    times = {FORWARD: (1.0, 1.5), BACKPROP_INPUT: (2.0, 0.5), BACKPROP_FILTER: (1.0, 1.5)}
    records = [ProfileRecord(H100.device, H100.cudnn_version, layer.cudnn_geometry(), kernel, 8,
                             1, "default", time_ms, 0, form=form)
               for kernel in KERNELS
               for time_ms, form in zip(times[kernel], (DIRECT, SUBSAMPLED))]
    first = dataclasses.replace(layer, input_gradient=False)
    with ProfileDatabase(tmp_path / "profiles.sqlite") as database:
        database.insert(records)
        xla = DatabasePlanner(database, 64 * MIB, machine=H100, compare_with_xla=True)
        plan = xla(layer)
        assert isinstance(plan, LayerPlan) and plan.backprop_input.form == SUBSAMPLED
        assert (xla.predict(layer, plan).xla_ms, xla.predict(layer, plan).plan_ms) == (4.0, 2.5)
        assert (xla.predict(first, plan).xla_ms, xla.predict(first, plan).plan_ms) == (2.0, 2.0)
        assert xla(first).startswith("XLA's own convolution is predicted as fast or faster")
        tensorflow = DatabasePlanner(database, 64 * MIB, machine=H100,
                                     leave_undivided_to_tensorflow=True)
        assert isinstance(tensorflow(layer), LayerPlan)
        assert tensorflow(first).startswith("no gain: every kernel runs best undivided")
