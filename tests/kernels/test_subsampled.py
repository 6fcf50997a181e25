"""Strided 1x1 convolutions planned subsampled (a stride-1 convolution on a copy of the input's
strided samples): the same results as TensorFlow's own convolution for every kernel, layout and
type, with legacy algorithms and engine configurations, eagerly and under XLA; measured with the
copies counted; and refused, naming the reason, where a plan mixes forms or cannot subsample."""

import numpy as np
import pytest
import reference
import tensorflow as tf

from tf_ucudnn.core.conv_layer import ConvLayer
from tf_ucudnn.core.plan import KERNELS, Algorithm, KernelPlan, LayerPlan, MicroBatch
from tf_ucudnn.graph.rewrite import rewrite_convolutions
from tf_ucudnn.kernels import fused_conv
from tf_ucudnn.kernels.library import engines_available, op_library
from tf_ucudnn.profiling import profiler

CONFIGS = {
    "NCHW-s2": reference.Conv((5, 8, 10, 10), (1, 1, 8, 6), strides=(2, 2), padding="VALID",
                              data_format="NCHW"),
    "NHWC-s2-odd-SAME": reference.Conv((5, 9, 11, 8), (1, 1, 8, 6), strides=(2, 2),
                                       padding="SAME", data_format="NHWC"),
    "NHWC-s13": reference.Conv((5, 7, 9, 4), (1, 1, 4, 6), strides=(1, 3), padding="VALID"),
    "NCDHW-s2": reference.Conv((5, 4, 5, 6, 6), (1, 1, 1, 4, 6), strides=(2, 2, 2),
                               padding="VALID", data_format="NCDHW"),
}
# A legacy algorithm every kernel of a stride-1 1x1 convolution runs.
ALGORITHMS = {"fwd": "algo=0,subsampled=1", "bwd_data": "algo=0,subsampled=1",
              "bwd_filter": "algo=1,subsampled=1"}


def _subsampled_plan(sizes=(2, 3)):
    return LayerPlan(*(KernelPlan(tuple(MicroBatch(size, Algorithm.parse(ALGORITHMS[kernel]))
                                        for size in sizes)) for kernel in KERNELS))


@pytest.mark.parametrize("dtype", [tf.float32, tf.float64, tf.float16], ids=lambda d: d.name)
@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_subsampled_plans_compute_tensorflows_convolution(device, config, dtype, rng):
    """float64 channels-last layouts also transpose (cuDNN has no such kernels)."""
    reference.check_conv(device, CONFIGS[config], dtype, _subsampled_plan(), rng)


@pytest.mark.parametrize("config", ["NCHW-s2", "NHWC-s2-odd-SAME"])
def test_subsampled_plans_run_under_xla(device, config, rng):
    reference.check_conv(device, CONFIGS[config], tf.float32, _subsampled_plan(), rng,
                         jit_compile=True)


def _raw_forward(x, w, algorithms, strides=(1, 2, 2, 1)):
    return op_library().ucudnn_conv2d(x, w, strides=list(strides), padding="VALID",
                                      micro_batches=[2] * len(algorithms), algorithms=algorithms)


def test_a_plan_that_mixes_forms_is_refused_naming_why(device):
    x, w = tf.ones([4, 6, 6, 3]), tf.ones([1, 1, 3, 2])
    with tf.device(device), pytest.raises(tf.errors.InvalidArgumentError) as info:
        _raw_forward(x, w, ["algo=0,subsampled=1", "algo=0"])
    message = info.value.message
    assert "plan [2@algo=0,subsampled=1, 2@algo=0]" in message
    assert "micro-batch 1 is not subsampled but micro-batch 0 is" in message
    assert "all its micro-batches or none" in message


@pytest.mark.parametrize("filter_shape, strides", [
    ([3, 3, 3, 2], (1, 2, 2, 1)),
    ([1, 1, 3, 2], (1, 1, 1, 1)),
], ids=["3x3", "stride-1"])
def test_subsampling_what_cannot_be_is_refused_naming_why(device, filter_shape, strides):
    x, w = tf.ones([2, 6, 6, 3]), tf.ones(filter_shape)
    with tf.device(device), pytest.raises(tf.errors.InvalidArgumentError) as info:
        _raw_forward(x, w, ["algo=0,subsampled=1"], strides)
    assert "needs a 1x1 filter, no padding and a stride above 1" in info.value.message


