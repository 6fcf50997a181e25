"""tf_ucudnn.kernels.ops: the forward and backprop ops against TensorFlow's (bad inputs: test_op_errors)."""

import numpy as np
import pytest
import tensorflow as tf
from reference import (
    CONV2D_CASES,
    CONV3D_CASES,
    GROUPED_CASES,
    Conv,
    assert_close,
    assert_on_device,
    backprop_filter,
    backprop_input,
    check_conv,
    conv,
    conv_and_grads,
    kernel_plan,
    random,
    safe_algorithms,
)

import tf_ucudnn
from tf_ucudnn.core.plan import Algorithm, KernelPlan, LayerPlan, MicroBatch

ALL_CASES = CONV2D_CASES + CONV3D_CASES
DTYPES = [tf.float64, tf.float32, tf.float16, tf.bfloat16]


def _ids(cases):
    return [case.id for case in cases]


def _forward(nd):
    return tf_ucudnn.conv2d if nd == 2 else tf_ucudnn.conv3d


def _backprop_input(nd):
    return tf_ucudnn.conv2d_backprop_input if nd == 2 else tf_ucudnn.conv3d_backprop_input


def _backprop_filter(nd):
    return tf_ucudnn.conv2d_backprop_filter if nd == 2 else tf_ucudnn.conv3d_backprop_filter


# ------------------------------------------------------------------------------ forward, per case

@pytest.mark.parametrize("case", ALL_CASES, ids=_ids(ALL_CASES))
def test_forward_matches_tf(device, case, rng):
    check_conv(device, case.cfg, tf.float32, case.plan().forward, rng, grads=False)


@pytest.mark.parametrize("case", ALL_CASES, ids=_ids(ALL_CASES))
def test_forward_float64(device, case, rng):
    check_conv(device, case.cfg, tf.float64, case.plan(), rng, grads=False)


_NHWC_CASES = [c for c in CONV2D_CASES if c.cfg.fmt == "NHWC"]


@pytest.mark.parametrize("case", _NHWC_CASES, ids=_ids(_NHWC_CASES))
def test_conv2d_equals_tf_nn_conv2d_in_float32(case, rng):
    """Straight against tf.nn.conv2d in float32, no reference helpers (the CPU runs NHWC with
    dilations and explicit padding): also vouches for the float64 references."""
    cfg = case.cfg
    x = random(cfg.input_shape, tf.float32, rng)
    w = random(cfg.filter_shape, tf.float32, rng)
    with tf.device("/CPU:0"):
        expected = tf.nn.conv2d(x, w, strides=cfg.spatial_strides, padding=cfg.padding,
                                dilations=cfg.spatial_dilations)
        actual = tf_ucudnn.conv2d(x, w, strides=cfg.spatial_strides, padding=cfg.padding,
                                  dilations=cfg.spatial_dilations, plan=case.plan())
    scale = tf.nn.conv2d(tf.abs(x), tf.abs(w), strides=cfg.spatial_strides, padding=cfg.padding,
                         dilations=cfg.spatial_dilations)
    assert_close(actual, expected, 2 * scale, tf.float32, str(cfg))
    assert_close(conv(x, w, cfg), expected, 2 * scale, tf.float32, "reference")


_NDHWC_CASES = [c for c in CONV3D_CASES if c.cfg.fmt == "NDHWC" and c.cfg.padding == "VALID"
                and c.cfg.spatial_dilations == [1, 1, 1]]


@pytest.mark.parametrize("case", _NDHWC_CASES, ids=_ids(_NDHWC_CASES))
def test_conv3d_equals_tf_nn_conv3d_in_float32(case, rng):
    cfg = case.cfg
    x = random(cfg.input_shape, tf.float32, rng)
    w = random(cfg.filter_shape, tf.float32, rng)
    strides = [1, *cfg.spatial_strides, 1]
    with tf.device("/CPU:0"):
        expected = tf.nn.conv3d(x, w, strides=strides, padding=cfg.padding)
        actual = tf_ucudnn.conv3d(x, w, strides=strides, padding=cfg.padding, plan=case.plan())
    scale = tf.nn.conv3d(tf.abs(x), tf.abs(w), strides=strides, padding=cfg.padding)
    assert_close(actual, expected, 2 * scale, tf.float32, str(cfg))


# ------------------------------------------------------------------------------- dtypes

