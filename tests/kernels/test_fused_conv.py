"""tf_ucudnn.kernels.fused_conv: the fused convolution + bias + activation op against TensorFlow's
unfused ops (convolution, tf.nn.bias_add, tf.nn.relu), forward and gradients, with plans."""

import numpy as np
import pytest
import tensorflow as tf
from reference import Conv, assert_close, assert_on_device, conv, kernel_plan, random

from tf_ucudnn.core.plan import WORKSPACE_ATTR, Algorithm, KernelPlan, LayerPlan, MicroBatch
from tf_ucudnn.kernels.fused_conv import fused_conv2d, fused_conv3d

CASES = [
    Conv((3, 7, 6, 4), (3, 3, 4, 5), (1, 1), "SAME"),
    Conv((2, 4, 9, 8), (3, 2, 4, 3), (2, 1), "VALID", "NCHW"),
    Conv((3, 8, 7, 2), (2, 3, 2, 4), (1, 2), [[0, 0], [1, 2], [0, 1], [0, 0]], "NHWC", (2, 1)),
    Conv((2, 3, 6, 6), (3, 3, 3, 2), (1, 1), "SAME", "NCHW", (2, 2)),
    Conv((2, 5, 4, 6, 2), (2, 3, 2, 2, 3), (1, 2, 1), "SAME"),
    Conv((2, 2, 4, 5, 6), (3, 2, 2, 2, 3), (2, 1, 1), "VALID", "NCDHW"),
]
ACTIVATIONS = ["relu", "identity"]


def _fused(cfg):
    return fused_conv2d if cfg.nd == 2 else fused_conv3d


def _unfused(x, w, b, cfg, activation):
    """TensorFlow's ops one after another, in float64 (the convolution from `reference`)."""
    z = tf.nn.bias_add(conv(x, w, cfg), tf.cast(b, tf.float64), data_format=cfg.fmt)
    return tf.nn.relu(z) if activation == "relu" else z


def _unfused_with_grads(x, w, b, dy, cfg, activation):
    x, w, b, dy = (tf.cast(t, tf.float64) for t in (x, w, b, dy))
    with tf.GradientTape() as tape:
        tape.watch([x, w, b])
        y = _unfused(x, w, b, cfg, activation)
    return (y, *tape.gradient(y, [x, w, b], output_gradients=dy))


def _check(device, cfg, dtype, activation, plan, rng, grads=True, roundings=1):
    """The fused op with its gradients on `device` against the unfused float64 ops. The error
    scale is the same computation on absolute values, the bias added and no activation (ReLU
    only drops terms)."""
    x = random(cfg.input_shape, dtype, rng)
    w = random(cfg.filter_shape, dtype, rng)
    b = random(cfg.filter_shape[-1:], dtype, rng)
    dy = random(cfg.output_shape, dtype, rng)
    with tf.device(device):
        with tf.GradientTape() as tape:
            tape.watch([x, w, b])
            y = _fused(cfg)(x, w, b, **cfg.kwargs(), activation=activation, plan=plan)
        results = (y, *tape.gradient(y, [x, w, b], output_gradients=dy)) if grads else (y,)
    assert_on_device(y, device)
    assert all(r.dtype == dtype for r in results)
    expected = _unfused_with_grads(x, w, b, dy, cfg, activation)
    scales = _unfused_with_grads(tf.abs(x), tf.abs(w), tf.abs(b), tf.abs(dy), cfg, "identity")
    for what, actual, want, scale in zip(["output", "input gradient", "filter gradient",
                                          "bias gradient"], results, expected, scales):
        # Filter gradients of several micro-batches add up in the result type on the GPU.
        sizes = plan.backprop_filter.sizes if isinstance(plan, LayerPlan) else ()
        extra = len(sizes) if what == "filter gradient" and device.startswith("/GPU") else 1
        assert_close(actual, want, scale, dtype, f"{cfg} {activation} {what}",
                     roundings * max(1, extra))


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("cfg", CASES, ids=str)
def test_matches_unfused_ops(device, cfg, activation, rng):
    """Output and the gradients of input, filter and bias, with the undivided plan."""
    _check(device, cfg, tf.float64, activation, None, rng)


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("cfg", [CASES[1], CASES[2], CASES[4]], ids=str)
def test_plans_split_the_batch(device, cfg, activation, rng):
    """Every kernel split its own way; explicit algorithms cycle through ones cuDNN runs for
    every shape (for Identity on the GPU, one fused call per micro-batch with
    IMPLICIT_PRECOMP_GEMM, convolution and bias with the other)."""
    batch = cfg.batch
    plan = LayerPlan(kernel_plan((1, batch - 1), "fwd", cfg=cfg),
                     kernel_plan((batch - 1, 1), "bwd_data", cfg=cfg),
                     kernel_plan((1,) * batch, "bwd_filter", cfg=cfg))
    _check(device, cfg, tf.float64, activation, plan, rng)


