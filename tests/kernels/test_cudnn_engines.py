"""cuDNN graph-API engine configurations on the GPU: every configuration the profiler lists for a
kernel (the knob variants beside the heuristics' own among them) computes the same convolution as
TensorFlow when a plan names it, alone or beside legacy algorithms in one plan, eagerly and under
XLA, and in the fused convolution op."""

import pytest
import reference
import tensorflow as tf
from tensorflow.python.framework import config as tf_config

import tf_ucudnn
from tf_ucudnn.core.conv_layer import ConvLayer
from tf_ucudnn.core.plan import KERNELS, Algorithm
from tf_ucudnn.kernels import fused_conv
from tf_ucudnn.kernels.library import engines_available
from tf_ucudnn.profiling import profiler

pytestmark = pytest.mark.gpu

CONFIGS = {
    "NCHW": reference.Conv((5, 8, 9, 10), (3, 3, 8, 16), padding="SAME", data_format="NCHW"),
    "NHWC": reference.Conv((5, 9, 10, 8), (3, 3, 8, 16), padding="SAME", data_format="NHWC"),
    "NHWC-grouped": reference.Conv((5, 9, 10, 8), (3, 3, 4, 16), padding="SAME",
                                   data_format="NHWC"),
    "NCHW-1x1-stride2": reference.Conv((5, 8, 9, 9), (1, 1, 8, 16), strides=(2, 2),
                                       padding="VALID", data_format="NCHW"),
}
# Configurations run per case, so that a case stays a few seconds.
MOST_CONFIGURATIONS = 8
# The kernels whose engines carry split-K knobs on these geometries. On the H100 (cuDNN 9.14) the
# forward and input-gradient engines the heuristics offer have tile and stage knobs only.
KERNELS_WITH_SPLIT_K = ("bwd_filter",)
# The knobs ListEngineConfigs varies from each engine's first configuration.
WORKSPACE_KNOBS = {"WORKSPACE", "SPLIT_K_BUF", "SPLIT_K_SLC", "REDUCTION_MODE", "STREAM_K",
                   "SPLIT_P_SLC"}


@pytest.fixture
def machine(gpu_device):
    if not engines_available():
        pytest.skip("tf_ucudnn was built without cudnn-frontend")
    return profiler.current_machine()


def _geometry(cfg, dtype):
    return ConvLayer("layer", "Conv2D", cfg.input_shape, cfg.filter_shape,
                     strides=tuple(cfg.full(cfg.spatial_strides)),
                     dilations=tuple(cfg.full(cfg.spatial_dilations)), padding=cfg.padding,
                     explicit_paddings=(), data_format=cfg.fmt, dtype=dtype.name,
                     groups=cfg.groups).cudnn_geometry()


def _engines_at(machine, cfg, kernel, sizes, dtype=tf.float32):
    """The engine configurations listed at every one of `sizes`, in a fixed order."""
    records = profiler.measure(_geometry(cfg, dtype), kernel, sizes, machine,
                               candidates=profiler.ENGINES)
    listed = [{r.algorithm for r in records if r.batch_size == size} for size in sizes]
    common = set.intersection(*listed)
    return sorted(common, key=lambda a: a.order_key)[:MOST_CONFIGURATIONS]


def _one_knob_apart(algorithms):
    """The configurations one workspace-trading knob away from another of their engine."""
    apart = []
    for algorithm in algorithms:
        knobs = dict(algorithm.knobs)
        for other in algorithms:
            other_knobs = dict(other.knobs)
            differing = {name for name in knobs.keys() | other_knobs.keys()
                         if knobs.get(name) != other_knobs.get(name)}
            if other.engine == algorithm.engine and len(differing) == 1 \
                    and differing <= WORKSPACE_KNOBS:
                apart.append(algorithm)
                break
    return apart


def _operands(cfg, rng, dtype=tf.float32):
    return (reference.random(cfg.input_shape, dtype, rng),
            reference.random(cfg.filter_shape, dtype, rng),
            reference.random(cfg.output_shape, dtype, rng))


@pytest.mark.parametrize("config", sorted(CONFIGS))
@pytest.mark.parametrize("kernel", KERNELS)
def test_every_listed_engine_configuration_is_right(machine, gpu_device, kernel, config, rng):
    cfg = CONFIGS[config]
    x, w, dy = _operands(cfg, rng)
    expected = reference.kernel_result(kernel, cfg, x, w, dy)
    scale = reference.kernel_result(kernel, cfg, tf.abs(x), tf.abs(w), tf.abs(dy))
    engines = _engines_at(machine, cfg, kernel, [2, 3])
    assert engines, f"cuDNN lists no engine configuration for {kernel} of {cfg}"
    for engine in engines:
        plan = reference.kernel_plan([2, 3], kernel, [engine.to_attr()])
        with tf.device(gpu_device):
            result = reference.run_kernel(kernel, cfg, x, w, dy, plan)
        # Two micro-batches' filter gradients are added in float32 (cudnnAddTensor).
        reference.assert_close(result, expected, scale, tf.float32, f"{kernel} {engine}",
                               roundings=2 if kernel == "bwd_filter" else 1)


