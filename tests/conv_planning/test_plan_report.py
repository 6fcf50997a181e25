import json

import pytest
from conv_planning.test_database_planner import H100, alexnet_layers, database  # noqa: F401

from tf_ucudnn.conv_planning import (
    DYNAMIC_ALLOCATOR,
    SHARED_WORKSPACE,
    InfeasibleBudgetError,
    KernelConfiguration,
    KernelOptions,
    kernel_limit_report,
    network_report,
    optimize_network,
    pareto_configurations,
)
from tf_ucudnn.conv_planning.database_planner import DatabasePlanner, kernels_run
from tf_ucudnn.conv_planning.plan_report import database_report, layer_label, summarize
from tf_ucudnn.core.plan import KERNELS, Algorithm, KernelPlan, LayerPlan, MicroBatch
from tf_ucudnn.core.units import MIB
from tf_ucudnn.profiling import AlgorithmTiming


def test_per_kernel_limit_report_on_the_measurements(fp32_tables):
    report = kernel_limit_report(fp32_tables, 256, 64 * MIB)
    # shared/profiles/README.md: "micro-batching makes the fp32 set 2.7x faster than the best
    # single algorithm that fits the limit on the whole batch".
    assert report.total_time_ms == pytest.approx(38.45439)
    assert report.total_undivided_time_ms == pytest.approx(103.7491)
    assert report.speedup == pytest.approx(2.698, abs=1e-3)
    assert len(report.kernels) == 30
    conv2 = next(k for k in report.kernels if (k.layer, k.kernel) == ("alexnet.conv2", "fwd"))
    assert conv2.speedup == pytest.approx(9.97571 / 1.57976)
    assert conv2.workspace_limit_bytes == 64 * MIB
    for k in report.kernels:
        assert k.chosen.workspace_bytes <= 64 * MIB and k.undivided.workspace_bytes <= 64 * MIB
        assert k.speedup >= 1.0  # the undivided plan is one of the DP's candidates

    data = json.loads(json.dumps(report.to_json()))
    row = next(r for r in data["kernels"] if (r["layer"], r["kernel"]) == ("alexnet.conv2", "fwd"))
    # Each micro-batch carries its profiled workspace (here all alike: the configuration's).
    assert conv2.chosen.workspace_bytes == 43168403
    assert row["micro_batches"] == [{"size": 32, "algorithm": "algo=1,math=default",
                                     "workspace_bytes": 43168403}] * 8
    assert row["undivided"]["plan"] == [{"size": 256, "algorithm": "algo=0,math=default",
                                         "workspace_bytes": conv2.undivided.workspace_bytes}]
    assert data["speedup"] == pytest.approx(report.speedup)

    text = report.to_text()
    assert text.splitlines()[0] == "per-kernel workspace limit 64 MiB, batch 256"
    conv2_line = next(line for line in text.splitlines() if line.startswith("alexnet.conv2   fwd"))
    assert "8x32@algo=1,math=default" in conv2_line and conv2_line.endswith("6.31x")
    assert text.splitlines()[-1].split()[-3:] == ["38.454", "103.749", "2.70x"]


def test_network_report_against_the_undivided_ilp(fp32_tables):
    def options(sizes):
        return [KernelOptions(layer, kernel, pareto_configurations(kernel, table, 256,
                                                                   micro_batch_sizes=sizes))
                for (layer, kernel), table in fp32_tables.items()]

    budget = 512 * MIB
    plan = optimize_network(options(None), budget)
    undivided = optimize_network(options([256]), budget)
    report = network_report(plan, undivided)
    assert report.title == "shared_workspace, budget 512 MiB"
    assert report.total_time_ms == pytest.approx(plan.total_time_ms)
    assert report.total_undivided_time_ms == pytest.approx(undivided.total_time_ms)
    assert report.speedup > 1.5
    assert all(k.workspace_limit_bytes is None for k in report.kernels)


