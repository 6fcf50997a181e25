"""tf_ucudnn.rewrite: convolution plans and the memory plan, put together on a training step."""

import pytest
import tensorflow as tf
from training_steps import SLOW_LINK, assert_same_step, conv_training_step

import tf_ucudnn
from tf_ucudnn.core.plan import KernelPlan, LayerPlan
from tf_ucudnn.memory import BudgetError
from tf_ucudnn.options import Options, OptionsError

# Compared with the original at float32 precision, on the GPU too.
pytestmark = pytest.mark.usefixtures("no_tf32")


def _split(layer):
    batch = layer.batch_size
    halves = KernelPlan.of((batch // 2, 0), (batch - batch // 2, 1))
    return LayerPlan(halves, halves, halves)


def test_convolutions_and_memory_planned_together_give_the_same_step():
    step = conv_training_step()
    _, unplanned = tf_ucudnn.rewrite(step, _split, memory_budget=1 << 40,
                                     device_model=SLOW_LINK)
    peak = unplanned.memory.decisions.prediction.peak_bytes
    rewritten, report = tf_ucudnn.rewrite(step, _split, memory_budget=int(peak * 0.85),
                                          device_model=SLOW_LINK)
    assert len(report.layers) == 4
    assert report.memory.swaps or report.memory.recomputes
    assert report.memory.decisions.prediction.peak_bytes <= peak * 0.85
    assert "memory plan for a" in report.to_text() and report.to_json()["memory"]
    assert_same_step(step, rewritten, rtol=1e-4, atol=1e-6)


def test_an_impossible_memory_budget_raises_before_anything_runs():
    with pytest.raises(BudgetError, match="cannot be met"):
        tf_ucudnn.rewrite(conv_training_step(), memory_budget="1KiB", device_model=SLOW_LINK)


def test_bad_requests_are_refused():
    step = conv_training_step()
    with pytest.raises(OptionsError, match="nothing to plan"):
        tf_ucudnn.rewrite(step, workspace_limit=None)
    with pytest.raises(TypeError, match="memory_budget plans a training step"):
        tf_ucudnn.rewrite(step.graph.as_graph_def(), memory_budget="1GiB", device_model=SLOW_LINK)
    with pytest.raises(OptionsError, match="for the default planner"):
        tf_ucudnn.rewrite(step, _split, workspace_budget="64MiB")
    with pytest.raises(OptionsError, match="workspace_limit: cannot read '64 parsecs'"):
        tf_ucudnn.rewrite(step, workspace_limit="64 parsecs")


def test_without_measurements_every_convolution_is_reported_left_alone_with_why():
    """The default 64 MiB limit needs profiles; with none (no GPU, nothing imported) the step is
    returned as it is and the report names each convolution node and the reason."""
    step = conv_training_step()
    rewritten, report = tf_ucudnn.rewrite(step)
    assert not report.layers and report.left_alone
    assert all("no planner: cannot tell which machine's measurements" in item.reason
               for item in report.left_alone)
    assert rewritten is step


def test_the_memory_plan_counts_the_workspace_the_convolutions_plans_need():
    from tf_ucudnn.core.plan import Algorithm, MicroBatch

    def halves_in_one_mib(layer):
        batch = layer.batch_size
        plan = KernelPlan((MicroBatch(batch // 2, Algorithm(0), 1 << 20),
                           MicroBatch(batch - batch // 2, Algorithm(1), 1 << 19)))
        return LayerPlan(plan, plan, plan)

    _, report = tf_ucudnn.rewrite(conv_training_step(), halves_in_one_mib,
                                  memory_budget=1 << 40, device_model=SLOW_LINK)
    liveness = report.memory.liveness
    kernels = [op.name for op in liveness.ops if op.type.startswith("Ucudnn")]
    scratch = {t.name.removesuffix(":scratch"): t.bytes
               for t in liveness.tensors if t.name.endswith(":scratch")}
    # Each kernel holds the larger of its micro-batches' workspaces while it runs.
    assert len(kernels) == 12 and scratch == {name: 1 << 20 for name in kernels}


def test_a_rewritten_training_step_compiles_with_xla():
    """The rewritten step, compiled by XLA (tf_ucudnn's ops in its computation), gives the
    original step's loss and gradients."""
    step = conv_training_step()
    compiled, report = tf_ucudnn.rewrite(step, _split, jit_compile=True)
    assert len(report.layers) == 4
    assert_same_step(step, compiled, rtol=1e-4, atol=1e-6)
    x_spec, y_spec = [t for t in step.inputs if t.dtype != tf.resource][:2]
    hlo = compiled.experimental_get_compiler_ir(tf.zeros(x_spec.shape),
                                                tf.zeros(y_spec.shape, tf.int32))(stage="hlo")
    assert "UcudnnConv2D" in hlo and "UcudnnConv2DBackpropFilter" in hlo
    with pytest.raises(TypeError, match="jit_compile compiles a function"):
        tf_ucudnn.rewrite(step.graph.as_graph_def(), _split, jit_compile=True)


def test_options_and_keyword_settings_fold_into_one_options():
    """A keyword setting overrides the same setting of `options`."""
    step = conv_training_step()
    _, report = tf_ucudnn.rewrite(step, _split, options=Options(memory_budget="1KiB"),
                                  memory_budget=1 << 40, device_model=SLOW_LINK)
    assert len(report.layers) == 4 and report.memory.budget_bytes == 1 << 40


def test_settings_only_the_default_planner_reads_are_refused_beside_a_planner():
    step = conv_training_step()
    with pytest.raises(OptionsError, match="database, profiles and planner=: those settings"):
        tf_ucudnn.rewrite(step, _split, database="mine.sqlite", profiles=["mine.jsonl"])
    with pytest.raises(OptionsError, match="device and planner="):
        tf_ucudnn.rewrite(step, _split, options=Options(device="H100"))
    with pytest.raises(OptionsError, match="trial_steps: not a setting of Options"):
        tf_ucudnn.rewrite(step, trial_steps=3)