def test_the_fused_op_leaves_subsampled_plans_to_the_convolution():
    plan = _subsampled_plan()
    assert "runs subsampled" in fused_conv.plan_refusal(plan)
    assert fused_conv.plan_refusal(LayerPlan(KernelPlan.of((5, 0)))) is None
    # Only the forward kernel runs inside the fused op; its gradients are tf_ucudnn's own ops.
    assert fused_conv.plan_refusal(LayerPlan(KernelPlan.of((5, 0)), plan.backprop_input,
                                             plan.backprop_filter)) is None


def test_a_rewrite_does_not_fuse_a_subsampled_layer_and_says_why():
    w = tf.Variable(tf.random.stateless_normal([1, 1, 3, 4], seed=[0, 0]))
    b = tf.Variable(tf.zeros([4]))

    @tf.function
    def step(x):
        return tf.nn.relu(tf.nn.bias_add(tf.nn.conv2d(x, w, 2, "VALID", name="strided"), b))

    concrete = step.get_concrete_function(tf.TensorSpec([4, 8, 8, 3]))
    rewritten, report = rewrite_convolutions(concrete, lambda layer: _subsampled_plan((2, 2)))
    assert not report.fused
    [not_fused] = report.not_fused
    assert not_fused.layer == "strided" and "runs subsampled" in not_fused.reason
    x = tf.random.stateless_normal([4, 8, 8, 3], seed=[1, 0])
    np.testing.assert_allclose(rewritten(x), concrete(x), rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------------------ on the GPU only

@pytest.fixture
def machine(gpu_device):
    return profiler.current_machine()


def _geometry(cfg, dtype=tf.float32):
    return ConvLayer("layer", "Conv2D", cfg.input_shape, cfg.filter_shape,
                     strides=tuple(cfg.full(cfg.spatial_strides)),
                     dilations=tuple(cfg.full(cfg.spatial_dilations)), padding=cfg.padding,
                     explicit_paddings=(), data_format=cfg.fmt, dtype=dtype.name,
                     groups=cfg.groups).cudnn_geometry()


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", KERNELS)
def test_measured_subsampled_runs_count_their_copies(machine, kernel):
    cfg = CONFIGS["NCHW-s2"]
    geometry = _geometry(cfg)
    subsampled = profiler.measure(geometry, kernel, [4, 2], machine, subsampled=True)
    direct = profiler.measure(geometry, kernel, [4, 2], machine)
    assert subsampled and all(r.subsampled for r in subsampled)
    assert not any(r.subsampled for r in direct)
    # The copy of the input (or its gradient) at the output's positions: C x Ho x Wo floats each.
    copy_bytes = {size: size * 8 * 5 * 5 * 4 for size in (4, 2)}
    for record in subsampled:
        assert record.workspace_bytes >= copy_bytes[record.batch_size]
        assert record.time_ms > 0
        assert str(record.algorithm).endswith(",subsampled=1")


@pytest.mark.gpu
@pytest.mark.parametrize("config", ["NCHW-s2", "NHWC-s2-odd-SAME"])
@pytest.mark.parametrize("kernel", KERNELS)
def test_every_measured_subsampled_configuration_is_right(machine, gpu_device, kernel, config,
                                                          rng):
    cfg = CONFIGS[config]
    x, w, dy = (reference.random(shape, tf.float32, rng)
                for shape in (cfg.input_shape, cfg.filter_shape, cfg.output_shape))
    expected = reference.kernel_result(kernel, cfg, x, w, dy)
    scale = reference.kernel_result(kernel, cfg, tf.abs(x), tf.abs(w), tf.abs(dy))
    kinds = [profiler.LEGACY] + ([profiler.ENGINES] if engines_available() else [])
    algorithms = {r.algorithm for kind in kinds
                  for r in profiler.measure(_geometry(cfg), kernel, [2, 3], machine,
                                            candidates=kind, subsampled=True)}
    assert any(a.is_engine for a in algorithms) == engines_available()
    for algorithm in sorted(algorithms, key=lambda a: a.order_key)[:12]:
        plan = reference.kernel_plan([2, 3], kernel, [algorithm.to_attr()])
        with tf.device(gpu_device):
            result = reference.run_kernel(kernel, cfg, x, w, dy, plan)
        reference.assert_close(result, expected, scale, tf.float32, f"{kernel} {algorithm}",
                               roundings=2 if kernel == "bwd_filter" else 1)
