"""tf_ucudnn: micro-batched cuDNN convolutions for TensorFlow, training beyond device memory, and
spatial parallelism for 3-D CNNs.

Importing the package registers the ops, their kernels and their gradients, so that a SavedModel
or GraphDef holding tf_ucudnn's ops loads after the import alone. Where the op library is not
built, the import still works and the ops raise LibraryNotBuilt where they are first used.
"""

from tf_ucudnn import memory, parallel  # noqa: F401  (as tf_ucudnn.memory, tf_ucudnn.parallel)
from tf_ucudnn.api import rewrite
from tf_ucudnn.conv_planning.database_planner import DatabasePlanner
from tf_ucudnn.core.errors import TfUcudnnError
from tf_ucudnn.core.plan import Algorithm, KernelPlan, LayerPlan, MicroBatch
from tf_ucudnn.keras.callback import MicroBatchCallback
from tf_ucudnn.kernels.library import engines_available, gpu_kernels_available, load_ops
from tf_ucudnn.kernels.ops import (
    conv2d,
    conv2d_backprop_filter,
    conv2d_backprop_input,
    conv3d,
    conv3d_backprop_filter,
    conv3d_backprop_input,
)
from tf_ucudnn.options import KerasOptions, Options, OptionsError
from tf_ucudnn.report import RewriteReport
from tf_ucudnn.savedmodel.converter import ConversionError, Converter

__all__ = [
    "Algorithm", "ConversionError", "Converter", "DatabasePlanner", "KerasOptions", "KernelPlan",
    "LayerPlan", "MicroBatch", "MicroBatchCallback", "Options", "OptionsError", "RewriteReport",
    "TfUcudnnError", "conv2d", "conv2d_backprop_filter", "conv2d_backprop_input", "conv3d",
    "conv3d_backprop_filter", "conv3d_backprop_input", "engines_available",
    "gpu_kernels_available", "load_ops", "memory", "parallel", "rewrite",
]
