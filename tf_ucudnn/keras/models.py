"""Models by name, for the command line and the benchmarks: "alexnet" (defined here, as μ-cuDNN
measured it: Caffe's AlexNet without groups), any `keras.applications` model by its function or
module name ("resnet50", "ResNet50", "vgg16", ...), or a saved .keras file.
"""

from __future__ import annotations

import os

import keras


def alexnet(data_format: str = "channels_last", classes: int = 1000) -> keras.Model:
    """AlexNet on 227x227 images: conv1 11x11/4, conv2 5x5, conv3-5 3x3, three dense layers."""
    shape = (227, 227, 3) if data_format == "channels_last" else (3, 227, 227)
    layers = keras.layers

    def conv(filters, size, strides=1, padding="same"):
        return layers.Conv2D(filters, size, strides=strides, padding=padding, activation="relu",
                             data_format=data_format)

    def pool():
        return layers.MaxPooling2D(3, 2, data_format=data_format)

    return keras.Sequential([
        keras.Input(shape),
        conv(96, 11, strides=4, padding="valid"), pool(),
        conv(256, 5), pool(),
        conv(384, 3), conv(384, 3), conv(256, 3), pool(),
        layers.Flatten(data_format=data_format),
        layers.Dense(4096, activation="relu"), layers.Dense(4096, activation="relu"),
        layers.Dense(classes),
    ], name="alexnet")


def _keras_application(name: str):
    lowered = name.lower().replace("_", "")
    for attribute in dir(keras.applications):
        candidate = getattr(keras.applications, attribute)
        if callable(candidate) and attribute.lower() == lowered:
            return candidate
    return None


def outputs_probabilities(model: keras.Model) -> bool:
    """Whether the model ends in a softmax, as keras.applications' classifiers do: its loss then
    takes probabilities, not logits."""
    last = model.layers[-1] if model.layers else None
    return isinstance(last, keras.layers.Softmax) or \
        getattr(last, "activation", None) is keras.activations.softmax


def load_model(spec: str, data_format: str = "channels_last") -> keras.Model:
    """A model by name or path (see the module's docstring), with random weights for names."""
    if spec.endswith(".keras"):
        if not os.path.exists(spec):
            raise FileNotFoundError(f"no model file {spec}")
        return keras.models.load_model(spec)
    if spec.lower() == "alexnet":
        return alexnet(data_format)
    application = _keras_application(spec)
    if application is None:
        raise ValueError(f"unknown model {spec!r}: not a .keras file, 'alexnet', or a "
                         "keras.applications model (e.g. resnet50, vgg16, mobilenet_v2)")
    previous = keras.config.image_data_format()
    keras.config.set_image_data_format(data_format)
    try:
        return application(weights=None)
    finally:
        keras.config.set_image_data_format(previous)
