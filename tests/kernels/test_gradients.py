"""tf_ucudnn.kernels.gradients: gradients of the ops, the plans they carry, and second-order gradients."""

import dataclasses

import numpy as np
import pytest
import tensorflow as tf
from reference import (
    CONV2D_CASES,
    CONV3D_CASES,
    GROUPED_CASES,
    Case,
    Conv,
    assert_close,
    assert_on_device,
    backprop_filter,
    backprop_input,
    check_conv,
    conv,
    kernel_plan,
    random,
    safe_algorithms,
)

import tf_ucudnn
from tf_ucudnn.core.plan import WORKSPACE_ATTR, KernelPlan, LayerPlan
from tf_ucudnn.kernels.ops import depthwise_filter
from tf_ucudnn.memory.analysis.liveness import kernel_scratch_bytes

ALL_CASES = CONV2D_CASES + CONV3D_CASES
BACKPROP_TYPES = {2: ("UcudnnConv2DBackpropInput", "UcudnnConv2DBackpropFilter"),
                  3: ("UcudnnConv3DBackpropInput", "UcudnnConv3DBackpropFilter")}


def _forward(nd):
    return tf_ucudnn.conv2d if nd == 2 else tf_ucudnn.conv3d


# --------------------------------------------------------------------- gradients, per case

@pytest.mark.parametrize("case", ALL_CASES, ids=[c.id for c in ALL_CASES])
def test_gradients_match_tf(device, case, rng):
    """tf.GradientTape through conv2d / conv3d with a LayerPlan: output, input gradient and
    filter gradient against TensorFlow's (float32 against the float64 reference)."""
    check_conv(device, case.cfg, tf.float32, case.plan(), rng)


@pytest.mark.parametrize("case", [CONV2D_CASES[1], CONV3D_CASES[0]], ids=lambda c: c.id)
def test_kernel_plan_gradients_use_auto_plans(device, case, rng):
    """A bare KernelPlan plans the forward kernel only; the gradient still matches."""
    check_conv(device, case.cfg, tf.float64, case.plan().forward, rng)


# ------------------------------------------------------------ grouped and depthwise gradients

@pytest.mark.parametrize("case", GROUPED_CASES, ids=[c.id for c in GROUPED_CASES])
def test_grouped_gradients_match_tf(device, case, rng):
    """A grouped convolution's gradients against TensorFlow's gradients of the convolution, one
    per group, concatenated (float32 against the float64 reference)."""
    check_conv(device, case.cfg, tf.float32, case.plan(), rng)


_TF_GROUPED_CASES = [c for c in GROUPED_CASES if c.cfg.nd == 2 or isinstance(c.cfg.padding, str)]


@pytest.mark.parametrize("case", _TF_GROUPED_CASES, ids=[c.id for c in _TF_GROUPED_CASES])
def test_grouped_gradients_equal_tensorflows_grouped_convolution(device, case, rng):
    """Against TensorFlow's own grouped Conv2D/Conv3D and its gradients, compiled by XLA (its CPU
    kernels have no grouped Conv3D), in float64."""
    cfg = case.cfg
    x = random(cfg.input_shape, tf.float64, rng)
    w = random(cfg.filter_shape, tf.float64, rng)
    dy = random(cfg.output_shape, tf.float64, rng)
    strides, dilations = cfg.full(cfg.spatial_strides), cfg.full(cfg.spatial_dilations)
    padding = cfg.padding if isinstance(cfg.padding, str) else "EXPLICIT"
    explicit = [] if isinstance(cfg.padding, str) else [v for pair in cfg.padding for v in pair]

    def tensorflow_conv(x, w):
        if cfg.nd == 2:
            return tf.raw_ops.Conv2D(input=x, filter=w, strides=strides, padding=padding,
                                     explicit_paddings=explicit, data_format=cfg.fmt,
                                     dilations=dilations)
        return tf.raw_ops.Conv3D(input=x, filter=w, strides=strides, padding=padding,
                                 data_format=cfg.fmt, dilations=dilations)

    def gradients(conv_fn, x, w, dy):
        with tf.GradientTape() as tape:
            tape.watch([x, w])
            y = conv_fn(x, w)
        return (y, *tape.gradient(y, [x, w], output_gradients=dy))

    with tf.device("/CPU:0"):
        expected = tf.function(gradients, jit_compile=True)(tensorflow_conv, x, w, dy)
    with tf.device(device):
        actual = gradients(lambda x, w: _forward(cfg.nd)(x, w, **cfg.kwargs(), plan=case.plan()),
                           x, w, dy)
    for got, want, what in zip(actual, expected, ("output", "input gradient", "filter gradient")):
        np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-10, err_msg=f"{cfg} {what}")


