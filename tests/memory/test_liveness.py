"""Liveness analysis: bytes held at each op, checked by hand on small graphs."""

import json

import pytest
import tensorflow as tf
from training_steps import gradient_step

from tf_ucudnn.memory.analysis.liveness import analyze


def _chain():
    graph = tf.Graph()
    with graph.as_default():
        a = tf.compat.v1.placeholder(tf.float32, [10], name="a")  # 40 bytes
        b = tf.math.square(a, name="b")  # 40
        c = tf.reshape(b, [2, 5], name="c")  # b's buffer; its shape is a Const (8 bytes)
        tf.math.exp(c, name="d")  # 40, read by nothing
    return graph


def test_a_chain_by_hand():
    report = analyze(_chain())
    # Ops: a, b, c/shape, c, d. a: op0-op1; b (and its alias c, read by d): op1-op4;
    # the shape: op2-op3; d: op4 only.
    assert [op.type for op in report.ops] == ["Placeholder", "Square", "Const", "Reshape", "Exp"]
    assert [op.live_bytes for op in report.ops] == [40, 80, 48, 48, 80]
    assert report.peak_bytes == 80 and report.peak_op == "b"
    assert [(t.name, t.bytes) for t in report.tensors] == [("a:0", 40), ("b:0", 40),
                                                          ("c/shape:0", 8), ("d:0", 40)]
    assert report.kept() == [] and report.unknown_size == [] and report.persistent_bytes == 0


def test_a_graphdef_gives_the_same_answer():
    report = analyze(_chain().as_graph_def())
    assert [op.live_bytes for op in report.ops] == [40, 80, 48, 48, 80]


def test_a_diamond_keeps_the_shared_tensor_across_the_branch():
    graph = tf.Graph()
    with graph.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [25], name="x")  # 100 bytes
        left = tf.math.sin(x, name="left")  # 100
        right = tf.math.cos(left, name="right")  # 100
        tf.math.add(x, right, name="sum")  # 100, reads x again at the end
    report = analyze(graph)
    # x lives to the end (op3); left op1-op2; right op2-op3; sum op3.
    assert [op.live_bytes for op in report.ops] == [100, 200, 300, 300]


def test_control_dependencies_do_not_extend_lifetimes_and_variables_count_once():
    graph = tf.Graph()
    with graph.as_default():
        variable = tf.Variable(tf.zeros([100]), name="v")  # 400 bytes
        a = tf.compat.v1.placeholder(tf.float32, [10], name="a")  # 40
        b = tf.math.square(a, name="b")  # 40
        with tf.control_dependencies([b]):
            c = tf.math.exp(a, name="c")  # 40; waits for b but does not read it
        tf.math.add(variable.read_value()[:10], c, name="once")
        tf.math.add(variable.read_value()[:10], c, name="twice")
    report = analyze(graph)
    assert report.persistent_bytes == 400
    live = {op.name: op.live_bytes for op in report.ops}
    # During c: a (read by c) and c itself; b, read by nothing, was freed after its own op.
    assert live["b"] == 80 and live["c"] == 80


def test_unknown_shapes_are_listed_not_guessed():
    graph = tf.Graph()
    with graph.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [None, 3], name="x")
        tf.math.square(x, name="y")
    report = analyze(graph)
    assert report.unknown_size == ["x:0", "y:0"]
    assert report.peak_bytes == 0
    assert "2 tensor(s) of unknown size" in report.to_text()


def _training_step():
    tf.keras.utils.set_random_seed(7)
    layers = tf.keras.layers
    model = tf.keras.Sequential([
        tf.keras.Input((8, 8, 3)),
        layers.Conv2D(4, 3, padding="same", activation="relu"),
        layers.Conv2D(4, 3, padding="same"),
        layers.GlobalAveragePooling2D(), layers.Dense(2),
    ])
    return gradient_step(model, 2)


def test_a_training_step_keeps_the_convolution_inputs(tmp_path):
    step = _training_step()
    report = analyze(step)
    kept = {t.name: t for t in report.kept()}
    conv_inputs = [op.inputs[0].name for op in step.graph.get_operations()
                   if op.type == "Conv2D" and "gradient" not in op.name]
    # The first convolution reads the step's input, which the caller holds: not counted as kept.
    assert len(conv_inputs) == 2 and conv_inputs[0] == "x:0" and "x:0" not in kept
    assert kept[conv_inputs[1]].bytes == 2 * 8 * 8 * 4 * 4
    # Parameters: 3*3*3*4 + 4 + 3*3*4*4 + 4 + 4*2 + 2 floats.
    assert report.persistent_bytes == (108 + 4 + 144 + 4 + 8 + 2) * 4
    # At the first backward op, every kept tensor is held.
    first_backward = next(i for i, op in enumerate(report.ops) if op.backward)
    assert report.ops[first_backward].live_bytes >= sum(t.bytes for t in report.kept())
    assert report.peak_bytes >= sum(t.bytes for t in report.kept())
    json.dumps(report.to_json())
    assert "tensors kept for the backward pass" in report.to_text()
    path = tmp_path / "timeline.png"
    report.plot(str(path))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_function_calls_are_listed():
    @tf.function
    def inner(x):
        return x * 2.0

    @tf.function
    def outer(x):
        return inner(x) + 1.0

    report = analyze(outer.get_concrete_function(tf.TensorSpec([4])))
    assert len(report.function_calls) == 1


