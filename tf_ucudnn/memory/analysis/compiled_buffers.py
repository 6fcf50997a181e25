"""What XLA allocates for a compiled function, from its own buffer assignment.

The liveness analysis reads TensorFlow's graph; a step that XLA compiles holds XLA's buffers
instead: its fusions, its layouts and the workspaces its autotuner chose, in one allocation of
temporaries taken before anything runs. That allocation is what runs out of memory (under
TensorFlow's BFC allocator, XLA then aborts the process), so a plan for an XLA step is checked
against XLA's own figure, read here from the optimized module's buffer assignment
(`experimental_get_compiler_ir(stage="optimized_hlo_proto_serialized")`), compiled for the
device the function would run on.
"""

from __future__ import annotations

import dataclasses

import tensorflow as tf
from tensorflow.compiler.xla.service import hlo_pb2

from tf_ucudnn.core.errors import TfUcudnnError


class CompiledBuffersError(TfUcudnnError, ValueError):
    """XLA's buffer assignment could not be read for a function; says why."""


@dataclasses.dataclass(frozen=True)
class CompiledBuffers:
    """Bytes of a compiled function's buffers, by who holds them."""

    # The function's arguments and captured variables: held before the call.
    parameter_bytes: int
    # Results in buffers of their own (not aliasing a parameter).
    output_bytes: int
    # Everything else XLA needs while it runs: intermediates, loop state, convolution workspaces.
    temp_bytes: int

    @property
    def peak_bytes(self) -> int:
        """All of them at once: the device memory one call needs, beside what else is held."""
        return self.parameter_bytes + self.output_bytes + self.temp_bytes

    def to_json(self) -> dict:
        return dataclasses.asdict(self) | {"peak_bytes": self.peak_bytes}


def compiled_buffers(function, *args) -> CompiledBuffers:
    """XLA's buffers for `function` (a Python function or a `tf.function`, compiled whole as
    `jit_compile=True` compiles it) called with `args` (tensors or TensorSpecs, nested as the
    function takes them), for the device it would run on. CompiledBuffersError if XLA cannot
    compile it."""
    name = getattr(function, "__name__", type(function).__name__)
    flat = tf.nest.flatten(args)
    specs = [t if isinstance(t, tf.TensorSpec) else tf.TensorSpec(t.shape, t.dtype) for t in flat]

    # The IR is asked of TensorSpecs one per argument, so nested arguments come in flat.
    def flat_call(*tensors):
        return function(*tf.nest.pack_sequence_as(args, tensors))
    try:
        serialized = tf.function(flat_call, jit_compile=True).experimental_get_compiler_ir(
            *specs)(stage="optimized_hlo_proto_serialized")
    except (tf.errors.OpError, ValueError) as error:
        raise CompiledBuffersError(
            f"XLA could not compile {name!r}: {str(error).strip().splitlines()[0]}") from error
    proto = hlo_pb2.HloProto()
    proto.ParseFromString(serialized)
    if not proto.HasField("buffer_assignment"):
        raise CompiledBuffersError(
            f"XLA's module for {name!r} came without its buffer assignment")
    return buffers_of(proto.buffer_assignment)


def buffers_of(assignment) -> CompiledBuffers:
    """Sums a BufferAssignmentProto's allocations by who holds them. Thread-local allocations
    (a CPU's stack) and constants (part of the executable) are left out."""
    parameter = output = temp = 0
    for allocation in assignment.buffer_allocations:
        if allocation.is_thread_local or allocation.is_constant:
            continue
        if allocation.is_entry_computation_parameter:
            parameter += allocation.size
        elif allocation.maybe_live_out:
            output += allocation.size
        else:
            temp += allocation.size
    return CompiledBuffers(parameter, output, temp)
