"""Gradients of the micro-batched ops, following TensorFlow's own (tensorflow/python/ops/nn_grad.py).

The gradient of a forward op runs the two backprop ops with the plans the forward op carries for
them. Second-order gradients (of the backprop ops) use plans chosen at run time. The batch
normalization's gradient is its own op; its statistics feed moving averages only, so no gradient
flows back through them.
"""

import tensorflow as tf

from tf_ucudnn.core.plan import workspace_attr
from tf_ucudnn.kernels.library import op_library
from tf_ucudnn.kernels.ops import with_workspaces

_CONV_ATTRS = ("strides", "padding", "explicit_paddings", "data_format", "dilations",
               "use_cudnn_on_gpu", "plan_batch_size")
_BACKPROP_OPS = {
    2: ("ucudnn_conv2d", "ucudnn_conv2d_backprop_input", "ucudnn_conv2d_backprop_filter"),
    3: ("ucudnn_conv3d", "ucudnn_conv3d_backprop_input", "ucudnn_conv3d_backprop_filter"),
}


def _backprop_ops(num_spatial):
    return [getattr(op_library(), name) for name in _BACKPROP_OPS[num_spatial]]


def _attrs(op):
    return {name: op.get_attr(name) for name in _CONV_ATTRS}


def gradient_plan_attrs(op, prefix: str) -> dict:
    """The plan a forward op carries for one of its gradient's kernels, as that op's attrs."""
    return {"micro_batches": op.get_attr(prefix + "micro_batches"),
            "algorithms": op.get_attr(prefix + "algorithms")}


def gradient_workspace(op, kernel: str) -> dict:
    """The workspace the forward op carries for one of its gradient's kernels, as that node's
    (traced only: nothing when it has none, or runs eagerly)."""
    if tf.executing_eagerly():
        return {}
    node = op.outputs[0].op  # the tape hands a stand-in, blind to internal attributes
    name = workspace_attr(kernel)
    return {"": node.get_attr(name)} if name in node.node_def.attr else {}


def _forward_grad(num_spatial):
    def grad_fn(op, grad):
        _, backprop_input, backprop_filter = _backprop_ops(num_spatial)
        input, filters = op.inputs
        return [
            with_workspaces(backprop_input(tf.shape(input), filters, grad, **_attrs(op),
                                           **gradient_plan_attrs(op, "backprop_input_")),
                            gradient_workspace(op, "backprop_input_")),
            with_workspaces(backprop_filter(input, tf.shape(filters), grad, **_attrs(op),
                                            **gradient_plan_attrs(op, "backprop_filter_")),
                            gradient_workspace(op, "backprop_filter_")),
        ]
    return grad_fn


def _backprop_input_grad(num_spatial):
    def grad_fn(op, grad):
        forward, _, backprop_filter = _backprop_ops(num_spatial)
        _, filters, out_backprop = op.inputs
        return [
            None,
            backprop_filter(grad, tf.shape(filters), out_backprop, **_attrs(op)),
            forward(grad, filters, **_attrs(op)),
        ]
    return grad_fn


def _backprop_filter_grad(num_spatial):
    def grad_fn(op, grad):
        forward, backprop_input, _ = _backprop_ops(num_spatial)
        input, _, out_backprop = op.inputs
        return [
            backprop_input(tf.shape(input), grad, out_backprop, **_attrs(op)),
            None,
            forward(input, grad, **_attrs(op)),
        ]
    return grad_fn


for _num_spatial in (2, 3):
    tf.RegisterGradient(f"UcudnnConv{_num_spatial}D")(_forward_grad(_num_spatial))
    tf.RegisterGradient(f"UcudnnConv{_num_spatial}DBackpropInput")(
        _backprop_input_grad(_num_spatial))
    tf.RegisterGradient(f"UcudnnConv{_num_spatial}DBackpropFilter")(
        _backprop_filter_grad(_num_spatial))


@tf.RegisterGradient("UcudnnBatchNorm")
def _batch_norm_grad(op, dy, _mean_grad, _inv_std_grad):
    x, scale, _ = op.inputs
    _, saved_mean, saved_inv_std = op.outputs
    return list(op_library().ucudnn_batch_norm_grad(dy, x, scale, saved_mean, saved_inv_std,
                                            epsilon=op.get_attr("epsilon")))
