import itertools
import random

import pytest

from tf_ucudnn.conv_planning import (
    DYNAMIC_ALLOCATOR,
    SHARED_WORKSPACE,
    InfeasibleBudgetError,
    KernelConfiguration,
    KernelOptions,
    optimize_network,
    pareto_configurations,
)
from tf_ucudnn.core.plan import KERNELS, Algorithm, KernelPlan, LayerPlan
from tf_ucudnn.core.units import MIB
from tf_ucudnn.profiling import AlgorithmTiming


def configuration(time_ms, workspace_bytes, algo=0):
    return KernelConfiguration(KernelPlan.of((8, algo)), time_ms, workspace_bytes)


def _random_instance(rng):
    options = []
    for layer in range(rng.randint(1, 2)):
        for kernel in rng.sample(KERNELS, rng.randint(1, 3)):
            count = rng.randint(1, 4)
            workspaces = sorted(rng.sample(range(0, 400 * MIB, MIB), count))
            times = sorted((round(rng.uniform(0.1, 5.0), 4) for _ in range(count)), reverse=True)
            options.append(KernelOptions(
                f"conv{layer}", kernel,
                tuple(configuration(t, w, algo)
                      for algo, (t, w) in enumerate(zip(times, workspaces))),
                live_bytes=rng.randrange(0, 600 * MIB, MIB)))
    return options


def _brute_force(options, budget, mode):
    """The smallest total time over every combination that fits; None if none fits."""
    best = None
    for combination in itertools.product(*(o.configurations for o in options)):
        if mode == SHARED_WORKSPACE:
            fits = sum(c.workspace_bytes for c in combination) <= budget
        else:
            fits = all(o.live_bytes + c.workspace_bytes <= budget
                       for o, c in zip(options, combination))
        if fits:
            total = sum(c.time_ms for c in combination)
            best = total if best is None else min(best, total)
    return best


@pytest.mark.parametrize("mode", [SHARED_WORKSPACE, DYNAMIC_ALLOCATOR])
def test_ilp_matches_brute_force(mode):
    rng = random.Random(7 if mode == SHARED_WORKSPACE else 8)
    solved = infeasible = 0
    for _ in range(25):
        options = _random_instance(rng)
        budget = rng.randrange(0, 1200 * MIB, MIB)
        expected = _brute_force(options, budget, mode)
        if expected is None:
            with pytest.raises(InfeasibleBudgetError):
                optimize_network(options, budget, mode)
            infeasible += 1
            continue
        plan = optimize_network(options, budget, mode)
        solved += 1
        assert plan.total_time_ms == pytest.approx(expected)
        assert [(p.layer, p.kernel) for p in plan.kernels] == [(o.layer, o.kernel) for o in options]
        for planned, o in zip(plan.kernels, options):
            assert planned.configuration in o.configurations
        if mode == SHARED_WORKSPACE:
            assert plan.memory_bytes == sum(p.configuration.workspace_bytes for p in plan.kernels)
        else:
            assert plan.memory_bytes == max(p.live_bytes + p.configuration.workspace_bytes
                                            for p in plan.kernels)
        assert plan.memory_bytes <= budget
    assert solved >= 10 and infeasible >= 2  # the random instances exercise both outcomes


def test_repeated_kernels_share_variables_but_each_gets_a_choice():
    # Repeated blocks: identical fronts are interchangeable and solved as counts.
    front = (configuration(3.0, 0), configuration(2.0, 100, 1), configuration(1.0, 250, 2))
    options = [KernelOptions(f"block{i}", "fwd", front) for i in range(5)]
    options.append(KernelOptions("head", "fwd", (configuration(4.0, 0), configuration(1.0, 90, 3))))
    for budget in range(0, 1400, 45):
        plan = optimize_network(options, budget, SHARED_WORKSPACE)
        assert plan.total_time_ms == pytest.approx(_brute_force(options, budget, SHARED_WORKSPACE))
        assert plan.memory_bytes <= budget
        assert [p.layer for p in plan.kernels] == [o.layer for o in options]
        assert all(p.configuration in o.configurations for p, o in zip(plan.kernels, options))


def test_shared_budget_trades_time_across_layers(fp32_tables):
    tables = {key: table for key, table in fp32_tables.items() if key[0].startswith("alexnet")}
    options = [KernelOptions(layer, kernel, pareto_configurations(kernel, table, 256))
               for (layer, kernel), table in tables.items()]
    totals = []
    for budget in (0, 64 * MIB, 256 * MIB, 1024 * MIB, 8192 * MIB):
        plan = optimize_network(options, budget, SHARED_WORKSPACE)
        assert plan.memory_bytes <= budget
        totals.append(plan.total_time_ms)
    assert totals == sorted(totals, reverse=True)
    # No budget at all is the zero-workspace algorithms; a huge one the fastest of each front.
    assert totals[0] == pytest.approx(sum(o.configurations[0].time_ms for o in options))
    assert totals[-1] == pytest.approx(sum(o.configurations[-1].time_ms for o in options))


