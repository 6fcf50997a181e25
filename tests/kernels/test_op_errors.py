"""tf_ucudnn.kernels.ops with bad plans and bad arguments: each refused with a message naming
the op, the plan and the reason."""

import numpy as np
import pytest
import tensorflow as tf
from reference import (
    CONV2D_CASES,
    CONV3D_CASES,
    random,
)
from tensorflow.python.autograph.impl.api import StagingError

import tf_ucudnn
from tf_ucudnn.core.conv_layer import UnsupportedConvolution
from tf_ucudnn.core.plan import Algorithm, KernelPlan, LayerPlan
from tf_ucudnn.kernels.library import op_library

ALL_CASES = CONV2D_CASES + CONV3D_CASES


# --------------------------------------------------------------------------------- bad plans

_X = np.random.default_rng(0).standard_normal([5, 6, 6, 3]).astype(np.float32)
_W = np.random.default_rng(1).standard_normal([3, 3, 3, 4]).astype(np.float32)
_ATTRS = {"strides": [1, 1, 1, 1], "padding": "SAME"}


def _raw_conv(**plan_attrs):
    return op_library().ucudnn_conv2d(_X, _W, **_ATTRS, **plan_attrs)


@pytest.mark.parametrize("nd", [2, 3])
def test_plan_not_summing_to_batch_fails_at_trace_time(nd):
    x = tf.zeros([5] + [4] * nd + [2])
    w = tf.zeros([1] * nd + [2, 3])
    op = tf_ucudnn.conv2d if nd == 2 else tf_ucudnn.conv3d
    name = f"UcudnnConv{nd}D"
    traced = tf.function(lambda x: op(x, w, 1, "SAME", plan=KernelPlan.of((2, 0), (2, 1))))
    with pytest.raises(ValueError) as info:
        traced.get_concrete_function(tf.TensorSpec(x.shape, x.dtype))
    message = str(info.value)
    assert name in message
    assert "micro_batches/algorithms [2@algo=0, 2@algo=1] of the fwd kernel" in message
    assert "sum to 4 but the batch has 5 samples" in message


@pytest.mark.parametrize("kernel, prefix", [("bwd_data", "backprop_input_"),
                                            ("bwd_filter", "backprop_filter_")])
def test_gradient_plan_not_summing_to_batch_fails_at_trace_time(kernel, prefix):
    bad = KernelPlan.of((3, 0), (3, 1))
    plan = LayerPlan(backprop_input=bad) if kernel == "bwd_data" else \
        LayerPlan(backprop_filter=bad)
    traced = tf.function(lambda x: tf_ucudnn.conv2d(x, _W, 1, "SAME", plan=plan))
    with pytest.raises(ValueError) as info:
        traced.get_concrete_function(tf.TensorSpec(_X.shape, tf.float32))
    message = str(info.value)
    assert "UcudnnConv2D" in message
    assert f"{prefix}micro_batches/{prefix}algorithms [3@algo=0, 3@algo=1] of the {kernel} kernel" \
        in message
    assert "sum to 6 but the batch has 5 samples" in message


@pytest.mark.parametrize("op_name", ["UcudnnConv2DBackpropInput", "UcudnnConv2DBackpropFilter"])
def test_backprop_plan_not_summing_to_batch_fails_at_trace_time(op_name):
    dy = tf.zeros([5, 6, 6, 4])
    plan = KernelPlan.of((4, 0))
    if op_name == "UcudnnConv2DBackpropInput":
        fn = lambda dy: tf_ucudnn.conv2d_backprop_input([5, 6, 6, 3], _W, dy, 1, "SAME", plan=plan)
    else:
        fn = lambda dy: tf_ucudnn.conv2d_backprop_filter(_X, [3, 3, 3, 4], dy, 1, "SAME",
                                                         plan=plan)
    with pytest.raises(ValueError) as info:
        tf.function(fn).get_concrete_function(tf.TensorSpec(dy.shape, dy.dtype))
    message = str(info.value)
    assert op_name in message and "[4@algo=0]" in message
    assert "sum to 4 but the batch has 5 samples" in message


