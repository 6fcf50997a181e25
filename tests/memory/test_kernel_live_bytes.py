"""The bytes beside each convolution kernel of a training step, from its liveness analysis."""

from savedmodel.test_converter import conv_model

from tf_ucudnn.core.plan import KERNELS
from tf_ucudnn.graph.conv_layers import find_conv_layers
from tf_ucudnn.keras.planned_step import keras_training_step
from tf_ucudnn.memory.analysis.kernel_live_bytes import training_live_bytes
from tf_ucudnn.memory.analysis.liveness import analyze


def test_training_live_bytes_are_the_liveness_at_each_kernel():
    model = conv_model()
    step = keras_training_step(model, 6)
    layers = find_conv_layers(step.graph)[0]
    live = training_live_bytes(step, layers)
    report = analyze(step)
    held = {op.name: op.live_bytes + report.persistent_bytes for op in report.ops}
    # Every kernel of every layer, each no more than the step holds there (its scratch aside).
    assert set(live) == {(layer, kernel) for layer in layers for kernel in KERNELS}
    operations = step.graph.get_operations()
    for (layer, kernel), size in live.items():
        op = {"fwd": layer.name}.get(kernel) or next(
            o.name for o in operations if o.name.startswith(f"gradient_tape/{layer.name}/")
            and o.type == {"bwd_data": "Conv2DBackpropInput",
                           "bwd_filter": "Conv2DBackpropFilter"}[kernel])
        assert report.persistent_bytes < size <= held[op]
    # The first backward kernel (the last layer's filter gradient) runs beside every tensor
    # the forward pass keeps.
    kept = sum(t.bytes for t in report.kept())
    assert live[(layers[-1], "bwd_filter")] >= kept + report.persistent_bytes
