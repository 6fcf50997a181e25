"""XLA's buffer assignment of a compiled function, summed by who holds the buffers, against the
sizes of the tensors TensorFlow passes in and gets back."""

import pytest
import tensorflow as tf
from tensorflow.compiler.xla.service import hlo_pb2

from tf_ucudnn.memory.analysis.compiled_buffers import (
    CompiledBuffers,
    CompiledBuffersError,
    buffers_of,
    compiled_buffers,
)


def test_parameters_and_outputs_are_the_tensors_passed_in_and_returned():
    @tf.function(jit_compile=True)
    def doubled(x, y):
        return x * 2.0, y + 1

    x, y = tf.ones([1000]), tf.ones([10, 3], tf.int32)
    buffers = compiled_buffers(doubled, tf.TensorSpec(x.shape), tf.TensorSpec(y.shape, tf.int32))
    returned = sum(t.numpy().nbytes for t in doubled(x, y))
    assert buffers.parameter_bytes == x.numpy().nbytes + y.numpy().nbytes
    # The two results, and the table of the tuple that holds them.
    assert returned <= buffers.output_bytes <= returned + 64
    assert buffers.peak_bytes == (buffers.parameter_bytes + buffers.output_bytes
                                  + buffers.temp_bytes)


def test_an_intermediate_never_returned_is_a_temporary():
    @tf.function(jit_compile=True)
    def product_sum(a, b):
        return tf.reduce_sum(tf.nn.relu(tf.matmul(a, b)))

    a, b = tf.TensorSpec([512, 256]), tf.TensorSpec([256, 512])
    buffers = compiled_buffers(product_sum, a, b)
    assert buffers.parameter_bytes == 2 * 512 * 256 * 4
    assert buffers.output_bytes < 64  # one scalar
    assert buffers.temp_bytes >= 512 * 512 * 4  # the product
    # Twice the rows, twice the product.
    larger = compiled_buffers(product_sum, tf.TensorSpec([1024, 256]), b)
    assert larger.temp_bytes >= 1024 * 512 * 4 > buffers.temp_bytes


def test_a_variable_updated_in_place_is_held_once():
    variable = tf.Variable(tf.zeros([4096]))

    @tf.function(jit_compile=True)
    def accumulate(x):
        variable.assign_add(x)
        return tf.reduce_sum(variable)

    buffers = compiled_buffers(accumulate, tf.TensorSpec([4096]))
    assert buffers.parameter_bytes == 2 * 4096 * 4  # the argument and the variable
    assert buffers.output_bytes < 4096 * 4  # the update aliases the variable's buffer
    assert buffers.to_json()["peak_bytes"] == buffers.peak_bytes


def test_a_function_xla_cannot_compile_is_named_in_the_error():
    @tf.function(jit_compile=True)
    def printed(x):
        return tf.strings.as_string(x)

    with pytest.raises(CompiledBuffersError, match="XLA could not compile 'printed'"):
        compiled_buffers(printed, tf.TensorSpec([3]))


def test_thread_local_and_constant_allocations_are_not_device_memory():
    assignment = hlo_pb2.BufferAssignmentProto()
    for size, flags in [(100, {"is_entry_computation_parameter": True}),
                        (20, {"maybe_live_out": True}), (7, {}),
                        (1000, {"is_thread_local": True}), (3000, {"is_constant": True}),
                        # A parameter updated in place: held as the parameter, once.
                        (50, {"is_entry_computation_parameter": True, "maybe_live_out": True})]:
        assignment.buffer_allocations.add(size=size, **flags)
    assert buffers_of(assignment) == CompiledBuffers(parameter_bytes=150, output_bytes=20,
                                                     temp_bytes=7)
    assert buffers_of(assignment).peak_bytes == 177
