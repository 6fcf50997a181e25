"""MicroBatchCallback: model.fit with micro-batched convolutions trains to the same weights."""

import dataclasses
import threading

import keras
import numpy as np
import pytest
import tensorflow as tf

from tf_ucudnn.core.plan import KernelPlan, LayerPlan
from tf_ucudnn.keras.callback import MicroBatchCallback
from tf_ucudnn.keras.input_prefetch import InputPrefetch

# Same weights within float32 tolerance needs full float32 on a GPU too, where TF32 would round
# TensorFlow's and tf_ucudnn's algorithms differently.
pytestmark = pytest.mark.usefixtures("no_tf32")


class SplittingPlanner:
    """Splits every kernel unevenly in two, and remembers the layers it was asked about."""

    def __init__(self, extra: int = 0):
        self.layers = []
        self.extra = extra

    def __call__(self, layer):
        self.layers.append(layer)
        batch = layer.batch_size
        halves = KernelPlan.of((batch // 2, 0), (batch - batch // 2 + self.extra, 1))
        return LayerPlan(halves, halves, halves)


def _vgg_style():
    layers = keras.layers
    return keras.Sequential([
        keras.Input((12, 12, 3)),
        layers.Conv2D(8, 3, padding="same", activation="relu"),
        layers.Conv2D(8, 3, padding="same", activation="relu"),
        layers.MaxPooling2D(),
        layers.Conv2D(16, 3, padding="same", activation="relu"),
        layers.Conv2DTranspose(4, 3),
        layers.GlobalAveragePooling2D(),
        layers.Dense(4),
    ])


def _resnet_style():
    layers = keras.layers
    inputs = keras.Input((12, 12, 3))
    x = layers.Conv2D(8, 3, strides=2, padding="same")(inputs)
    shortcut = x
    x = layers.Conv2D(8, 3, padding="same", activation="relu")(x)
    x = layers.BatchNormalization()(x)
    x = layers.Conv2D(8, 1)(x)
    x = layers.Add()([x, shortcut])
    x = layers.Conv2D(16, 3, strides=2, padding="valid", dilation_rate=1)(x)
    x = layers.GlobalAveragePooling2D()(x)
    return keras.Model(inputs, layers.Dense(4)(x))


def _data(samples=40):
    rng = np.random.RandomState(0)
    return rng.rand(samples, 12, 12, 3).astype("float32"), np.arange(samples) % 4


def _fit(build, callbacks, epochs=3, batch_size=16, validation=False, jit_compile="auto"):
    keras.utils.set_random_seed(1)
    model = build()
    model.compile(keras.optimizers.SGD(0.1),
                  keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  jit_compile=jit_compile)
    x, y = _data()
    history = model.fit(x, y, batch_size=batch_size, epochs=epochs, verbose=0, shuffle=False,
                        callbacks=callbacks, validation_data=(x[:10], y[:10]) if validation
                        else None)
    return model, history.history


@pytest.mark.parametrize("build", [_vgg_style, _resnet_style], ids=["vgg", "resnet"])
def test_fit_with_the_callback_trains_to_the_same_weights(build):
    plain, plain_history = _fit(build, [])
    planner = SplittingPlanner()
    callback = MicroBatchCallback(planner=planner, verbose=0)
    planned, planned_history = _fit(build, [callback], validation=True)

    convs = [layer for layer in planned.layers if type(layer) is keras.layers.Conv2D]
    assert [item.layer.name for item in callback.report.layers] == [layer.path for layer in convs]
    # Planned for the real batch (16), not the last partial one (40 = 16 + 16 + 8).
    assert {layer.batch_size for layer in planner.layers} == {16}
    # Only the first layer reads the images, whose gradient training does not compute.
    assert {layer.name: layer.input_gradient for layer in planner.layers} == {
        layer.path: layer is not convs[0] for layer in convs}
    np.testing.assert_allclose(planned_history["loss"], plain_history["loss"], rtol=1e-5)
    for a, b in zip(planned.get_weights(), plain.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


def _mobilenet_style():
    """Depthwise and pointwise convolutions, as in MobileNet, and a grouped one, as in ResNeXt."""
    layers = keras.layers
    return keras.Sequential([
        keras.Input((12, 12, 3)),
        layers.Conv2D(8, 3, strides=2, padding="same", activation="relu"),
        layers.DepthwiseConv2D(3, padding="same", activation="relu"),
        layers.Conv2D(16, 1, activation="relu"),
        layers.DepthwiseConv2D(3, strides=2, depth_multiplier=2, padding="same", use_bias=False),
        layers.Conv2D(16, 3, groups=4, padding="same", activation="relu"),
        layers.GlobalAveragePooling2D(),
        layers.Dense(4),
    ])


def test_depthwise_and_grouped_layers_train_planned_to_the_same_weights():
    plain, plain_history = _fit(_mobilenet_style, [])
    callback = MicroBatchCallback(planner=SplittingPlanner(), verbose=0)
    planned, planned_history, seen = _fit_seeing_op_types(_mobilenet_style, [callback])

    assert callback.report.left_alone == []
    layers = [item.layer for item in callback.report.layers]
    assert [(layer.op_type, layer.groups) for layer in layers] == [
        ("Conv2D", 1), ("DepthwiseConv2dNative", 8), ("Conv2D", 1),
        ("DepthwiseConv2dNative", 16), ("Conv2D", 4)]
    assert layers[3].filter_shape == (3, 3, 1, 32)
    assert "UcudnnConv2D" in seen and "DepthwiseConv2dNative" not in seen
    np.testing.assert_allclose(planned_history["loss"], plain_history["loss"], rtol=1e-5)
    for a, b in zip(planned.get_weights(), plain.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
    # Given back: the depthwise layers run their own call again.
    assert all("call" not in vars(layer) and "convolution_op" not in vars(layer)
               for layer in planned.layers)
    assert "DepthwiseConv2dNative" in _op_types(planned)


def test_layers_left_alone_are_reported_with_the_reason():
    callback = MicroBatchCallback(planner=SplittingPlanner(), verbose=0)
    _fit(_vgg_style, [callback], epochs=1)
    (left,) = callback.report.left_alone
    assert "conv2d_transpose" in left.node
    assert "Conv2DTranspose is not a Keras Conv2D or Conv3D" in left.reason
    assert "1 left as they are" in callback.summary()


def test_a_layer_the_planner_declines_keeps_its_own_op_and_is_reported():
    callback = MicroBatchCallback(planner=lambda layer: "no gain: a test's reason", verbose=0)
    _fit(_vgg_style, [callback], epochs=1)
    assert not callback.report.layers
    reasons = {item.reason for item in callback.report.left_alone}
    assert "no gain: a test's reason" in reasons


def test_the_planned_ops_really_run():
    # A plan one sample too long is refused by tf_ucudnn's op, naming it: the planned op ran.
    callback = MicroBatchCallback(planner=SplittingPlanner(extra=1), verbose=0)
    with pytest.raises(tf.errors.InvalidArgumentError, match="Ucudnn"):
        _fit(_vgg_style, [callback], epochs=2)
    # Keras calls no callback after a failed step; the model got its own layers back anyway.
    assert all("convolution_op" not in vars(layer) for layer in callback.model.layers)


def _op_types(model):
    graph = tf.function(model).get_concrete_function(tf.TensorSpec([16, 12, 12, 3])).graph
    return {op.type for op in graph.get_operations()}


def _fit_seeing_op_types(build, callbacks, epochs=3, jit_compile="auto"):
    """`_fit` with `callbacks`, and the op types the model runs at its second training step."""
    seen = set()

    class Probe(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if batch == 1:
                seen.update(_op_types(self.model))

    model, history = _fit(build, [*callbacks, Probe()], epochs=epochs, jit_compile=jit_compile)
    return model, history, seen


def test_after_training_the_model_is_plain_again():
    callback = MicroBatchCallback(planner=SplittingPlanner(), verbose=0)
    model, _ = _fit(_vgg_style, [callback], epochs=1)
    assert callback.report.layers
    assert all("convolution_op" not in vars(layer) for layer in model.layers)
    types = _op_types(model)
    assert "Conv2D" in types and not any(t.startswith("Ucudnn") for t in types)


def test_while_training_the_layers_run_tf_ucudnn_ops():
    _, _, seen = _fit_seeing_op_types(
        _vgg_style, [MicroBatchCallback(planner=SplittingPlanner(), verbose=0)], epochs=1,
        jit_compile=False)  # as on a CPU: under XLA nothing is fused
    # Each Conv2D has a bias and a ReLU: its convolution, bias and activation run fused.
    assert "UcudnnFusedConv2D" in seen and "Conv2D" not in seen


def _fusion_style():
    """Layers the callback fuses (bias and ReLU, bias alone, channels first, 3-D) and ones it
    does not (no bias, another activation)."""
    layers = keras.layers
    return keras.Sequential([
        keras.Input((12, 12, 3)),
        layers.Conv2D(8, 3, padding="same", activation="relu"),
        layers.Conv2D(8, 3, strides=2, padding="valid"),
        layers.Conv2D(8, 3, padding="same", use_bias=False, activation="relu"),
        layers.Conv2D(8, 3, padding="same", groups=2, activation="relu6"),
        layers.Reshape((5, 5, 8, 1)),
        layers.Conv3D(4, 3, padding="same", activation="relu"),
        layers.Reshape((5, 5, 32)),
        layers.Permute((3, 1, 2)),
        layers.Conv2D(8, 3, padding="same", dilation_rate=2, data_format="channels_first",
                      activation="relu"),
        layers.GlobalAveragePooling2D(data_format="channels_first"),
        layers.Dense(4),
    ])


def test_layers_with_a_bias_and_a_relu_or_none_train_fused_to_the_same_weights():
    plain, plain_history = _fit(_fusion_style, [])
    callback = MicroBatchCallback(planner=SplittingPlanner(), verbose=0)
    planned, planned_history, seen = _fit_seeing_op_types(_fusion_style, [callback])

    paths = [layer.path for layer in planned.layers]
    assert [(item.layer, item.activation) for item in callback.report.fused] == [
        (paths[0], "relu"), (paths[1], "identity"), (paths[5], "relu"), (paths[8], "relu")]
    reasons = {item.layer: item.reason for item in callback.report.not_fused}
    assert "use_bias=False" in reasons[paths[2]] and "relu6" in reasons[paths[3]]
    assert f"fused {paths[0]} with its bias and relu" in callback.summary()
    assert {"UcudnnFusedConv2D", "UcudnnFusedConv3D", "UcudnnConv2D"} <= seen
    np.testing.assert_allclose(planned_history["loss"], plain_history["loss"], rtol=1e-5)
    for a, b in zip(planned.get_weights(), plain.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
    assert all("call" not in vars(layer) for layer in planned.layers)


def test_under_xla_the_callback_fuses_nothing_and_says_why():
    callback = MicroBatchCallback(planner=SplittingPlanner(), trial_steps=0, verbose=0)
    _fit(_vgg_style, [callback], epochs=1, jit_compile=True)
    assert callback.report.fused == [] and callback.report.not_fused
    assert all("XLA" in item.reason for item in callback.report.not_fused)


def test_with_a_memory_budget_training_follows_the_memory_plan(monkeypatch):
    from training_steps import SLOW_LINK

    # As on a GPU, where the batches would be copied ahead but for the budget.
    monkeypatch.setattr(InputPrefetch, "default_device", staticmethod(lambda: "/device:CPU:0"))
    probe = MicroBatchCallback(planner=SplittingPlanner(), accumulate_gradients=False,
                               memory_budget=1 << 40,
                               device_model=SLOW_LINK, verbose=0)
    _fit(_vgg_style, [probe], epochs=1)
    unplanned_peak = probe.report.memory.decisions.prediction.peak_bytes
    assert not probe.report.memory.swaps and not probe.report.memory.recomputes

    plain, plain_history = _fit(_vgg_style, [])
    callback = MicroBatchCallback(planner=SplittingPlanner(), accumulate_gradients=False,
                                  memory_budget=int(
        unplanned_peak * 0.9), device_model=SLOW_LINK, verbose=0)
    trained_by = []

    class Probe(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            trained_by.append(self.model.train_function.__qualname__)

    planned, history = _fit(_vgg_style, [callback, Probe()])
    # After the first step, the memory-planned step trains.
    assert all("_plan_memory" in name for name in trained_by) and len(trained_by) == 9
    assert callback.report.input_prefetch == ("batches not copied ahead: under a memory budget "
                                              "(each batch ahead holds GPU memory)")
    memory = callback.report.memory
    assert memory.swaps or memory.recomputes
    assert memory.decisions.prediction.peak_bytes <= unplanned_peak * 0.9
    np.testing.assert_allclose(history["loss"], plain_history["loss"], rtol=1e-5)
    for a, b in zip(planned.get_weights(), plain.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
    assert "train_step" not in vars(planned)


def test_with_a_memory_budget_no_step_runs_unplanned(monkeypatch):
    """Beyond the device's memory the unplanned step would not fit, so even the first batch
    trains with the planned step: Keras's own train function is never called."""
    from training_steps import SLOW_LINK

    own_calls = []
    make_own = keras.Model.make_train_function

    def counted_make_train_function(model, force=False):
        if model.train_function is not None and not force:
            return model.train_function
        make_own(model, force)
        own = model.train_function

        def train_function(iterator):
            own_calls.append(1)
            return own(iterator)
        model.train_function = train_function
        return train_function
    monkeypatch.setattr(keras.Model, "make_train_function", counted_make_train_function)

    plain, plain_history = _fit(_vgg_style, [])
    assert len(own_calls) == 9  # the spy sees plain training
    own_calls.clear()
    callback = MicroBatchCallback(planner=SplittingPlanner(), accumulate_gradients=False,
                                  memory_budget=1 << 40,
                                  device_model=SLOW_LINK, verbose=0)
    planned, history = _fit(_vgg_style, [callback])
    assert own_calls == []
    assert callback.report.layers[0].layer.input_shape == (16, 12, 12, 3)
    np.testing.assert_allclose(history["loss"], plain_history["loss"], rtol=1e-5)
    for a, b in zip(planned.get_weights(), plain.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


def test_the_memory_plan_counts_the_workspace_of_each_planned_kernel():
    from training_steps import SLOW_LINK

    def with_workspace(plan, size):
        return KernelPlan(tuple(dataclasses.replace(mb, workspace_bytes=size)
                                for mb in plan.micro_batches))

    class ProfiledPlanner(SplittingPlanner):
        def __call__(self, layer):
            plan = super().__call__(layer)
            return LayerPlan(with_workspace(plan.forward, 4096),
                             with_workspace(plan.backprop_input, 8192), plan.backprop_filter)

    callback = MicroBatchCallback(planner=ProfiledPlanner(), accumulate_gradients=False,
                                  memory_budget=1 << 40,
                                  device_model=SLOW_LINK, verbose=0)
    _fit(_vgg_style, [callback], epochs=1)
    liveness = callback.report.memory.liveness
    scratch = [(liveness.ops[t.producer].type, t.bytes) for t in liveness.tensors
               if t.name.endswith(":scratch") and
               liveness.ops[t.producer].type.startswith("Ucudnn")]
    # The three convolutions, forward and input gradient; the filter gradients' plans were not
    # profiled. (The transposed convolution is TensorFlow's own, its copies counted as such.)
    assert sorted(scratch) == [("UcudnnConv2D", 4096)] * 3 + \
        [("UcudnnConv2DBackpropInput", 8192)] * 3


def test_under_a_tighter_budget_the_first_layers_train_in_micro_batches():
    from training_steps import SLOW_LINK

    probe = MicroBatchCallback(planner=SplittingPlanner(), accumulate_gradients=False,
                               memory_budget=1 << 40,
                               device_model=SLOW_LINK, verbose=0)
    _fit(_vgg_style, [probe], epochs=1)
    budget = int(probe.report.memory.decisions.prediction.peak_bytes * 0.6)
    plain, plain_history = _fit(_vgg_style, [])
    callback = MicroBatchCallback(planner=SplittingPlanner(), accumulate_gradients=False,
                                  memory_budget=budget,
                                  device_model=SLOW_LINK, verbose=0)
    planned, history = _fit(_vgg_style, [callback])
    chosen = callback.memory_plan
    assert chosen.prefix_end.startswith("max_pooling2d") and chosen.micro_batches == 4
    assert chosen.passed_over[0].startswith("whole batches:")
    assert callback.report.memory.decisions.prediction.peak_bytes <= budget
    np.testing.assert_allclose(history["loss"], plain_history["loss"], rtol=1e-5)
    for a, b in zip(planned.get_weights(), plain.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
    assert "call" not in vars(planned) and "train_step" not in vars(planned)


def _stem_style():
    layers = keras.layers
    return keras.Sequential([
        keras.Input((12, 12, 3)),
        layers.Conv2D(8, 3, strides=2, padding="same"),
        layers.BatchNormalization(momentum=0.5),
        layers.ReLU(),
        layers.ZeroPadding2D(1),
        layers.MaxPooling2D(3, 2),
        layers.Conv2D(8, 3, padding="same", activation="relu"),
        layers.GlobalAveragePooling2D(),
        layers.Dense(4),
    ])


def test_asked_to_the_callback_trains_first_layers_with_a_batch_normalization_in_micro_batches():
    from training_steps import SLOW_LINK

    plain, plain_history = _fit(_stem_style, [])
    callback = MicroBatchCallback(planner=SplittingPlanner(), accumulate_gradients=False,
                                  memory_budget=1 << 40,
                                  device_model=SLOW_LINK, whole_batches=False, verbose=0)
    planned, history = _fit(_stem_style, [callback])
    chosen = callback.memory_plan
    assert chosen.prefix_end.startswith("max_pooling2d")
    assert chosen.passed_over == ["whole batches: not tried, as asked"]
    np.testing.assert_allclose(history["loss"], plain_history["loss"], rtol=1e-5)
    # The weights and the normalization's moving statistics.
    for a, b in zip(planned.get_weights(), plain.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
    assert "call" not in vars(planned) and "train_step" not in vars(planned)


def test_without_a_workspace_limit_convolutions_stay_tensorflows_under_a_memory_budget():
    from training_steps import SLOW_LINK

    probe = MicroBatchCallback(None, accumulate_gradients=False,
                               memory_budget=1 << 40, device_model=SLOW_LINK, verbose=0)
    _fit(_vgg_style, [probe], epochs=1)
    budget = int(probe.report.memory.decisions.prediction.peak_bytes * 0.9)
    plain, plain_history = _fit(_vgg_style, [])
    callback = MicroBatchCallback(None, accumulate_gradients=False,
                                  memory_budget=budget, device_model=SLOW_LINK, verbose=0)
    planned, history = _fit(_vgg_style, [callback])
    report = callback.report
    assert not report.layers
    assert [(item.node, item.reason) for item in report.left_alone] == [
        (layer.path, "workspace_limit=None: TensorFlow's own convolution")
        for layer in planned.layers if "conv" in layer.name]
    assert report.memory.decisions.prediction.peak_bytes <= budget
    # The peak is inside TensorFlow's transposed convolution, which no swap lowers.
    assert callback.memory_plan.passed_over[0].startswith("whole batches:")
    assert callback.memory_plan.prefix_end.startswith("max_pooling2d")
    assert not any(op.type.startswith("Ucudnn") for op in report.memory.liveness.ops)
    np.testing.assert_allclose(history["loss"], plain_history["loss"], rtol=1e-5)
    for a, b in zip(planned.get_weights(), plain.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


def test_streamed_convolutions_with_their_batch_normalization_train_to_the_same_weights():
    from training_steps import SLOW_LINK

    plain, plain_history = _fit(_stem_style, [])
    callback = MicroBatchCallback(None, accumulate_gradients=False,
                                  memory_budget=1 << 40, device_model=SLOW_LINK,
                                  stream_conv_batch_norm=4, verbose=0)
    planned, history = _fit(_stem_style, [callback])
    first, second = [layer for layer in planned.layers if "conv" in layer.name]
    assert [(u.layer, u.reason) for u in callback.unstreamed] == [
        (second.path, "activation relu between convolution and normalization")]
    # The stem's gradients in 4 micro-batches, the other convolution's whole.
    assert sum(op.type == "Conv2DBackpropFilter"
               for op in callback.report.memory.liveness.ops) == 4 + 1
    np.testing.assert_allclose(history["loss"], plain_history["loss"], rtol=1e-5)
    for a, b in zip(planned.get_weights(), plain.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
    assert all("call" not in vars(layer) for layer in planned.layers)


def test_streamed_pairs_need_tensorflows_convolutions():
    with pytest.raises(ValueError, match="stream_conv_batch_norm=4 and workspace_limit=67108864: "
                                         "the streamed pairs' gradients are TensorFlow's"):
        MicroBatchCallback("64MiB", stream_conv_batch_norm=4)


def test_a_memory_budget_that_cannot_be_met_stops_training_with_the_reason():
    from training_steps import SLOW_LINK

    from tf_ucudnn.memory import BudgetError

    callback = MicroBatchCallback(planner=SplittingPlanner(), accumulate_gradients=False,
                                  memory_budget="1KiB",
                                  device_model=SLOW_LINK, verbose=0)
    with pytest.raises(BudgetError, match="cannot be met"):
        _fit(_vgg_style, [callback], epochs=1)
    assert "train_step" not in vars(callback.model)
    assert all("convolution_op" not in vars(layer) for layer in callback.model.layers)


@pytest.mark.parametrize("kernel,op_type", [(True, "FusedBatchNormV3"),
                                            ("xla", "PartitionedCall"),
                                            ("ucudnn", "UcudnnBatchNorm")])
def test_fused_batch_norm_trains_to_the_same_weights_and_is_undone_after(kernel, op_type):
    plain, plain_history = _fit(_resnet_style, [])
    callback = MicroBatchCallback(planner=SplittingPlanner(), fuse_batch_norm=kernel, verbose=0)
    seen = {}

    class Probe(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            training = tf.function(lambda x: self.model(x, training=True))  # traced, not run
            graph = training.get_concrete_function(tf.TensorSpec([16, 12, 12, 3])).graph
            seen.setdefault("types", {op.type for op in graph.get_operations()})

    fused, history = _fit(_resnet_style, [callback, Probe()])
    np.testing.assert_allclose(history["loss"], plain_history["loss"], rtol=1e-5)
    for a, b in zip(fused.get_weights(), plain.get_weights()):  # moving statistics included
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
    assert op_type in seen["types"]
    assert callback.unfused_batch_norm == []
    name = "cudnn" if kernel is True else kernel
    assert f"batch normalization trained with the {name!r} kernel" in callback.summary()
    assert callback.report.batch_norm_kernel == name
    assert "0 batch normalization layer(s) left unfused" in callback.summary()
    normalization = [layer for layer in fused.layers
                     if isinstance(layer, keras.layers.BatchNormalization)]
    assert normalization and all("call" not in vars(layer) for layer in normalization)


class _JitProbe(keras.callbacks.Callback):
    """Notes, at the second step, whether Keras compiles the step and which ops it runs."""

    def on_train_batch_end(self, batch, logs=None):
        if batch == 1:
            self.jit_compile = self.model.jit_compile
            self.types = _op_types(self.model)


@pytest.mark.parametrize("build", [_vgg_style, _resnet_style], ids=["vgg", "resnet"])
def test_with_xla_the_planned_layers_compile_and_train_to_the_same_weights(build):
    """The step stays compiled by XLA, tf_ucudnn's ops in it; the last batch of each epoch (8 of
    40 samples) runs undivided, as its plan is for 16."""
    plain, plain_history = _fit(build, [], jit_compile=True)
    callback = MicroBatchCallback(planner=SplittingPlanner(), trial_steps=0, verbose=0)
    probe = _JitProbe()
    planned, planned_history = _fit(build, [callback, probe], jit_compile=True)
    assert probe.jit_compile is True and planned.jit_compile is True
    assert "UcudnnConv2D" in probe.types
    assert callback.report.layers and callback.report.trial is None
    np.testing.assert_allclose(planned_history["loss"], plain_history["loss"], rtol=1e-5)
    for a, b in zip(planned.get_weights(), plain.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


class _FakeClock:
    """perf_counter for the callback: each timed step takes the next of `durations` seconds."""

    def __init__(self, durations):
        self.durations = list(durations)
        self.now = 0.0
        self.running = False

    def perf_counter(self):
        if self.running:
            self.now += self.durations.pop(0)
        self.running = not self.running
        return self.now


@pytest.mark.parametrize("planned_ms, unplanned_ms, kept", [
    (10.0, 5.0, "XLA's own convolutions"), (5.0, 10.0, "plans"),
    (9.95, 10.0, "XLA's own convolutions")])  # faster, but by less than TRIAL_MARGIN
def test_the_step_trial_keeps_the_faster_step(monkeypatch, planned_ms, unplanned_ms, kept):
    """A first step each way that is not timed, then two each way in turns; then the plans stay
    if they are TRIAL_MARGIN faster. Kept without its plans, every layer is reported left alone
    with the two times."""
    import tf_ucudnn.keras.callback as callback_module
    clock = _FakeClock([1.0, 1.0] + [planned_ms / 1e3, unplanned_ms / 1e3] * 2)
    monkeypatch.setattr(callback_module, "time", clock)
    plain, _ = _fit(_vgg_style, [], jit_compile=True)
    callback = MicroBatchCallback(planner=SplittingPlanner(), trial_steps=2, verbose=0)
    model, _ = _fit(_vgg_style, [callback], jit_compile=True)
    trial = callback.report.trial
    assert trial.planned_ms == pytest.approx([planned_ms] * 2)
    assert trial.unplanned_ms == pytest.approx([unplanned_ms] * 2)
    assert trial.kept == kept and f"kept {kept}" in callback.report.to_text()
    if kept == "plans":
        assert len(callback.report.layers) == 3
    else:
        assert callback.report.layers == []
        measured = [item for item in callback.report.left_alone if item.reason.startswith(
            f"measured: the step with the plans took {planned_ms:.2f} ms, with XLA's own "
            f"convolutions {unplanned_ms:.2f} ms (the plans must gain 1%)")]
        assert len(measured) == 3
    for a, b in zip(model.get_weights(), plain.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


class _BatchNormProbe(keras.callbacks.Callback):
    """Notes at each step end whether the model's batch normalization layers are switched."""

    def __init__(self):
        super().__init__()
        self.switched = []

    def on_train_batch_end(self, batch, logs=None):
        self.switched.append(all("call" in vars(layer) for layer in self.model.layers
                                 if isinstance(layer, keras.layers.BatchNormalization)))


@pytest.mark.parametrize("planned_ms, unplanned_ms, kept", [
    (5.0, 10.0, "plans"),
    (10.0, 5.0, "TensorFlow's own convolutions and Keras's batch normalization")])
def test_the_step_trial_tries_the_xla_batch_norm_kernel(monkeypatch, capsys, planned_ms,
                                                        unplanned_ms, kept):
    """With fuse_batch_norm left to it and no XLA, the callback's step trains batch
    normalization with the "xla" kernel, even where no convolution is planned, and keeps it only
    if the trial does."""
    import tf_ucudnn.keras.callback as callback_module
    monkeypatch.setattr(callback_module, "time",
                        _FakeClock([1.0, 1.0] + [planned_ms / 1e3, unplanned_ms / 1e3] * 2))
    plain, plain_history = _fit(_resnet_style, [], jit_compile=False)
    callback = MicroBatchCallback(planner=lambda layer: "TensorFlow's own is faster",
                                  trial_steps=2, verbose=1)
    probe = _BatchNormProbe()
    model, history = _fit(_resnet_style, [callback, probe], jit_compile=False)
    printed = capsys.readouterr().out
    assert "the step trial tries batch normalization with the 'xla' kernel; 0 layer(s)" in printed
    assert f"kept {kept}" in printed
    report = callback.report
    assert not report.layers and report.trial.kept == kept
    assert report.trial.own == "TensorFlow's own convolutions and Keras's batch normalization"
    # Switched when planned, after the first step, through the trial's 2 + 2 * 2 steps; then as
    # the trial decided, for the 3 steps an epoch left.
    assert len(probe.switched) == 9 and all(probe.switched[:6])
    assert all(probe.switched[6:]) if kept == "plans" else not any(probe.switched[6:])
    assert report.batch_norm_kernel == ("xla" if kept == "plans" else None)
    assert report.to_json()["batch_norm_kernel"] == report.batch_norm_kernel
    # After training too, the summary says what the step trained with.
    assert ("0 batch normalization layer(s) left unfused" in callback.summary()) == (
        kept == "plans")
    assert all("call" not in vars(layer) for layer in model.layers)  # undone after training
    np.testing.assert_allclose(history["loss"], plain_history["loss"], rtol=1e-5)
    for a, b in zip(model.get_weights(), plain.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("options, jit_compile", [({"fuse_batch_norm": False}, False),
                                                  ({"trial_steps": 0}, False), ({}, True)])
def test_batch_norm_is_left_to_keras_when_asked_untimed_or_under_xla(options, jit_compile):
    """fuse_batch_norm=False keeps Keras's normalization; so does a callback that times no trial
    (nothing unplanned goes untimed into the step), and one whose step XLA compiles."""
    callback = MicroBatchCallback(planner=lambda layer: "left alone", verbose=0, **options)
    probe = _BatchNormProbe()
    _fit(_resnet_style, [callback, probe], epochs=2, jit_compile=jit_compile)
    assert not any(probe.switched)
    assert callback.report.trial is None and callback.report.batch_norm_kernel is None


def test_the_step_trial_takes_turns(monkeypatch):
    """The planned step and Keras's alternate, step by step, so a drift weighs on both alike."""
    import tf_ucudnn.keras.callback as callback_module
    monkeypatch.setattr(callback_module, "time", _FakeClock([1.0, 1.0] + [0.005, 0.010] * 3))
    switched = []
    own_guarded = MicroBatchCallback._guarded

    def guarded(self, inner):
        if self._trial is not None:
            switched.append(inner)
        return own_guarded(self, inner)
    monkeypatch.setattr(MicroBatchCallback, "_guarded", guarded)
    callback = MicroBatchCallback(planner=SplittingPlanner(), trial_steps=3, verbose=0)
    _fit(_vgg_style, [callback], epochs=4, jit_compile=True)
    assert callback.report.trial.kept == "plans"
    planned, unplanned = switched[:2]
    assert planned is not unplanned
    # The planned step first, then a switch after each of the 2 + 2 * 3 trial steps but the last.
    assert switched == [planned, unplanned] * 4


def test_with_xla_and_no_layer_planned_the_compiled_step_goes_on(monkeypatch):
    """Tracing the step again would cost XLA a compilation for the same step."""
    retraces = []
    own_retrace = MicroBatchCallback._retrace
    monkeypatch.setattr(MicroBatchCallback, "_retrace",
                        lambda self: retraces.append(1) or own_retrace(self))
    callback = MicroBatchCallback(planner=lambda layer: "XLA's own is faster", verbose=0)
    _fit(_vgg_style, [callback], epochs=2, jit_compile=True)
    assert not callback.report.layers and callback.report.trial is None
    assert len(retraces) == 2  # when training begins and when it ends, not after planning
    retraces.clear()
    _fit(_vgg_style, [MicroBatchCallback(planner=SplittingPlanner(), trial_steps=0, verbose=0)],
         epochs=1, jit_compile=True)
    assert len(retraces) == 3


def test_without_xla_the_step_trial_weighs_the_plans_against_tensorflows_convolutions(monkeypatch):
    import tf_ucudnn.keras.callback as callback_module
    monkeypatch.setattr(callback_module, "time", _FakeClock([1.0, 1.0] + [0.010, 0.005] * 2))
    callback = MicroBatchCallback(planner=SplittingPlanner(), trial_steps=2, verbose=0)
    model, _ = _fit(_vgg_style, [callback], jit_compile=False)
    assert callback.report.trial.kept == "TensorFlow's own convolutions"
    measured = [item.reason for item in callback.report.left_alone
                if item.reason.startswith("measured")]
    assert not callback.report.layers and len(measured) == 3
    assert all("with TensorFlow's own convolutions 5.00 ms" in reason for reason in measured)
    assert all("convolution_op" not in vars(layer) for layer in model.layers)


class _LayoutOptimizerSeen(keras.callbacks.Callback):
    """Grappler's layout optimizer setting at the end of each training step."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def on_train_batch_end(self, batch, logs=None):
        self.seen.append(tf.config.optimizer.get_experimental_options().get("layout_optimizer"))


@pytest.mark.parametrize("jit_compile", [False, True], ids=["tensorflow", "xla"])
def test_grapplers_layout_optimizer_is_off_while_planned_layers_train_without_xla(jit_compile):
    """It would transpose every activation around tf_ucudnn's NHWC ops and keep both layouts."""
    before = tf.config.optimizer.get_experimental_options().get("layout_optimizer")
    seen = _LayoutOptimizerSeen()
    callback = MicroBatchCallback(planner=SplittingPlanner(), trial_steps=0, verbose=0)
    _fit(_vgg_style, [seen, callback], epochs=1, jit_compile=jit_compile)
    # The first step runs before planning, as Keras made it.
    assert seen.seen[0] == before
    assert set(seen.seen[1:]) == ({before} if jit_compile else {False})
    assert tf.config.optimizer.get_experimental_options().get("layout_optimizer") in (before, True)


def test_when_the_step_trial_keeps_tensorflows_step_the_layout_optimizer_comes_back(monkeypatch):
    import tf_ucudnn.keras.callback as callback_module
    monkeypatch.setattr(callback_module, "time", _FakeClock([1.0, 1.0] + [0.010, 0.005] * 2))
    seen = _LayoutOptimizerSeen()
    callback = MicroBatchCallback(planner=SplittingPlanner(), trial_steps=2, verbose=0)
    _fit(_vgg_style, [seen, callback], epochs=3, jit_compile=False)
    assert callback.report.trial.kept == "TensorFlow's own convolutions"
    # Planned from the second step; three steps each way, the first not timed.
    assert seen.seen[1:7] == [False] * 6
    assert len(seen.seen) > 7 and all(value is not False for value in seen.seen[7:])


def test_a_model_with_no_layer_to_plan_is_still_reported():
    """A Conv1D model: nothing tf_ucudnn can run, each layer named with why."""
    def conv1d_model():
        return keras.Sequential([keras.Input((12, 3)), keras.layers.Conv1D(4, 3),
                                 keras.layers.GlobalAveragePooling1D(), keras.layers.Dense(4)])

    callback = MicroBatchCallback(planner=SplittingPlanner(), verbose=0)
    keras.utils.set_random_seed(1)
    model = conv1d_model()
    model.compile("sgd", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    x = np.random.RandomState(0).rand(8, 12, 3).astype("float32")
    model.fit(x, np.arange(8) % 4, epochs=1, verbose=0, callbacks=[callback])
    (left,) = callback.report.left_alone
    assert "conv1d" in left.node and "Conv1D is not a Keras Conv2D or Conv3D" in left.reason
    assert not callback.report.layers


def _failing_identity(x):
    check = tf.debugging.assert_less(tf.reduce_sum(x), -1e30, message="failing step, for a test")
    with tf.control_dependencies([check]):
        return tf.identity(x)


def test_a_first_step_that_fails_gives_the_model_its_layers_back():
    """Keras calls no callback when a step fails; the callback's guard undoes its patches."""
    layers = keras.layers
    model = keras.Sequential([
        keras.Input((12, 12, 3)),
        layers.Conv2D(8, 3, padding="same"),
        # Fails when the step runs, as a step out of memory would.
        layers.Lambda(_failing_identity),
        layers.GlobalAveragePooling2D(),
        layers.Dense(4),
    ])
    # XLA would compile the assertion away (on a GPU, jit_compile="auto" turns it on).
    model.compile("sgd", keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  jit_compile=False)
    callback = MicroBatchCallback(planner=SplittingPlanner(), verbose=0)
    x, y = _data()
    with pytest.raises(tf.errors.InvalidArgumentError, match="failing step, for a test"):
        model.fit(x, y, epochs=1, verbose=0, callbacks=[callback])
    assert all("convolution_op" not in vars(layer) for layer in model.layers)


def test_a_planner_that_answers_nothing_is_named_with_the_layer():
    from tf_ucudnn.core.plan import PlannerAnswerError

    callback = MicroBatchCallback(planner=lambda layer: None, verbose=0)
    with pytest.raises(PlannerAnswerError, match="the planner returned None"):
        _fit(_vgg_style, [callback], epochs=1)


def test_without_a_gpu_the_batches_are_not_copied_ahead_and_the_report_says_so(monkeypatch):
    monkeypatch.setattr(InputPrefetch, "default_device", staticmethod(lambda: None))
    callback = MicroBatchCallback(planner=SplittingPlanner(), verbose=0)
    _fit(_vgg_style, [callback], epochs=1)
    assert callback.report.input_prefetch == "batches not copied ahead: no GPU"
    assert "  batches not copied ahead: no GPU" in callback.summary().splitlines()


def test_batches_copied_ahead_train_to_the_same_weights_and_the_copying_stops(monkeypatch):
    plain, plain_history = _fit(_resnet_style, [])
    monkeypatch.setattr(InputPrefetch, "default_device", staticmethod(lambda: "/device:CPU:0"))
    callback = MicroBatchCallback(planner=SplittingPlanner(), verbose=0)
    planned, history = _fit(_resnet_style, [callback])
    assert callback.report.input_prefetch == ("batches copied to /device:CPU:0 up to 2 step(s) "
                                              "ahead")
    assert not any(t.name == "tf_ucudnn_input_prefetch" for t in threading.enumerate())
    np.testing.assert_allclose(history["loss"], plain_history["loss"], rtol=1e-5)
    for a, b in zip(planned.get_weights(), plain.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


def test_prefetch_batches_zero_copies_nothing_ahead_and_negative_is_refused(monkeypatch):
    monkeypatch.setattr(InputPrefetch, "default_device", staticmethod(lambda: "/device:CPU:0"))
    callback = MicroBatchCallback(planner=SplittingPlanner(), prefetch_batches=0, verbose=0)
    _fit(_vgg_style, [callback], epochs=1)
    assert callback.report.input_prefetch == "batches not copied ahead: prefetch_batches=0"
    with pytest.raises(ValueError, match="prefetch_batches must be 0 or more, got -1"):
        MicroBatchCallback(prefetch_batches=-1)