_DTYPE_CASES = [CONV2D_CASES[0], CONV2D_CASES[4], CONV2D_CASES[11], CONV3D_CASES[1],
                CONV3D_CASES[4]]


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.name)
@pytest.mark.parametrize("case", _DTYPE_CASES, ids=_ids(_DTYPE_CASES))
def test_dtypes_forward_and_gradients(device, case, dtype, rng):
    check_conv(device, case.cfg, dtype, case.plan(), rng)


# ------------------------------------------------------------------ grouped and depthwise

@pytest.mark.parametrize("case", GROUPED_CASES, ids=_ids(GROUPED_CASES))
def test_grouped_forward_float64(device, case, rng):
    check_conv(device, case.cfg, tf.float64, case.plan(), rng, grads=False)


@pytest.mark.parametrize("case", GROUPED_CASES, ids=_ids(GROUPED_CASES))
def test_grouped_backprop_ops_match_tf_gradients(device, case, rng):
    """The backprop ops of a grouped convolution against TensorFlow's gradients of the
    convolution (one per group, concatenated), in float64."""
    cfg = case.cfg
    x = random(cfg.input_shape, tf.float64, rng)
    w = random(cfg.filter_shape, tf.float64, rng)
    dy = random(cfg.output_shape, tf.float64, rng)
    with tf.device(device):
        dx = _backprop_input(cfg.nd)(tf.constant(cfg.input_shape, tf.int32), w, dy,
                                     **cfg.kwargs(), plan=case.kernel_plan("bwd_data"))
        dw = _backprop_filter(cfg.nd)(x, tf.constant(cfg.filter_shape, tf.int32), dy,
                                      **cfg.kwargs(), plan=case.kernel_plan("bwd_filter"))
    assert_on_device(dx, device)
    _, expected_dx, expected_dw = conv_and_grads(x, w, dy, cfg)
    _, scale_dx, scale_dw = conv_and_grads(tf.abs(x), tf.abs(w), tf.abs(dy), cfg)
    assert_close(dx, expected_dx, scale_dx, tf.float64, f"{cfg} backprop input")
    assert_close(dw, expected_dw, scale_dw, tf.float64, f"{cfg} backprop filter")


def test_grouped_micro_batches_are_the_batch(rng):
    """Groups do not change how a plan splits the batch: each micro-batch's result is the
    grouped convolution of its samples alone."""
    x = random((3, 6, 6, 4), tf.float64, rng)
    w = random((3, 3, 1, 8), tf.float64, rng)
    with tf.device("/CPU:0"):
        y = tf_ucudnn.conv2d(x, w, 1, "SAME", plan=KernelPlan.of((1, 0), (2, 1)))
        alone = [tf_ucudnn.conv2d(x[:1], w, 1, "SAME"), tf_ucudnn.conv2d(x[1:], w, 1, "SAME")]
    np.testing.assert_allclose(y, tf.concat(alone, 0), rtol=1e-12, atol=1e-12)


# ---------------------------------------------------------------------------- plans that split

_SPLIT_CFG_2D = Conv((7, 3, 6, 5), (3, 3, 3, 4), (1, 2), "SAME", "NCHW")
_SPLITS = [(7,), (1, 4, 2), (3, 4), (1,) * 7, (2, 2, 2, 1), (6, 1), (1, 6)]


@pytest.mark.parametrize("sizes", _SPLITS, ids=lambda s: "+".join(map(str, s)))
def test_every_split_of_the_batch_gives_the_same_result(device, sizes, rng):
    cfg = _SPLIT_CFG_2D
    plan = LayerPlan(kernel_plan(sizes, "fwd", cfg=cfg),
                     kernel_plan(sizes[::-1], "bwd_data", cfg=cfg),
                     kernel_plan(sizes, "bwd_filter", cfg=cfg))
    check_conv(device, cfg, tf.float64, plan, rng)


def test_plan_micro_batches_are_the_batch_not_copies(rng):
    """Each micro-batch covers its own samples: a plan 1+1+1 over three different samples gives
    three different results, each equal to the convolution of its sample alone."""
    cfg = Conv((3, 5, 5, 2), (3, 3, 2, 2), (1, 1), "SAME")
    x = random(cfg.input_shape, tf.float64, rng)
    w = random(cfg.filter_shape, tf.float64, rng)
    with tf.device("/CPU:0"):
        y = tf_ucudnn.conv2d(x, w, 1, "SAME", plan=KernelPlan.of((1, 0), (1, 1), (1, 0)))
        for n in range(3):
            alone = tf_ucudnn.conv2d(x[n:n + 1], w, 1, "SAME")
            np.testing.assert_allclose(y[n:n + 1], alone, rtol=1e-12, atol=1e-12)
    assert not np.allclose(y[0], y[1])