@pytest.mark.parametrize("mode", ["eager", "unknown-batch"])
def test_plan_not_summing_to_batch_fails_at_run_time(device, mode):
    plan = KernelPlan.of((2, 0), (2, 1))
    fn = lambda x: tf_ucudnn.conv2d(x, _W, 1, "SAME", plan=plan, name="my_conv")
    if mode == "unknown-batch":
        fn = tf.function(fn, input_signature=[tf.TensorSpec([None, 6, 6, 3], tf.float32)])
        fn.get_concrete_function()  # traces fine: the batch is not known yet
    with tf.device(device), pytest.raises(tf.errors.InvalidArgumentError) as info:
        fn(tf.constant(_X))
    message = info.value.message
    # Eager ops are named after their type; graph nodes keep the name given.
    assert ("UcudnnConv2D 'my_conv'" if mode == "unknown-batch" else "UcudnnConv2D '") in message
    assert "(fwd kernel, plan [2@algo=0, 2@algo=1])" in message
    assert "the micro-batch sizes sum to 4 but the batch has 5 samples" in message
    # The same function runs where the batch matches.
    with tf.device(device):
        assert fn(tf.constant(_X[:4])).shape == (4, 6, 6, 4)


def test_gradient_plan_not_summing_to_batch_fails_when_the_gradient_runs(device):
    plan = LayerPlan(backprop_filter=KernelPlan.of((1, 0), (3, 1)))

    @tf.function(input_signature=[tf.TensorSpec([None, 6, 6, 3], tf.float32)])
    def grads(x):
        w = tf.constant(_W)
        with tf.GradientTape() as tape:
            tape.watch(w)
            y = tf_ucudnn.conv2d(x, w, 1, "SAME", plan=plan)
        return tape.gradient(y, w)

    with tf.device(device), pytest.raises(tf.errors.InvalidArgumentError) as info:
        grads(tf.constant(_X))
    message = info.value.message
    assert "UcudnnConv2DBackpropFilter" in message and "bwd_filter kernel" in message
    assert "[1@algo=0, 3@algo=1]" in message and "sum to 4 but the batch has 5" in message
    with tf.device(device):
        assert grads(tf.constant(_X[:4])).shape == (3, 3, 3, 4)


def test_op_library_writes_engine_configs_as_plan_py_does():
    """The op's text of a plan (in its errors) has the knobs sorted, as Algorithm.to_attr."""
    given = "engine=12,knobs=TILE_SIZE:5/SPLIT_K_SLC:2"
    canonical = Algorithm.parse(given).to_attr()
    with tf.device("/CPU:0"), pytest.raises(tf.errors.InvalidArgumentError) as info:
        _raw_conv(micro_batches=[1, 3], algorithms=[given, "engine=3"])
    assert f"[1@{canonical}, 3@engine=3]" in info.value.message
    assert "sum to 4 but the batch has 5" in info.value.message


def test_cpu_kernel_runs_a_plan_of_engine_configs():
    """The CPU kernels take any algorithm; an engine configuration only chooses a cuDNN engine."""
    plan = ["engine=12,knobs=SPLIT_K_SLC:2", "engine=0"]
    with tf.device("/CPU:0"):
        planned = _raw_conv(micro_batches=[2, 3], algorithms=plan)
        undivided = _raw_conv(micro_batches=[], algorithms=[])
    np.testing.assert_allclose(planned.numpy(), undivided.numpy(), rtol=1e-5, atol=1e-5)


