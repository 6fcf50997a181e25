"""Reading each device's slab of a sample, not the whole sample (the parallel I/O of Oyama et al.):
volumes in HDF5, chunked along the split dimension, so that a slab read touches only its rows.

    write_volumes("cosmo.h5", volumes, targets)   # or make_synthetic_volumes(...)
    dataset = slab_dataset("cosmo.h5", slab_sizes=[64, 64], batch_size=8)
    model.fit(dataset)   # a SpatialCosmoFlow with spatial_split=2 takes the slabs as its input

Across workers (data parallelism over processes, `parallel.multi_worker`), each worker reads only
its own samples' slabs: `slab_dataset(..., num_workers=4, worker_index=1)`.
"""

from __future__ import annotations

from typing import Optional, Sequence

import h5py
import numpy as np
import tensorflow as tf

from tf_ucudnn.parallel.spatial import even_sizes

VOLUMES, TARGETS = "volumes", "targets"


def write_volumes(path: str, volumes: np.ndarray, targets: np.ndarray,
                  rows_per_chunk: int = 8) -> None:
    """Samples [N, D, H, W, C] and their targets [N, T], chunked by sample and depth rows."""
    if volumes.ndim != 5 or len(volumes) != len(targets):
        raise ValueError(f"expected volumes [N, D, H, W, C] and N targets, got {volumes.shape} "
                         f"and {np.shape(targets)}")
    with h5py.File(path, "w") as file:
        chunks = (1, min(rows_per_chunk, volumes.shape[1]), *volumes.shape[2:])
        file.create_dataset(VOLUMES, data=volumes, chunks=chunks)
        file.create_dataset(TARGETS, data=targets)


def make_synthetic_volumes(path: str, samples: int, size: int, channels: int = 4,
                           outputs: int = 4, seed: int = 0) -> None:
    """Smooth random fields whose targets are functions of the fields (something to learn)."""
    rng = np.random.default_rng(seed)
    volumes = rng.standard_normal((samples, size, size, size, channels), dtype=np.float32)
    for axis in (1, 2, 3):  # smooth along each spatial axis
        volumes = (volumes + np.roll(volumes, 1, axis) + np.roll(volumes, -1, axis)) / 3
    moments = [volumes.mean(axis=(1, 2, 3, 4)), volumes.std(axis=(1, 2, 3, 4))]
    targets = np.stack([moments[i % 2] * (i + 1) for i in range(outputs)], axis=1)
    write_volumes(path, volumes, targets.astype(np.float32))


def slab_dataset(path: str, slab_sizes: Optional[Sequence[int]] = None, devices: int = 1,
                 batch_size: int = 1, num_workers: int = 1, worker_index: int = 0,
                 first_batch: int = 0, repeat: bool = False) -> tf.data.Dataset:
    """((slab_0, ..., slab_k), target) batches: each slab read on its own, rows of the depth.

    Over `num_workers` workers, worker `worker_index` reads only its own samples: those at
    positions worker_index, worker_index + num_workers, ... of each global batch of
    `num_workers * batch_size` samples (`batch_size` is this worker's share), so that together
    the workers' batches are the global batch one worker would read. Every worker gets the same
    number of batches: the samples past the last whole global batch are left out. `first_batch`
    starts at that global batch without reading the ones before (a run resumed from a
    checkpoint); `repeat` goes on past the last sample, epoch after epoch."""
    if not 0 <= worker_index < num_workers:
        raise ValueError(f"worker_index {worker_index} is not one of {num_workers} workers")
    with h5py.File(path, "r") as file:
        samples, depth = file[VOLUMES].shape[:2]
        shape, dtype = file[VOLUMES].shape[2:], file[VOLUMES].dtype
        outputs = file[TARGETS].shape[1]
    sizes = list(slab_sizes or even_sizes(depth, devices))
    if sum(sizes) != depth:
        raise ValueError(f"slab sizes {sizes} do not cover the depth of {depth} in {path}")
    global_batch = num_workers * batch_size
    if global_batch > samples:
        raise ValueError(f"a global batch of {global_batch} samples ({num_workers} worker(s) x "
                         f"{batch_size}) is more than the {samples} samples in {path}")
    starts = np.cumsum([0, *sizes])

    def read_slab(sample, index):
        with h5py.File(path, "r") as file:  # a hyperslab read: only these rows
            return file[VOLUMES][sample, starts[index]:starts[index + 1]]

    def read_target(sample):
        with h5py.File(path, "r") as file:
            return file[TARGETS][sample]

    def load(sample):
        slabs = tuple(
            tf.ensure_shape(tf.numpy_function(lambda s, i=i: read_slab(s, i), [sample],
                                              tf.as_dtype(dtype)), [size, *shape])
            for i, size in enumerate(sizes))
        target = tf.ensure_shape(tf.numpy_function(read_target, [sample], tf.float32),
                                 [outputs])
        return slabs, target

    # Skipped and shared out as sample numbers, before any read.
    indices = tf.data.Dataset.range(samples // global_batch * global_batch)
    if repeat:
        indices = indices.repeat()
    indices = indices.skip(first_batch * global_batch).shard(num_workers, worker_index)
    return (indices.map(load).batch(batch_size, drop_remainder=True)
            .prefetch(tf.data.AUTOTUNE))