@pytest.mark.parametrize("kernel", KERNELS)
def test_configurations_one_workspace_knob_apart_are_listed_and_right(machine, gpu_device, kernel,
                                                                      rng):
    listed = 0
    for config in sorted(CONFIGS):
        cfg = CONFIGS[config]
        records = profiler.measure(_geometry(cfg, tf.float32), kernel, [2, 3], machine,
                                   candidates=profiler.ENGINES)
        common = ({r.algorithm for r in records if r.batch_size == 2}
                  & {r.algorithm for r in records if r.batch_size == 3})
        apart = sorted(_one_knob_apart(list(common)), key=lambda a: a.order_key)
        listed += len(apart)
        x, w, dy = _operands(cfg, rng)
        expected = reference.kernel_result(kernel, cfg, x, w, dy)
        scale = reference.kernel_result(kernel, cfg, tf.abs(x), tf.abs(w), tf.abs(dy))
        for engine in apart[:MOST_CONFIGURATIONS // 2]:
            plan = reference.kernel_plan([2, 3], kernel, [engine.to_attr()])
            with tf.device(gpu_device):
                result = reference.run_kernel(kernel, cfg, x, w, dy, plan)
            reference.assert_close(result, expected, scale, tf.float32,
                                   f"{kernel} {config} {engine}",
                                   roundings=2 if kernel == "bwd_filter" else 1)
    if kernel in KERNELS_WITH_SPLIT_K:
        assert listed, f"no two {kernel} configurations of an engine one workspace knob apart"
    elif not listed:
        pytest.skip(f"cuDNN lists no {kernel} configuration with a workspace-trading knob here")


def test_engine_records_say_whether_cudnn_notes_them_deterministic(machine, gpu_device):
    geometry = _geometry(CONFIGS["NHWC"], tf.float32)
    # Filter gradients: where cuDNN has nondeterministic configurations (atomics) beside others.
    records = profiler.measure(geometry, "bwd_filter", [2], machine, candidates=profiler.ENGINES)
    assert records and all(isinstance(r.deterministic, bool) for r in records)
    tf_config.enable_op_determinism()
    try:
        strict = profiler.measure(geometry, "bwd_filter", [2], machine,
                                  candidates=profiler.ENGINES)
    finally:
        tf_config.disable_op_determinism()
    # Under op determinism the listing keeps only the configurations recorded deterministic.
    assert strict and all(r.deterministic for r in strict)
    assert {r.algorithm for r in strict} == {r.algorithm for r in records if r.deterministic}


@pytest.mark.parametrize("dtype", [tf.float32, tf.float16], ids=["float32", "float16"])
@pytest.mark.parametrize("kernel", KERNELS)
def test_engine_and_legacy_micro_batches_share_a_plan(machine, gpu_device, kernel, dtype, rng):
    cfg = CONFIGS["NCHW"]
    x, w, dy = _operands(cfg, rng, dtype)
    engine = _engines_at(machine, cfg, kernel, [1, 2, 3], dtype)[0]
    # Engine first, legacy after, and the other way round: a filter gradient accumulates either
    # way (beta = 1 after a legacy call; after an engine, a buffer of its own added to the rest).
    for algorithms in ([engine.to_attr(), 0], [0, engine.to_attr(), engine.to_attr()]):
        sizes = [3, 2] if len(algorithms) == 2 else [1, 3, 1]
        plan = reference.kernel_plan(sizes, kernel, algorithms)
        with tf.device(gpu_device):
            result = reference.run_kernel(kernel, cfg, x, w, dy, plan)
        scale = reference.kernel_result(kernel, cfg, tf.abs(x), tf.abs(w), tf.abs(dy))
        reference.assert_close(result, reference.kernel_result(kernel, cfg, x, w, dy), scale,
                               dtype, f"{kernel} {algorithms}", roundings=len(sizes))


def test_engine_plans_run_under_xla(machine, gpu_device, rng):
    cfg = CONFIGS["NHWC"]
    plans = {kernel: _engines_at(machine, cfg, kernel, [2, 3])[0].to_attr() for kernel in KERNELS}
    plan = tf_ucudnn.LayerPlan(*(reference.kernel_plan([2, 3], kernel, [plans[kernel]])
                                 for kernel in KERNELS))
    reference.check_conv(gpu_device, cfg, tf.float32, plan, rng, jit_compile=True)


@pytest.mark.parametrize("activation", ["relu", "identity"])
def test_the_fused_op_runs_engine_micro_batches(machine, gpu_device, activation, rng):
    cfg = CONFIGS["NCHW"]
    x, w, _ = _operands(cfg, rng)
    bias = reference.random([cfg.filter_shape[-1]], tf.float32, rng)
    engine = _engines_at(machine, cfg, "fwd", [2, 3])[0]
    plan = tf_ucudnn.LayerPlan(reference.kernel_plan([2, 3], "fwd", [engine.to_attr(), 0]),
                               reference.kernel_plan([5], "bwd_data"),
                               reference.kernel_plan([5], "bwd_filter"))
    with tf.device(gpu_device):
        y = fused_conv.fused_conv2d(x, w, bias, activation=activation, plan=plan,
                                    **cfg.kwargs())
    expected = tf.nn.bias_add(reference.conv(x, w, cfg), tf.cast(bias, tf.float64),
                              data_format=cfg.fmt)
    scale = tf.nn.bias_add(reference.conv(tf.abs(x), tf.abs(w), cfg),
                           tf.cast(tf.abs(bias), tf.float64), data_format=cfg.fmt)
    if activation == "relu":
        expected = tf.nn.relu(expected)
    reference.assert_close(y, expected, scale, tf.float32, f"fused {activation} with {engine}")


def test_a_configuration_cudnn_does_not_offer_is_an_error_naming_it(machine, gpu_device, rng):
    cfg = CONFIGS["NCHW"]
    x, w, dy = _operands(cfg, rng)
    bogus = Algorithm(engine=9999)
    plan = reference.kernel_plan([5], "fwd", [bogus.to_attr()])
    with pytest.raises(tf.errors.OpError, match="engine=9999"):
        with tf.device(gpu_device):
            reference.run_kernel("fwd", cfg, x, w, dy, plan)
