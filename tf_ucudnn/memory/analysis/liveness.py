"""Liveness analysis of a training step: which tensors are on the device at each op, and the peak.

The ops run in the graph's own order (`tf.Graph.get_operations()`: the order tracing created them,
a topological order, which is also the order TensorFlow's executor mostly follows on one stream).
A tensor is held from the start of its producer to the end of its last consumer; a tensor nothing
reads is held during its producer only, unless the step returns it. Ops that hand on their input's
buffer (Identity, Reshape, ...) make no new tensor: they extend the life of the one they read.
A graph placed on several devices (a spatial split) has a peak per device: each tensor counts on
its producer's device, unplaced ops on the one TensorFlow's placer would pick (the first GPU, else
the CPU). Variables are persistent, counted apart; function calls count as one op (listed in the
report), so inline calls first (`tf_ucudnn.graph.functions.inline_function_calls`) to see inside
them.
Some GPU kernels allocate buffers of their own while they run (`kernel_scratch_bytes`); each is
counted as a tensor `<op>:scratch` held during its op only. The steps are planned for the GPU, so
these are its kernels' buffers, also when the analysis runs on a CPU.

The backward pass is the ops `tf.GradientTape` put under a `gradient_tape/` (or `gradients/`) name
scope and every op depending on them. Tensors made by the forward pass and read by the backward
pass are the kept activations that swapping and recomputation act on.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Optional

import numpy as np
import tensorflow as tf
from tensorflow.core.framework import graph_pb2

from tf_ucudnn.core.plan import WORKSPACE_ATTR
from tf_ucudnn.core.units import MIB
from tf_ucudnn.graph.functions import is_concrete_function
from tf_ucudnn.memory.analysis.tensor_use import TensorUse, tensor_bytes

# Ops whose output is their input's buffer.
ALIASING_OPS = {"Identity", "Reshape", "ExpandDims", "Squeeze", "StopGradient", "Snapshot",
                "EnsureShape", "PreventGradient"}
CALL_OPS = {"PartitionedCall", "StatefulPartitionedCall"}


def _on_other_devices(op: tf.Operation, source: tf.Tensor) -> bool:
    """Whether `op` reads `source` from another device: TensorFlow's runtime then copies the
    tensor into a buffer of the reader's device, and nothing is aliased."""
    if not op.device and not source.op.device:
        return False
    return _canonical_device(op.device) != _canonical_device(source.op.device)


def aliased_input(op: tf.Operation, output: int = 0) -> Optional[tf.Tensor]:
    """The input whose buffer `op`'s output (by index) shares, if any: an aliasing op's, an
    IdentityN's own (tf.custom_gradient's outputs), or a split's along the first dimension
    (TensorFlow slices the buffer, rows being contiguous); none across devices."""
    source = _aliased_input_on_any_device(op, output)
    return None if source is None or _on_other_devices(op, source) else source


def _aliased_input_on_any_device(op: tf.Operation, output: int) -> Optional[tf.Tensor]:
    if op.type == "IdentityN":
        source = op.inputs[output]
        return source if source.dtype not in (tf.resource, tf.variant) else None
    if op.type in ALIASING_OPS and op.inputs and \
            op.inputs[0].dtype not in (tf.resource, tf.variant):
        return op.inputs[0]
    if op.type in ("Split", "SplitV"):
        value, axis = (op.inputs[1], op.inputs[0]) if op.type == "Split" else \
            (op.inputs[0], op.inputs[2])
        if tf.get_static_value(axis) == 0:
            return value
    return None


def buffer_of(tensor: tf.Tensor) -> str:
    """The name of the tensor whose buffer `tensor` is: itself, or what it aliases."""
    while (source := aliased_input(tensor.op, tensor.value_index)) is not None:
        tensor = source
    return tensor.name


_BATCH_NORMS = {"FusedBatchNorm": 2, "FusedBatchNormV2": 2, "FusedBatchNormV3": 2,
                "FusedBatchNormGrad": 3, "FusedBatchNormGradV2": 3, "FusedBatchNormGradV3": 3}


