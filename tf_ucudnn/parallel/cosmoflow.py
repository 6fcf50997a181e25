"""A CosmoFlow-style 3-D CNN (conv3d + leaky ReLU + pooling stacks, then a dense head, as in
Mathuriya et al. and Oyama et al.) whose convolution stack runs spatially split over devices.

    model = SpatialCosmoFlow(input_size=128, channels=4, spatial_split=2)
    model.compile(optimizer, loss); model.fit(volumes, targets)

Each sample's depth is cut into `spatial_split` slabs on as many devices (GPUs when there are
enough, else logical CPUs); the convolutions exchange halos, the pooling stays on each slab, and
the slabs are gathered for the dense head. Under a `tf.distribute.MirroredStrategy` whose replicas
are the first devices of the spatial groups in `mesh`, the batch is also split across the groups
(data parallelism) and Keras all-reduces the gradients through the strategy. `fit`'s datasets come
split by the strategy; the model splits a `train_on_batch`, `test_on_batch` or `predict_on_batch`
batch itself, which Keras 3 hands to every replica whole.
"""

from __future__ import annotations

from typing import Optional, Sequence, Union

import keras
import tensorflow as tf
from tensorflow.python.framework import device as tf_device

from tf_ucudnn.parallel import spatial


def _canonical(name: str) -> str:
    return tf_device.canonical_name(name).split("/device:")[-1].upper()


def _shared_out(batch, strategy):
    """A batch (tensors, arrays and Nones, batch-major) as each replica's share of its rows on
    the replica's device, the shares as even as can be, as a distributed dataset hands out a
    global batch (shares that differ weigh each replica's mean loss alike, as with `fit`'s last
    batch). Each share is cut where the batch is, so only it crosses to its device. A batch
    already per replica stays as it is."""
    values = tf.nest.flatten(batch)
    if any(isinstance(value, tf.distribute.DistributedValues) for value in values):
        return batch
    devices = strategy.extended.worker_devices
    tensors = [None if value is None else tf.convert_to_tensor(value) for value in values]
    rows = next(int(tensor.shape[0]) for tensor in tensors if tensor is not None)
    if rows < len(devices):
        raise spatial.SpatialSplitError(
            f"a batch of {rows} sample(s) cannot be shared by {len(devices)} replicas")
    sizes = spatial.even_sizes(rows, len(devices))
    shares = [[] for _ in devices]
    for tensor in tensors:
        if tensor is None:
            parts = [None] * len(devices)
        else:
            with tf.device(tensor.device):
                parts = tf.split(tensor, sizes)
        for share, device, part in zip(shares, devices, parts):
            with tf.device(device):
                share.append(None if part is None else tf.identity(part))
    per_replica = [tf.nest.pack_sequence_as(batch, share) for share in shares]
    return strategy.experimental_distribute_values_from_function(
        lambda context: per_replica[context.replica_id_in_sync_group])


def _batches_shared_out(function, strategy):
    """`function` (Keras's train, test or predict function) with each whole batch it is handed
    shared out over the replicas first. Keras 3 hands the batch of `train_on_batch` (and of
    `test_on_batch`, `predict_on_batch`) to every replica whole: each replica trained on all of
    it, so a step did the replicas' times one device's work for one device's update (Keras
    divides the loss by the replicas), and predictions came back once per replica. The
    iterators of `fit`, `evaluate` and `predict`, which the strategy distributes, pass as they
    are."""
    def shared_out(batches):
        if isinstance(batches, (tf.data.Iterator, tf.distribute.DistributedIterator)):
            return function(batches)
        if isinstance(batches, (list, tuple)):  # the predict function indexes its list
            return function([_shared_out(batch, strategy) for batch in batches])
        return function(_shared_out(batch, strategy) for batch in batches)
    return shared_out


