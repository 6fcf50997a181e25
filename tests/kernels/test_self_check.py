"""The self-check (TF_UCUDNN_SELF_CHECK=1): each planned kernel's first run against one undivided
reference run. Each case runs in a fresh process, as the kernels read the setting when made."""

import os
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent("""
    import numpy as np
    import tensorflow as tf
    import tf_ucudnn
    from tf_ucudnn.core.plan import KernelPlan, LayerPlan

    x = tf.constant(np.random.RandomState(0).randn(6, 9, 9, 4), tf.float32)
    w = tf.constant(np.random.RandomState(1).randn(3, 3, 4, 5), tf.float32)
    split = KernelPlan.of((2, 0), (4, 1))
    plan = LayerPlan(split, split, split)

    @tf.function
    def step(x, w):
        with tf.GradientTape() as tape:
            tape.watch([x, w])
            y = tf_ucudnn.conv2d(x, w, 1, "SAME", plan=plan, name="layer3")
            loss = tf.reduce_sum(y * y)
        return (y,) + tuple(tape.gradient(loss, [x, w]))

    y, dx, dw = step(x, w)
    with tf.GradientTape() as tape:
        tape.watch([x, w])
        expected = tf.nn.conv2d(x, w, 1, "SAME")
        loss = tf.reduce_sum(expected * expected)
    want = [expected] + tape.gradient(loss, [x, w])
    for got, ref in zip((y, dx, dw), want):
        np.testing.assert_allclose(got.numpy(), ref.numpy(), rtol=1e-4, atol=1e-3)
    step(x, w)  # checked once: later runs are not compared again
    print("trained")
""")


def _run(**environment):
    return subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "CUDA_VISIBLE_DEVICES": "",
                                            **environment})


def test_planned_kernels_that_match_the_reference_run_on():
    done = _run(TF_UCUDNN_SELF_CHECK="1")
    assert done.returncode == 0 and "trained" in done.stdout, done.stderr[-2000:]


@pytest.mark.parametrize("value", ["0", ""])
def test_the_check_is_off_unless_asked_for(value):
    # Even a tolerance no result can meet fails nothing while the check is off.
    done = _run(TF_UCUDNN_SELF_CHECK=value, TF_UCUDNN_SELF_CHECK_TOLERANCE="-1")
    assert done.returncode == 0 and "trained" in done.stdout, done.stderr[-2000:]


def test_a_mismatch_names_the_layer_the_kernel_and_the_plan():
    # A negative tolerance fails every comparison: the error the user would see on a mismatch.
    done = _run(TF_UCUDNN_SELF_CHECK="1", TF_UCUDNN_SELF_CHECK_TOLERANCE="-1")
    assert done.returncode != 0 and "trained" not in done.stdout
    message = done.stderr
    assert "self-check failed" in message and "normalized L2 error" in message
    assert "UcudnnConv2D 'layer3'" in message and "(fwd kernel, " in message
    assert "plan [2@algo=0, 4@algo=1]" in message, message[-1500:]
