"""Convolutions planned in another form than as they are: strided 1x1 ones subsampled (a stride-1
convolution on the input's strided samples), strided ones of few channels in space-to-depth
blocks of the stride, channels-last ones on channels-first copies of their tensors. The same
results as TensorFlow's own convolution
for every kernel, layout, padding and type, with legacy algorithms and engine configurations,
eagerly and under XLA; measured with the copies counted; and refused, naming the reason, where a
plan mixes forms or a convolution cannot take its form."""

import numpy as np
import pytest
import reference
import tensorflow as tf

from tf_ucudnn.core.conv_layer import ConvLayer
from tf_ucudnn.core.plan import (
    CHANNELS_FIRST,
    KERNELS,
    SPACE_TO_DEPTH,
    SUBSAMPLED,
    Algorithm,
    KernelPlan,
    LayerPlan,
    MicroBatch,
)
from tf_ucudnn.graph.rewrite import rewrite_convolutions
from tf_ucudnn.kernels import fused_conv
from tf_ucudnn.kernels.library import engines_available, op_library
from tf_ucudnn.profiling import profiler

CONFIGS = {
    SUBSAMPLED: {
        "NCHW-s2": reference.Conv((5, 8, 10, 10), (1, 1, 8, 6), strides=(2, 2),
                                  padding="VALID", data_format="NCHW"),
        "NHWC-s2-odd-SAME": reference.Conv((5, 9, 11, 8), (1, 1, 8, 6), strides=(2, 2),
                                           padding="SAME", data_format="NHWC"),
        "NHWC-s13": reference.Conv((5, 7, 9, 4), (1, 1, 4, 6), strides=(1, 3),
                                   padding="VALID"),
        "NCDHW-s2": reference.Conv((5, 4, 5, 6, 6), (1, 1, 1, 4, 6), strides=(2, 2, 2),
                                   padding="VALID", data_format="NCDHW"),
    },
    SPACE_TO_DEPTH: {
        # ResNet's stem and AlexNet's first layer, small.
        "NCHW-7x7-s2-pad3": reference.Conv(
            (5, 3, 16, 16), (7, 7, 3, 8), strides=(2, 2),
            padding=[[0, 0], [0, 0], [3, 3], [3, 3]], data_format="NCHW"),
        "NHWC-11x11-s4": reference.Conv((5, 27, 27, 3), (11, 11, 3, 6), strides=(4, 4),
                                        padding="VALID"),
        "NHWC-3x3-s2-odd-SAME": reference.Conv((5, 9, 11, 4), (3, 3, 4, 6), strides=(2, 2),
                                               padding="SAME"),
        "NHWC-5x3-s2-asymmetric": reference.Conv(
            (5, 10, 9, 2), (5, 3, 2, 4), strides=(2, 2),
            padding=[[0, 0], [2, 1], [0, 2], [0, 0]]),
        # The last rows and columns are read by no output: their gradient is zero.
        "NCHW-3x3-s4-unread": reference.Conv((5, 2, 18, 18), (3, 3, 2, 4), strides=(4, 4),
                                             padding="VALID", data_format="NCHW"),
    },
    CHANNELS_FIRST: {
        "NHWC-depthwise-3x3-SAME": reference.Conv((5, 9, 9, 6), (3, 3, 1, 6), padding="SAME"),
        "NHWC-grouped2-3x3-s2-asymmetric": reference.Conv(
            (5, 10, 9, 4), (3, 3, 2, 6), strides=(2, 2),
            padding=[[0, 0], [1, 2], [0, 1], [0, 0]]),
        "NDHWC-3x3x3": reference.Conv((5, 4, 5, 6, 3), (3, 3, 3, 3, 4), padding="VALID"),
    },
}
# Legacy algorithms every kernel of the stride-1 convolution cuDNN is given runs.
ALGORITHMS = {"fwd": "algo=0", "bwd_data": "algo=1", "bwd_filter": "algo=1"}
CASES = [(form, config) for form, configs in CONFIGS.items() for config in sorted(configs)]


