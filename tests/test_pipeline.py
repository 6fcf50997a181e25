"""The pipeline: one planner for every entry point, and the passes in one order."""

import pytest
from training_steps import SLOW_LINK, assert_same_step, conv_training_step

from tf_ucudnn.core.plan import KernelPlan, LayerPlan
from tf_ucudnn.options import Options
from tf_ucudnn.passes import CONVOLUTION_REWRITE, MEMORY_PLANNING, SPATIAL_SPLIT
from tf_ucudnn.pipeline import choose_passes, conv_planner, plan_graph
from tf_ucudnn.profiling.database import ProfileDatabaseError


def _halves(layer):
    batch = layer.batch_size
    halves = KernelPlan.of((batch // 2, 0), (batch - batch // 2, 1))
    return LayerPlan(halves, halves, halves)


def test_a_given_planner_is_used_as_it_is():
    with conv_planner(Options(), _halves) as planner:
        assert planner is _halves


def test_without_a_workspace_limit_there_is_no_planner():
    with conv_planner(Options(workspace_limit=None)) as planner:
        assert planner is None


def test_without_measurements_each_layer_is_left_alone_with_why(tmp_path):
    with conv_planner(Options(database=str(tmp_path / "empty.sqlite"))) as planner:
        reason = planner(object())
    assert reason.startswith("no planner: cannot tell which machine's measurements")


def test_a_damaged_database_is_an_error_that_names_it(tmp_path):
    damaged = tmp_path / "damaged.sqlite"
    damaged.write_bytes(b"not a database" * 100)
    with pytest.raises(ProfileDatabaseError, match="damaged.sqlite"):
        with conv_planner(Options(database=str(damaged))):
            pass


def test_convolutions_then_memory_in_one_call_give_the_same_step():
    step = conv_training_step()
    planned, report = plan_graph(step, Options(memory_budget=1 << 40), _halves,
                                 device_model=SLOW_LINK)
    assert report.layers and not report.left_alone and report.memory is not None
    assert not report.memory.swaps and not report.memory.recomputes
    assert_same_step(step, planned)


def test_where_nothing_is_planned_the_step_goes_on_as_given(tmp_path):
    step = conv_training_step()
    rewritten, report = plan_graph(step, Options(database=str(tmp_path / "empty.sqlite")))
    assert rewritten is step and not report.layers and report.left_alone


def test_the_passes_are_chosen_once_from_the_options_in_one_order():
    budget = "1GiB"
    assert choose_passes(Options(), None, None) == [CONVOLUTION_REWRITE]
    assert choose_passes(Options(workspace_limit=None), None, None) == []
    assert choose_passes(Options(workspace_limit=None), _halves, None) == [CONVOLUTION_REWRITE]
    assert choose_passes(Options(memory_budget=budget), _halves, None) == [
        CONVOLUTION_REWRITE, MEMORY_PLANNING]
    assert choose_passes(Options(workspace_limit=None, memory_budget=budget), None, None) == [
        MEMORY_PLANNING]
    assert choose_passes(Options(memory_budget=budget), None, ["/CPU:0", "/CPU:1"]) == [
        SPATIAL_SPLIT, MEMORY_PLANNING]
