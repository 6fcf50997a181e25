"""The swap pass: kept activations copied to the host and back give the same training step."""

import pytest
import tensorflow as tf
from training_steps import assert_same_step, gradient_step

from tf_ucudnn.memory.passes.swap import HOST, Swap, SwapError, insert_swaps, swap_function
from tf_ucudnn.memory.search.step_plan import held_back, latest_inputs


def _model():
    tf.keras.utils.set_random_seed(3)
    layers = tf.keras.layers
    return tf.keras.Sequential([
        tf.keras.Input((10, 10, 3)),
        layers.Conv2D(6, 3, padding="same", activation="relu"),
        layers.Conv2D(6, 3, padding="same", activation="relu"),
        layers.GlobalAveragePooling2D(),
        layers.Dense(4),
    ])


def _conv_input_swaps(graph, prefetch=False):
    """Each Conv2D's input, swapped in for the gradient ops that read it."""
    swaps = []
    ops = graph.get_operations()
    last_forward = next(i for i, op in enumerate(ops) if "gradient" in op.name) - 1
    for op in ops:
        if op.type != "Conv2D" or "gradient" in op.name:
            continue
        tensor = op.inputs[0]
        backward = [c.name for c in tensor.consumers() if "gradient" in c.name]
        swaps.append(Swap(tensor.name, backward, ops[last_forward].name if prefetch else None,
                          ops[last_forward + 1].name if prefetch else None,
                          held_back(ops, latest_inputs(ops), last_forward) if prefetch else ()))
    return swaps


@pytest.mark.parametrize("prefetch", [False, True], ids=["eager", "prefetched"])
def test_swapped_step_gives_the_same_loss_and_gradients(prefetch):
    model = _model()
    step = gradient_step(model, 4)
    swaps = _conv_input_swaps(step.graph, prefetch)
    assert len(swaps) == 2 and all(swap.backward_consumers for swap in swaps)
    swapped = swap_function(step, swaps)
    assert_same_step(step, swapped, rtol=1e-5, atol=1e-7)


def test_swap_nodes_are_placed_wired_and_protected():
    step = gradient_step(_model(), 4)
    swaps = _conv_input_swaps(step.graph, prefetch=True)
    graph_def = insert_swaps(step.graph.as_graph_def(), swaps, graph=step.graph)
    nodes = {node.name: node for node in graph_def.node}
    for swap in swaps:
        base = f"{swap.producer}/ucudnn_swap_{swap.output_index}"
        swap_out, held, swap_in = (nodes[f"{base}/{part}"] for part in ("out", "held", "in"))
        assert swap_out.device == HOST and list(swap_out.input) == [swap.tensor]
        # The copy back waits on the host: the transfer starts after the prefetch op.
        assert held.device == HOST
        assert list(held.input) == [swap_out.name, f"^{swap.prefetch_after}"]
        assert list(swap_in.input) == [held.name]
        assert all(node.attr["_grappler_do_not_remove"].b for node in (swap_out, held, swap_in))
        # The work after the prefetch op waits for the copy back to be queued.
        assert swap.held_back
        for name in swap.held_back:
            assert f"^{held.name}" in nodes[name].input
        # The op the model frees the buffer before waits for the copy out.
        assert f"^{swap_out.name}" in nodes[swap.copied_out_before].input
        for consumer in swap.backward_consumers:
            assert swap_in.name in nodes[consumer].input
            assert not {swap.tensor, swap.producer} & set(nodes[consumer].input)
        # The forward consumers still read the original.
        names = {swap.tensor, swap.producer} if swap.output_index == 0 else {swap.tensor}
        forward = [n for n in graph_def.node if names & set(n.input) and n.name != swap_out.name]
        assert forward and all("gradient" not in n.name for n in forward)


def test_bad_swaps_are_named():
    step = gradient_step(_model(), 4)
    (swap, _) = _conv_input_swaps(step.graph)
    graph_def = step.graph.as_graph_def()
    with pytest.raises(SwapError, match="no node 'nowhere'"):
        insert_swaps(graph_def, [Swap("nowhere:0", swap.backward_consumers)], graph=step.graph)
    with pytest.raises(SwapError, match="does not read it"):
        insert_swaps(graph_def, [Swap(swap.tensor, [swap.producer])], graph=step.graph)
    with pytest.raises(SwapError, match="no backward consumers"):
        insert_swaps(graph_def, [Swap(swap.tensor, [])], graph=step.graph)
    with pytest.raises(SwapError, match="waits for .* which needs the swapped-in tensor"):
        insert_swaps(graph_def, [Swap(swap.tensor, swap.backward_consumers,
                                      swap.backward_consumers[0])], graph=step.graph)
    with pytest.raises(SwapError, match="held_back names no node"):
        insert_swaps(graph_def, [Swap(swap.tensor, swap.backward_consumers, swap.producer,
                                      held_back=["later"])], graph=step.graph)
    with pytest.raises(SwapError, match="no prefetch op"):
        insert_swaps(graph_def, [Swap(swap.tensor, swap.backward_consumers,
                                      held_back=swap.backward_consumers)], graph=step.graph)
    # The first gradient op, held back for a copy back that waits for one of its readers.
    first = next(op for op in step.graph.get_operations()
                 if "gradient" in op.name and op.outputs and op.outputs[0].consumers())
    reader = first.outputs[0].consumers()[0].name
    with pytest.raises(SwapError, match="held back .* leads to"):
        insert_swaps(graph_def, [Swap(swap.tensor, swap.backward_consumers, reader,
                                      held_back=[first.name])], graph=step.graph)
    with pytest.raises(SwapError, match="prefetch_after names no node"):
        insert_swaps(graph_def, [Swap(swap.tensor, swap.backward_consumers, "later")],
                     graph=step.graph)


def test_holding_back_the_ops_after_an_op_holds_back_all_later_work():
    step = gradient_step(_model(), 4)
    ops = step.graph.get_operations()
    index = next(i for i, op in enumerate(ops) if "gradient" in op.name)
    held = set(held_back(ops, latest_inputs(ops), index))
    assert held and all(ops.index(step.graph.get_operation_by_name(name)) > index
                        for name in held)
    # Every later op waits for one held back, at some remove, or is made of constants alone.
    waiting, constants = set(held), set()
    for i, op in enumerate(ops):
        reads = {t.op.name for t in op.inputs} | {c.name for c in op.control_inputs}
        if op.type != "Placeholder" and reads <= constants:
            constants.add(op.name)
            assert op.name not in held
        elif op.name in held:
            assert all(ops.index(step.graph.get_operation_by_name(r)) <= index
                       for r in reads - constants)
        elif i > index:
            assert reads & waiting, op.name
            waiting.add(op.name)