def _plan(form, sizes=(2, 3)):
    return LayerPlan(*(KernelPlan(tuple(MicroBatch(size, Algorithm.parse(f"{ALGORITHMS[k]},"
                                                                          f"{form}=1"))
                                        for size in sizes)) for k in KERNELS))


@pytest.mark.parametrize("dtype", [tf.float32, tf.float64, tf.float16], ids=lambda d: d.name)
@pytest.mark.parametrize("form, config", CASES)
def test_plans_in_each_form_compute_tensorflows_convolution(device, form, config, dtype, rng):
    """float64 channels-last layouts also transpose (cuDNN has no such kernels)."""
    reference.check_conv(device, CONFIGS[form][config], dtype, _plan(form), rng)


@pytest.mark.parametrize("form, config", [(SUBSAMPLED, "NCHW-s2"),
                                          (SUBSAMPLED, "NHWC-s2-odd-SAME"),
                                          (SPACE_TO_DEPTH, "NCHW-7x7-s2-pad3"),
                                          (SPACE_TO_DEPTH, "NHWC-3x3-s2-odd-SAME"),
                                          (CHANNELS_FIRST, "NHWC-depthwise-3x3-SAME")])
def test_plans_in_each_form_run_under_xla(device, form, config, rng):
    reference.check_conv(device, CONFIGS[form][config], tf.float32, _plan(form), rng,
                         jit_compile=True)


def _raw_forward(x, w, algorithms, strides=(1, 2, 2, 1)):
    return op_library().ucudnn_conv2d(x, w, strides=list(strides), padding="VALID",
                                      micro_batches=[2] * len(algorithms), algorithms=algorithms)


@pytest.mark.parametrize("algorithms, planned", [
    (["algo=0,subsampled=1", "algo=0"], "micro-batch 1 runs direct but micro-batch 0 subsampled"),
    (["algo=0,space_to_depth=1", "algo=0,subsampled=1"],
     "micro-batch 1 runs subsampled but micro-batch 0 space_to_depth"),
])
def test_a_plan_that_mixes_forms_is_refused_naming_why(device, algorithms, planned):
    x, w = tf.ones([4, 6, 6, 3]), tf.ones([1, 1, 3, 2])
    with tf.device(device), pytest.raises(tf.errors.InvalidArgumentError) as info:
        _raw_forward(x, w, algorithms)
    message = info.value.message
    assert f"plan [2@{algorithms[0]}, 2@{algorithms[1]}]" in message
    assert planned in message and "all of a plan's micro-batches run in one form" in message


@pytest.mark.parametrize("form, filter_shape, strides, why", [
    (SUBSAMPLED, [3, 3, 3, 2], (1, 2, 2, 1), "needs a 1x1 filter, no padding and a stride above 1"),
    (SUBSAMPLED, [1, 1, 3, 2], (1, 1, 1, 1), "needs a 1x1 filter, no padding and a stride above 1"),
    (SPACE_TO_DEPTH, [1, 1, 3, 2], (1, 2, 2, 1), "a filter of more than one tap"),
    (SPACE_TO_DEPTH, [3, 3, 3, 2], (1, 1, 2, 1), "one stride above 1 in both"),
    (SPACE_TO_DEPTH, [3, 3, 3, 2], (1, 1, 1, 1), "one stride above 1 in both"),
], ids=["sub-3x3", "sub-stride-1", "blocks-1x1", "blocks-uneven-strides", "blocks-stride-1"])
def test_a_form_a_convolution_cannot_take_is_refused_naming_why(device, form, filter_shape,
                                                                strides, why):
    x, w = tf.ones([2, 6, 6, 3]), tf.ones(filter_shape)
    with tf.device(device), pytest.raises(tf.errors.InvalidArgumentError) as info:
        _raw_forward(x, w, [f"algo=0,{form}=1"], strides)
    assert why in info.value.message


