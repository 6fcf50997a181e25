"""The memory planner on a real training step: a budget met, the same results, or a clear no."""

import pytest

from tf_ucudnn.memory.performance_model import BudgetError
from tf_ucudnn.memory.planner import apply_memory_plan, plan_step_memory
from training_steps import SLOW_LINK, assert_same_step, conv_training_step


def test_a_budget_below_the_peak_is_met_with_the_same_results():
    step = conv_training_step()
    unplanned = plan_step_memory(step, 1 << 40, SLOW_LINK)
    peak = unplanned.decisions.prediction.peak_bytes
    assert not unplanned.swaps and not unplanned.recomputes
    budget = int(peak * 0.85)
    plan = plan_step_memory(step, budget, SLOW_LINK)
    assert plan.decisions.prediction.peak_bytes <= budget
    assert plan.swaps or plan.recomputes
    # The step's own input is the caller's: swapping it would free nothing.
    assert all(not swap.tensor.startswith("x:") for swap in plan.swaps)
    assert "memory plan for a" in plan.to_text()
    planned = apply_memory_plan(step, plan)
    assert_same_step(step, planned, rtol=1e-5, atol=1e-6)


def test_an_impossible_budget_says_by_how_much():
    step = conv_training_step()
    with pytest.raises(BudgetError, match="cannot be met") as error:
        plan_step_memory(step, 1 << 10, SLOW_LINK)
    assert error.value.shortfall_bytes > 0
    assert error.value.prediction.peak_bytes - error.value.shortfall_bytes == 1 << 10