def kernel_scratch_bytes(op: tf.Operation) -> int:
    """Bytes the op's GPU kernel allocates for itself while it runs.

    A convolution tf_ucudnn planned (by `rewrite`, or traced from `tf_ucudnn.conv2d` with a
    plan, as the callback does): the cuDNN workspace of its plan, as the profiles give it.
    TensorFlow's own convolutions: the copies `_tensorflow_convolution_copies` names (their
    workspace, chosen at run time, is not counted). TensorFlow's batch normalization runs
    channels-last input through cuDNN in NCHW unless it is float16 with
    TF_USE_CUDNN_BATCHNORM_SPATIAL_PERSISTENT set: training forward, it holds the input and
    output transposed (two activation-sized buffers); backward, the input, the output's gradient
    and the input's gradient (three). Such a gradient, with its copies, can be a ResNet's peak:
    four activation-sized buffers for one normalization."""
    if WORKSPACE_ATTR in op.node_def.attr:
        return op.get_attr(WORKSPACE_ATTR)
    if op.type in _CONVOLUTIONS:
        return _tensorflow_convolution_copies(op)
    copies = _BATCH_NORMS.get(op.type)
    if copies is None or op.get_attr("data_format") not in (b"NHWC", b"NDHWC") or \
            not op.get_attr("is_training"):
        return 0
    if op.type.endswith("V3") and op.inputs[0].dtype == tf.float16 and \
            os.environ.get("TF_USE_CUDNN_BATCHNORM_SPATIAL_PERSISTENT", "0") not in ("", "0"):
        return 0
    return copies * (tensor_bytes(op.inputs[0]) or 0)


_CONVOLUTIONS = {"Conv2D": "forward", "Conv3D": "forward",
                 "Conv2DBackpropInput": "input", "Conv3DBackpropInputV2": "input",
                 "Conv2DBackpropFilter": "filter", "Conv3DBackpropFilterV2": "filter"}


def _tensorflow_convolution_copies(op: tf.Operation) -> int:
    """Bytes of the copies TensorFlow's cuDNN convolution kernels make (conv_ops_impl.h,
    conv_grad_input_ops.h, their 3-D forms), besides their workspace, which they choose at run
    time and give up when memory is short (not counted).

    The gradient of the input is computed into a buffer of its own and then handed on (or
    transposed) to the output, both held meanwhile: one more input-sized buffer, enough to put a
    planned step out of memory where a stride-2 convolution's gradient (three such buffers) is
    the peak. Channels-last tensors are transposed to NCHW
    around the cuDNN call unless it computes channels-last: float16 and bfloat16, and float32 with
    TF32 allowed (TensorFlow's default), on the Ampere and later GPUs the steps are planned for.
    An uneven SAME padding pads a copy of the input (or of its gradient). A 1x1 convolution with
    unit strides on channels-last tensors is a matrix product with none of these."""
    kind = _CONVOLUTIONS[op.type]
    channels_last = op.get_attr("data_format") in (b"NHWC", b"NDHWC")
    x, filters = (op.outputs[0] if kind == "input" else op.inputs[0],
                  op.inputs[1] if kind != "filter" else op.outputs[0])
    y = op.inputs[2] if kind != "forward" else op.outputs[0]
    shapes = [t.shape for t in (x, filters, y)]
    if not all(shape.is_fully_defined() for shape in shapes):
        return 0
    spatial = slice(1, -1) if channels_last else slice(2, None)
    windows = filters.shape[:-2]
    strides, dilations = op.get_attr("strides")[spatial], op.get_attr("dilations")[spatial]
    grouped = x.shape[-1 if channels_last else 1] != filters.shape[-2]
    if channels_last and not grouped and set(windows) | set(strides) | set(dilations) == {1}:
        return 0
    copies = 0
    computes_channels_last = x.dtype in (tf.float16, tf.bfloat16) or (
        x.dtype == tf.float32 and tf.config.experimental.tensor_float_32_execution_enabled())
    if channels_last and not computes_channels_last:
        copies += {"forward": tensor_bytes(x) + tensor_bytes(y),
                   "input": tensor_bytes(y), "filter": tensor_bytes(x) + tensor_bytes(y)}[kind]
    if kind == "input":
        copies += tensor_bytes(x)
    if op.get_attr("padding") == b"SAME" and any(
            (max(0, (out - 1) * stride + (window - 1) * dilation + 1 - size)) % 2
            for size, out, window, stride, dilation in zip(
                x.shape[spatial], y.shape[spatial], windows, strides, dilations)):
        copies += tensor_bytes(x)
    return copies


BACKWARD_SCOPES = ("gradient_tape/", "gradients/")


@dataclasses.dataclass(frozen=True)
class StepOp:
    name: str
    type: str
    backward: bool
    live_bytes: int  # held while it runs, on all devices together (see device_peaks)


