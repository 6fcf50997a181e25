"""Passes with a contract: the manager checks each pass's requirements before any pass runs and
its guarantees right after it, and each guarantee's check catches what breaks it."""

import types

import pytest
import tensorflow as tf
from tensorflow.core.framework import graph_pb2
from training_steps import conv_training_step

from tf_ucudnn.core.plan import FORWARD
from tf_ucudnn.memory.passes.recompute import Recompute
from tf_ucudnn.memory.passes.swap import Swap
from tf_ucudnn.options import Options
from tf_ucudnn.parallel.spatial_split import SplitLayer
from tf_ucudnn.passes import (
    CONVOLUTION_REWRITE,
    EVERY_CONVOLUTION_REPORTED,
    FUNCTION_GRAPH,
    MEMORY_PLAN_IN_GRAPH,
    MEMORY_PLANNING,
    MEMORY_WITHIN_BUDGET,
    SPATIAL_SPLIT,
    UNSPLIT_ONLY_WITH_REASON,
    GraphPass,
    PassContext,
    PassContractError,
    PassManager,
    PassOutcome,
    Property,
)
from tf_ucudnn.report import LeftAlone, RewriteReport

HOLDS = Property("it holds", lambda outcome: [])
BROKEN = Property("the graph is empty", lambda outcome: [f"{len(outcome.after.node)} node(s)"])


def _noted(name, ran, **contract):
    """A pass that notes it ran and changes nothing."""
    def run(graph_def, report, context):
        ran.append(name)
        return graph_def, report
    return GraphPass(name, run, **contract)


def _graph_def(*nodes):
    """A GraphDef of (name, op, inputs) nodes."""
    graph_def = graph_pb2.GraphDef()
    for name, op, inputs in nodes:
        graph_def.node.add(name=name, op=op, input=inputs)
    return graph_def


def _outcome(after, report, before=None, **options):
    return PassOutcome(before or after, after, report, PassContext(Options(**options)))


def test_passes_run_in_their_order_each_requirement_met_by_one_before():
    ran = []
    manager = PassManager([_noted("first", ran, guarantees=(HOLDS,)),
                           _noted("second", ran, requires=(HOLDS,)),
                           _noted("third", ran, requires=(HOLDS, FUNCTION_GRAPH))])
    graph_def = _graph_def(("x", "Placeholder", []))
    after, _ = manager.run(graph_def, RewriteReport(), PassContext(Options()),
                           given=[FUNCTION_GRAPH])
    assert ran == ["first", "second", "third"] and after is graph_def


def test_a_requirement_no_earlier_pass_guarantees_is_an_error_before_any_pass_runs():
    ran = []
    later = PassManager([_noted("user", ran, requires=(HOLDS,)),
                         _noted("maker", ran, guarantees=(HOLDS,))])
    with pytest.raises(PassContractError, match=r"the user pass requires that it holds, which "
                                                r"neither the input gives nor a pass before it "
                                                r"\(none\) guarantees"):
        later.run(graph_pb2.GraphDef(), RewriteReport(), PassContext(Options()))
    assert ran == []
    with pytest.raises(PassContractError, match="the memory planning pass requires that the "
                                                "graph is a ConcreteFunction's"):
        PassManager([CONVOLUTION_REWRITE, MEMORY_PLANNING]).check_order()


def test_a_broken_guarantee_is_an_error_naming_the_pass_and_the_guarantee():
    ran = []
    manager = PassManager([_noted("filler", ran, guarantees=(HOLDS, BROKEN)),
                           _noted("after it", ran)])
    with pytest.raises(PassContractError, match="the filler pass broke its guarantee that the "
                                                "graph is empty: 1 node"):
        manager.run(_graph_def(("x", "Placeholder", [])), RewriteReport(),
                    PassContext(Options()))
    assert ran == ["filler"]


def test_a_guarantee_without_a_check_is_refused():
    with pytest.raises(PassContractError, match="the maker pass guarantees that the graph is a "
                                                "ConcreteFunction's, .*with no check to run"):
        PassManager([_noted("maker", [], guarantees=(FUNCTION_GRAPH,))])


def test_the_graph_for_shapes_is_dropped_once_a_pass_hands_on_another_graph_def():
    graph = tf.Graph()
    context = PassContext(Options(), graph=graph)
    PassManager([_noted("same", [])]).run(graph_pb2.GraphDef(), RewriteReport(), context)
    assert context.graph is graph
    other = GraphPass("other", lambda graph_def, report, context: (graph_pb2.GraphDef(), report))
    PassManager([other]).run(graph_pb2.GraphDef(), RewriteReport(), context)
    assert context.graph is None


def test_a_convolution_pass_that_forgets_a_node_breaks_its_guarantee():
    step = conv_training_step()
    forgetful = GraphPass(CONVOLUTION_REWRITE.name, lambda graph_def, report, context:
                          (graph_def, report), guarantees=CONVOLUTION_REWRITE.guarantees)
    with pytest.raises(PassContractError, match=r"the convolution rewrite pass broke its "
                                                r"guarantee that every convolution is rewritten, "
                                                r"split or reported left alone with why: "
                                                r".*\(Conv2D\).* and \d+ more"):
        PassManager([forgetful]).run(step.graph.as_graph_def(), RewriteReport(),
                                     PassContext(Options(), graph=step.graph))


