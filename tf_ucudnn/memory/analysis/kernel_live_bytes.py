"""What each convolution kernel of a training step runs beside: the bytes the liveness analysis
finds held while it runs, which the network ILP's dynamic-allocator mode plans workspaces
against (`tf-ucudnn plan --mode dynamic_allocator`)."""

from __future__ import annotations

from typing import Sequence

from tf_ucudnn.core.conv_layer import ConvLayer
from tf_ucudnn.core.plan import BACKPROP_FILTER, BACKPROP_INPUT, FORWARD
from tf_ucudnn.memory.analysis.liveness import analyze, kernel_scratch_bytes


# The kernel each of TensorFlow's convolution ops runs; a gradient reads its forward op's
# filters (input gradient) or input (filter gradient) at this input.
_TENSORFLOW_KERNELS = {
    **dict.fromkeys(("Conv2D", "Conv3D", "DepthwiseConv2dNative"), (FORWARD, None)),
    **dict.fromkeys(("Conv2DBackpropInput", "Conv3DBackpropInputV2",
                     "DepthwiseConv2dNativeBackpropInput"), (BACKPROP_INPUT, 1)),
    **dict.fromkeys(("Conv2DBackpropFilter", "Conv3DBackpropFilterV2",
                     "DepthwiseConv2dNativeBackpropFilter"), (BACKPROP_FILTER, 0)),
}


def training_live_bytes(step, layers: Sequence[ConvLayer]) -> dict[tuple[ConvLayer, str], int]:
    """The bytes held beside each kernel of `layers` (the forward convolutions of `step`, a
    traced training step) as it runs, by the liveness analysis of the step: the tensors live
    then and the variables, less the kernel's own scratch, which its workspace in the
    dynamic_allocator mode stands for. A gradient is its forward op's: it reads the same
    filters (input gradient) or the same input (filter gradient)."""
    report = analyze(step)
    held = {op.name: op.live_bytes for op in report.ops}
    by_name = {layer.name: layer for layer in layers}
    live = {}
    for op in step.graph.get_operations():
        kernel, shared = _TENSORFLOW_KERNELS.get(op.type, (None, None))
        if kernel is None:
            continue
        forwards = [op] if shared is None else [
            reader for reader in op.inputs[shared].consumers()
            if _TENSORFLOW_KERNELS.get(reader.type, (None,))[0] == FORWARD
            and (kernel != BACKPROP_FILTER or reader.inputs[1].shape == op.outputs[0].shape)]
        layer = by_name.get(forwards[0].name) if len(forwards) == 1 else None
        if layer is not None:
            live[(layer, kernel)] = (held[op.name] - kernel_scratch_bytes(op)
                                     + report.persistent_bytes)
    return live