@pytest.mark.parametrize("algorithms", [["auto", "auto"], ["algo=0", "algo=1,math=default"],
                                        ["algo=1,math=fma", "auto"]],
                         ids=["auto", "explicit", "mixed"])
def test_algorithms_with_math_modes(device, algorithms, rng):
    cfg = Conv((5, 6, 6, 2), (3, 3, 2, 3), (1, 1), "SAME")
    plan = KernelPlan(tuple(MicroBatch(size, Algorithm.parse(text))
                            for size, text in zip((2, 3), algorithms)))
    check_conv(device, cfg, tf.float32, plan, rng, grads=False)


def test_strides_and_dilations_forms_are_equivalent(rng):
    x = random((2, 9, 9, 2), tf.float64, rng)
    w = random((3, 3, 2, 2), tf.float64, rng)
    with tf.device("/CPU:0"):
        results = [tf_ucudnn.conv2d(x, w, strides=s, padding="SAME", dilations=d)
                   for s, d in [(2, 2), ([2], [2]), ([2, 2], [2, 2]), ([1, 2, 2, 1], [1, 2, 2, 1])]]
        x_nchw = tf.transpose(x, [0, 3, 1, 2])
        nchw = tf_ucudnn.conv2d(x_nchw, w, strides=[1, 1, 2, 2], padding="SAME",
                                data_format="NCHW", dilations=[1, 1, 2, 2])
    for result in results[1:]:
        np.testing.assert_array_equal(result, results[0])
    np.testing.assert_allclose(tf.transpose(nchw, [0, 2, 3, 1]), results[0], rtol=1e-12,
                               atol=1e-12)


# ------------------------------------------------------------------------------ backprop ops

@pytest.mark.parametrize("case", ALL_CASES, ids=_ids(ALL_CASES))
def test_backprop_input_matches_raw_op(device, case, rng):
    """Against tf.raw_ops.Conv2DBackpropInput / Conv3DBackpropInputV2 (in float64)."""
    cfg = case.cfg
    w = random(cfg.filter_shape, tf.float64, rng)
    dy = random(cfg.output_shape, tf.float64, rng)
    plan = case.kernel_plan("bwd_data")
    with tf.device(device):
        dx = _backprop_input(cfg.nd)(tf.constant(cfg.input_shape, tf.int32), w, dy,
                                     **cfg.kwargs(), plan=plan)
    assert_on_device(dx, device)
    expected = backprop_input(cfg.input_shape, w, dy, cfg)
    scale = backprop_input(cfg.input_shape, tf.abs(w), tf.abs(dy), cfg)
    assert_close(dx, expected, scale, tf.float64, f"{cfg} backprop input")


@pytest.mark.parametrize("case", ALL_CASES, ids=_ids(ALL_CASES))
def test_backprop_filter_matches_raw_op(device, case, rng):
    """Against tf.raw_ops.Conv2DBackpropFilter / Conv3DBackpropFilterV2 (in float64)."""
    cfg = case.cfg
    x = random(cfg.input_shape, tf.float64, rng)
    dy = random(cfg.output_shape, tf.float64, rng)
    plan = case.kernel_plan("bwd_filter")
    with tf.device(device):
        dw = _backprop_filter(cfg.nd)(x, tf.constant(cfg.filter_shape, tf.int32), dy,
                                      **cfg.kwargs(), plan=plan)
    assert_on_device(dw, device)
    expected = backprop_filter(x, cfg.filter_shape, dy, cfg)
    scale = backprop_filter(tf.abs(x), cfg.filter_shape, tf.abs(dy), cfg)
    assert_close(dw, expected, scale, tf.float64, f"{cfg} backprop filter")


