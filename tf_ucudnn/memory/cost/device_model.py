"""The device a step runs on, as the memory planner sees it: compute speed, copy bandwidth to the
host and back, and each op's and tensor's size from the graph."""

from __future__ import annotations

import dataclasses
import time
from typing import Optional

import tensorflow as tf
from tensorflow.core.framework import attr_value_pb2

from tf_ucudnn.memory.analysis.tensor_use import tensor_bytes

GB = 1e9


_SLICES = {"Slice", "StridedSlice"}


@dataclasses.dataclass(frozen=True)
class DeviceModel:
    """What the model assumes of the machine: copy bandwidths in bytes per second, and for the
    ops without measurements a roofline (device memory bandwidth, peak FLOP/s, launch cost)."""

    name: str
    device_to_host: float
    host_to_device: float
    memory_bandwidth: float = 3.35e12  # H100 SXM HBM3, datasheet
    peak_flops: float = 4.9e14  # H100 SXM dense TF32 tensor cores, datasheet
    launch_ms: float = 0.005

    def op_ms(self, op: tf.Operation) -> float:
        """A roofline estimate of one op's time: its FLOPs at peak or its bytes at the memory
        bandwidth, whichever is longer, plus a launch; tensors of unknown shape count as none.
        A slice reads only the part it copies."""
        return self._op_ms(op, tensor_bytes)

    def ops_ms(self, operations) -> list[float]:
        """`op_ms` of each op, each tensor's size worked out once (most are read by other ops
        than their producer, and a shape is slow to ask TensorFlow for)."""
        sizes = {}

        def size(tensor) -> Optional[int]:
            key = tensor.ref()
            if key not in sizes:
                sizes[key] = tensor_bytes(tensor)
            return sizes[key]
        return [self._op_ms(op, size) for op in operations]

    def _op_ms(self, op: tf.Operation, size) -> float:
        moved = sum(size(t) or 0 for t in (
            *(op.outputs if op.type in _SLICES else op.inputs), *op.outputs))
        return self.launch_ms + 1e3 * max(_flops(op) / self.peak_flops,
                                          moved / self.memory_bandwidth)

    @classmethod
    def measure(cls, device: str = "/GPU:0", size_bytes: int = 1 << 30,
                repeats: int = 5) -> "DeviceModel":
        """Times copies of a `size_bytes` tensor between the host and `device` the way the swap
        nodes make them: out to the host, and back from what came out. TensorFlow receives a
        device's tensor on the host in pinned memory, so the swap-in copies from pinned memory;
        a tensor made on the host is pageable, and copies from it run several times slower."""
        if not tf.config.list_logical_devices("GPU"):
            raise RuntimeError("no GPU to measure host-device bandwidth on; give a DeviceModel "
                               "with the bandwidths instead")
        count = size_bytes // 4

        def kept(x):
            # Kept as the swap nodes are: Grappler may drop an Identity it sees through.
            x.op._set_attr("_grappler_do_not_remove", attr_value_pb2.AttrValue(b=True))
            return x

        def copies(back_whole: bool):
            """Out to the host, then back whole, or only one value back; summed on the device
            so that what the caller receives (unpinned, and timed too) is one number."""
            @tf.function(autograph=False)
            def run(x):
                with tf.device("/CPU:0"):
                    x = kept(tf.identity(x))
                    if not back_whole:
                        x = x[:1]
                with tf.device(device):
                    return tf.reduce_sum(kept(tf.identity(x)))
            return run

        def best_seconds(run):
            # A fresh tensor each time: eager tensors keep a mirror on a device they were copied
            # to once.
            best = float("inf")
            for repeat in range(repeats + 1):
                with tf.device(device):
                    data = tf.random.stateless_uniform([count], seed=[repeat, 0])
                data[:1].numpy()  # made before the clock starts
                start = time.perf_counter()
                run(data).numpy()
                if repeat:  # the first call traces
                    best = min(best, time.perf_counter() - start)
            return best

        out = best_seconds(copies(back_whole=False))
        round_trip = best_seconds(copies(back_whole=True))
        if round_trip <= out:
            raise RuntimeError(f"copying {size_bytes} bytes out and back in to {device} took "
                               f"{round_trip * 1e3:.3f} ms, no longer than out alone "
                               f"({out * 1e3:.3f} ms): the copies did not run as timed")
        name = tf.config.experimental.get_device_details(
            tf.config.list_physical_devices("GPU")[0]).get("device_name", device)
        return cls(name, device_to_host=size_bytes / out,
                   host_to_device=size_bytes / (round_trip - out))


_MATRIX_PRODUCTS = ("MatMul", "BatchMatMulV2", "BatchMatMulV3")
_CONVOLUTIONS = ("Conv2D", "Conv3D", "UcudnnConv", "UcudnnFusedConv")


def _flops(op: tf.Operation) -> float:
    """Multiply-adds x 2 of the matrix and convolution ops, from their static shapes."""
    if op.type not in _MATRIX_PRODUCTS and not op.type.startswith(_CONVOLUTIONS):
        return 0.0  # before asking for shapes: most ops are neither
    shapes = [t.shape for t in (*op.inputs, *op.outputs)]
    if not all(shape.is_fully_defined() for shape in shapes):
        return 0.0
    if op.type in _MATRIX_PRODUCTS:
        a = op.inputs[0].shape
        k = a[-2] if op.get_attr("transpose_a" if op.type == "MatMul" else "adj_x") else a[-1]
        return 2.0 * op.outputs[0].shape.num_elements() * k
    # All three kernels of a convolution do the forward's work: for each output element, one
    # multiply-add per filter element of its output channel.
    backprop_filter = "BackpropFilter" in op.type
    outputs = op.inputs[2] if "Backprop" in op.type else op.outputs[0]
    filters = op.outputs[0] if backprop_filter else op.inputs[1]
    return 2.0 * outputs.shape.num_elements() * (filters.shape.num_elements()
                                                 // filters.shape[-1])