# Bad plan attributes: (micro_batches, algorithms, the reason the message must give).
_BAD_PLANS = {
    "negative-algorithm": ([5], ["algo=-1"], "algorithm -1 is not a cudnnConvolutionFwdAlgo_t"),
    "unknown-algorithm": ([2, 3], ["algo=0", "algo=8"],
                          "micro-batch 1: algorithm 8 is not a cudnnConvolutionFwdAlgo_t (0..7)"),
    "missing-equals": ([5], ["algo1"], "cannot parse algorithm 'algo1': missing '='"),
    "unknown-key": ([5], ["algo=1,engine=2"], "unknown key 'engine'"),
    "unknown-math": ([5], ["algo=1,math=tf32"], "unknown math mode 'tf32'"),
    "non-integer": ([5], ["algo=one"], "algo is not an integer"),
    "no-algo": ([5], ["math=fma"], "no 'algo'"),
    "twice": ([5], ["algo=1,algo=1"], "'algo' given twice"),
    "engine-with-math": ([5], ["engine=1,math=fma"], "unknown key 'math'"),
    "engine-not-integer": ([5], ["engine=x"], "engine is not an integer"),
    "negative-engine": ([5], ["engine=-2"], "engine must be non-negative"),
    "bad-knob": ([5], ["engine=1,knobs=SPLIT_K_SLC"], "knob 'SPLIT_K_SLC' is not NAME:INTEGER"),
    "knob-twice": ([5], ["engine=1,knobs=TILEK:1/TILEK:2"], "knob 'TILEK' given twice"),
    "more-sizes": ([2, 3], ["auto"], "plan has 2 micro-batch sizes but 1 algorithms"),
    "more-algorithms": ([5], ["auto", "auto"], "plan has 1 micro-batch sizes but 2 algorithms"),
    "zero-size": ([5, 0], ["auto", "auto"], "micro-batch 1 has size 0; sizes must be positive"),
    "negative-size": ([6, -1], ["auto", "auto"],
                      "micro-batch 1 has size -1; sizes must be positive"),
}


def _plan_text(sizes, algorithms, prefix=""):
    return (f"plan {prefix}micro_batches=[{', '.join(map(str, sizes))}] {prefix}algorithms=['"
            + "', '".join(algorithms) + "'] is invalid")


@pytest.mark.parametrize("name", list(_BAD_PLANS))
def test_bad_plan_eager(device, name):
    sizes, algorithms, reason = _BAD_PLANS[name]
    with tf.device(device), pytest.raises(tf.errors.InvalidArgumentError) as info:
        _raw_conv(micro_batches=sizes, algorithms=algorithms, name="bad")
    message = info.value.message
    assert "UcudnnConv2D '" in message and "' (fwd kernel)" in message
    assert _plan_text(sizes, algorithms) in message
    assert reason in message


@pytest.mark.parametrize("name", list(_BAD_PLANS))
def test_bad_plan_at_trace_time(name):
    sizes, algorithms, reason = _BAD_PLANS[name]
    with pytest.raises(ValueError) as info:
        tf.function(lambda: _raw_conv(micro_batches=sizes, algorithms=algorithms))()
    message = str(info.value)
    assert "UcudnnConv2D" in message
    assert _plan_text(sizes, algorithms) in message
    assert reason in message


@pytest.mark.parametrize("prefix, enum", [("backprop_input_", "cudnnConvolutionBwdDataAlgo_t"),
                                          ("backprop_filter_", "cudnnConvolutionBwdFilterAlgo_t")])
def test_bad_gradient_plan_at_trace_time(prefix, enum):
    """A forward op's gradient plans are checked, against their own kernel's algorithms."""
    algorithms = ["algo=7"]  # a forward algorithm, but no backprop one
    with pytest.raises(ValueError) as info:
        tf.function(lambda: _raw_conv(**{prefix + "micro_batches": [5],
                                         prefix + "algorithms": algorithms}))()
    message = str(info.value)
    assert "UcudnnConv2D" in message
    assert _plan_text([5], algorithms, prefix) in message
    assert f"algorithm 7 is not a {enum}" in message


@pytest.mark.parametrize("prefix, kernel", [("backprop_input_", "bwd_data"),
                                            ("backprop_filter_", "bwd_filter")])