def test_other_targets_are_refused():
    with pytest.raises(TypeError, match="GraphDef, a tf.Graph or a ConcreteFunction"):
        analyze("graph.pbtxt")


def test_a_split_along_the_first_dimension_shares_its_input_buffer():
    graph = tf.Graph()
    with graph.as_default():
        a = tf.compat.v1.placeholder(tf.float32, [4, 5], name="a")  # 80 bytes
        b = tf.math.square(a, name="b")  # 80
        rows = tf.split(b, 2, axis=0, name="rows")  # b's buffer, sliced
        columns = tf.split(b, [2, 3], axis=1, name="columns")  # copies: 32 and 48 bytes
        tf.add_n([tf.reduce_sum(t) for t in (*rows, *columns)], name="total")
    report = analyze(graph)
    sizes = dict((t.name, t.bytes) for t in report.tensors)
    assert "rows:0" not in sizes and "rows:1" not in sizes
    assert sizes["b:0"] == 80 and sizes["columns:0"] == 32 and sizes["columns:1"] == 48
    # b stays until the last read of its rows.
    b = next(t for t in report.tensors if t.name == "b:0")
    reads_of_rows = [i for i, op in enumerate(graph.get_operations())
                     if any(t.name.startswith("rows:") for t in op.inputs)]
    assert max(b.consumers) >= max(reads_of_rows)


def _batch_norm_graph(data_format: str, dtype=tf.float32):
    graph = tf.Graph()
    with graph.as_default():
        x = tf.compat.v1.placeholder(dtype, [2, 3, 4, 5], name="x")  # 480 bytes in float32
        tf.raw_ops.FusedBatchNormV3(
            x=x, scale=tf.ones([5 if data_format == "NHWC" else 3]),
            offset=tf.zeros([5 if data_format == "NHWC" else 3]), mean=tf.zeros([0]),
            variance=tf.zeros([0]), data_format=data_format, is_training=True, name="bn")
    return graph


def test_channels_last_batch_norm_holds_its_kernels_transposed_copies():
    report = analyze(_batch_norm_graph("NHWC"))
    scratch = {t.name: (t.bytes, t.producer, t.consumers) for t in report.tensors
               if t.name.endswith(":scratch")}
    bn = [op.name for op in report.ops].index("bn")
    assert scratch == {"bn:scratch": (2 * 480, bn, ())}
    # At the batch norm: x (480), scale and offset (5 floats each), its output y (480), the four
    # statistics (5 floats each), and the two transposed copies; none in NCHW (3 channels).
    assert report.ops[bn].live_bytes == 480 + 2 * 20 + 480 + 4 * 20 + 2 * 480
    assert analyze(_batch_norm_graph("NCHW")).ops[bn].live_bytes == 480 + 2 * 12 + 480 + 4 * 12


