"""Parallelism past one GPU: spatial partitioning of 3-D CNN layers across devices."""

from tf_ucudnn.parallel.spatial import (
    Slabs,
    SpatialSplitError,
    batch_norm,
    conv,
    gather,
    pool,
    split,
)

__all__ = ["Slabs", "SpatialSplitError", "batch_norm", "conv", "gather", "pool", "split"]