@dataclasses.dataclass
class LivenessReport:
    ops: list[StepOp]
    tensors: list[TensorUse]  # one per buffer, indices into `ops`
    persistent_bytes: int  # variables
    unknown_size: list[str]  # tensors of unknown shape, counted as 0 bytes
    function_calls: list[str]  # call ops counted as one op, their insides unseen

    @property
    def peak_bytes(self) -> int:
        return max((op.live_bytes for op in self.ops), default=0)

    def device_peaks(self) -> dict[str, int]:
        """Each device's peak of tensors ("" for a graph on one device)."""
        live: dict[str, list[int]] = {}
        for tensor in self.tensors:
            held = live.setdefault(tensor.device, [0] * len(self.ops))
            for i in range(tensor.producer, max(tensor.consumers, default=tensor.producer) + 1):
                held[i] += tensor.bytes
        return {device: max(held, default=0) for device, held in sorted(live.items())}

    @property
    def peak_op(self) -> Optional[str]:
        return max(self.ops, key=lambda op: op.live_bytes).name if self.ops else None

    def kept(self) -> list[TensorUse]:
        """Tensors the forward pass makes for the backward pass, largest first (the step's
        inputs are the caller's, and variables persistent: neither counts)."""
        return sorted((t for t in self.tensors if t.backward_consumers and t.bytes
                       and not self.ops[t.producer].backward
                       and self.ops[t.producer].type != "Placeholder"), key=lambda t: -t.bytes)

    def to_json(self) -> dict:
        return {"peak_bytes": self.peak_bytes, "peak_op": self.peak_op,
                "persistent_bytes": self.persistent_bytes,
                "ops": [dataclasses.asdict(op) for op in self.ops],
                "kept": [dataclasses.asdict(t) for t in self.kept()],
                "unknown_size": self.unknown_size, "function_calls": self.function_calls}

    def to_text(self) -> str:
        kept = self.kept()
        lines = [f"{len(self.ops)} ops; peak {self.peak_bytes / MIB:.1f} MiB of tensors at "
                 f"{self.peak_op}, plus {self.persistent_bytes / MIB:.1f} MiB of variables; "
                 f"{len(kept)} tensors kept for the backward pass "
                 f"({sum(t.bytes for t in kept) / MIB:.1f} MiB)"]
        lines += [f"  kept {t.name}: {t.bytes / MIB:.2f} MiB, made at op {t.producer}, read "
                  f"back at op {t.backward_consumers[0]}" for t in kept[:5]]
        if self.unknown_size:
            lines.append(f"  {len(self.unknown_size)} tensor(s) of unknown size counted as 0, "
                         f"e.g. {', '.join(self.unknown_size[:3])}")
        if self.function_calls:
            lines.append(f"  {len(self.function_calls)} function call(s) counted as one op each: "
                         f"{', '.join(self.function_calls[:3])}")
        return "\n".join(lines)

    def plot(self, path: str) -> None:
        """The memory timeline as a PNG: bytes held at each op, the backward pass shaded."""
        import matplotlib

        matplotlib.use("Agg")
        from matplotlib import pyplot

        figure, axes = pyplot.subplots(figsize=(10, 4))
        live = [op.live_bytes / MIB for op in self.ops]
        axes.plot(range(len(live)), live, linewidth=1, label="tensors on the device")
        backward = [i for i, op in enumerate(self.ops) if op.backward]
        if backward:
            axes.axvspan(backward[0], backward[-1], alpha=0.1, label="backward pass")
        peak = max(range(len(live)), key=live.__getitem__) if live else 0
        if live:
            axes.annotate(f"peak {live[peak]:.1f} MiB\n{self.ops[peak].name}", (peak, live[peak]),
                          fontsize=7)
        axes.set_xlabel("op, in execution order")
        axes.set_ylabel("MiB")
        axes.legend(loc="upper left")
        figure.tight_layout()
        figure.savefig(path, dpi=100)
        pyplot.close(figure)


def _graph_of(target) -> tuple[tf.Graph, set[str]]:
    """The graph, and the names of the tensors it returns."""
    if isinstance(target, graph_pb2.GraphDef):
        graph = tf.Graph()
        with graph.as_default():
            tf.graph_util.import_graph_def(target, name="")
        return graph, set()
    if isinstance(target, tf.Graph):
        return target, set()
    if is_concrete_function(target):
        return target.graph, {t.name for t in target.outputs}
    raise TypeError(f"analyze takes a GraphDef, a tf.Graph or a ConcreteFunction, got "
                    f"{type(target).__name__}")


