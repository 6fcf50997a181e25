"""Parallelism past one GPU: spatial partitioning of 3-D CNN layers across devices, a
CosmoFlow-style model trained with data x spatial parallelism (`parallel.cosmoflow`), and across
worker processes (`parallel.multi_worker`), a loader that reads each device's slab
(`parallel.data`), and the scaling model (`parallel.scaling`)."""

from tf_ucudnn.parallel.spatial import (
    Slabs,
    SpatialSplitError,
    batch_norm,
    conv,
    from_parts,
    gather,
    pool,
    split,
)

__all__ = ["Slabs", "SpatialSplitError", "batch_norm", "conv", "from_parts", "gather", "pool",
           "split"]