def test_a_channels_first_convolution_is_not_given_channels_first_copies(device):
    x, w = tf.ones([2, 3, 6, 6]), tf.ones([3, 3, 3, 2])
    with tf.device(device), pytest.raises(tf.errors.InvalidArgumentError,
                                          match="needs channels-last tensors"):
        op_library().ucudnn_conv2d(x, w, strides=[1, 1, 1, 1], padding="VALID",
                                   data_format="NCHW", micro_batches=[2],
                                   algorithms=["algo=0,channels_first=1"])


def test_a_grouped_or_dilated_convolution_is_not_run_in_blocks(device):
    x = tf.ones([2, 8, 8, 4])
    with tf.device(device), pytest.raises(tf.errors.InvalidArgumentError, match="no groups"):
        _raw_forward(x, tf.ones([3, 3, 2, 4]), ["algo=0,space_to_depth=1"])
    with tf.device(device), pytest.raises(tf.errors.InvalidArgumentError, match="no dilation"):
        op_library().ucudnn_conv2d(x, tf.ones([3, 3, 4, 4]), strides=[1, 2, 2, 1],
                                   dilations=[1, 2, 2, 1], padding="VALID", micro_batches=[2],
                                   algorithms=["algo=0,space_to_depth=1"])


@pytest.mark.parametrize("form", [SUBSAMPLED, SPACE_TO_DEPTH, CHANNELS_FIRST])
def test_the_fused_op_leaves_plans_in_other_forms_to_the_convolution(form):
    plan = _plan(form)
    assert f"runs in the {form} form" in fused_conv.plan_refusal(plan)
    assert fused_conv.plan_refusal(LayerPlan(KernelPlan.of((5, 0)))) is None
    # Only the forward kernel runs inside the fused op; its gradients are tf_ucudnn's own ops.
    assert fused_conv.plan_refusal(LayerPlan(KernelPlan.of((5, 0)), plan.backprop_input,
                                             plan.backprop_filter)) is None