def test_equals_tf_nn_ops_in_float32(rng):
    """Straight against tf.nn.conv2d + tf.nn.bias_add + tf.nn.relu in float32, gradients by
    tf.GradientTape through both (no reference helpers)."""
    x = random((4, 9, 8, 3), tf.float32, rng)
    w = random((3, 3, 3, 6), tf.float32, rng)
    b = random((6,), tf.float32, rng)
    kwargs = {"strides": [1, 2], "padding": "SAME", "dilations": [1, 1]}
    plan = LayerPlan(KernelPlan.of((3, 0), (1, 1)), KernelPlan.of((2, 0), (2, 0)),
                     KernelPlan.of((1, 1), (3, 0)))
    with tf.device("/CPU:0"), tf.GradientTape(persistent=True) as tape:
        tape.watch([x, w, b])
        expected = tf.nn.relu(tf.nn.bias_add(tf.nn.conv2d(x, w, **kwargs), b))
        actual = fused_conv2d(x, w, b, **kwargs, plan=plan)
    for got, want in zip([actual, *tape.gradient(actual, [x, w, b])],
                         [expected, *tape.gradient(expected, [x, w, b])]):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)
    assert np.count_nonzero(actual) < actual.shape.num_elements()  # the ReLU did cut


@pytest.mark.parametrize("dtype", [tf.float32, tf.float16, tf.bfloat16], ids=lambda d: d.name)
def test_dtypes(device, dtype, rng):
    """Forward in each type (the CPU rounds the convolution, then the sum with the bias: twice).
    Gradients of half types are left out: a pre-activation within their rounding of zero may
    fall on either side of the ReLU."""
    cfg = CASES[1]
    _check(device, cfg, dtype, "relu", LayerPlan(kernel_plan((1, 1), "fwd", cfg=cfg)), rng,
           grads=dtype == tf.float32, roundings=2)


def test_gradient_keeps_only_the_output_and_uses_the_plans():
    """The gradient's ReLU derivative reads the fused op's output, nothing recomputes or stores a
    pre-activation, and the backprop ops carry the plans (and known workspaces) given."""
    cfg = CASES[0]
    plan = LayerPlan(KernelPlan.of((1, 0), (2, 1)),
                     KernelPlan((MicroBatch(3, Algorithm(1), workspace_bytes=4096),)),
                     KernelPlan.of((2, 0), (1, 3)))

    @tf.function
    def step(x, w, b):
        with tf.GradientTape() as tape:
            tape.watch([x, w, b])
            y = fused_conv2d(x, w, b, **cfg.kwargs(), plan=plan)
        return tape.gradient(y, [x, w, b])

    spec = [tf.TensorSpec(s, tf.float32) for s in (cfg.input_shape, cfg.filter_shape, [5])]
    graph = step.get_concrete_function(*spec).graph
    ops = {op.type: op for op in graph.get_operations()}
    fused = ops["UcudnnFusedConv2D"]
    assert fused.get_attr("micro_batches") == [1, 2]
    assert not {"Relu", "BiasAdd", "Conv2D", "UcudnnConv2D"} & set(ops)
    assert ops["ReluGrad"].inputs[1] is fused.outputs[0]
    backprop_input = ops["UcudnnConv2DBackpropInput"]
    backprop_filter = ops["UcudnnConv2DBackpropFilter"]
    assert backprop_input.get_attr("micro_batches") == [3]
    assert backprop_input.get_attr("algorithms") == [b"algo=1"]
    assert backprop_input.get_attr(WORKSPACE_ATTR) == 4096
    assert backprop_filter.get_attr("micro_batches") == [2, 1]
    assert WORKSPACE_ATTR not in backprop_filter.node_def.attr  # its workspace is not known
    for op in (backprop_input, backprop_filter, ops["BiasAddGrad"]):
        assert op.inputs[-1].op is ops["ReluGrad"]


def test_identity_gradient_has_no_relu_derivative():
    @tf.function
    def grads(x, w, b):
        with tf.GradientTape() as tape:
            tape.watch([x, w, b])
            y = fused_conv2d(x, w, b, 1, "SAME", activation="identity")
        return tape.gradient(y, [x, w, b])

    spec = [tf.TensorSpec(s, tf.float32) for s in ((1, 4, 4, 2), (3, 3, 2, 2), (2,))]
    types = {op.type for op in grads.get_concrete_function(*spec).graph.get_operations()}
    assert "ReluGrad" not in types and "BiasAddGrad" in types