@pytest.mark.parametrize("data_format", ["NHWC", "NCHW"])
@pytest.mark.parametrize("strides,dilations,padding", [
    ((1, 1), (1, 1), "SAME"), ((2, 2), (1, 1), "VALID"), ((1, 1), (2, 2), "SAME"),
], ids=["same", "valid-s2", "same-d2"])
def test_depthwise_equals_tf_nn_depthwise_conv2d(device, data_format, strides, dilations,
                                                 padding, rng):
    """tf.nn.depthwise_conv2d as the grouped convolution (filter [kh, kw, C, M] reshaped to
    [kh, kw, 1, C * M]): output and both gradients equal TensorFlow's, micro-batched."""
    x = random((5, 9, 8, 3), tf.float64, rng)
    w = random((3, 3, 3, 2), tf.float64, rng)
    with tf.GradientTape() as tape:
        tape.watch([x, w])
        expected = tf.nn.depthwise_conv2d(x, w, [1, *strides, 1], padding, dilations=dilations)
    dy = random(expected.shape, tf.float64, rng)
    expected_dx, expected_dw = tape.gradient(expected, [x, w], output_gradients=dy)

    def to_format(t):
        return t if data_format == "NHWC" else tf.transpose(t, [0, 3, 1, 2])

    plan = LayerPlan(KernelPlan.of((2, None), (3, None)), KernelPlan.of((4, None), (1, None)),
                     KernelPlan.of((1, None), (4, None)))
    with tf.device(device):
        x_op = to_format(x)
        with tf.GradientTape() as tape:
            tape.watch([x_op, w])
            y = tf_ucudnn.conv2d(x_op, depthwise_filter(w), strides,
                                 padding, data_format=data_format, dilations=dilations, plan=plan)
        dx, dw = tape.gradient(y, [x_op, w], output_gradients=to_format(dy))
    assert_on_device(y, device)
    np.testing.assert_allclose(y, to_format(expected), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(dx, to_format(expected_dx), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(dw, expected_dw, rtol=1e-12, atol=1e-12)


def _random_case(seed: int) -> Case:
    """A random convolution (2-D for even seeds, 3-D for odd) with random plans."""
    rng = np.random.default_rng(1000 + seed)
    nd = 2 if seed % 2 == 0 else 3
    while True:
        channels_last = bool(rng.integers(2))
        batch = int(rng.integers(1, 9 if nd == 2 else 6))
        spatial = [int(rng.integers(1, 13 if nd == 2 else 7)) for _ in range(nd)]
        kernel = [int(rng.integers(1, 4)) for _ in range(nd)]
        strides = [int(rng.integers(1, 4)) for _ in range(nd)]
        dilations = [int(rng.integers(1, 3)) if rng.random() < 0.4 else 1 for _ in range(nd)]
        in_ch, out_ch = (int(rng.integers(1, 9 if nd == 2 else 4)) for _ in range(2))
        kind = rng.choice(["SAME", "VALID", "EXPLICIT"])
        pairs = [[int(rng.integers(0, 3)), int(rng.integers(0, 3))] for _ in range(nd)]
        effective = [(k - 1) * d + 1 for k, d in zip(kernel, dilations)]
        padded = [s + (a + b if kind == "EXPLICIT" else 0) for s, (a, b) in zip(spatial, pairs)]
        if kind != "SAME" and any(p < e for p, e in zip(padded, effective)):
            continue  # an empty output: tested on its own in test_ops
        break
    if kind == "EXPLICIT":
        padding = [[0, 0], *pairs, [0, 0]] if channels_last else [[0, 0], [0, 0], *pairs]
    else:
        padding = str(kind)
    fmt = ("NHWC" if channels_last else "NCHW") if nd == 2 else \
        ("NDHWC" if channels_last else "NCDHW")
    shape = (batch, *spatial, in_ch) if channels_last else (batch, in_ch, *spatial)
    cfg = Conv(shape, (*kernel, in_ch, out_ch), tuple(strides), padding, fmt, tuple(dilations))

    def split():
        if rng.random() < 0.15:
            return ()  # the empty plan
        sizes, left = [], batch
        while left:
            sizes.append(int(rng.integers(1, left + 1)))
            left -= sizes[-1]
        return tuple(sizes)

    return Case(f"{seed:02d}", cfg, split(), split(), split())


def _random_plan(case: Case, seed: int) -> LayerPlan:
    rng = np.random.default_rng(2000 + seed)

    def plan(kernel):
        choices = list(dict.fromkeys([*safe_algorithms(kernel, case.cfg), "auto"]))
        return kernel_plan(case.sizes(kernel), kernel,
                           [choices[i] for i in rng.permutation(len(choices))])

    return LayerPlan(plan("fwd"), plan("bwd_data"), plan("bwd_filter"))


_SWEEP = [_random_case(seed) for seed in range(40)]


@pytest.mark.parametrize("case", _SWEEP, ids=[f"{c.id}-{c.cfg}-plan{'+'.join(map(str, c.fwd))}"
                                              for c in _SWEEP])
def test_random_sweep(device, case, rng):
    """Seeded random convolutions (20 conv2d, 20 conv3d) with random plans: forward and both
    gradients. Every third one in float32, the rest in float64."""
    seed = int(case.id)
    dtype = tf.float32 if seed % 3 == 0 else tf.float64
    check_conv(device, case.cfg, dtype, _random_plan(case, seed), rng)


def test_random_sweep_covers_the_space():
    """The sweep really mixes what it claims to (so a change to the generator cannot quietly
    narrow it)."""
    cfgs = [c.cfg for c in _SWEEP]
    assert {c.nd for c in cfgs} == {2, 3}
    assert {c.fmt for c in cfgs} == {"NHWC", "NCHW", "NDHWC", "NCDHW"}
    kinds = {c.padding if isinstance(c.padding, str) else "EXPLICIT" for c in cfgs}
    assert kinds == {"SAME", "VALID", "EXPLICIT"}
    assert any(max(c.spatial_strides) > 1 for c in cfgs)
    assert any(max(c.spatial_dilations) > 1 for c in cfgs)
    assert any(len(c.fwd) > 1 and len(set(c.fwd)) > 1 for c in _SWEEP)  # uneven splits
    assert any(() in (c.fwd, c.bwd_data, c.bwd_filter) for c in _SWEEP)  # empty plans


def test_numerical_gradient(rng):
    """Theoretical against finite-difference Jacobians (independent of TensorFlow's own
    convolution gradients)."""
    cfg = Conv((3, 2, 4, 5), (2, 3, 2, 2), (1, 2), [[0, 0], [0, 0], [1, 0], [2, 1]], "NCHW",
               (1, 1))
    x = random(cfg.input_shape, tf.float64, rng)
    w = random(cfg.filter_shape, tf.float64, rng)
    plan = LayerPlan(KernelPlan.of((1, 0), (2, 1)), KernelPlan.of((2, 1), (1, 0)),
                     KernelPlan.of((1, 3), (1, 0), (1, 1)))
    fn = lambda x, w: tf_ucudnn.conv2d(x, w, **cfg.kwargs(), plan=plan)
    with tf.device("/CPU:0"):
        theoretical, numerical = tf.test.compute_gradient(fn, [x, w], delta=1e-3)
    for t, n in zip(theoretical, numerical):
        assert t.shape == n.shape and np.abs(t).max() > 0.1
        np.testing.assert_allclose(t, n, rtol=1e-6, atol=1e-6)


def test_gradient_with_unknown_batch(device, rng):
    """In a tf.function traced without the batch size the plan is checked when the step runs."""
    cfg = CONV2D_CASES[0].cfg
    plan = CONV2D_CASES[0].plan()

    @tf.function(input_signature=[tf.TensorSpec([None, 7, 7, 3], tf.float32),
                                  tf.TensorSpec(cfg.filter_shape, tf.float32)])
    def grads(x, w):
        with tf.GradientTape() as tape:
            tape.watch([x, w])
            y = tf_ucudnn.conv2d(x, w, **cfg.kwargs(), plan=plan)
        return tape.gradient(y, [x, w])

    x = random(cfg.input_shape, tf.float32, rng)
    w = random(cfg.filter_shape, tf.float32, rng)
    with tf.device(device):
        dx, dw = grads(x, w)
    assert_on_device(dx, device)
    scale_dx, scale_dw = _reference_grads(tf.abs(x), tf.abs(w), cfg)
    expected_dx, expected_dw = _reference_grads(x, w, cfg)
    assert_close(dx, expected_dx, scale_dx, tf.float32, "input gradient")
    assert_close(dw, expected_dw, scale_dw, tf.float32, "filter gradient")


def _reference_grads(x, w, cfg):
    x, w = tf.cast(x, tf.float64), tf.cast(w, tf.float64)
    with tf.GradientTape() as tape:
        tape.watch([x, w])
        y = conv(x, w, cfg)
    return tape.gradient(y, [x, w])


# ------------------------------------------------------------------ plans in the gradient graph

def _gradient_graph(case: Case, plan):
    cfg = case.cfg
    op = _forward(cfg.nd)

    @tf.function
    def grads(x, w):
        with tf.GradientTape() as tape:
            tape.watch([x, w])
            y = op(x, w, **cfg.kwargs(), plan=plan)
        return tape.gradient(y, [x, w])

    return grads.get_concrete_function(tf.TensorSpec(cfg.input_shape, tf.float32),
                                       tf.TensorSpec(cfg.filter_shape, tf.float32)).graph


def _ops_of_type(graph, op_type):
    return [op for op in graph.get_operations() if op.type == op_type]


_GRAPH_CASES = [CONV2D_CASES[2], CONV2D_CASES[4], CONV3D_CASES[1], CONV3D_CASES[4]]


@pytest.mark.parametrize("case", _GRAPH_CASES, ids=[c.id for c in _GRAPH_CASES])
def test_gradient_ops_carry_the_layer_plan(case):
    plan = LayerPlan(kernel_plan(case.sizes("fwd"), "fwd"),
                     kernel_plan(case.sizes("bwd_data"), "bwd_data", ["algo=1,math=tensor_op",
                                                                      "auto", "algo=0"]),
                     kernel_plan(case.sizes("bwd_filter"), "bwd_filter", [3, "auto", 1]))
    graph = _gradient_graph(case, plan)
    nd = case.cfg.nd
    (forward,) = _ops_of_type(graph, f"UcudnnConv{nd}D")
    (data,) = _ops_of_type(graph, BACKPROP_TYPES[nd][0])
    (filt,) = _ops_of_type(graph, BACKPROP_TYPES[nd][1])

    def plan_of(op, prefix=""):
        return KernelPlan.from_attrs(op.get_attr(prefix + "micro_batches"),
                                     op.get_attr(prefix + "algorithms"))

    assert plan_of(forward) == plan.forward
    assert plan_of(forward, "backprop_input_") == plan.backprop_input
    assert plan_of(forward, "backprop_filter_") == plan.backprop_filter
    assert plan_of(data) == plan.backprop_input
    assert plan_of(filt) == plan.backprop_filter
    assert data.get_attr("micro_batches") == list(case.sizes("bwd_data"))
    assert [a.decode() for a in filt.get_attr("algorithms")] == \
        plan.backprop_filter.attrs()["algorithms"]
    # The gradient ops are the same convolution.
    for name in ("strides", "padding", "explicit_paddings", "data_format", "dilations"):
        assert data.get_attr(name) == forward.get_attr(name) == filt.get_attr(name)
    # ... fed by the forward op's own inputs, and nothing of TensorFlow's convolutions.
    assert filt.inputs[0].name == forward.inputs[0].name
    types = {op.type for op in graph.get_operations()}
    assert not any(t.startswith(("Conv2D", "Conv3D")) for t in types), types


def test_gradient_ops_carry_their_profiled_workspace_for_the_memory_planner():
    case = CONV2D_CASES[2]

    def profiled(sizes, kernel, workspaces):
        plan = kernel_plan(sizes, kernel)
        return KernelPlan(tuple(dataclasses.replace(mb, workspace_bytes=w)
                                for mb, w in zip(plan.micro_batches, workspaces)))

    forward, data, filt = (case.sizes(k) for k in ("fwd", "bwd_data", "bwd_filter"))
    plan = LayerPlan(profiled(forward, "fwd", [100 * (i + 1) for i in range(len(forward))]),
                     profiled(data, "bwd_data", [7000] * len(data)),
                     kernel_plan(filt, "bwd_filter"))  # not profiled: no workspace known
    graph = _gradient_graph(case, plan)
    ops = [_ops_of_type(graph, t)[0] for t in ("UcudnnConv2D", *BACKPROP_TYPES[2])]
    # Micro-batches run one at a time: a kernel needs its largest one's.
    assert [kernel_scratch_bytes(op) for op in ops] == [100 * len(forward), 7000, 0]
    # Without profiles, no node claims a workspace.
    bare = _gradient_graph(case, case.plan())
    assert not [op for op in bare.get_operations() if WORKSPACE_ATTR in op.node_def.attr]


def test_kernel_plan_leaves_gradient_plans_empty():
    case = CONV2D_CASES[0]
    graph = _gradient_graph(case, case.plan().forward)
    (data,) = _ops_of_type(graph, "UcudnnConv2DBackpropInput")
    (filt,) = _ops_of_type(graph, "UcudnnConv2DBackpropFilter")
    for op in (data, filt):
        assert op.get_attr("micro_batches") == [] and op.get_attr("algorithms") == []
    (forward,) = _ops_of_type(graph, "UcudnnConv2D")
    assert forward.get_attr("micro_batches") == [2, 3]
    assert forward.get_attr("algorithms") == [b"algo=0", b"algo=1"]


def test_empty_plan_is_auto_everywhere(device, rng):
    case = CONV2D_CASES[3]
    graph = _gradient_graph(case, None)
    for op in graph.get_operations():
        if op.type.startswith("Ucudnn"):
            assert op.get_attr("micro_batches") == [] and op.get_attr("algorithms") == []
    check_conv(device, case.cfg, tf.float64, LayerPlan(), rng)
    check_conv(device, case.cfg, tf.float64, None, rng)


# ------------------------------------------------------------------------ second-order gradients

_SECOND_ORDER_CASES = [CONV2D_CASES[0], CONV2D_CASES[4], CONV2D_CASES[11], CONV3D_CASES[2],
                       CONV3D_CASES[4]]


@pytest.mark.parametrize("case", _SECOND_ORDER_CASES, ids=[c.id for c in _SECOND_ORDER_CASES])
def test_gradients_of_backprop_input(device, case, rng):
    """The backprop-input op's own gradients (with respect to the filter and out_backprop)."""
    cfg = case.cfg
    w = random(cfg.filter_shape, tf.float64, rng)
    dy = random(cfg.output_shape, tf.float64, rng)
    v = random(cfg.input_shape, tf.float64, rng)
    op = tf_ucudnn.conv2d_backprop_input if cfg.nd == 2 else tf_ucudnn.conv3d_backprop_input
    with tf.device(device):
        with tf.GradientTape() as tape:
            tape.watch([w, dy])
            dx = op(cfg.input_shape, w, dy, **cfg.kwargs(),
                    plan=case.kernel_plan("bwd_data"))
        dw2, ddy = tape.gradient(dx, [w, dy], output_gradients=v)
    assert_on_device(dw2, device)
    with tf.GradientTape() as tape:
        tape.watch([w, dy])
        expected = backprop_input(cfg.input_shape, w, dy, cfg)
    expected_dw2, expected_ddy = tape.gradient(expected, [w, dy], output_gradients=v)
    with tf.GradientTape() as tape:
        aw, ady = tf.abs(w), tf.abs(dy)
        tape.watch([aw, ady])
        scaled = backprop_input(cfg.input_shape, aw, ady, cfg)
    scale_dw2, scale_ddy = tape.gradient(scaled, [aw, ady], output_gradients=tf.abs(v))
    assert_close(dw2, expected_dw2, scale_dw2, tf.float64, "d filter")
    assert_close(ddy, expected_ddy, scale_ddy, tf.float64, "d out_backprop")


@pytest.mark.parametrize("case", _SECOND_ORDER_CASES, ids=[c.id for c in _SECOND_ORDER_CASES])
def test_gradients_of_backprop_filter(device, case, rng):
    """The backprop-filter op's own gradients (with respect to the input and out_backprop)."""
    cfg = case.cfg
    x = random(cfg.input_shape, tf.float64, rng)
    dy = random(cfg.output_shape, tf.float64, rng)
    v = random(cfg.filter_shape, tf.float64, rng)
    op = tf_ucudnn.conv2d_backprop_filter if cfg.nd == 2 else tf_ucudnn.conv3d_backprop_filter
    with tf.device(device):
        with tf.GradientTape() as tape:
            tape.watch([x, dy])
            dw = op(x, cfg.filter_shape, dy, **cfg.kwargs(),
                    plan=case.kernel_plan("bwd_filter"))
        dx2, ddy = tape.gradient(dw, [x, dy], output_gradients=v)
    assert_on_device(dx2, device)
    with tf.GradientTape() as tape:
        tape.watch([x, dy])
        expected = backprop_filter(x, cfg.filter_shape, dy, cfg)
    expected_dx2, expected_ddy = tape.gradient(expected, [x, dy], output_gradients=v)
    with tf.GradientTape() as tape:
        ax, ady = tf.abs(x), tf.abs(dy)
        tape.watch([ax, ady])
        scaled = backprop_filter(ax, cfg.filter_shape, ady, cfg)
    scale_dx2, scale_ddy = tape.gradient(scaled, [ax, ady], output_gradients=tf.abs(v))
    assert_close(dx2, expected_dx2, scale_dx2, tf.float64, "d input")
    assert_close(ddy, expected_ddy, scale_ddy, tf.float64, "d out_backprop")


def _double_backprop(op, x, w, dy, v_x, v_w):
    """d/d(x, w, dy) of <grad_x, v_x> + <grad_w, v_w>, the gradients of op(x, w) for dy."""
    with tf.GradientTape() as outer:
        outer.watch([x, w, dy])
        with tf.GradientTape() as inner:
            inner.watch([x, w])
            y = op(x, w)
        gx, gw = inner.gradient(y, [x, w], output_gradients=dy)
        loss = tf.reduce_sum(gx * v_x) + tf.reduce_sum(gw * v_w)
    return outer.gradient(loss, [x, w, dy])


@pytest.mark.parametrize("case", _SECOND_ORDER_CASES, ids=[c.id for c in _SECOND_ORDER_CASES])
def test_second_order_gradients_of_conv(device, case, rng):
    """Gradients of gradients through conv2d / conv3d with a LayerPlan (as a gradient penalty
    needs), against TensorFlow's second-order gradients."""
    cfg = case.cfg
    x = random(cfg.input_shape, tf.float64, rng)
    w = random(cfg.filter_shape, tf.float64, rng)
    dy = random(cfg.output_shape, tf.float64, rng)
    v_x = random(cfg.input_shape, tf.float64, rng)
    v_w = random(cfg.filter_shape, tf.float64, rng)
    plan = case.plan()
    with tf.device(device):
        actual = _double_backprop(lambda x, w: _forward(cfg.nd)(x, w, **cfg.kwargs(), plan=plan),
                                  x, w, dy, v_x, v_w)
    assert_on_device(actual[0], device)
    expected = _double_backprop(lambda x, w: conv(x, w, cfg), x, w, dy, v_x, v_w)
    scale = _double_backprop(lambda x, w: conv(x, w, cfg), tf.abs(x), tf.abs(w), tf.abs(dy),
                             tf.abs(v_x), tf.abs(v_w))
    for name, a, e, s in zip(("x", "w", "dy"), actual, expected, scale):
        assert_close(a, e, s, tf.float64, f"second-order gradient for {name}")
