"""tf_ucudnn's op library, loaded on first use (as TF-TRT and tensorflow/addons load theirs):
importing tf_ucudnn stays cheap, and a missing build fails where an op is first needed, with how
to build it."""

from __future__ import annotations

import functools
import glob
import os

import tensorflow as tf
from tensorflow.python.framework import kernels

from tf_ucudnn.core.errors import TfUcudnnError

_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class LibraryNotBuilt(TfUcudnnError, ImportError):
    """The op library was not built for this TensorFlow."""


@functools.cache
def op_library():
    """The loaded op library: its ops as Python functions. Loading registers the ops, their CPU,
    GPU and XLA kernels with TensorFlow."""
    candidates = glob.glob(os.path.join(_PACKAGE, "_ucudnn_ops*.so"))
    if not candidates:
        raise LibraryNotBuilt(
            f"tf_ucudnn's op library is not built (no _ucudnn_ops*.so in {_PACKAGE}). Build it "
            "against the installed TensorFlow with `pip install --no-build-isolation -e .`")
    return tf.load_op_library(candidates[0])


def load_ops() -> None:
    """Registers tf_ucudnn's ops with TensorFlow, as loading a SavedModel or a GraphDef that
    holds them needs (the plugin's own entry points do it themselves)."""
    op_library()


def gpu_kernels_available() -> bool:
    """Whether the library was built with its cuDNN kernels (they run only where a GPU is)."""
    load_ops()
    registered = kernels.get_registered_kernels_for_op("UcudnnConv2D")
    return any(k.device_type == "GPU" for k in registered.kernel)


@functools.cache
def engines_available() -> bool:
    """Whether the cuDNN kernels were built with cudnn-frontend, so that plans may run cuDNN's
    graph-API engine configurations and the profiler may time them. Asked once per process (the
    library is loaded once), not for every layer the profiler measures."""
    if not gpu_kernels_available():
        return False
    with tf.device("/CPU:0"):
        return bool(op_library().ucudnn_engines_available())
