"""The recomputation pass: activations made again for the backward pass give the same step."""

import numpy as np
import pytest
import tensorflow as tf
from training_steps import assert_same_step, gradient_step

from tf_ucudnn.memory.passes.recompute import (
    Recompute,
    RecomputeError,
    insert_recomputes,
    recompute_function,
)


def _training_step():
    tf.keras.utils.set_random_seed(5)
    layers = tf.keras.layers
    model = tf.keras.Sequential([
        tf.keras.Input((10, 10, 3)),
        layers.Conv2D(6, 3, padding="same"), layers.BatchNormalization(), layers.ReLU(),
        layers.Conv2D(6, 3, padding="same"), layers.ReLU(),
        layers.GlobalAveragePooling2D(), layers.Dense(4),
    ])
    return gradient_step(model, 4)


def _relu_recomputes(graph):
    ops = graph.get_operations()
    last_forward = ops[next(i for i, op in enumerate(ops) if "gradient" in op.name) - 1].name
    recomputes = []
    for op in ops:
        if op.type == "Relu" and "gradient" not in op.name:
            backward = [c.name for c in op.outputs[0].consumers() if "gradient" in c.name]
            recomputes.append(Recompute(op.outputs[0].name, backward, last_forward))
    return recomputes


def test_recomputed_step_gives_the_same_loss_and_gradients():
    step = _training_step()
    recomputes = _relu_recomputes(step.graph)
    assert len(recomputes) == 2 and all(r.backward_consumers for r in recomputes)
    recomputed = recompute_function(step, recomputes)
    assert_same_step(step, recomputed, rtol=1e-5, atol=1e-7)


def test_behind_barriers_the_step_compiled_by_xla_gives_the_same_loss_and_gradients():
    step = _training_step()
    recomputes = _relu_recomputes(step.graph)
    graph_def = insert_recomputes(step.graph.as_graph_def(), recomputes, step.graph,
                                  barriers=True)
    nodes = {node.name: node for node in graph_def.node}
    for recompute in recomputes:
        clone = nodes[f"{recompute.producer}/ucudnn_recompute"]
        barrier = nodes[clone.input[0].partition(":")[0]]
        # The clone reads its input through the barrier, which also takes the trigger's output,
        # and no control edge is left for XLA to drop.
        assert barrier.op == "XlaOptimizationBarrier" and not any(
            text.startswith("^") for text in clone.input)
        assert list(barrier.input) == [*nodes[recompute.producer].input, recompute.trigger]
    assert_same_step(step, recompute_function(step, recomputes, jit_compile=True),
                     rtol=1e-5, atol=1e-6)


def test_clones_read_the_same_inputs_and_feed_the_backward_consumers():
    step = _training_step()
    recomputes = _relu_recomputes(step.graph)
    graph_def = insert_recomputes(step.graph.as_graph_def(), recomputes, step.graph)
    nodes = {node.name: node for node in graph_def.node}
    for recompute in recomputes:
        original, clone = nodes[recompute.producer], nodes[f"{recompute.producer}/ucudnn_recompute"]
        assert clone.op == "Relu" and list(clone.input[:-1]) == list(original.input)
        assert clone.input[-1] == f"^{recompute.trigger}"
        assert clone.attr["_grappler_do_not_remove"].b
        for consumer in recompute.backward_consumers:
            assert clone.name in nodes[consumer].input
            assert recompute.producer not in nodes[consumer].input


def test_what_cannot_be_recomputed_is_refused_with_the_reason():
    step = _training_step()
    (relu, _) = _relu_recomputes(step.graph)
    graph_def = step.graph.as_graph_def()
    placeholder = next(op for op in step.graph.get_operations() if op.type == "Placeholder")
    with pytest.raises(RecomputeError, match="Placeholder is cheaper to keep"):
        insert_recomputes(graph_def, [Recompute(placeholder.outputs[0].name, ["x"])], step.graph)
    with pytest.raises(RecomputeError, match="does not read it"):
        insert_recomputes(graph_def, [Recompute(relu.tensor, [relu.trigger])], step.graph)
    with pytest.raises(RecomputeError, match="trigger names no node"):
        insert_recomputes(graph_def, [Recompute(relu.tensor, relu.backward_consumers, "later")],
                          step.graph)

    @tf.function
    def noisy(x):
        return tf.random.uniform([3]) * x

    graph = noisy.get_concrete_function(tf.TensorSpec([3])).graph
    random = next(op for op in graph.get_operations() if op.type == "RandomUniform")
    consumer = random.outputs[0].consumers()[0].name
    with pytest.raises(RecomputeError, match="stateful"):
        insert_recomputes(graph.as_graph_def(), [Recompute(random.outputs[0].name, [consumer])],
                          graph)