def test_bad_gradient_plan_in_eager_forward(prefix, kernel):
    """Eagerly too, the forward op refuses a gradient plan that its backward pass could not run."""
    algorithms = ["algo=-1"]
    with pytest.raises(tf.errors.InvalidArgumentError) as info:
        _raw_conv(**{prefix + "micro_batches": [5], prefix + "algorithms": algorithms})
    message = info.value.message
    assert f"UcudnnConv2D 'UcudnnConv2D' (gradient's {kernel} kernel)" in message
    assert _plan_text([5], algorithms, prefix) in message
    assert "algorithm -1 is not a" in message


@pytest.mark.parametrize("op_name", ["UcudnnConv2DBackpropInput", "UcudnnConv2DBackpropFilter",
                                     "UcudnnConv3DBackpropInput", "UcudnnConv3DBackpropFilter"])
def test_bad_plan_on_backprop_ops(device, op_name):
    nd = 3 if "3D" in op_name else 2
    x = tf.zeros([2] + [3] * nd + [1])
    w = tf.zeros([1] * nd + [1, 1])
    attrs = {"strides": [1] * (nd + 2), "padding": "VALID", "micro_batches": [1, 1],
             "algorithms": ["auto", "algo=6"]}
    ops = {2: (op_library().ucudnn_conv2d_backprop_input, op_library().ucudnn_conv2d_backprop_filter),
           3: (op_library().ucudnn_conv3d_backprop_input, op_library().ucudnn_conv3d_backprop_filter)}[nd]
    if "Input" in op_name:
        run = lambda: ops[0](tf.shape(x), w, x, **attrs)
        reason = "algorithm 6 is not a cudnnConvolutionBwdDataAlgo_t (0..5)"
    else:
        attrs["algorithms"] = ["auto", "algo=7"]
        run = lambda: ops[1](x, tf.shape(w), x, **attrs)
        reason = "algorithm 7 is not a cudnnConvolutionBwdFilterAlgo_t (0..6)"
    with tf.device(device), pytest.raises(tf.errors.InvalidArgumentError) as info:
        run()
    kernel = "bwd_data" if "Input" in op_name else "bwd_filter"
    assert f"{op_name} '" in info.value.message and f"({kernel} kernel)" in info.value.message
    assert _plan_text([1, 1], attrs["algorithms"]) in info.value.message
    assert f"micro-batch 1: {reason}" in info.value.message


def test_python_algorithm_rejects_negative_before_the_op():
    with tf.device("/CPU:0"), pytest.raises(ValueError, match="non-negative"):
        tf_ucudnn.conv2d(_X, _W, 1, "SAME", plan=KernelPlan.of((5, -1)))
    with pytest.raises(ValueError, match="non-negative"):
        Algorithm(-1)


def test_cpu_accepts_every_in_range_algorithm(rng):
    """The CPU kernels ignore the algorithm: every legal number gives the same result."""
    x = random((4, 5, 5, 2), tf.float64, rng)
    w = random((3, 3, 2, 3), tf.float64, rng)
    with tf.device("/CPU:0"):
        base = tf_ucudnn.conv2d(x, w, 1, "SAME")
        for algo in range(8):
            y = tf_ucudnn.conv2d(x, w, 1, "SAME", plan=KernelPlan.of((1, algo), (3, 7 - algo)))
            np.testing.assert_allclose(y, base, rtol=1e-12, atol=1e-12)


# ------------------------------------------------------------------------- bad conv arguments