@pytest.mark.parametrize("dtype", [tf.float32, tf.float16], ids=lambda d: d.name)
def test_backprop_ops_equal_tf_raw_ops_in_same_dtype(dtype, rng):
    """NHWC, dilation 1: TensorFlow's own CPU backprop ops run as they are, in the op's dtype."""
    cfg = Conv((5, 7, 6, 3), (3, 2, 3, 4), (2, 1), "SAME")
    x = random(cfg.input_shape, dtype, rng)
    w = random(cfg.filter_shape, dtype, rng)
    dy = random(cfg.output_shape, dtype, rng)
    attrs = {"strides": [1, 2, 1, 1], "padding": "SAME"}
    with tf.device("/CPU:0"):
        dx = tf_ucudnn.conv2d_backprop_input(cfg.input_shape, w, dy, plan=KernelPlan.of(
            (2, 0), (3, 1)), **attrs)
        dw = tf_ucudnn.conv2d_backprop_filter(x, cfg.filter_shape, dy, plan=KernelPlan.of(
            (1, 0), (4, 3)), **attrs)
        expected_dx = tf.raw_ops.Conv2DBackpropInput(input_sizes=cfg.input_shape, filter=w,
                                                     out_backprop=dy, **attrs)
        expected_dw = tf.raw_ops.Conv2DBackpropFilter(input=x, filter_sizes=cfg.filter_shape,
                                                      out_backprop=dy, **attrs)
    scale_dx = backprop_input(cfg.input_shape, tf.abs(w), tf.abs(dy), cfg)
    scale_dw = backprop_filter(tf.abs(x), cfg.filter_shape, tf.abs(dy), cfg)
    # Two results that each round once: twice the tolerance of one.
    assert_close(dx, expected_dx, scale_dx, dtype, "backprop input", roundings=2)
    assert_close(dw, expected_dw, scale_dw, dtype, "backprop filter", roundings=2)


def test_conv3d_backprop_input_takes_int64_sizes(device, rng):
    cfg = CONV3D_CASES[0].cfg
    w = random(cfg.filter_shape, tf.float64, rng)
    dy = random(cfg.output_shape, tf.float64, rng)
    with tf.device(device):
        # Algorithm 1 is deterministic (0 adds with atomics), so the two runs agree bit for bit.
        plan = KernelPlan.of((2, 1), (3, 1))
        dx32 = tf_ucudnn.conv3d_backprop_input(tf.constant(cfg.input_shape, tf.int32), w, dy,
                                               **cfg.kwargs(), plan=plan)
        dx64 = tf_ucudnn.conv3d_backprop_input(tf.constant(cfg.input_shape, tf.int64), w, dy,
                                               **cfg.kwargs(), plan=plan)
    assert_on_device(dx64, device)
    np.testing.assert_array_equal(dx32, dx64)
    assert_close(dx64, backprop_input(cfg.input_shape, w, dy, cfg),
                 backprop_input(cfg.input_shape, tf.abs(w), tf.abs(dy), cfg), tf.float64)


# ------------------------------------------------------------------- shapes, empty, and graphs

@pytest.mark.parametrize("case", ALL_CASES, ids=_ids(ALL_CASES))
def test_static_shapes_in_graph(case):
    """The shape functions give TensorFlow's output shape, and what they cannot know stays
    unknown."""
    cfg = case.cfg
    op = _forward(cfg.nd)
    x_spec = tf.TensorSpec(cfg.input_shape, tf.float32)
    w_spec = tf.TensorSpec(cfg.filter_shape, tf.float32)
    traced = tf.function(lambda x, w: op(x, w, **cfg.kwargs(), plan=case.plan()))
    out = traced.get_concrete_function(x_spec, w_spec).outputs[0]
    assert tuple(out.shape) == cfg.output_shape

    unknown = tf.TensorSpec([None] * len(cfg.input_shape), tf.float32)
    out = tf.function(lambda x, w: op(x, w, **cfg.kwargs())).get_concrete_function(
        unknown, w_spec).outputs[0]
    assert out.shape.rank == len(cfg.input_shape) and out.shape.num_elements() is None
    channel_axis = -1 if cfg.channels_last else 1
    assert out.shape[channel_axis] == cfg.filter_shape[-1]

    dy_spec = tf.TensorSpec(cfg.output_shape, tf.float32)
    dx = tf.function(lambda w, dy: _backprop_input(cfg.nd)(
        tf.constant(cfg.input_shape), w, dy, **cfg.kwargs())).get_concrete_function(
        w_spec, dy_spec).outputs[0]
    assert tuple(dx.shape) == cfg.input_shape
    dw = tf.function(lambda x, dy: _backprop_filter(cfg.nd)(
        x, tf.constant(cfg.filter_shape), dy, **cfg.kwargs())).get_concrete_function(
        x_spec, dy_spec).outputs[0]
    assert tuple(dw.shape) == cfg.filter_shape