def test_plan_batch_size_runs_other_batches_undivided(device, rng):
    """A plan for batches of 3 runs a batch of 2 undivided, forward and backward."""
    cfg = Conv((2, 5, 5, 3), (3, 3, 3, 4), (1, 1), "SAME")
    plan = LayerPlan(kernel_plan((1, 2), "fwd", cfg=cfg), kernel_plan((2, 1), "bwd_data", cfg=cfg),
                     kernel_plan((1, 1, 1), "bwd_filter", cfg=cfg))
    x = random(cfg.input_shape, tf.float64, rng)
    w = random(cfg.filter_shape, tf.float64, rng)
    b = random((4,), tf.float64, rng)
    with tf.device(device), tf.GradientTape() as tape:
        tape.watch([x, w, b])
        y = fused_conv2d(x, w, b, **cfg.kwargs(), plan=plan, plan_batch_size=3)
    grads = tape.gradient(y, [x, w, b])
    expected = _unfused_with_grads(x, w, b, tf.ones_like(y), cfg, "relu")
    for actual, want in zip([y, *grads], expected):
        np.testing.assert_allclose(actual, want, rtol=1e-10, atol=1e-10)


def test_empty_input_depth_gives_the_activated_bias(device):
    """No input channels: the convolution is zeros, so y = relu(bias) everywhere."""
    b = tf.constant([-1.0, 0.5, 2.0], tf.float64)
    with tf.device(device):
        y = fused_conv2d(tf.zeros([2, 4, 4, 0], tf.float64), tf.zeros([3, 3, 0, 3], tf.float64),
                         b, 1, "SAME")
    np.testing.assert_array_equal(y, np.broadcast_to([0.0, 0.5, 2.0], (2, 4, 4, 3)))


def test_empty_batch(device):
    with tf.device(device):
        y = fused_conv2d(tf.zeros([0, 5, 5, 2]), tf.ones([3, 3, 2, 4]), tf.ones([4]), 1, "SAME",
                         data_format="NHWC")
    assert y.shape == (0, 5, 5, 4)


# -------------------------------------------------------------------------------------- errors

@pytest.mark.parametrize("bias_shape, message", [
    ((3,), "bias has 3 values but the convolution has 5 output channels"),
    ((1, 5), r"bias must be a vector of one value per output channel, got shape \[1,5\]"),
])
def test_bad_bias_is_named(bias_shape, message):
    x, w, b = tf.zeros([2, 6, 6, 4]), tf.zeros([3, 3, 4, 5]), tf.zeros(bias_shape)
    with tf.device("/CPU:0"), pytest.raises(tf.errors.InvalidArgumentError,
                                            match=r"UcudnnFusedConv2D .*" + message):
        fused_conv2d(x, w, b, 1, "SAME")
    # Traced, the shape function says the same while the graph is built.
    with pytest.raises(ValueError, match=message):
        tf.function(lambda: fused_conv2d(x, w, b, 1, "SAME")).get_concrete_function()


def test_bias_gives_the_channels_an_unknown_filter_does_not():
    @tf.function(input_signature=[tf.TensorSpec([2, 6, 6, 4]), tf.TensorSpec(None),
                                  tf.TensorSpec([7])])
    def fn(x, w, b):
        return fused_conv2d(x, w, b, 1, "SAME")

    assert fn.get_concrete_function().structured_outputs.shape.as_list() == [2, None, None, 7]


@pytest.mark.parametrize("activation", ["sigmoid", "Relu6", None])
def test_unknown_activation_is_refused(activation):
    with pytest.raises(ValueError, match=r"activation must be one of \['identity', 'relu'\]"):
        fused_conv2d(tf.zeros([1, 4, 4, 2]), tf.zeros([3, 3, 2, 2]), tf.zeros([2]), 1, "SAME",
                     activation=activation)


def test_plan_that_does_not_fit_the_batch_names_the_plan():
    with tf.device("/CPU:0"), pytest.raises(tf.errors.InvalidArgumentError,
                                            match=r"plan \[1@auto, 1@auto\].*sum to 2 but the "
                                                  r"batch has 3 samples"):
        fused_conv2d(tf.zeros([3, 4, 4, 2]), tf.zeros([3, 3, 2, 2]), tf.zeros([2]), 1, "SAME",
                     plan=KernelPlan.of((1, None), (1, None)))


def test_bad_gradient_plan_fails_where_it_was_written():
    plan = LayerPlan(backprop_filter=KernelPlan.of((2, 99)))
    with tf.device("/CPU:0"), pytest.raises(tf.errors.InvalidArgumentError,
                                            match=r"backprop_filter_micro_batches=\[2\].*invalid"):
        fused_conv2d(tf.zeros([2, 4, 4, 2]), tf.zeros([3, 3, 2, 2]), tf.zeros([2]), 1, "SAME",
                     plan=plan)
