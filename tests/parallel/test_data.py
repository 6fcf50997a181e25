"""The slab loader: each device's rows of each sample, from HDF5, training as whole volumes do."""

import numpy as np
import pytest
import tensorflow as tf

from tf_ucudnn.parallel.cosmoflow import SpatialCosmoFlow
from tf_ucudnn.parallel.data import make_synthetic_volumes, slab_dataset, write_volumes

SMALL = dict(input_size=16, channels=2, filters=(4, 8), dense=(16,), outputs=3)


@pytest.fixture
def volumes(tmp_path):
    path = str(tmp_path / "volumes.h5")
    make_synthetic_volumes(path, samples=6, size=16, channels=2, outputs=3, seed=4)
    return path


def _whole(path):
    import h5py
    with h5py.File(path, "r") as file:
        return file["volumes"][:], file["targets"][:]


def test_slabs_are_the_rows_of_each_sample(volumes):
    x, y = _whole(volumes)
    batches = list(slab_dataset(volumes, slab_sizes=[5, 11], batch_size=3))
    assert len(batches) == 2
    (first, second), targets = batches[1]
    np.testing.assert_array_equal(first.numpy(), x[3:6, :5])
    np.testing.assert_array_equal(second.numpy(), x[3:6, 5:])
    np.testing.assert_array_equal(targets.numpy(), y[3:6])


def test_training_from_slabs_equals_training_from_whole_volumes(volumes):
    x, y = _whole(volumes)
    tf.keras.utils.set_random_seed(5)
    whole = SpatialCosmoFlow(**SMALL)
    parted = SpatialCosmoFlow(**SMALL, spatial_split=2)
    parted.set_weights(whole.get_weights())
    for model, data in ((whole, tf.data.Dataset.from_tensor_slices((x, y)).batch(3)),
                        (parted, slab_dataset(volumes, devices=2, batch_size=3))):
        model.compile(tf.keras.optimizers.SGD(0.05), "mse")
        model.fit(data, epochs=2, verbose=0)
    for a, b in zip(parted.get_weights(), whole.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


def test_bad_files_and_splits_are_named(tmp_path, volumes):
    with pytest.raises(ValueError, match="do not cover the depth of 16"):
        slab_dataset(volumes, slab_sizes=[8, 9])
    with pytest.raises(ValueError, match="expected volumes"):
        write_volumes(str(tmp_path / "bad.h5"), np.zeros((2, 4, 4, 4)), np.zeros((2, 1)))
