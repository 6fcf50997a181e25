"""Shared fixtures: the devices the equivalence tests run on, and seeded random numbers.

Every equivalence test takes the `device` fixture: it runs on /CPU:0 always and again on /GPU:0
as a `gpu`-marked case, skipped (with the reason) where there is no GPU or the op library was
built without its cuDNN kernels. `python -m pytest tests -m gpu` runs the GPU cases alone.
"""

import os
import sys
import tempfile
import zlib
from pathlib import Path

import numpy as np
import pytest
import tensorflow as tf

import tf_ucudnn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # for `import reference`

# The default profile database of the tests is their own, so measurements a developer's machine
# holds in ~/.cache do not change what the tests plan.
os.environ["TF_UCUDNN_DATABASE"] = os.path.join(
    tempfile.mkdtemp(prefix="tf_ucudnn-tests-"), "profiles.sqlite")

# Four logical CPU devices, for the spatial-parallel tests; set before TensorFlow starts its runtime.
LOGICAL_CPUS = 4
tf.config.set_logical_device_configuration(
    tf.config.list_physical_devices("CPU")[0],
    [tf.config.LogicalDeviceConfiguration()] * LOGICAL_CPUS)

def gpu_unavailable_reason():
    """Why the GPU cases cannot run here, or None if they can."""
    if not tf.config.list_physical_devices("GPU"):
        return "no GPU visible to TensorFlow"
    if not tf_ucudnn.gpu_kernels_available():
        return "tf_ucudnn was built without its cuDNN kernels"
    return None


@pytest.fixture
def no_tf32():
    """Full float32 precision on the GPU (TF32 off) for the test, restored after it."""
    enabled = tf.config.experimental.tensor_float_32_execution_enabled()
    tf.config.experimental.enable_tensor_float_32_execution(False)
    yield
    tf.config.experimental.enable_tensor_float_32_execution(enabled)


def _use_device(name):
    if name.startswith("/GPU"):
        reason = gpu_unavailable_reason()
        if reason:
            pytest.skip(reason)
    return name


@pytest.fixture(params=["/CPU:0", pytest.param("/GPU:0", marks=pytest.mark.gpu)],
                ids=["cpu", "gpu"])
def device(request, no_tf32):
    """The device a test runs the ops on: /CPU:0, and /GPU:0 where the cuDNN kernels are."""
    return _use_device(request.param)


@pytest.fixture
def gpu_device(no_tf32):
    """For GPU-only tests (mark them @pytest.mark.gpu too)."""
    return _use_device("/GPU:0")


@pytest.fixture
def rng(request):
    """A random generator seeded from the test's id, so every case is reproducible on its own."""
    return np.random.default_rng(zlib.crc32(request.node.nodeid.encode()))


# The measured H100 profiles, copied into tests/data so that CI tests the optimizer on them.
_PROFILE_DIRS = ([Path(os.environ["TF_UCUDNN_PROFILES"])] if "TF_UCUDNN_PROFILES" in os.environ
                 else []) + [Path(__file__).resolve().parent / "data" / "profiles"]


@pytest.fixture(scope="session")
def profiles_dir() -> Path:
    """The folder of the measured H100 profiles (../shared/profiles/README.md)."""
    for candidate in _PROFILE_DIRS:
        if (candidate / "h100-cudnn9.14-fp32-nchw.jsonl").exists():
            return candidate
    pytest.skip(f"measured profiles not found in {[str(c) for c in _PROFILE_DIRS]}")
