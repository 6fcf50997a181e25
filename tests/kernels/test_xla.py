"""tf_ucudnn's ops compiled by XLA (tf.function(jit_compile=True)): outputs and gradients against
the float64 references and against TensorFlow's own ops compiled alike, what XLA makes of a plan
(one HLO convolution per micro-batch on the CPU, one custom call on the GPU), the batch
normalization ops, and a library loaded after XLA was first used."""

import os
import re
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import tensorflow as tf
from reference import (
    CONV2D_CASES,
    CONV3D_CASES,
    GROUPED_CASES,
    check_conv,
    kernel_plan,
    layer_plan,
    random,
)

import tf_ucudnn
from tf_ucudnn.kernels import ops

ALL_CASES = CONV2D_CASES + CONV3D_CASES


def _ids(cases):
    return [case.id for case in cases]


def _hlo(function, *args):
    """The HLO TensorFlow hands XLA for `function` (before XLA optimizes it)."""
    return tf.function(function, jit_compile=True).experimental_get_compiler_ir(*args)(
        stage="hlo")


@pytest.mark.parametrize("case", ALL_CASES, ids=_ids(ALL_CASES))
def test_compiled_op_and_gradients_match_the_references(device, case, rng):
    check_conv(device, case.cfg, tf.float32, case.plan(), rng, jit_compile=True)


@pytest.mark.parametrize("case", GROUPED_CASES, ids=_ids(GROUPED_CASES))
def test_compiled_grouped_op_and_gradients_match_the_references(device, case, rng):
    check_conv(device, case.cfg, tf.float32, case.plan(), rng, jit_compile=True)


@pytest.mark.parametrize("dtype", [tf.float64, tf.float16], ids=["float64", "float16"])
@pytest.mark.parametrize("case", [CONV2D_CASES[2], CONV3D_CASES[1]], ids=lambda c: c.id)
def test_compiled_op_in_other_dtypes(device, case, dtype, rng):
    check_conv(device, case.cfg, dtype, case.plan(), rng, jit_compile=True)


@pytest.mark.parametrize("nd", [2, 3])
def test_training_step_equals_tensorflow_under_jit_compile(device, nd, rng):
    """One loss-and-gradients step through two layers: tf_ucudnn's ops and tf.nn's, both compiled
    by XLA, give the same numbers."""
    batch, spatial = 6, [9, 8, 7][:nd]
    x = random([batch, *spatial, 3], tf.float32, rng)
    w1 = random([3] * nd + [3, 4], tf.float32, rng)
    w2 = random([1] * nd + [4, 5], tf.float32, rng)
    # cuDNN's heuristics pick each micro-batch's algorithm: no one explicit algorithm runs every
    # channels-last case (reference.safe_algorithms).
    plan = tf_ucudnn.LayerPlan(*(kernel_plan(sizes, kernel, ["auto"]) for sizes, kernel in
                                 [((2, 4), "fwd"), ((3, 3), "bwd_data"), ((1, 2, 3), "bwd_filter")]))
    ours = tf_ucudnn.conv2d if nd == 2 else tf_ucudnn.conv3d
    theirs = tf.nn.conv2d if nd == 2 else tf.nn.conv3d

    def step(conv, **planned):
        def run(x, w1, w2):
            with tf.GradientTape() as tape:
                tape.watch([x, w1, w2])
                hidden = tf.nn.relu(conv(x, w1, [1, *[2] * nd, 1], "SAME", **planned))
                loss = tf.reduce_sum(tf.square(conv(hidden, w2, [1] * (nd + 2), "VALID",
                                                    **planned)))
            return (loss, *tape.gradient(loss, [x, w1, w2]))
        with tf.device(device):
            return tf.function(run, jit_compile=True)(x, w1, w2)

    for name, a, b in zip(["loss", "dx", "dw1", "dw2"], step(ours, plan=plan), step(theirs)):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-4,
                                   atol=1e-4 * float(tf.reduce_max(tf.abs(b))), err_msg=name)


def test_cpu_compiles_one_convolution_per_micro_batch(rng):
    x = random([7, 6, 6, 2], tf.float32, rng)
    w = random([3, 3, 2, 4], tf.float32, rng)
    dy = random([7, 6, 6, 4], tf.float32, rng)
    kwargs = {"strides": 1, "padding": "SAME"}
    plan = kernel_plan((1, 4, 2), "fwd")
    with tf.device("/CPU:0"):
        forward = _hlo(lambda x, w: tf_ucudnn.conv2d(x, w, plan=plan, **kwargs), x, w)
        backprop_filter = _hlo(lambda x, dy: tf_ucudnn.conv2d_backprop_filter(
            x, [3, 3, 2, 4], dy, plan=kernel_plan((3, 4), "bwd_filter"), **kwargs), x, dy)
        whole = _hlo(lambda x, w: tf_ucudnn.conv2d(x, w, **kwargs), x, w)
    assert len(re.findall(r"= f32\[[0-9,]+\]\{[0-9,]+\} convolution\(", forward)) == 3
    assert re.search(r"f32\[1,6,6,2\].* slice\(", forward)
    assert re.search(r"f32\[4,6,6,2\].* slice\(", forward)
    assert "concatenate(" in forward
    assert len(re.findall(r" convolution\(", backprop_filter)) == 2
    assert " add(" in backprop_filter
    assert len(re.findall(r" convolution\(", whole)) == 1 and "slice(" not in whole


