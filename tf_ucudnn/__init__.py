"""tf_ucudnn: micro-batched cuDNN convolutions for TensorFlow.

Importing the package loads the op library and registers the ops' gradients, so graphs and
SavedModels that contain tf_ucudnn ops load and differentiate once it is imported.
"""

from tf_ucudnn import gradients as _gradients  # noqa: F401  (registers gradients)
from tf_ucudnn.ops import (
    conv2d,
    conv2d_backprop_filter,
    conv2d_backprop_input,
    conv3d,
    conv3d_backprop_filter,
    conv3d_backprop_input,
    gpu_kernels_available,
)
from tf_ucudnn.callback import MicroBatchCallback
from tf_ucudnn.converter import ConversionError, Converter
from tf_ucudnn.api import rewrite
from tf_ucudnn.graph.rewrite import RewriteReport
from tf_ucudnn.plan import Algorithm, KernelPlan, LayerPlan, MicroBatch
from tf_ucudnn import memory, parallel  # noqa: F401  (as tf_ucudnn.memory, tf_ucudnn.parallel)
from tf_ucudnn.planner import DatabasePlanner

__all__ = [
    "Algorithm", "ConversionError", "Converter", "DatabasePlanner", "KernelPlan", "LayerPlan",
    "MicroBatch", "MicroBatchCallback", "RewriteReport",
    "conv2d", "conv2d_backprop_filter", "conv2d_backprop_input",
    "conv3d", "conv3d_backprop_filter", "conv3d_backprop_input",
    "gpu_kernels_available", "memory", "parallel", "rewrite",
]