@pytest.mark.parametrize("case", [CONV2D_CASES[0], CONV2D_CASES[2], CONV3D_CASES[2]],
                         ids=lambda c: c.id)
def test_tf_function_equals_eager(device, case, rng):
    cfg = case.cfg
    op = _forward(cfg.nd)
    x = random(cfg.input_shape, tf.float32, rng)
    w = random(cfg.filter_shape, tf.float32, rng)
    with tf.device(device):
        eager = op(x, w, **cfg.kwargs(), plan=case.plan())
        graph = tf.function(lambda x, w: op(x, w, **cfg.kwargs(), plan=case.plan()))(x, w)
    np.testing.assert_array_equal(eager, graph)
    assert_on_device(graph, device)


@pytest.mark.parametrize("cfg", [
    Conv((3, 2, 2, 2), (3, 3, 2, 4), (2, 2), "VALID"),
    Conv((3, 2, 2, 2), (3, 3, 2, 4), (2, 2), [[0, 0]] * 4),
    Conv((3, 2, 5, 2), (2, 2, 2, 4), (2, 1), "VALID", dilations=(2, 1)),
    Conv((2, 2, 3, 3, 1), (3, 3, 2, 1, 2), (3, 1, 1), "VALID", "NDHWC"),
], ids=["valid-s2", "explicit-s2", "valid-s2-d2", "3d-valid-s3"])
def test_empty_output(device, cfg, rng):
    """A window that never fits gives an empty output, as in TensorFlow (its output size
    formula truncates), and zero gradients."""
    x = random(cfg.input_shape, tf.float64, rng)
    w = random(cfg.filter_shape, tf.float64, rng)
    expected_shape = cfg.output_shape  # from TensorFlow's own op
    assert 0 in expected_shape
    plan = LayerPlan(KernelPlan.of((1, 0), (cfg.batch - 1, 1)), KernelPlan.of((cfg.batch, 0)),
                     KernelPlan.of((cfg.batch - 1, 0), (1, 1)))
    with tf.device(device):
        with tf.GradientTape() as tape:
            tape.watch([x, w])
            y = _forward(cfg.nd)(x, w, **cfg.kwargs(), plan=plan)
        dx, dw = tape.gradient(y, [x, w], output_gradients=tf.zeros_like(y))
        dw_direct = _backprop_filter(cfg.nd)(x, cfg.filter_shape, tf.zeros(y.shape, tf.float64),
                                             **cfg.kwargs(), plan=plan.backprop_filter)
    assert tuple(y.shape) == expected_shape
    for grad in (dx, dw, dw_direct):
        np.testing.assert_array_equal(grad, np.zeros(grad.shape))
    assert dx.shape == x.shape and dw.shape == w.shape


def test_empty_batch(device, rng):
    w = random((3, 3, 2, 4), tf.float64, rng)
    with tf.device(device):
        y = tf_ucudnn.conv2d(tf.zeros([0, 5, 5, 2], tf.float64), w, 1, "SAME")
        dw = tf_ucudnn.conv2d_backprop_filter(tf.zeros([0, 5, 5, 2], tf.float64), [3, 3, 2, 4],
                                              tf.zeros([0, 5, 5, 4], tf.float64), 1, "SAME")
    assert y.shape == (0, 5, 5, 4)
    np.testing.assert_array_equal(dw, np.zeros([3, 3, 2, 4]))
    with pytest.raises(tf.errors.InvalidArgumentError, match="sum to 2 but the batch has 0"):
        tf_ucudnn.conv2d(tf.zeros([0, 5, 5, 2], tf.float64), w, 1, "SAME",
                         plan=KernelPlan.of((2, 0)))


def test_negative_output_size_is_an_error():
    x = tf.zeros([2, 1, 5, 1])
    w = tf.zeros([3, 1, 1, 1])
    with tf.device("/CPU:0"), pytest.raises(tf.errors.InvalidArgumentError) as info:
        tf_ucudnn.conv2d(x, w, 1, "VALID", dilations=2, plan=KernelPlan.of((2, 1)))
    message = info.value.message
    assert "UcudnnConv2D" in message and "[2@algo=1]" in message
    assert "output size would be negative" in message
    with pytest.raises(ValueError, match="output size would be negative"):
        tf.function(lambda: tf_ucudnn.conv2d(x, w, 1, "VALID", dilations=2))()