def test_a_chain_is_recomputed_from_the_kept_tensor_before_it():
    step = _training_step()
    ops = step.graph.get_operations()
    last_forward = ops[next(i for i, op in enumerate(ops) if "gradient" in op.name) - 1].name
    # The first ReLU's output, made again from its input: the batch normalization's output,
    # itself made again from the ops that compute it out of kept tensors.
    relu = next(op for op in ops if op.type == "Relu" and "gradient" not in op.name)
    bn_output = relu.inputs[0].op
    backward = [c.name for c in relu.outputs[0].consumers() if "gradient" in c.name]
    recompute = Recompute(relu.outputs[0].name, backward, last_forward, chain=[bn_output.name])
    graph_def = insert_recomputes(step.graph.as_graph_def(), [recompute], step.graph)
    nodes = {node.name: node for node in graph_def.node}
    relu_clone = nodes[f"{relu.name}/ucudnn_recompute"]
    bn_clone = nodes[f"{bn_output.name}/ucudnn_recompute"]
    assert relu_clone.input[0] == bn_clone.name  # the clone reads the clone
    assert f"^{last_forward}" in bn_clone.input and f"^{last_forward}" not in relu_clone.input
    assert_same_step(step, recompute_function(step, [recompute]), rtol=1e-5, atol=1e-7)


def test_recomputations_whose_chains_meet_clone_their_own_and_make_no_cycle():
    graph = tf.Graph()
    with graph.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [4], name="x")
        r = tf.nn.relu(x - 0.5, name="r")
        t1, t2 = tf.multiply(r, 2.0, name="t1"), tf.multiply(r, 3.0, name="t2")
        tf.add(tf.sin(t1, name="e1"), t2, name="e2")
    # t2 is needed last, so its chain waits for e1; t1's must not wait with it (e1 reads t1).
    recomputes = [Recompute("t2:0", ("e2",), trigger="e1", chain=("r",)),
                  Recompute("t1:0", ("e1",), chain=("r",))]
    graph_def = insert_recomputes(graph.as_graph_def(), recomputes, graph)
    nodes = {node.name: node for node in graph_def.node}
    # e1 reads sin(t1 clone); e2 reads the t2 clone second: each clone reads its own relu clone.
    relu_clones = {nodes[nodes[nodes["e1"].input[0]].name].input[0],
                   nodes[nodes["e2"].input[1]].input[0]}
    assert len(relu_clones) == 2 and all(name.startswith("r/ucudnn_recompute")
                                         for name in relu_clones)
    _assert_e2_is_sin_2r_plus_3r(graph_def)


def test_a_tensor_made_on_an_earlier_chain_is_not_made_again():
    graph = tf.Graph()
    with graph.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [4], name="x")
        a = tf.nn.relu(x - 0.5, name="a")
        b = tf.multiply(a, 2.0, name="b")
        e1 = tf.sin(b, name="e1")
        tf.add(e1, tf.multiply(a, 3.0, name="a3"), name="e2")
    # b is needed first: its chain makes a again, and a's readers (needed later) read that
    # clone; a chain after them reads it too instead of the original.
    recomputes = [Recompute("b:0", ("e1",), trigger="x", chain=("a",)),
                  Recompute("a:0", ("a3",)),
                  Recompute("a3:0", ("e2",), trigger="e1")]
    graph_def = insert_recomputes(graph.as_graph_def(), recomputes, graph)
    nodes = {node.name: node for node in graph_def.node}
    assert [name for name in nodes if name.startswith("a/")] == ["a/ucudnn_recompute"]
    assert nodes["b/ucudnn_recompute"].input[0] == "a/ucudnn_recompute"
    assert nodes["a3"].input[0] == "a/ucudnn_recompute"
    assert nodes["a3/ucudnn_recompute"].input[0] == "a/ucudnn_recompute"
    assert "^e1" in nodes["a3/ucudnn_recompute"].input  # read a clone made earlier: still waits
    _assert_e2_is_sin_2r_plus_3r(graph_def)


def _assert_e2_is_sin_2r_plus_3r(graph_def):
    """e2 = sin(2 r) + 3 r with r = relu(x - 0.5), run from the GraphDef in a Session."""
    with tf.Graph().as_default():
        e2, = tf.graph_util.import_graph_def(graph_def, return_elements=["e2:0"])
        with tf.compat.v1.Session() as session:
            values = np.array([-1.0, 0.25, 1.0, 2.0], np.float32)
            got = session.run(e2, {"import/x:0": values})
    r = np.maximum(values - 0.5, 0)
    np.testing.assert_allclose(got, np.sin(2 * r) + 3 * r, rtol=1e-6)