def test_a_rewrite_does_not_fuse_a_layer_in_another_form_and_says_why():
    w = tf.Variable(tf.random.stateless_normal([1, 1, 3, 4], seed=[0, 0]))
    b = tf.Variable(tf.zeros([4]))

    @tf.function
    def step(x):
        return tf.nn.relu(tf.nn.bias_add(tf.nn.conv2d(x, w, 2, "VALID", name="strided"), b))

    concrete = step.get_concrete_function(tf.TensorSpec([4, 8, 8, 3]))
    rewritten, report = rewrite_convolutions(concrete, lambda layer: _plan(SUBSAMPLED, (2, 2)))
    assert not report.fused
    [not_fused] = report.not_fused
    assert not_fused.layer == "strided" and "runs in the subsampled form" in not_fused.reason
    x = tf.random.stateless_normal([4, 8, 8, 3], seed=[1, 0])
    np.testing.assert_allclose(rewritten(x), concrete(x), rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------------------ on the GPU only

@pytest.fixture
def machine(gpu_device):
    return profiler.current_machine()


def _geometry(cfg, dtype=tf.float32):
    explicit = not isinstance(cfg.padding, str)  # [before, after] pairs over every dim
    return ConvLayer("layer", "Conv2D", cfg.input_shape, cfg.filter_shape,
                     strides=tuple(cfg.full(cfg.spatial_strides)),
                     dilations=tuple(cfg.full(cfg.spatial_dilations)),
                     padding="EXPLICIT" if explicit else cfg.padding,
                     explicit_paddings=tuple(v for pair in cfg.padding for v in pair)
                     if explicit else (), data_format=cfg.fmt, dtype=dtype.name,
                     groups=cfg.groups).cudnn_geometry()


def test_geometries_keep_their_padding():
    """The GPU tests measure each configuration's own geometry."""
    stem = _geometry(CONFIGS[SPACE_TO_DEPTH]["NCHW-7x7-s2-pad3"])
    assert stem.pads == (3, 3) and stem.can_space_to_depth
    assert _geometry(CONFIGS[SUBSAMPLED]["NCHW-s2"]).can_subsample
    assert _geometry(CONFIGS[CHANNELS_FIRST]["NHWC-depthwise-3x3-SAME"]).can_run_channels_first


# The copy of the input (or its gradient) cuDNN is given per sample, in float32 bytes: the
# output's positions (subsampled), or the blocks (C x s x s channels of (Ho + k' - 1) rows and
# columns, k' the filter's taps in blocks); on channels-first copies, the input's and the output's.
COPY_BYTES = {(SUBSAMPLED, "NCHW-s2"): 8 * 5 * 5 * 4,
              (SPACE_TO_DEPTH, "NCHW-7x7-s2-pad3"): 3 * 4 * (8 + 4 - 1) ** 2 * 4,
              (CHANNELS_FIRST, "NHWC-depthwise-3x3-SAME"): (9 * 9 * 6 + 9 * 9 * 6) * 4}


@pytest.mark.gpu
@pytest.mark.parametrize("form, config", sorted(COPY_BYTES))
@pytest.mark.parametrize("kernel", KERNELS)
def test_measured_runs_in_other_forms_count_their_copies(machine, kernel, form, config):
    geometry = _geometry(CONFIGS[form][config])
    other = profiler.measure(geometry, kernel, [4, 2], machine, form=form)
    direct = profiler.measure(geometry, kernel, [4, 2], machine)
    assert other and all(r.form == form for r in other)
    assert not any(r.form == form for r in direct)
    for record in other:
        assert record.workspace_bytes >= record.batch_size * COPY_BYTES[(form, config)]
        assert record.time_ms > 0
        assert str(record.algorithm).endswith(f",{form}=1")


@pytest.mark.gpu
@pytest.mark.parametrize("form, config", [(SUBSAMPLED, "NCHW-s2"),
                                          (SUBSAMPLED, "NHWC-s2-odd-SAME"),
                                          (SPACE_TO_DEPTH, "NCHW-7x7-s2-pad3"),
                                          (SPACE_TO_DEPTH, "NHWC-11x11-s4"),
                                          (SPACE_TO_DEPTH, "NCHW-3x3-s4-unread"),
                                          (CHANNELS_FIRST, "NHWC-depthwise-3x3-SAME"),
                                          (CHANNELS_FIRST, "NHWC-grouped2-3x3-s2-asymmetric")])
@pytest.mark.parametrize("kernel", KERNELS)
def test_every_measured_configuration_in_another_form_is_right(machine, gpu_device, kernel, form,
                                                               config, rng):
    cfg = CONFIGS[form][config]
    x, w, dy = (reference.random(shape, tf.float32, rng)
                for shape in (cfg.input_shape, cfg.filter_shape, cfg.output_shape))
    expected = reference.kernel_result(kernel, cfg, x, w, dy)
    scale = reference.kernel_result(kernel, cfg, tf.abs(x), tf.abs(w), tf.abs(dy))
    kinds = [profiler.LEGACY] + ([profiler.ENGINES] if engines_available() else [])
    algorithms = {r.algorithm for kind in kinds
                  for r in profiler.measure(_geometry(cfg), kernel, [2, 3], machine,
                                            candidates=kind, form=form)}
    assert any(a.is_engine for a in algorithms) == engines_available()
    for algorithm in sorted(algorithms, key=lambda a: a.order_key)[:12]:
        plan = reference.kernel_plan([2, 3], kernel, [algorithm.to_attr()])
        with tf.device(gpu_device):
            result = reference.run_kernel(kernel, cfg, x, w, dy, plan)
        reference.assert_close(result, expected, scale, tf.float32, f"{kernel} {algorithm}",
                               roundings=reference.algorithm_roundings(kernel, algorithm.algo))
