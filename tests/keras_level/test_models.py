"""models: networks by name for the command line and the benchmarks."""

import pytest

from tf_ucudnn.keras import models


def test_alexnet_matches_mu_cudnn_geometry():
    model = models.alexnet()
    convs = [layer for layer in model.layers if layer.__class__.__name__ == "Conv2D"]
    assert [c.filters for c in convs] == [96, 256, 384, 384, 256]
    assert [c.kernel_size for c in convs] == [(11, 11), (5, 5), (3, 3), (3, 3), (3, 3)]
    assert model.output_shape == (None, 1000)


@pytest.mark.parametrize("name", ["resnet50", "ResNet50", "res_net50"])
def test_keras_applications_by_any_spelling(name):
    model = models.load_model(name)
    assert model.name.lower().startswith("resnet50")
    assert model.input_shape == (None, 224, 224, 3)


def test_channels_first_is_honoured_and_restored():
    import keras
    before = keras.config.image_data_format()
    model = models.load_model("resnet50", "channels_first")
    assert model.input_shape == (None, 3, 224, 224)
    assert keras.config.image_data_format() == before


def test_unknown_model_names_what_is_accepted():
    with pytest.raises(ValueError, match="unknown model 'lenet-9'.*keras.applications"):
        models.load_model("lenet-9")
    with pytest.raises(FileNotFoundError, match="no model file"):
        models.load_model("/nonexistent/model.keras")
