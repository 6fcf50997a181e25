"""The memory planner on a real training step: a budget met, the same results, or a clear no."""

import warnings

import pytest
import tensorflow as tf
from training_steps import (
    SLOW_LINK,
    assert_anchors_cannot_merge_into_a_cycle,
    assert_same_step,
    conv_training_step,
)

from tf_ucudnn.memory.search.greedy import BudgetError
from tf_ucudnn.memory.search.step_plan import apply_memory_plan, plan_step_memory


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
    assert_anchors_cannot_merge_into_a_cycle(planned)
    assert_same_step(step, planned, rtol=1e-5, atol=1e-6)


def test_an_impossible_budget_says_by_how_much():
    step = conv_training_step()
    with pytest.raises(BudgetError, match="cannot be met") as error:
        plan_step_memory(step, 1 << 10, SLOW_LINK)
    assert error.value.shortfall_bytes > 0
    assert error.value.prediction.peak_bytes - error.value.shortfall_bytes == 1 << 10


def test_a_measured_step_time_calibrates_the_estimates():
    step = conv_training_step()
    plain = plan_step_memory(step, 1 << 40, SLOW_LINK, step_ms=50.0)
    assert plain.decisions.prediction.step_ms == pytest.approx(50.0)
    first = step.graph.get_operations()[0].name
    pinned = plan_step_memory(step, 1 << 40, SLOW_LINK, measured_ms={first: 10.0}, step_ms=50.0)
    assert pinned.decisions.prediction.step_ms == pytest.approx(50.0)


def test_recomputation_chains_reach_back_to_kept_tensors():
    from training_steps import gradient_step

    from tf_ucudnn.memory.analysis.liveness import analyze
    from tf_ucudnn.memory.search.step_plan import _recompute_chains, op_times

    tf.keras.utils.set_random_seed(4)
    layers = tf.keras.layers
    model = tf.keras.Sequential([
        tf.keras.Input((8, 8, 3)),
        layers.Conv2D(4, 3, padding="same"), layers.BatchNormalization(), layers.ReLU(),
        layers.Conv2D(4, 3, padding="same"), layers.GlobalAveragePooling2D(), layers.Dense(2),
    ])
    step = gradient_step(model, 2)
    report = analyze(step)
    chains = _recompute_chains(step.graph, report, op_times(step.graph, SLOW_LINK, None, None))
    operations = step.graph.get_operations()
    relu = next(op for op in operations if op.type == "Relu" and "gradient" not in op.name)
    chain = chains[relu.outputs[0].name]
    # The ReLU's input (the normalization's output) was not kept: its ops run again too.
    assert chain.ops and relu.inputs[0].op.name in chain.ops and chain.cost_ms > 0
    assert all(operations.index(step.graph.get_operation_by_name(name)) < operations.index(relu)
               for name in chain.ops)
    # The chain starts from the convolution's output, kept for the backward pass anyway.
    conv = next(op for op in operations if op.type == "Conv2D" and "gradient" not in op.name)
    assert any(name.startswith(conv.name.rsplit("/", 1)[0]) for name in chain.reads)


def test_swaps_and_recomputations_wait_only_for_ops_after_the_forward_pass():
    from tf_ucudnn.memory.analysis.liveness import analyze
    from tf_ucudnn.memory.search.step_plan import _after_forward, op_times

    step = _fused_conv_batch_norm_step(blocks=3, size=16, channels=8)
    report = analyze(step)
    operations = step.graph.get_operations()
    after = _after_forward(operations, report, op_times(step.graph, SLOW_LINK, None, None))
    # The tape's zeros for the fused kernel's unused outputs come late in the graph's order but
    # are ready at once, as are the shapes it reads off forward tensors: neither can time a
    # swap-in or a recomputation.
    early = {op.name for op, use in zip(operations, report.ops)
             if use.backward and op.type in ("Fill", "ZerosLike", "ShapeN")}
    assert early and not early & after
    assert all(op.name in after for op in operations
               if op.type in ("Conv2DBackpropInput", "FusedBatchNormGradV3", "ReluGrad"))
    peak = plan_step_memory(step, 1 << 40, SLOW_LINK).decisions.prediction.peak_bytes
    plan = plan_step_memory(step, int(peak * 0.8), SLOW_LINK)
    anchors = [s.prefetch_after for s in plan.swaps] + [r.trigger for r in plan.recomputes
                                                         if r.trigger is not None]
    assert anchors and all(anchor in after for anchor in anchors)
    # A recomputation without a trigger of its own is made on the way of one with a trigger.
    chained = {name for r in plan.recomputes if r.trigger is not None for name in r.chain}
    assert all(r.producer in chained for r in plan.recomputes if r.trigger is None)