# ----------------------------------------------------------------------------------- GPU only

@pytest.mark.gpu
@pytest.mark.parametrize("what", ["fft-stride2", "fft-dilation2"])
def test_gpu_unsupported_algorithm_for_the_shape(gpu_device, what, rng):
    """Forward algorithm 4 (FFT) supports neither strides nor dilations: cuDNN rejects it."""
    x = random((4, 8, 8, 2), tf.float32, rng)
    w = random((3, 3, 2, 2), tf.float32, rng)
    kwargs = {"strides": 2} if what == "fft-stride2" else {"strides": 1, "dilations": 2}
    with tf.device(gpu_device), pytest.raises(tf.errors.InvalidArgumentError) as info:
        tf_ucudnn.conv2d(x, w, padding="SAME", plan=KernelPlan.of((1, 0), (3, 4)), **kwargs)
    message = info.value.message
    assert "UcudnnConv2D '" in message and "(fwd kernel, plan [1@algo=0, 3@algo=4])" in message
    assert "micro-batch 1 (samples 1..3)" in message
    assert "does not support algorithm 4" in message


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [tf.float16, tf.bfloat16], ids=lambda d: d.name)
@pytest.mark.parametrize("case", [CONV2D_CASES[2], CONV2D_CASES[5], CONV3D_CASES[0]],
                         ids=lambda c: c.id)
def test_gpu_low_precision_with_tensor_ops(gpu_device, case, dtype, rng):
    """float16 / bfloat16 on the GPU, with tensor-op math requested explicitly, against the
    float64 reference."""
    sizes = case.fwd or (case.cfg.batch,)

    def tensor_op(kernel):
        choices = [a if a == "auto" else f"algo={a},math=tensor_op"
                   for a in safe_algorithms(kernel, case.cfg)]
        return kernel_plan(sizes, kernel, [*choices, "auto"])

    plan = LayerPlan(tensor_op("fwd"), tensor_op("bwd_data"), tensor_op("bwd_filter"))
    check_conv(gpu_device, case.cfg, dtype, plan, rng)


@pytest.mark.gpu
def test_gpu_float64_runs_on_the_gpu(gpu_device, rng):
    cfg = CONV2D_CASES[0].cfg
    check_conv(gpu_device, cfg, tf.float64, CONV2D_CASES[0].plan(), rng)


@pytest.mark.parametrize("jit_compile", [False, True], ids=["op", "xla"])
def test_plan_batch_size_runs_other_batches_undivided(device, jit_compile, rng):
    """A plan for 4 samples, given as such: a batch of 3 runs undivided, gradients too, where it
    would otherwise be refused."""
    plan = LayerPlan(*(kernel_plan(sizes, kernel, ["auto"]) for sizes, kernel in
                       [((1, 3), "fwd"), ((2, 2), "bwd_data"), ((3, 1), "bwd_filter")]))
    w = random([3, 3, 2, 5], tf.float32, rng)

    def step(conv, x, **kwargs):
        def run(x, w):
            with tf.GradientTape() as tape:
                tape.watch([x, w])
                y = conv(x, w, strides=1, padding="SAME", **kwargs)
                loss = tf.reduce_sum(y * y)
            return (y, *tape.gradient(loss, [x, w]))
        with tf.device(device):
            return tf.function(run, jit_compile=jit_compile)(x, w)

    for batch in (4, 3):
        x = random([batch, 6, 6, 2], tf.float32, rng)
        expected = step(tf.nn.conv2d, x)
        got = step(tf_ucudnn.conv2d, x, plan=plan, plan_batch_size=4)
        for name, a, b in zip(["y", "dx", "dw"], got, expected):
            np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-4,
                                       atol=1e-4 * float(tf.reduce_max(tf.abs(b))),
                                       err_msg=f"batch {batch}: {name}")
    with pytest.raises((ValueError, tf.errors.InvalidArgumentError), match="sum to 4 but the "
                       "batch has 3"):
        step(tf_ucudnn.conv2d, random([3, 6, 6, 2], tf.float32, rng), plan=plan)
    with pytest.raises(tf.errors.InvalidArgumentError,
                       match="sums to 4 samples but is for batches of plan_batch_size=5"):
        step(tf_ucudnn.conv2d, random([5, 6, 6, 2], tf.float32, rng), plan=plan,
             plan_batch_size=5)
