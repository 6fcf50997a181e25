"""tf_ucudnn's op library. `import tf_ucudnn` registers its ops and their CPU, GPU and XLA kernels
(`load_ops`), so that a SavedModel or GraphDef holding them loads after the import alone, as
tensorflow_text's do; registering is cheap next to the import. The ops' Python functions
(`op_library`), whose generation costs more than the registration, are made on first use. Where
the library is not built, or not for this TensorFlow, the import still works and an op fails
where it is first needed, with how to build it."""

from __future__ import annotations

import contextlib
import functools
import glob
import os

import tensorflow as tf
from tensorflow.python.framework import kernels

from tf_ucudnn.core.errors import TfUcudnnError

_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_BUILD_COMMAND = "`pip install --no-build-isolation -e .`"


class LibraryNotBuilt(TfUcudnnError, ImportError):
    """The op library was not built for this TensorFlow."""


@functools.cache
def _library_path() -> str:
    candidates = glob.glob(os.path.join(_PACKAGE, "_ucudnn_ops*.so"))
    if not candidates:
        raise LibraryNotBuilt(
            f"tf_ucudnn's op library is not built (no _ucudnn_ops*.so in {_PACKAGE}). Build it "
            f"against the installed TensorFlow with {_BUILD_COMMAND}")
    return candidates[0]


@functools.cache
def load_ops() -> None:
    """Registers tf_ucudnn's ops and their kernels with TensorFlow, as loading a SavedModel or a
    GraphDef that holds them needs. `import tf_ucudnn` has done it where the library is built;
    called again, it does nothing. Raises LibraryNotBuilt where the library is missing or cannot
    be loaded."""
    try:
        tf.load_library(_library_path())
    except tf.errors.NotFoundError as error:  # the loader's: built for another TensorFlow, say
        raise LibraryNotBuilt(
            f"tf_ucudnn's op library cannot be loaded ({error.message}). Rebuild it "
            f"against the installed TensorFlow with {_BUILD_COMMAND}") from error


@functools.cache
def op_library():
    """The ops as Python functions, on the library `load_ops` registered."""
    load_ops()
    return tf.load_op_library(_library_path())


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


# Registered when tf_ucudnn is imported, so that a SavedModel or GraphDef holding the ops loads
# after the import alone; where the library is not built, the ops raise this where first used.
with contextlib.suppress(LibraryNotBuilt):
    load_ops()
