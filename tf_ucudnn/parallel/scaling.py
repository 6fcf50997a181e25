"""The scaling model of hybrid data x spatial parallelism for a CosmoFlow-style network: per step
and per device, the convolution work, the halo bytes exchanged with the neighbours and the bytes of
the gradient all-reduce, and from them a predicted step time, to set against measurements on the
GPUs there are and to extrapolate to more.

Per convolution (3^3 kernels, SAME, stride 1, on a depth x edge^2 volume in slabs of depth):
  work   = 2 * samples * depth * edge^2 * 27 * C_in * C_out / spatial FLOPs per device (forward; the two
           backward kernels twice that again),
  halo   = per inner slab face, one row of edge^2 * C_in values for the forward pass and one of
           edge^2 * C_out gradients for the backward pass, times the samples,
and per step the ring all-reduce of the gradients moves 2 * (groups - 1) / groups of the
parameters' bytes through each device.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence


@dataclasses.dataclass(frozen=True)
class Link:
    """What the model assumes of the machine."""

    flops: float  # sustained convolution FLOP/s of one device
    halo_bandwidth: float  # bytes/s between neighbouring devices
    allreduce_bandwidth: float  # bytes/s of each device's share of the all-reduce


@dataclasses.dataclass(frozen=True)
class StepCost:
    compute_s: float
    halo_bytes: int  # sent by the busiest (inner) device per step
    halo_s: float
    allreduce_bytes: int
    allreduce_s: float
    step_s: float

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


def cosmoflow_step_cost(edge: int, channels: int, filters: Sequence[int], batch: int,
                        spatial: int, groups: int, link: Link, parameters: int,
                        dtype_bytes: int = 4, overlap_halo: bool = True,
                        depth: Optional[int] = None) -> StepCost:
    """One training step of `batch` samples over `groups` data groups of `spatial` devices;
    the volume is `depth` (the split dimension; `edge` if not given) x edge x edge."""
    samples = batch / groups
    flops = halo_values = 0.0
    size, c_in = edge, channels
    depth = depth or edge
    for c_out in filters:
        # Forward, backward-data and backward-filter: three times the forward's work.
        flops += 3 * 2 * samples * depth * size ** 2 * 27 * c_in * c_out / spatial
        if spatial > 1:
            faces = 2 if spatial > 2 else 1  # an inner slab has two neighbours
            halo_values += faces * samples * size ** 2 * (c_in + c_out)
        size, depth = size // 2, depth // 2  # the pooling after each block
        c_in = c_out
    compute = flops / link.flops
    halo_bytes = int(halo_values * dtype_bytes)
    halo = halo_bytes / link.halo_bandwidth
    allreduce_bytes = int(2 * (groups - 1) / groups * parameters * dtype_bytes)
    allreduce = allreduce_bytes / link.allreduce_bandwidth
    exposed_halo = max(0.0, halo - compute) if overlap_halo else halo
    return StepCost(compute_s=compute, halo_bytes=halo_bytes, halo_s=halo,
                    allreduce_bytes=allreduce_bytes, allreduce_s=allreduce,
                    step_s=compute + exposed_halo + allreduce)


def strong_scaling(edge: int, channels: int, filters: Sequence[int], batch: int,
                   device_counts: Sequence[int], link: Link, parameters: int) -> list[dict]:
    """Step time and parallel efficiency of a fixed sample split over more devices."""
    one = cosmoflow_step_cost(edge, channels, filters, batch, 1, 1, link, parameters).step_s
    rows = []
    for count in device_counts:
        cost = cosmoflow_step_cost(edge, channels, filters, batch, count, 1, link, parameters)
        rows.append({"devices": count, **cost.to_json(),
                     "efficiency": one / (count * cost.step_s)})
    return rows