@pytest.mark.gpu
def test_gpu_compiles_a_plan_to_one_custom_call(gpu_device, rng):
    x = random([6, 9, 9, 3], tf.float32, rng)
    w = random([3, 3, 3, 4], tf.float32, rng)
    plan = layer_plan((2, 4), (3, 3), (6,))

    def step(x, w):
        with tf.GradientTape() as tape:
            tape.watch([x, w])
            y = tf_ucudnn.conv2d(x, w, 1, "SAME", plan=plan)
        return (y, *tape.gradient(y, [x, w], output_gradients=tf.ones_like(y)))

    with tf.device(gpu_device):
        hlo = _hlo(step, x, w)
    calls = re.findall(r'custom_call_target="tf_ucudnn_convolution"', hlo)
    assert len(calls) == 3, hlo
    assert " convolution(" not in hlo
    assert "sizes = array<i64: 2, 4>" in hlo and "sizes = array<i64: 3, 3>" in hlo
    # The filter of the forward pass and of the input gradient, and the filter gradient, laid
    # out as cuDNN's NHWC filter (KRSC): XLA copies it, the calls do not.
    assert hlo.count("cudnn_filter_layout = 1") == 3, hlo
    assert hlo.count("f32[3,3,3,4]{2,1,0,3}") >= 3, hlo


def test_batch_norm_compiled_matches_the_op(device, rng):
    shape = [4, 5, 3, 6]
    x = tf.constant(rng.normal(1.5, 2.0, shape), tf.float32)
    dy = tf.constant(rng.normal(size=shape), tf.float32)
    scale = tf.constant(rng.uniform(0.5, 2.0, shape[-1]), tf.float32)
    offset = tf.constant(rng.normal(size=shape[-1]), tf.float32)

    def run(x, scale, offset, dy):
        with tf.GradientTape() as tape:
            tape.watch([x, scale, offset])
            y, mean, inv_std = ops.batch_norm(x, scale, offset)
        return (y, mean, inv_std, *tape.gradient(y, [x, scale, offset], output_gradients=dy))

    with tf.device("/CPU:0"):
        expected = run(x, scale, offset, dy)
    with tf.device(device):
        compiled = tf.function(run, jit_compile=True)(x, scale, offset, dy)
        hlo = _hlo(run, x, scale, offset, dy)
    assert "batch-norm-training(" in hlo
    for name, a, b in zip(["y", "mean", "inv_std", "dx", "d_scale", "d_offset"], compiled,
                          expected):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=2e-4, atol=2e-4, err_msg=name)


def test_a_plan_that_does_not_fit_the_compiled_batch_is_refused_naming_the_op():
    # The batch is unknown when traced, so the shape function cannot tell; XLA's kernel does.
    step = tf.function(lambda x, w: tf_ucudnn.conv2d(x, w, 1, "SAME", plan=kernel_plan(
        (1, 2), "fwd"), name="too_few"), jit_compile=True,
        input_signature=[tf.TensorSpec([None, 5, 5, 2]), tf.TensorSpec([3, 3, 2, 2])])
    with pytest.raises(tf.errors.InvalidArgumentError,
                       match="UcudnnConv2D 'too_few' .*compiled by XLA.*sum to 3 but the batch "
                             "has 4"):
        step(tf.zeros([4, 5, 5, 2]), tf.zeros([3, 3, 2, 2]))


def test_the_library_compiles_when_loaded_after_xla_was_first_used(tmp_path):
    """XLA makes its compilation kernels once; ops loaded later register theirs themselves."""
    script = textwrap.dedent("""
        import numpy as np, tensorflow as tf
        tf.function(lambda x: x * 3, jit_compile=True)(tf.ones([2]))  # XLA's kernels made here
        import tf_ucudnn
        x, w = tf.ones([4, 5, 5, 2]), tf.ones([3, 3, 2, 3])
        plan = tf_ucudnn.KernelPlan.of((1, None), (3, None))
        got = tf.function(lambda x, w: tf_ucudnn.conv2d(x, w, 1, "SAME", plan=plan),
                          jit_compile=True)(x, w)
        print("max difference", float(tf.reduce_max(tf.abs(got - tf.nn.conv2d(x, w, 1, "SAME")))))
    """)
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", TF_CPP_MIN_LOG_LEVEL="2")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            env=env, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "max difference 0.0" in result.stdout
