"""Planned kernels' workspaces chosen with the step's memory: the kernel at the peak gives up
workspace while that fits the budget, or fits it at a shorter predicted step."""

import pytest
from training_steps import SLOW_LINK, WorkspaceFrontPlanner, assert_same_step, conv_training_step

from tf_ucudnn.conv_planning.kernel_dp import KernelConfiguration
from tf_ucudnn.core.plan import WORKSPACE_ATTR, Algorithm, KernelPlan, MicroBatch
from tf_ucudnn.memory.cost.simulator import Prediction
from tf_ucudnn.memory.search.greedy import BudgetError
from tf_ucudnn.memory.search.workspace_choice import StepOutcome, choose_workspaces
from tf_ucudnn.options import Options
from tf_ucudnn.pipeline import plan_graph


def configuration(workspace, time_ms, algorithm=0):
    return KernelConfiguration(KernelPlan((MicroBatch(8, Algorithm(algorithm), workspace),)),
                               time_ms, workspace)


def modelled_step(budget, held=5, swap_ms_per_byte=0.0):
    """A step whose peak is `held` bytes plus the largest chosen workspace, at that kernel;
    over `budget` it misses, else its predicted step is 10 ms plus `swap_ms_per_byte` for each
    byte over 8 (as swaps would cost). Notes every choice it is asked about."""
    asked = []

    def plan_for(choice):
        asked.append({node: c.workspace_bytes for node, c in choice.items()})
        node = max(sorted(choice), key=lambda n: choice[n].workspace_bytes)
        peak = held + choice[node].workspace_bytes
        if peak > budget:
            miss = Prediction(step_ms=10.0, compute_ms=10.0, peak_bytes=peak, peak_op=0,
                              transfer_ms=0.0)
            return StepOutcome(None, None, node, BudgetError(budget, miss))
        return StepOutcome("planned", 10.0 + swap_ms_per_byte * max(peak - 8, 0), node)
    return plan_for, asked


FRONTS = {"a": [configuration(0, 3.0), configuration(10, 1.0, 1)],
          "b": [configuration(0, 2.5), configuration(6, 1.0, 1)]}


def test_kernels_keep_their_fastest_plans_where_the_budget_allows():
    plan_for, asked = modelled_step(budget=100)
    outcome, workspaces = choose_workspaces(FRONTS, plan_for)
    assert outcome.result == "planned" and workspaces.lowered == []
    # Lowering the kernel at the peak was tried, and cost more than it saved.
    assert asked == [{"a": 10, "b": 6}, {"a": 0, "b": 6}]
    assert workspaces.tried == ["a: 10 B -> 0 B: not kept (predicted step 10.000 ms, with the "
                                "slower kernels 12.000 ms)"]


def test_the_kernel_at_the_peak_gives_up_workspace_until_the_step_fits():
    plan_for, asked = modelled_step(budget=8)
    outcome, workspaces = choose_workspaces(FRONTS, plan_for)
    assert [(k.node, k.chosen.workspace_bytes) for k in workspaces.lowered] == [("a", 0),
                                                                                 ("b", 0)]
    assert workspaces.extra_ms == pytest.approx(2.0 + 1.5)
    assert asked[-1] == {"a": 0, "b": 0} and outcome.result == "planned"
    assert workspaces.tried[0].startswith("a: 10 B -> 0 B: kept (the budget is missed by")


def test_workspace_is_given_up_where_it_saves_more_step_time_than_it_costs():
    # Each byte held over 8 costs 0.6 ms (as swaps would). Lowering a takes the peak from 15 to
    # 11 bytes (2.4 ms saved) for 2 ms more; lowering b then from 11 to 5 (1.8 ms) for 3 ms more.
    fronts = {"a": FRONTS["a"], "b": [configuration(0, 4.0), configuration(6, 1.0, 1)]}
    plan_for, _ = modelled_step(budget=100, swap_ms_per_byte=0.6)
    outcome, workspaces = choose_workspaces(fronts, plan_for)
    assert [k.node for k in workspaces.lowered] == ["a"]
    assert outcome.step_ms == pytest.approx(10.0 + 0.6 * 3)
    assert workspaces.tried == [
        "a: 10 B -> 0 B: kept (predicted step 11.800 ms, with the slower kernels 13.800 ms)",
        "b: 6 B -> 0 B: not kept (predicted step 10.000 ms, with the slower kernels 15.000 ms)"]


def test_no_choice_that_fits_raises_the_budget_error():
    plan_for, _ = modelled_step(budget=4)
    with pytest.raises(BudgetError, match="cannot be met"):
        choose_workspaces(FRONTS, plan_for)


def test_rewrite_under_a_budget_lowers_the_workspaces_that_keep_the_step_from_fitting():
    step = conv_training_step()
    _, roomy = plan_graph(step, Options(memory_budget=1 << 40), WorkspaceFrontPlanner(),
                          device_model=SLOW_LINK)
    assert roomy.memory_workspaces.lowered == []
    assert roomy.memory.liveness.peak_bytes > WorkspaceFrontPlanner.BIG  # a workspace is the peak

    planned, report = plan_graph(step, Options(memory_budget=32 << 20), WorkspaceFrontPlanner(),
                                 device_model=SLOW_LINK)
    # Every kernel holds 64 MiB while it runs: each must give it up, and then nothing else.
    lowered = report.memory_workspaces.lowered
    assert len(lowered) == 4 * 3 and all(k.chosen.workspace_bytes == 0 for k in lowered)
    assert not report.memory.swaps and not report.memory.recomputes
    assert report.memory.decisions.prediction.peak_bytes <= 32 << 20
    ops = [op for op in planned.get_concrete_function().graph.get_operations()
           if op.type.startswith("Ucudnn")]
    assert len(ops) == 12 and all(op.get_attr(WORKSPACE_ATTR) == 0 and
                                  list(op.get_attr("micro_batches")) == [4, 4] for op in ops)
    assert "12 kernel(s) given less workspace for the budget" in report.to_text()
    assert_same_step(step, planned)