def test_every_convolution_reported_counts_rewritten_split_and_left_alone_nodes():
    graph_def = _graph_def(("x", "Placeholder", []), ("w", "Placeholder", []),
                           ("conv", "Conv2D", ["x", "w"]),
                           ("old", "Conv3DBackpropInput", ["x", "w", "conv"]))
    check = EVERY_CONVOLUTION_REPORTED.check
    assert check(_outcome(graph_def, RewriteReport())) == [
        "conv (Conv2D)", "old (Conv3DBackpropInput)"]
    report = RewriteReport(left_alone=[LeftAlone("old", "", "V1")],
                           spatial=[SplitLayer("conv", {FORWARD: "conv"}, ("/CPU:0",), (4,))])
    assert check(_outcome(graph_def, report)) == []


def test_unsplit_only_with_reason_catches_a_silent_or_a_false_split():
    kept = _graph_def(("x", "Placeholder", []), ("w", "Placeholder", []),
                      ("conv", "Conv2D", ["x", "w"]))
    check = UNSPLIT_ONLY_WITH_REASON.check
    assert check(_outcome(kept, RewriteReport())) == [
        "conv (Conv2D) not split, with no reason reported"]
    explained = RewriteReport(left_alone=[LeftAlone("conv", "", "not split: thin slabs")])
    assert check(_outcome(kept, explained)) == []
    false_split = RewriteReport(
        left_alone=explained.left_alone,
        spatial=[SplitLayer("conv", {FORWARD: "conv"}, ("/CPU:0", "/CPU:1"), (2, 2))])
    assert check(_outcome(kept, false_split)) == ["conv reported split but no PartitionedCall"]


def test_memory_within_budget_catches_a_plan_over_it():
    check = MEMORY_WITHIN_BUDGET.check
    over = RewriteReport(memory=types.SimpleNamespace(predicted_peak_bytes=3 << 20))
    assert check(_outcome(graph_pb2.GraphDef(), over, memory_budget="2MiB")) == [
        "a predicted peak of 3 MiB for a budget of 2 MiB"]
    assert check(_outcome(graph_pb2.GraphDef(), over, memory_budget="3MiB")) == []
    assert check(_outcome(graph_pb2.GraphDef(), RewriteReport(), memory_budget="3MiB")) == [
        "the report holds no memory plan"]


def test_memory_plan_in_graph_catches_a_swap_or_recomputation_not_made():
    plan = types.SimpleNamespace(swaps=[Swap("relu:0", ("grad",))],
                                 recomputes=[Recompute("pool:0", ("pool_grad",))])
    unplanned = _graph_def(("relu", "Relu", []), ("pool", "MaxPool", ["relu"]),
                           ("grad", "ReluGrad", ["relu"]), ("pool_grad", "MaxPoolGrad", ["pool"]))
    check = MEMORY_PLAN_IN_GRAPH.check
    assert check(_outcome(unplanned, RewriteReport(memory=plan))) == [
        "relu:0 swapped, yet grad is missing or reads it still",
        "pool:0 recomputed, yet pool_grad is missing or reads it still"]
    planned = _graph_def(("relu", "Relu", []), ("pool", "MaxPool", ["relu"]),
                         ("relu/ucudnn_swap_0/in", "Identity", ["relu"]),
                         ("grad", "ReluGrad", ["relu/ucudnn_swap_0/in"]),
                         ("pool/ucudnn_recompute", "MaxPool", ["relu"]),
                         ("pool_grad", "MaxPoolGrad", ["pool/ucudnn_recompute"]))
    assert check(_outcome(planned, RewriteReport(memory=plan))) == []


def test_the_split_reports_the_convolutions_it_does_not_split():
    """A depthwise convolution is no layer the split serves: reported left alone with why, so
    that the split keeps its guarantee."""
    @tf.function
    def forward(x, w, d):
        return tf.nn.depthwise_conv2d(tf.nn.conv2d(x, w, 1, "SAME"), d, [1, 1, 1, 1], "SAME")

    function = forward.get_concrete_function(tf.TensorSpec([1, 8, 8, 2]),
                                             tf.TensorSpec([3, 3, 2, 2]),
                                             tf.TensorSpec([3, 3, 2, 1]))
    context = PassContext(Options(workspace_limit=None), spatial_devices=("/CPU:0", "/CPU:1"),
                          graph=function.graph)
    split, report = PassManager([SPATIAL_SPLIT]).run(function.graph.as_graph_def(),
                                                     RewriteReport(), context)
    assert [item.layer for item in report.spatial] == ["Conv2D"]
    (depthwise,) = report.left_alone
    assert depthwise.reason == ("not split: a depthwise convolution; the spatial split takes "
                                "Conv2D and Conv3D")
    assert {node.op for node in split.node} >= {"PartitionedCall", "DepthwiseConv2dNative"}