def test_shared_workspace_infeasible_names_the_largest_kernels():
    options = [KernelOptions("a", "fwd", (configuration(1.0, 300),)),
               KernelOptions("b", "fwd", (configuration(1.0, 500), configuration(0.5, 900))),
               KernelOptions("c", "bwd_data", (configuration(1.0, 0),))]
    with pytest.raises(InfeasibleBudgetError, match=r"800 bytes, 50 bytes over the budget of 750"
                                                    r".*b/fwd \(500 bytes\), a/fwd \(300") as error:
        optimize_network(options, 750, SHARED_WORKSPACE)
    assert error.value.shortfall_bytes == 50
    assert error.value.kernels[0] == "b/fwd"
    plan = optimize_network(options, 800, SHARED_WORKSPACE)
    assert plan.memory_bytes == 800 and plan.total_time_ms == 3.0


def test_dynamic_allocator_infeasible_names_the_kernel():
    options = [KernelOptions("conv1", "fwd", (configuration(1.0, 100),), live_bytes=500),
               KernelOptions("conv2", "fwd", (configuration(2.0, 0), configuration(1.0, 100)),
                             live_bytes=950),
               KernelOptions("conv2", "bwd_filter", (configuration(2.0, 40),), live_bytes=990)]
    with pytest.raises(InfeasibleBudgetError,
                       match=r"1 kernel.*conv2/bwd_filter needs 990 live \+ 40 workspace bytes, "
                             r"30 bytes over") as error:
        optimize_network(options, 1000, DYNAMIC_ALLOCATOR)
    assert error.value.kernels == ("conv2/bwd_filter",) and error.value.shortfall_bytes == 30
    plan = optimize_network(options, 1030, DYNAMIC_ALLOCATOR)
    # conv2/fwd can afford only 80 bytes beside its 950 live ones: the slow, workspace-free choice.
    assert [p.configuration.time_ms for p in plan.kernels] == [1.0, 2.0, 2.0]
    assert plan.memory_bytes == 1030


def test_dynamic_allocator_is_looser_than_a_shared_workspace():
    options = [KernelOptions(f"conv{i}", "fwd", (configuration(2.0, 0), configuration(1.0, 600)))
               for i in range(3)]
    # One 600-byte workspace at a time fits 1000 bytes; three at once do not.
    assert optimize_network(options, 1000, DYNAMIC_ALLOCATOR).total_time_ms == 3.0
    assert optimize_network(options, 1000, SHARED_WORKSPACE).total_time_ms == 5.0


def test_layer_plans_and_json():
    fast = KernelConfiguration(KernelPlan.of((4, 1), (4, 1)), 1.0, 10)
    options = [KernelOptions("conv1", "fwd", (fast,)),
               KernelOptions("conv1", "bwd_filter", (configuration(1.0, 0, algo=3),))]
    plan = optimize_network(options, 100)
    assert plan.layer_plans() == {"conv1": LayerPlan(forward=fast.plan,
                                                     backprop_filter=KernelPlan.of((8, 3)))}
    data = plan.to_json()
    assert data["mode"] == SHARED_WORKSPACE and data["kernels"][0]["plan"] == fast.plan.to_json()
    assert KernelConfiguration.from_json(data["kernels"][0]) == fast


def test_solution_is_deterministic(fp32_tables):
    options = [KernelOptions(layer, kernel, pareto_configurations(kernel, table, 256))
               for (layer, kernel), table in fp32_tables.items()]
    first = optimize_network(options, 1024 * MIB)
    assert optimize_network(options, 1024 * MIB) == first


def test_bad_input():
    option = KernelOptions("a", "fwd", (configuration(1.0, 0),))
    with pytest.raises(ValueError, match="mode"):
        optimize_network([option], 10, "static")
    with pytest.raises(ValueError, match="once.*a/fwd"):
        optimize_network([option, option], 10)
    with pytest.raises(ValueError, match="no configurations"):
        KernelOptions("a", "fwd", ())


def test_engine_configurations_are_candidates_across_layers():
    """Two kernels' fronts from tables with engine configurations, under a shared budget."""
    def engine(engine_id, time_ms, workspace_bytes):
        return AlgorithmTiming.from_algorithm(Algorithm(engine=engine_id, knobs={"TILE_SIZE": 2}),
                                              time_ms, workspace_bytes)

    tables = {"conv1": {8: [AlgorithmTiming(1, "default", 4.0, 0), engine(3, 1.0, 60 * MIB)]},
              "conv2": {8: [AlgorithmTiming(0, "default", 3.0, 0), engine(5, 2.0, 50 * MIB)]}}
    options = [KernelOptions(layer, "fwd", pareto_configurations("fwd", table, 8))
               for layer, table in tables.items()]
    # Both engines fit 110 MiB; at 60 MiB, conv1's saves more time (3.0 ms against 1.0 ms).
    for budget_mib, expected in [(110, ("8@engine=3,knobs=TILE_SIZE:2",
                                        "8@engine=5,knobs=TILE_SIZE:2")),
                                 (60, ("8@engine=3,knobs=TILE_SIZE:2", "8@algo=0,math=default")),
                                 (0, ("8@algo=1,math=default", "8@algo=0,math=default"))]:
        plan = optimize_network(options, budget_mib * MIB)
        plans = plan.layer_plans()
        assert (str(plans["conv1"].forward), str(plans["conv2"].forward)) == expected
        assert {layer: LayerPlan.from_json(p.to_json()) for layer, p in plans.items()} == plans