def backward_ops(operations) -> list[bool]:
    """The ops under a gradient scope and all that depend on them (tf.GradientTape names its
    gradient sums AddN_<k>, outside the scope; optimizer updates follow them)."""
    index = {op.name: i for i, op in enumerate(operations)}
    backward = [op.name.startswith(BACKWARD_SCOPES) or
                any(f"/{scope}" in op.name for scope in BACKWARD_SCOPES) for op in operations]
    frontier = [i for i, flag in enumerate(backward) if flag]
    while frontier:
        op = operations[frontier.pop()]
        # Control edges too: no public accessor gives an op's control outputs.
        followers = [c for t in op.outputs for c in t.consumers()] + list(op._control_outputs)
        for follower in followers:
            i = index.get(follower.name)
            if i is not None and not backward[i]:
                backward[i] = True
                frontier.append(i)
    return backward


def _canonical_device(device: str) -> str:
    """A device's name without job, replica and task; an op placed nowhere runs on the first
    GPU, or the CPU without one."""
    if not device:
        return "/device:GPU:0" if tf.config.list_logical_devices("GPU") else "/device:CPU:0"
    return tf.DeviceSpec.from_string(device).replace(job=None, replica=None,
                                                     task=None).to_string()


def _placement(operations):
    """op -> its device's canonical name; "" for every op of a graph on one device."""
    if len({_canonical_device(op.device) for op in operations}) <= 1:
        return lambda op: ""
    return lambda op: _canonical_device(op.device)


def _held_at_each_op(tensors: list[TensorUse], count: int) -> list[int]:
    """The bytes of the tensors held at each of `count` ops: each from its producer to its last
    reader, summed as changes at those ops (a tensor may live for most of the step)."""
    change = np.zeros(count + 1, dtype=np.int64)
    np.add.at(change, [t.producer for t in tensors], [t.bytes for t in tensors])
    np.add.at(change, [max(t.consumers, default=t.producer) + 1 for t in tensors],
              [-t.bytes for t in tensors])
    return np.cumsum(change[:-1]).tolist()


def analyze(target) -> LivenessReport:
    """Liveness of a GraphDef, tf.Graph or ConcreteFunction (see the module's docstring)."""
    graph, returned = _graph_of(target)
    operations = graph.get_operations()
    is_backward = backward_ops(operations)

    # Each tensor's buffer: itself, or for aliasing ops the buffer of their input.
    buffers: dict[str, str] = {}
    for op in operations:
        for output in op.outputs:
            source = aliased_input(op, output.value_index)
            buffers[output.name] = output.name if source is None else buffers[source.name]

    variables, unknown, sizes = {}, [], {}
    producers: dict[str, int] = {}
    readers: dict[str, set[int]] = {}
    for i, op in enumerate(operations):
        for output in op.outputs:
            if buffers[output.name] != output.name:
                continue
            size = tensor_bytes(output)
            if size is None:
                unknown.append(output.name)
                size = 0
            if op.type == "ReadVariableOp":  # the variable's own buffer, however often read
                variables[op.inputs[0].name] = size
                size = 0
            sizes[output.name] = size
            producers[output.name] = i
            readers[output.name] = set()
        for tensor in op.inputs:
            readers[buffers[tensor.name]].add(i)
        scratch = kernel_scratch_bytes(op)
        if scratch:
            sizes[f"{op.name}:scratch"], producers[f"{op.name}:scratch"] = scratch, i
            readers[f"{op.name}:scratch"] = set()
    last = len(operations) - 1
    for name in returned:
        readers[buffers[name]].add(last)

    device_of = _placement(operations)
    tensors = []
    for name, producer in producers.items():
        consumers = sorted(readers[name])
        backward = tuple(c for c in consumers if is_backward[c] and not is_backward[producer])
        tensors.append(TensorUse(name, sizes[name], producer, tuple(consumers), backward,
                                 device_of(operations[producer])))
    live = _held_at_each_op(tensors, len(operations))
    ops = [StepOp(op.name, op.type, is_backward[i], live[i])
           for i, op in enumerate(operations)]
    return LivenessReport(ops=ops, tensors=tensors, persistent_bytes=sum(variables.values()),
                          unknown_size=unknown,
                          function_calls=[op.name for op in operations if op.type in CALL_OPS])
