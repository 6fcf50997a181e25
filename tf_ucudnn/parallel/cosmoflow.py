"""A CosmoFlow-style 3-D CNN (conv3d + leaky ReLU + pooling stacks, then a dense head, as in
Mathuriya et al. and Oyama et al.) whose convolution stack runs spatially split over devices.

    model = SpatialCosmoFlow(input_size=128, channels=4, spatial_split=2)
    model.compile(optimizer, loss); model.fit(volumes, targets)

Each sample's depth is cut into `spatial_split` slabs on as many devices (GPUs when there are
enough, else logical CPUs); the convolutions exchange halos, the pooling stays on each slab, and
the slabs are gathered for the dense head. Under a `tf.distribute.MirroredStrategy` whose replicas
are the first devices of the spatial groups in `mesh`, the batch is also split across the groups
(data parallelism) and Keras all-reduces the gradients through the strategy.
"""

from __future__ import annotations

from typing import Optional, Sequence, Union

import keras
import tensorflow as tf
from tensorflow.python.framework import device as tf_device

from tf_ucudnn.parallel import spatial


def _canonical(name: str) -> str:
    return tf_device.canonical_name(name).split("/device:")[-1].upper()


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
        self.mesh = [list(group) for group in mesh] if mesh else [spatial.default_devices(spatial_split)]
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