class SpatialCosmoFlow(keras.Model):
    """CosmoFlow with its convolutions split over devices along the depth.

    Args:
      input_size: the volume's edge (input is input_size^3 x channels, channels-last), or its
        (depth, height, width); the depth is split.
      channels: input channels (4 redshifts in CosmoFlow's data).
      filters: the convolution blocks' filters; each block halves the volume.
      dense: the dense head's hidden units; `outputs` the regression targets.
      spatial_split: the devices one sample is split over (ignored when `mesh` is given).
      mesh: device groups, one per data-parallel replica, each splitting a sample spatially.
      planner: plans each device's convolutions (micro-batches and algorithms), as
        `tf_ucudnn.rewrite` takes one.
    """

    def __init__(self, input_size: Union[int, Sequence[int]] = 64, channels: int = 4,
                 filters: Sequence[int] = (16, 32, 64, 128), dense: Sequence[int] = (128, 64),
                 outputs: int = 4, spatial_split: int = 1,
                 mesh: Optional[Sequence[Sequence[str]]] = None, planner=None, **kwargs):
        super().__init__(**kwargs)
        self.planner = planner
        self.input_size = ((input_size,) * 3 if isinstance(input_size, int)
                           else tuple(input_size))
        self.channels = channels
        self.mesh = ([list(group) for group in mesh] if mesh
                     else [spatial.default_devices(spatial_split)])
        for edge in self.input_size:
            for _ in filters:
                if edge % 2:
                    raise spatial.SpatialSplitError(
                        f"a {'x'.join(map(str, self.input_size))} volume cannot go through "
                        f"{len(filters)} pooling blocks: an edge of {edge} does not halve")
                edge //= 2
        self.convs = [keras.layers.Conv3D(f, 3, padding="same", name=f"conv{i}")
                      for i, f in enumerate(filters)]
        self.dense_layers = [keras.layers.Dense(units, name=f"dense{i}")
                             for i, units in enumerate(dense)]
        self.head = keras.layers.Dense(outputs, name="output")
        shape = (None, *self.input_size, channels)
        for conv in self.convs:
            conv.build(shape)
            shape = (None, *(s // 2 for s in shape[1:4]), conv.filters)
        width = shape[1] * shape[2] * shape[3] * shape[4]
        for layer in self.dense_layers:
            layer.build((None, width))
            width = layer.units
        self.head.build((None, width))

    def compile(self, *args, jit_compile=False, **kwargs):
        """As keras.Model.compile, with XLA off unless asked for: tf_ucudnn's ops have no XLA
        kernels (Keras's "auto" turns XLA on for GPUs and would refuse the model)."""
        super().compile(*args, jit_compile=jit_compile, **kwargs)

    def make_train_function(self, force=False):
        return self._shared_out_function("train_function", super().make_train_function, force)

    def make_test_function(self, force=False):
        return self._shared_out_function("test_function", super().make_test_function, force)

    def make_predict_function(self, force=False):
        return self._shared_out_function("predict_function", super().make_predict_function,
                                         force)

    def _shared_out_function(self, attribute: str, make, force: bool):
        """Keras's function, made by `make`, sharing out whole batches over the replicas."""
        fresh = force or getattr(self, attribute) is None
        make(force)
        strategy = self.distribute_strategy
        if fresh and strategy.num_replicas_in_sync > 1:
            setattr(self, attribute, _batches_shared_out(getattr(self, attribute), strategy))
        return getattr(self, attribute)

    def _devices(self) -> list[str]:
        """The spatial group of the current replica (the only group without a strategy)."""
        context = tf.distribute.get_replica_context()
        if len(self.mesh) > 1 and context is not None and context.devices:
            first = context.devices[0]  # a device, or the list of a replica's devices
            leader = _canonical(first[0] if isinstance(first, (list, tuple)) else first)
            for group in self.mesh:
                if _canonical(group[0]) == leader:
                    return group
            raise spatial.SpatialSplitError(
                f"replica on {leader} leads none of the mesh's groups {self.mesh}; "
                "make the strategy's devices the groups' first devices")
        return self.mesh[0]

    def call(self, x, training=False):
        """`x`: whole volumes, or a tuple of their slabs, one per device (`slab_dataset`'s)."""
        devices = self._devices()
        slabs = (spatial.from_parts(x, devices) if isinstance(x, (list, tuple))
                 else spatial.split(x, devices))
        for conv in self.convs:
            slabs = spatial.conv(slabs, conv.kernel, padding="SAME", name=conv.name,
                                 planner=self.planner)
            slabs = slabs.map(lambda part, bias: tf.nn.leaky_relu(part + bias, 0.3), conv.bias)
            slabs = spatial.pool(slabs, 2, "AVG", name=f"{conv.name}_pool")
        x = spatial.gather(slabs)
        x = tf.reshape(x, [tf.shape(x)[0], -1])
        for layer in self.dense_layers:
            x = tf.nn.leaky_relu(layer(x), 0.3)
        return self.head(x)