def test_a_recomputation_reads_the_copy_of_a_swapped_tensor_with_the_same_results():
    from tf_ucudnn.memory.cost.simulator import RecomputeDecision, SwapDecision, predict
    from tf_ucudnn.memory.passes.recompute import CLONE, Recompute
    from tf_ucudnn.memory.passes.swap import Swap
    from tf_ucudnn.memory.search.greedy import MemoryDecisions
    from tf_ucudnn.memory.search.step_plan import MemoryPlan

    step = conv_training_step()
    # A convolution's output, made again from its input, which is itself swapped.
    report, op_ms, by_name, made, chain = _a_recompute_chain(
        step, lambda producer, chain, ops: chain.direct_reads and "Conv2D" in {producer, *ops})
    operations = step.graph.get_operations()
    tensor, read = by_name[made], by_name[sorted(chain.direct_reads)[0]]
    trigger = _unmergeable(operations, tensor.backward_consumers[0] - 1, tensor.backward_consumers)
    prefetch = max(read.last_forward_use, trigger - 1)
    swap = SwapDecision(read.name, prefetch)
    recompute = RecomputeDecision(made, chain.cost_ms, (read.name,))
    decisions = MemoryDecisions((swap,), (recompute,), predict(
        op_ms, report.tensors, SLOW_LINK, [swap], report.persistent_bytes, [recompute]))

    def readers(kept):
        return tuple(operations[i].name for i in kept.backward_consumers
                     if any(t.name == kept.name for t in operations[i].inputs))
    plan = MemoryPlan(1 << 40, report, decisions,
                      [Swap(read.name, readers(read), operations[prefetch].name)],
                      [Recompute(made, readers(tensor), operations[trigger].name, chain.ops)])
    planned = apply_memory_plan(step, plan)
    assert_anchors_cannot_merge_into_a_cycle(planned)
    swap_in = f"{read.name.rsplit(':', 1)[0]}/ucudnn_swap_0/in"
    nodes = planned.get_concrete_function().graph.as_graph_def().node
    # (The planned function imports the graph under a scope of its own.)
    assert any(CLONE in node.name and any(name.endswith(swap_in) for name in node.input)
               for node in nodes), "the clone should read the copy swapped back in"
    assert_same_step(step, planned, rtol=1e-5, atol=1e-6)


def test_a_segment_recomputed_in_one_go_gives_the_same_results():
    step = _fused_conv_batch_norm_step(blocks=4, size=32, channels=16)
    peak = plan_step_memory(step, 1 << 40, SLOW_LINK).decisions.prediction.peak_bytes
    plan = plan_step_memory(step, int(peak * 0.6), SLOW_LINK)
    along = [d for d in plan.decisions.recomputes if d.made_with]
    assert along and plan.decisions.prediction.peak_bytes <= int(peak * 0.6)
    # What a recomputation makes on its way is in its chain, and is not made again.
    for decision in along:
        producer = decision.tensor.rsplit(":", 1)[0]
        owner = next(r for r in plan.recomputes if r.tensor == decision.made_with)
        assert producer in owner.chain
        assert all(r.chain == () and r.trigger is None
                   for r in plan.recomputes if r.tensor == decision.tensor)
    planned = apply_memory_plan(step, plan)
    assert_anchors_cannot_merge_into_a_cycle(planned)
    assert_same_step(step, planned, rtol=1e-5, atol=1e-6)


def test_a_step_with_xla_batch_norm_is_planned_with_the_same_results():
    step = _fused_conv_batch_norm_step(blocks=4, size=32, channels=16, kernel="xla")
    peak = plan_step_memory(step, 1 << 40, SLOW_LINK).decisions.prediction.peak_bytes
    plan = plan_step_memory(step, int(peak * 0.8), SLOW_LINK)
    assert plan.decisions.prediction.peak_bytes <= int(peak * 0.8)
    planned = apply_memory_plan(step, plan)
    assert_anchors_cannot_merge_into_a_cycle(planned)
    assert_same_step(step, planned, rtol=1e-5, atol=1e-6)