def test_the_batch_norm_gradient_holds_three_transposed_copies():
    x = tf.random.normal([2, 3, 4, 5])

    @tf.function
    def step(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = tf.raw_ops.FusedBatchNormV3(
                x=x, scale=tf.ones([5]), offset=tf.zeros([5]), mean=tf.zeros([0]),
                variance=tf.zeros([0]), data_format="NHWC", is_training=True)[0]
        return tape.gradient(y, x)

    report = analyze(step.get_concrete_function(x))
    (grad,) = [i for i, op in enumerate(report.ops) if op.type == "FusedBatchNormGradV3"]
    scratch = {t.name: t.bytes for t in report.tensors if t.name.endswith(":scratch")}
    assert scratch[f"{report.ops[grad].name}:scratch"] == 3 * 480
    assert len(scratch) == 2  # and the forward's


def test_an_identity_n_output_shares_the_buffer_of_its_own_input():
    graph = tf.Graph()
    with graph.as_default():  # as tf.custom_gradient returns its outputs
        a = tf.compat.v1.placeholder(tf.float32, [10], name="a")  # 40 bytes
        b = tf.math.square(a, name="b")  # 40
        _, b_out = tf.raw_ops.IdentityN(input=[a, b], name="outputs")
        tf.math.exp(b_out, name="d")  # 40
    report = analyze(graph)
    # Ops: a, b, outputs, d. No buffer of IdentityN's own; b lives until d reads it, a until
    # the IdentityN.
    assert [t.name for t in report.tensors] == ["a:0", "b:0", "d:0"]
    assert [op.live_bytes for op in report.ops] == [40, 80, 80, 80]


def test_each_device_has_its_own_peak():
    graph = tf.Graph()
    with graph.as_default():
        with tf.device("/CPU:0"):
            a = tf.compat.v1.placeholder(tf.float32, [10], name="a")  # 40 bytes
        with tf.device("/job:localhost/replica:0/task:0/device:CPU:1"):
            b = tf.math.square(a, name="b")  # 40
        tf.math.exp(b, name="c")  # 40, unplaced: where the placer puts it (no GPU: CPU:0)
    report = analyze(graph)
    assert [(t.name, t.device) for t in report.tensors] == [
        ("a:0", "/device:CPU:0"), ("b:0", "/device:CPU:1"), ("c:0", "/device:CPU:0")]
    # Ops a, b, c: a is held at a and b, c at c, on the first device; b at b and c on the second.
    assert report.device_peaks() == {"/device:CPU:0": 40, "/device:CPU:1": 40}
    assert report.peak_bytes == 80  # all devices' tensors together, at op b and at op c
    assert analyze(_chain()).device_peaks() == {"": 80}


def test_an_identity_on_another_device_is_a_copy_there():
    graph = tf.Graph()
    with graph.as_default():
        a = tf.compat.v1.placeholder(tf.float32, [10], name="a")  # unplaced: CPU:0 (no GPU)
        with tf.device("/CPU:1"):
            b = tf.identity(a, name="b")  # received into a buffer of CPU:1
            moved = tf.identity(b, name="moved")  # b's buffer again
        with tf.device("/CPU:0"):
            tf.math.exp(a, name="c")
        tf.math.exp(moved, name="d")
    report = analyze(graph)
    assert [(t.name, t.device) for t in report.tensors] == [
        ("a:0", "/device:CPU:0"), ("b:0", "/device:CPU:1"), ("c:0", "/device:CPU:0"),
        ("d:0", "/device:CPU:0")]
    # a is freed on CPU:0 after c; b (and moved) held on CPU:1 until d reads it.
    assert report.device_peaks() == {"/device:CPU:0": 80, "/device:CPU:1": 40}


def _convolution_scratch(window, strides, padding, shape=(2, 8, 8, 4), filters=6):
    """`<op type>: scratch bytes` of one convolution's training step (forward and gradients)."""
    x = tf.random.normal(shape)
    kernel = tf.random.normal([*window, shape[-1], filters])
    conv = tf.nn.conv2d if len(shape) == 4 else tf.nn.conv3d

    @tf.function
    def step(x, kernel):
        with tf.GradientTape() as tape:
            tape.watch([x, kernel])
            y = conv(x, kernel, [1, *strides, 1], padding)
        return tape.gradient(y, [x, kernel])

    report = analyze(step.get_concrete_function(x, kernel))
    types = {op.name: op.type for op in report.ops}
    return {types[t.name[:-len(":scratch")]]: t.bytes for t in report.tensors
            if t.name.endswith(":scratch")}


def test_the_gradient_of_a_convolution_input_holds_a_second_buffer_of_its_size():
    # x: 2x8x8x4 floats = 2048 bytes. cuDNN computes channels-last (TF32 allowed), so only the
    # input's gradient is made twice.
    assert _convolution_scratch((3, 3), (1, 1), "SAME") == {"Conv2DBackpropInput": 2048}
    assert _convolution_scratch((1, 1, 1), (1, 1, 1), "VALID", shape=(2, 3, 8, 8, 4)) == {}
    assert _convolution_scratch((3, 3, 3), (1, 1, 1), "SAME", shape=(2, 3, 8, 8, 4)) == \
        {"Conv3DBackpropInputV2": 3 * 2048}
    # A 1x1 convolution with unit strides is a matrix product; with stride 2 it is not.
    assert _convolution_scratch((1, 1), (1, 1), "VALID") == {}
    assert _convolution_scratch((1, 1), (2, 2), "VALID") == {"Conv2DBackpropInput": 2048}


def test_an_uneven_same_padding_pads_a_copy_of_the_input():
    # 3x3, stride 2, on 8 rows: 1 row of padding in all, at the bottom only.
    assert _convolution_scratch((3, 3), (2, 2), "SAME") == {
        "Conv2D": 2048, "Conv2DBackpropInput": 2 * 2048, "Conv2DBackpropFilter": 2048}


def test_without_tf32_channels_last_convolutions_are_transposed_around_cudnn():
    tf.config.experimental.enable_tensor_float_32_execution(False)
    try:
        # x is 2048 bytes, y (6 channels, SAME) 3072.
        assert _convolution_scratch((3, 3), (1, 1), "SAME") == {
            "Conv2D": 2048 + 3072, "Conv2DBackpropInput": 3072 + 2048,
            "Conv2DBackpropFilter": 2048 + 3072}
    finally:
        tf.config.experimental.enable_tensor_float_32_execution(True)