@pytest.mark.parametrize("kwargs, error, text", [
    ({"padding": "FULL"}, ValueError, "padding must be 'SAME', 'VALID' or explicit pairs"),
    ({"padding": [[0, 0], [1, 1], [1, 1]]}, ValueError, "explicit padding needs 4"),
    ({"padding": [[0, 0], [1, 1], [1], [0, 0]]}, ValueError, "explicit padding needs 4"),
    ({"strides": [1, 2, 2]}, ValueError, "strides should have 1, 2 or 4 entries"),
    ({"dilations": [1, 2, 2, 2, 1]}, ValueError, "dilations should have 1, 2 or 4 entries"),
    ({"plan": [(5, 1)]}, TypeError, "plan must be a LayerPlan, a KernelPlan or None"),
], ids=["padding-name", "padding-pairs", "padding-pair-length", "strides", "dilations", "plan"])
def test_wrapper_rejects(kwargs, error, text):
    args = {"strides": 1, "padding": "SAME", **kwargs}
    with pytest.raises(error, match=text.replace("(", r"\(").replace("[", r"\[")):
        tf_ucudnn.conv2d(_X, _W, **args)


def test_backprop_wrappers_take_only_kernel_plans():
    with pytest.raises(TypeError, match="plan must be a KernelPlan or None"):
        tf_ucudnn.conv2d_backprop_input([5, 6, 6, 3], _W, tf.zeros([5, 6, 6, 4]), 1, "SAME",
                                        plan=LayerPlan())


@pytest.mark.parametrize("attrs, text", [
    ({"strides": [2, 1, 1, 1]}, "strides in the batch and channel dimensions must be 1"),
    ({"dilations": [1, 1, 1, 2]}, "dilations in the batch and channel dimensions must be 1"),
    ({"strides": [1, 0, 1, 1]}, "strides and dilations must be >= 1"),
    ({"padding": "EXPLICIT", "explicit_paddings": [0, 0, 1, 1]},
     "explicit_paddings must have 8 entries"),
    ({"padding": "EXPLICIT", "explicit_paddings": [0, 0, -1, 1, 0, 0, 0, 0]},
     "explicit_paddings must be non-negative"),
    ({"padding": "EXPLICIT", "explicit_paddings": [0, 0, 1, 1, 1, 1, 1, 0]},
     "explicit_paddings in the batch and channel dimensions must be 0"),
    ({"explicit_paddings": [0, 0, 1, 1, 1, 1, 0, 0]},
     "explicit_paddings must be empty unless padding is EXPLICIT"),
], ids=["stride-batch", "dilation-channel", "stride-zero", "explicit-count", "explicit-negative",
        "explicit-channel", "explicit-not-explicit"])
def test_bad_conv_attributes(attrs, text):
    full = {"strides": [1, 1, 1, 1], "padding": "SAME", **attrs}
    with tf.device("/CPU:0"), pytest.raises(tf.errors.InvalidArgumentError) as info:
        op_library().ucudnn_conv2d(_X, _W, **full, name="attrs")
    assert "UcudnnConv2D '" in info.value.message and "(fwd kernel, plan [] " in info.value.message
    assert text in info.value.message
    with pytest.raises(ValueError, match=text.replace("[", r"\[")):
        tf.function(lambda: op_library().ucudnn_conv2d(_X, _W, **full))()