def test_report_without_an_undivided_choice():
    table = {256: [AlgorithmTiming(1, "default", 1.0, 100 * MIB)],
             64: [AlgorithmTiming(1, "default", 0.3, 20 * MIB)]}
    report = kernel_limit_report({("conv", "fwd"): table}, 256, 32 * MIB)
    [row] = report.kernels
    assert row.undivided is None and row.speedup is None and report.speedup is None
    assert row.chosen.plan == KernelPlan.uniform(256, 64, Algorithm(1, "default"))
    assert "none fits" in report.to_text()
    assert json.loads(json.dumps(report.to_json()))["kernels"][0]["undivided"] is None

    options = [KernelOptions("conv", "fwd", pareto_configurations("fwd", table, 256),
                             live_bytes=10 * MIB)]
    undivided = [KernelOptions("conv", "fwd",
                               pareto_configurations("fwd", table, 256, micro_batch_sizes=[256]),
                               live_bytes=10 * MIB)]
    with pytest.raises(InfeasibleBudgetError):
        optimize_network(undivided, 64 * MIB, DYNAMIC_ALLOCATOR)
    report = network_report(optimize_network(options, 64 * MIB, DYNAMIC_ALLOCATOR), None)
    assert report.title.endswith("(no undivided plan fits the budget)")
    assert report.kernels[0].workspace_limit_bytes == 54 * MIB


def test_summarize_folds_runs():
    plan = KernelPlan((MicroBatch(64, Algorithm(1, "tensor_op")),) * 3
                      + (MicroBatch(32, Algorithm(1, "tensor_op")), MicroBatch(32, Algorithm(0))))
    assert summarize(plan) == ("3x64@algo=1,math=tensor_op + 1x32@algo=1,math=tensor_op"
                               " + 1x32@algo=0")


def test_json_of_configurations_round_trips():
    configuration = KernelConfiguration(KernelPlan.of((128, 1), (128, 5)), 0.5, 1234)
    assert KernelConfiguration.from_json(json.loads(json.dumps(configuration.to_json()))) == \
        configuration
    assert SHARED_WORKSPACE in network_report(
        optimize_network([KernelOptions("c", "fwd", (configuration,))], 2000), None).title


def _layer_plans(report, layers):
    chosen = {(k.layer, k.kernel): k.chosen.plan for k in report.kernels}
    return [LayerPlan(*(chosen[(layer_label(layer), kernel)] for kernel in KERNELS))
            for layer in layers]


def test_the_database_report_shows_the_planners_plans(database, alexnet_layers):
    planner = DatabasePlanner(database, 64 * MIB, machine=H100)
    report = database_report(alexnet_layers, planner)
    assert report.title == "per-kernel workspace limit 64 MiB, batch 256"
    assert _layer_plans(report, alexnet_layers) == [planner(layer) for layer in alexnet_layers]
    conv2_forward = next(k for k in report.kernels
                         if (k.layer, k.kernel) == (layer_label(alexnet_layers[1]), "fwd"))
    assert conv2_forward.speedup == pytest.approx(9.97571 / 1.57976)
    assert all(k.left_alone is None for k in report.kernels)

    budget = DatabasePlanner(database, None, workspace_budget_bytes=512 * MIB, machine=H100)
    report = database_report(alexnet_layers, budget)
    assert report.title == "shared_workspace, budget 512 MiB"
    budget.prepare(alexnet_layers)
    assert _layer_plans(report, alexnet_layers) == [budget(layer) for layer in alexnet_layers]
    assert sum(k.chosen.workspace_bytes for k in report.kernels) <= 512 * MIB
    assert report.total_undivided_time_ms > report.total_time_ms


def test_the_layers_xla_keeps_run_as_xla_would(database, alexnet_layers):
    planner = DatabasePlanner(database, 64 * MIB, machine=H100, compare_with_xla=True)
    report = database_report(alexnet_layers, planner)
    for layer in alexnet_layers:
        rows = {k.kernel: k for k in report.kernels if k.layer == layer_label(layer)}
        reason = planner(layer)
        assert isinstance(reason, str)  # within 64 MiB, no plan beats XLA's by 10% here
        assert {row.left_alone for row in rows.values()} == {reason}
        # Each kernel as XLA's autotuner would run it: undivided, at any workspace.
        assert all(row.chosen.plan.sizes == (256,) for row in rows.values())
        assert sum(rows[kernel].chosen.time_ms for kernel in kernels_run(layer)) == \
            pytest.approx(planner.predict(layer).xla_ms)
    text = report.to_text()
    assert "own: 5 layer(s) keep TensorFlow's or XLA's own convolution" in text
    assert f"  {layer_label(alexnet_layers[1])}: XLA's own convolution is predicted" in text
    assert json.loads(json.dumps(report.to_json()))["kernels"][0]["left_alone"].startswith(
        "XLA's own convolution is predicted as fast or faster")
