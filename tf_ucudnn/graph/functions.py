"""Functions as graphs and back: a ConcreteFunction's graph, changed as a GraphDef, becomes a
callable again over the same inputs and captured variables; calls to other functions can be
inlined first, so that a pass sees one flat graph with known shapes.
"""

import tensorflow as tf
from tensorflow.core.framework import graph_pb2
from tensorflow.python.eager import context
from tensorflow.python.framework import convert_to_constants

# The name scope of a rewritten graph's ops inside the tf.function that runs it.
CALL_SCOPE = "ucudnn"


def is_concrete_function(target) -> bool:
    return hasattr(target, "graph") and hasattr(target, "captured_inputs")


def inline_function_calls(function):
    """The ConcreteFunction's graph with every function call inlined, as a tf.function.

    Uses Grappler's function optimizer, as TF-TRT's converter does before it rewrites.
    """
    graph_def = convert_to_constants._run_inline_graph_optimization(  # noqa: SLF001
        function, lower_control_flow=False, aggressive_inlining=True)
    return callable_over(graph_def, function)


def callable_over(graph_def: graph_pb2.GraphDef, function, jit_compile: bool = False):
    """A tf.function running `graph_def`, whose placeholders are `function`'s inputs; compiled
    by XLA with `jit_compile`."""
    captures = dict(zip([t.name for t in function.graph.internal_captures],
                        function.captured_inputs))
    inputs = [t.name for t in function.inputs if t.name not in captures]
    outputs = [t.name for t in function.outputs]
    specs = [tf.TensorSpec(t.shape, t.dtype) for t in function.inputs if t.name not in captures]
    # Functions a pass added to the library (its own calls) must be known to the runtime, which
    # does not learn them from the import.
    for definition in graph_def.library.function:
        if not context.context().has_function(definition.signature.name):
            context.context().add_function_def(definition)

    if jit_compile:
        # XLA compiles every node of the function, and has no kernel for a placeholder, which
        # the import brings along though its readers are mapped to the inputs: a NoOp in its
        # place keeps the name the mapping refers to.
        mapped = {name.partition(":")[0] for name in (*inputs, *captures)}
        given, graph_def = graph_def, graph_pb2.GraphDef()
        graph_def.CopyFrom(given)
        for node in graph_def.node:
            if node.name in mapped and node.op == "Placeholder":
                node.op = "NoOp"
                node.attr.clear()

    @tf.function(input_signature=specs, autograph=False, jit_compile=jit_compile or None)
    def run(*args):
        input_map = dict(zip(inputs, args))
        graph = tf.compat.v1.get_default_graph()
        # The variables' handles become captures of the new function, as of the old one.
        input_map.update({name: graph.capture(value) for name, value in captures.items()})
        results = tf.graph_util.import_graph_def(graph_def, input_map=input_map,
                                                 return_elements=outputs, name=CALL_SCOPE)
        return tf.nest.pack_sequence_as(function.structured_outputs, results,
                                        expand_composites=True)

    return run


def graph_of(graph_def, graph=None) -> tf.Graph:
    """`graph` if given (the graph `graph_def` came from), else `graph_def` imported."""
    if graph is None:
        graph = tf.Graph()
        with graph.as_default():
            tf.graph_util.import_graph_def(graph_def, name="")
    return graph