def test_channels_that_do_not_make_groups():
    """A filter's input depth must divide the input's (the groups), and the groups the output
    depth, as in TensorFlow's Conv2D: the wrapper refuses it with the plugin's reason; the op's
    shape function and its kernel refuse it too, where the raw op is called."""
    message = "the input's 3 channels are not a multiple of the filter's 2 input channels"
    with pytest.raises(UnsupportedConvolution, match=message):
        tf_ucudnn.conv2d(_X, _W[:, :, :2], 1, "SAME")
    # AutoGraph passes the plugin's error on as its StagingError, message kept.
    with pytest.raises((UnsupportedConvolution, StagingError), match=message):
        tf.function(lambda: tf_ucudnn.conv2d(_X, _W[:, :, :2], 1, "SAME"))()
    with pytest.raises(ValueError, match="is not a multiple of the filter's input depth 2"):
        tf.function(lambda: op_library().ucudnn_conv2d(_X, _W[:, :, :2], **_ATTRS))()
    with tf.device("/CPU:0"), pytest.raises(tf.errors.InvalidArgumentError) as info:
        op_library().ucudnn_conv2d(_X, _W[:, :, :2], **_ATTRS,
                                   **KernelPlan.of((5, 1)).attrs())
    message = info.value.message
    assert "UcudnnConv2D" in message and "[5@algo=1]" in message
    assert "the input's depth 3 is not a multiple of the filter's input depth 2" in message
    # Three groups of one channel each cannot make 4 outputs.
    with pytest.raises(UnsupportedConvolution, match="4 output channels are not a multiple of "
                                                     "its 3 groups"):
        tf_ucudnn.conv2d(_X, _W[:, :, :1], 1, "SAME")
    with tf.device("/CPU:0"), pytest.raises(tf.errors.InvalidArgumentError,
                                            match="output depth 4 is not a multiple of the 3 "
                                                  "groups"):
        op_library().ucudnn_conv2d_backprop_filter(_X, [3, 3, 1, 4], tf.zeros([5, 6, 6, 4]),
                                                   **_ATTRS)
    with pytest.raises(ValueError, match="output depth 4 is not a multiple of the 3 groups"):
        tf.function(lambda: op_library().ucudnn_conv2d_backprop_filter(
            _X, [3, 3, 1, 4], tf.zeros([5, 6, 6, 4]), **_ATTRS))()
    with pytest.raises(ValueError, match="input's depth 3 is not a multiple of the filter's "
                                         "input depth 2"):
        tf.function(lambda: op_library().ucudnn_conv2d_backprop_input(
            [5, 6, 6, 3], _W[:, :, :2], tf.zeros([5, 6, 6, 4]), **_ATTRS))()


def test_grouped_shapes_in_graph():
    """The shape functions take a grouped filter as TensorFlow's Conv2D does."""
    def shapes(x):
        y = tf_ucudnn.conv2d(x, tf.zeros([3, 3, 1, 6]), 2, "SAME")
        return (y, op_library().ucudnn_conv2d_backprop_input([5, 6, 6, 3], tf.zeros([3, 3, 1, 6]),
                                                             y, strides=[1, 2, 2, 1],
                                                             padding="SAME"))
    graph = tf.function(shapes).get_concrete_function(tf.TensorSpec([None, 6, 6, 3])).graph
    y, dx = graph.outputs
    assert y.shape.as_list() == [None, 3, 3, 6] and dx.shape.as_list() == [5, 6, 6, 3]


@pytest.mark.parametrize("which", ["input", "filter"])
def test_backprop_out_backprop_shape_mismatch(which):
    dy = tf.zeros([5, 5, 6, 4])  # the output is [5, 6, 6, 4]
    with tf.device("/CPU:0"), pytest.raises(tf.errors.InvalidArgumentError) as info:
        if which == "input":
            tf_ucudnn.conv2d_backprop_input([5, 6, 6, 3], _W, dy, 1, "SAME",
                                            plan=KernelPlan.of((5, 0)))
        else:
            tf_ucudnn.conv2d_backprop_filter(_X, [3, 3, 3, 4], dy, 1, "SAME",
                                             plan=KernelPlan.of((5, 0)))
    message = info.value.message
    assert f"UcudnnConv2DBackprop{which.capitalize()}" in message and "[5@algo=0]" in message
    assert "out_backprop has shape [5, 5, 6, 4] but the convolution's output has shape " \
           "[5, 6, 6, 4]" in message


def test_backprop_input_sizes_must_be_a_vector():
    with tf.device("/CPU:0"), pytest.raises(tf.errors.InvalidArgumentError) as info:
        op_library().ucudnn_conv2d_backprop_input(tf.constant([[5, 6, 6, 3]]), _W, tf.zeros([5, 6, 6, 4]),
                                          strides=[1, 1, 1, 1], padding="SAME")
    assert "UcudnnConv2DBackpropInput" in info.value.message
    assert "input_sizes must be a vector" in info.value.message