def test_an_xla_batch_norm_call_is_recomputed_with_the_same_results():
    from tf_ucudnn.memory.cost.simulator import RecomputeDecision, predict
    from tf_ucudnn.memory.passes.recompute import CLONE, Recompute
    from tf_ucudnn.memory.search.greedy import MemoryDecisions
    from tf_ucudnn.memory.search.step_plan import MemoryPlan

    step = _fused_conv_batch_norm_step(blocks=2, size=16, channels=8, kernel="xla")
    # The first block's ReLU output, made again through the normalization's XLA call.
    report, op_ms, by_name, made, chain = _a_recompute_chain(
        step, lambda producer, chain, ops: producer == "Relu")
    assert "PartitionedCall" in {step.graph.get_operation_by_name(op).type for op in chain.ops}
    operations = step.graph.get_operations()
    tensor = by_name[made]
    recompute = RecomputeDecision(made, chain.cost_ms)
    decisions = MemoryDecisions((), (recompute,), predict(
        op_ms, report.tensors, SLOW_LINK, (), report.persistent_bytes, [recompute]))
    readers = tuple(operations[i].name for i in tensor.backward_consumers)
    trigger = _unmergeable(operations, tensor.backward_consumers[0] - 1, tensor.backward_consumers)
    plan = MemoryPlan(1 << 40, report, decisions, [], [Recompute(
        made, readers, operations[trigger].name, chain.ops)])
    planned = apply_memory_plan(step, plan)
    assert_anchors_cannot_merge_into_a_cycle(planned)
    nodes = planned.get_concrete_function().graph.as_graph_def().node
    assert any(CLONE in node.name and node.op == "PartitionedCall" and
               node.attr["_XlaMustCompile"].b for node in nodes)
    assert_same_step(step, planned, rtol=1e-5, atol=1e-6)


def _unmergeable(operations, index: int, readers) -> int:
    """The op at `index`, or the last before it that shares no input with the ops `readers`
    (by index), so that no fusion merges the two (as the planner picks its anchors)."""
    shared = {t.name for i in readers for t in operations[i].inputs}
    while any(t.name in shared for t in operations[index].inputs):
        index -= 1
    return index


def _a_recompute_chain(step, wanted):
    """The step's liveness, op times and tensors by name, and the first kept tensor, with its
    recompute chain, for which `wanted(producer type, chain, chain's op types)` holds."""
    from tf_ucudnn.memory.analysis.liveness import analyze
    from tf_ucudnn.memory.search.step_plan import _recompute_chains, op_times

    report = analyze(step)
    operations = step.graph.get_operations()
    op_ms = op_times(step.graph, SLOW_LINK, None, None)
    by_name = {t.name: t for t in report.tensors}
    made, chain = next(
        (name, chain) for name, chain in _recompute_chains(step.graph, report, op_ms).items()
        if wanted(operations[by_name[name].producer].type, chain,
                  {step.graph.get_operation_by_name(op).type for op in chain.ops}))
    return report, op_ms, by_name, made, chain


def _fused_conv_batch_norm_step(blocks: int, size: int, channels: int, kernel: str = "cudnn"):
    """Convolution, fused batch normalization and ReLU blocks, batch 8, with gradients."""
    from training_steps import gradient_step

    from tf_ucudnn.keras.batch_norm_forms import fused_batch_norm

    tf.keras.utils.set_random_seed(5)
    layers = tf.keras.layers
    model = tf.keras.Sequential([tf.keras.Input((size, size, 3))] + [
        layer for _ in range(blocks) for layer in (layers.Conv2D(channels, 3, padding="same"),
                                                   layers.BatchNormalization(), layers.ReLU())] + [
        layers.GlobalAveragePooling2D(), layers.Dense(2)])
    with fused_batch_norm(model, kernel):
        return gradient_step(model, 8)


@pytest.mark.gpu
def test_on_a_gpu_the_settings_that_add_uncounted_copies_are_named(gpu_device, monkeypatch):
    step = conv_training_step()
    plan = plan_step_memory(step, 1 << 40, SLOW_LINK)
    monkeypatch.delenv("TF_DISABLE_RZ_CHECK", raising=False)
    monkeypatch.delenv("TF_CUDNN_USE_AUTOTUNE", raising=False)
    layout = tf.config.optimizer.get_experimental_options().get("layout_optimizer", True)
    try:
        tf.config.optimizer.set_experimental_options({"layout_optimizer": True})
        with pytest.warns(UserWarning) as caught:
            apply_memory_plan(step, plan)
        messages = " ".join(str(w.message) for w in caught)
        assert "layout optimizer is on" in messages and "TF_DISABLE_RZ_CHECK=1" in messages
        assert "TF_CUDNN_USE_AUTOTUNE=0" in messages
        tf.config.optimizer.set_experimental_options({"layout_optimizer": False})
        monkeypatch.setenv("TF_DISABLE_RZ_CHECK", "1")
        monkeypatch.setenv("TF_CUDNN_USE_AUTOTUNE", "0")
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            apply_memory_plan(step, plan)
    finally:
        tf.config.optimizer.set_experimental_options({"layout_optimizer": layout})
