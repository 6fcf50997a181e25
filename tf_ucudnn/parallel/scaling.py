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

Beyond one host (`Cluster`, `cluster_step_cost`, `recommend_split`) the machine is hosts of
`devices_per_host` GPUs: an intra-host `Connection` per GPU (NVLink through the NVSwitch) and an
inter-host one per host (all its NICs together), each with a bandwidth and a latency, and every
message costs latency + bytes / bandwidth (the alpha-beta model). Devices are numbered host by host
and data group g holds the devices g * spatial .. (g + 1) * spatial - 1, so a spatial group stays
inside a host when spatial divides devices_per_host and spans hosts when it is larger.
"""

from __future__ import annotations

import dataclasses
import math
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
    # Set by `cluster_step_cost`; the one-host model is a ring with the whole batch at once.
    algorithm: str = "ring"
    micro_batches: int = 1  # per data group, one after the other, each exchanging its halos
    halo_crosses_hosts: bool = False

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


def _blocks(edge: int, depth: int, channels: int, filters: Sequence[int]):
    """(depth, edge, C_in, C_out) of each convolution block's input; each block's pooling halves
    the volume."""
    c_in = channels
    for c_out in filters:
        yield depth, edge, c_in, c_out
        edge, depth, c_in = edge // 2, depth // 2, c_out


def _conv_flops(samples: float, depth: int, edge: int, c_in: int, c_out: int,
                spatial: int) -> float:
    """Forward, backward-data and backward-filter: three times the forward's work."""
    return 3 * 2 * samples * depth * edge ** 2 * 27 * c_in * c_out / spatial


def cosmoflow_step_cost(edge: int, channels: int, filters: Sequence[int], batch: int,
                        spatial: int, groups: int, link: Link, parameters: int,
                        dtype_bytes: int = 4, overlap_halo: bool = True,
                        depth: Optional[int] = None) -> StepCost:
    """One training step of `batch` samples over `groups` data groups of `spatial` devices;
    the volume is `depth` (the split dimension; `edge` if not given) x edge x edge."""
    samples = batch / groups
    flops = halo_values = 0.0
    for block_depth, size, c_in, c_out in _blocks(edge, depth or edge, channels, filters):
        flops += _conv_flops(samples, block_depth, size, c_in, c_out, spatial)
        if spatial > 1:
            faces = 2 if spatial > 2 else 1  # an inner slab has two neighbours
            halo_values += faces * samples * size ** 2 * (c_in + c_out)
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


# Beyond one host.

ALLREDUCE_ALGORITHMS = ("ring", "hierarchical", "recursive_halving")


@dataclasses.dataclass(frozen=True)
class Connection:
    """One kind of link: a message of n bytes takes latency + n / bandwidth."""

    bandwidth: float  # bytes/s, each way
    latency: float  # seconds per message

    def seconds(self, nbytes: float) -> float:
        return self.latency + nbytes / self.bandwidth

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class Cluster:
    """Hosts of `devices_per_host` GPUs."""

    flops: float  # sustained convolution FLOP/s of one device
    devices_per_host: int
    intra_host: Connection  # each GPU's, to any GPU of its host
    # Each host's NICs together. Each GPU has its share (a NIC per GPU or per pair, as on DGX
    # H100): a GPU alone on the wire still gets only bandwidth / devices_per_host.
    inter_host: Connection
    memory_bytes: float  # of one GPU

    def nic_share(self) -> Connection:
        return Connection(self.inter_host.bandwidth / self.devices_per_host,
                          self.inter_host.latency)

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


def allreduce_seconds(algorithm: str, nbytes: float, participants: int,
                      participants_per_host: int, cluster: Cluster) -> float:
    """All-reduce of `nbytes` over `participants`, `participants_per_host` on each host, in the
    alpha-beta model, with a = latency and B = bandwidth of the intra-host (i) and inter-host (e)
    connections, p participants, L of them per host on H hosts (the reduction's arithmetic free);
    B_e is the NIC shares of a host's L participants, L / devices_per_host of its NICs:

    ring: 2 (p - 1) steps (reduce-scatter, then all-gather), each moving n / p bytes per
      participant; a step lasts as long as its slowest hop, and each host sends n / p bytes out
      per step (NCCL runs a ring per NIC, each carrying a share, so the host's NICs together
      carry one hop's bytes):  2 (p - 1) * max(a_i + n / (p B_i), a_e + n / (p B_e)).
      (Patarasuk & Yuan 2009; Thakur, Rabenseifner & Gropp 2005, section 4; NCCL's ring.)
    hierarchical: reduce-scatter in each host by a ring of L, L concurrent rings of n / L bytes
      over the H hosts (each host's NICs carrying n / H a step), all-gather in each host:
      2 (L - 1) (a_i + n / (L B_i)) + 2 (H - 1) (a_e + n / (H B_e)).
      (Horovod's hierarchical all-reduce; Jia et al. 2018, "Highly scalable deep learning training
      system with mixed-precision", 2D all-reduce.)
    recursive_halving: Rabenseifner's reduce-scatter by recursive vector halving and distance
      doubling, then all-gather by recursive doubling (Thakur et al. 2005, section 4.5): step k
      exchanges n / 2^k bytes with the partner 2^(k-1) away, so the log2 L nearest steps stay in
      the host and the log2 H others cross it, all L participants of a host at once:
      2 log2(L) a_i + 2 (1 - 1/L) n / B_i + 2 log2(H) a_e + 2 (1 - 1/H) n / B_e.
      It needs power-of-two L and H. In this model it is never slower than hierarchical: same
      bandwidth, fewer messages; what the model leaves out is that its partners change every step
      (no pipelining, more exposed to network contention), which is why NCCL uses rings and trees.
    """
    if participants <= 1 or nbytes == 0:
        return 0.0
    local = participants_per_host
    hosts = math.ceil(participants / local)
    # Only the participants' NIC shares carry the host's traffic (see Cluster.inter_host).
    intra, share = cluster.intra_host, cluster.nic_share()
    inter = Connection(share.bandwidth * min(local, cluster.devices_per_host), share.latency)
    if algorithm == "ring":
        chunk = nbytes / participants
        step = max(intra.seconds(chunk) if local > 1 else 0.0,
                   inter.seconds(chunk) if hosts > 1 else 0.0)
        return 2 * (participants - 1) * step
    if algorithm == "hierarchical":
        return (2 * (local - 1) * intra.seconds(nbytes / local)
                + 2 * (hosts - 1) * inter.seconds(nbytes / hosts))
    if algorithm == "recursive_halving":
        if not (_power_of_two(local) and _power_of_two(hosts)):
            raise ValueError(f"recursive halving needs power-of-two participants per host and "
                             f"hosts, not {local} and {hosts}")
        return 2 * (sum(intra.seconds(nbytes / 2 ** k) for k in range(1, local.bit_length()))
                    + sum(inter.seconds(nbytes / 2 ** k) for k in range(1, hosts.bit_length())))
    raise ValueError(f"unknown all-reduce algorithm {algorithm!r}; one of {ALLREDUCE_ALGORITHMS}")


def _power_of_two(count: int) -> bool:
    return count >= 1 and count & (count - 1) == 0


def groups_per_host(spatial: int, groups: int, devices_per_host: int) -> int:
    """Data groups (all-reduce participants: each group's gradients are summed on its first
    device, as `MirroredStrategy` over the groups does) on one host; a group spanning hosts
    counts on its first."""
    if devices_per_host % spatial and spatial % devices_per_host:
        raise ValueError(f"groups of {spatial} devices straddle hosts of {devices_per_host}")
    return min(groups, max(1, devices_per_host // spatial))


def _halo_faces(spatial: int, groups: int, devices_per_host: int) -> set:
    """(faces to a device of the same host, faces to another host) of each device's slab."""
    faces = set()
    for device in range(spatial * groups):
        first = device - device % spatial  # of its group
        neighbours = [n for n in (device - 1, device + 1) if first <= n < first + spatial]
        inter = sum(n // devices_per_host != device // devices_per_host for n in neighbours)
        faces.add((len(neighbours) - inter, inter))
    return faces


def activation_bytes(edge: int, channels: int, filters: Sequence[int], spatial: int = 1,
                     depth: Optional[int] = None, dtype_bytes: int = 4) -> float:
    """An estimate of one sample's training memory on each of `spatial` devices: every block
    keeps its input and the halo-padded copy the convolution reads (2 C_in values a voxel) and the
    convolution's output before and after the activation (2 C_out) for the backward pass, which
    holds besides the gradients of the largest block's input and output (C_in + C_out). The
    pooled outputs and the dense head are small beside them; workspaces are left out."""
    kept = largest = 0.0
    for block_depth, size, c_in, c_out in _blocks(edge, depth or edge, channels, filters):
        voxels = block_depth * size ** 2 / spatial
        kept += voxels * 2 * (c_in + c_out)
        largest = max(largest, voxels * (c_in + c_out))
    return (kept + largest) * dtype_bytes


def parameter_state_bytes(parameters: int, dtype_bytes: int = 4) -> float:
    """Weights, gradients and Adam's two moments, on every device."""
    return 4 * parameters * dtype_bytes


def cosmoflow_parameters(edge: int, channels: int, filters: Sequence[int],
                         dense: Sequence[int] = (128, 64), outputs: int = 4,
                         depth: Optional[int] = None) -> int:
    """Trainable parameters of `SpatialCosmoFlow` (3^3 convolutions and dense layers, biases)."""
    count, shape = 0, None
    for block_depth, size, c_in, c_out in _blocks(edge, depth or edge, channels, filters):
        count += 27 * c_in * c_out + c_out
        shape = (block_depth // 2, size // 2, c_out)
    width = shape[0] * shape[1] ** 2 * shape[2]
    for units in (*dense, outputs):
        count += width * units + units
        width = units
    return count


def cluster_step_cost(edge: int, channels: int, filters: Sequence[int], batch: int,
                      spatial: int, groups: int, cluster: Cluster, parameters: int,
                      algorithm: str = "ring", micro_batches: int = 1, dtype_bytes: int = 4,
                      overlap_halo: bool = True, depth: Optional[int] = None) -> StepCost:
    """As `cosmoflow_step_cost`, on a `Cluster`: each group runs its samples in `micro_batches`
    (to fit memory), and each micro-batch exchanges every block's halos twice (the inputs forward,
    their gradients backward). An exchange lasts as long as the busiest device's: its faces to the
    same host share its intra-host bandwidth, those to another host its NIC share, both at once:
      max(a_i + f_i * face / B_i, a_e + f_e * face / (B_e / devices_per_host)),
    f_i and f_e its faces of each kind, face = samples per micro-batch * edge^2 * C values. The
    gradients are then all-reduced across the groups by `algorithm` (`allreduce_seconds`)."""
    samples = batch / groups
    faces = _halo_faces(spatial, groups, cluster.devices_per_host) if spatial > 1 else set()
    nic_share = cluster.nic_share()

    def exchange_seconds(face_bytes: float) -> float:
        return max(max(cluster.intra_host.seconds(intra * face_bytes) if intra else 0.0,
                       nic_share.seconds(inter * face_bytes) if inter else 0.0)
                   for intra, inter in faces)

    flops = halo = halo_values = 0.0
    busiest_faces = max((sum(pair) for pair in faces), default=0)
    for block_depth, size, c_in, c_out in _blocks(edge, depth or edge, channels, filters):
        flops += _conv_flops(samples, block_depth, size, c_in, c_out, spatial)
        if faces:
            halo_values += busiest_faces * samples * size ** 2 * (c_in + c_out)
            for values in (c_in, c_out):
                face_bytes = samples / micro_batches * size ** 2 * values * dtype_bytes
                halo += micro_batches * exchange_seconds(face_bytes)
    compute = flops / cluster.flops
    local = groups_per_host(spatial, groups, cluster.devices_per_host)
    nbytes = parameters * dtype_bytes
    allreduce = allreduce_seconds(algorithm, nbytes, groups, local, cluster)
    exposed_halo = max(0.0, halo - compute) if overlap_halo else halo
    return StepCost(compute_s=compute, halo_bytes=int(halo_values * dtype_bytes), halo_s=halo,
                    allreduce_bytes=int(2 * (groups - 1) / groups * nbytes),
                    allreduce_s=allreduce, step_s=compute + exposed_halo + allreduce,
                    algorithm=algorithm, micro_batches=micro_batches,
                    halo_crosses_hosts=any(inter for _, inter in faces))


@dataclasses.dataclass(frozen=True)
class SplitChoice:
    """One data x spatial split with one all-reduce algorithm, and how it fared."""

    data: int
    spatial: int
    algorithm: Optional[str]  # None where the split itself is ruled out
    micro_batch: int  # samples a group runs at once (0: not even one fits)
    cost: Optional[StepCost]  # None where ruled out
    verdict: str  # "chosen", or why it lost

    def to_json(self) -> dict:
        row = dataclasses.asdict(self)
        row["cost"] = self.cost.to_json() if self.cost else None
        return row


@dataclasses.dataclass(frozen=True)
class Recommendation:
    devices: int
    edge: int
    batch: int
    parameters: int
    sample_bytes: float  # `activation_bytes` of one sample on one device
    chosen: SplitChoice
    alternatives: list  # of SplitChoice, fastest first, then those ruled out
    one_device_step_s: float  # the batch's compute on one device, were there memory for it
    one_device_fits: bool  # whether one sample (with the parameters' state) fits one device
    efficiency: float  # one_device_step_s / (devices * chosen step)

    def to_json(self) -> dict:
        row = {field.name: getattr(self, field.name) for field in dataclasses.fields(self)}
        row["chosen"] = self.chosen.to_json()
        row["alternatives"] = [choice.to_json() for choice in self.alternatives]
        return row


def _largest_micro_batch(samples: int, per_sample: float, free: float) -> int:
    return min(samples, int(free // per_sample)) if free > 0 else 0


def recommend_split(devices: int, edge: int, channels: int, filters: Sequence[int], batch: int,
                    cluster: Cluster, parameters: Optional[int] = None,
                    dtype_bytes: int = 4) -> Recommendation:
    """The data x spatial split of `batch` samples over `devices` and the all-reduce algorithm
    with the least predicted step (`cluster_step_cost`). Spatial is a power of two dividing
    `devices`; a split is ruled out where the batch does not divide over its data groups, where
    its slabs do not hold whole pooling windows through every block (as `spatial.pool` demands),
    where its groups straddle hosts unevenly, or where not one sample's `activation_bytes` on each
    device, with the `parameter_state_bytes`, fits `cluster.memory_bytes`. Each group runs the
    largest micro-batch that fits. Ties go to the less spatial split and the earlier algorithm
    of ALLREDUCE_ALGORITHMS."""
    if parameters is None:
        parameters = cosmoflow_parameters(edge, channels, filters)
    free = cluster.memory_bytes - parameter_state_bytes(parameters, dtype_bytes)
    sample_bytes = activation_bytes(edge, channels, filters, 1, dtype_bytes=dtype_bytes)
    ranked, ruled_out = [], []
    for spatial in (2 ** k for k in range(devices.bit_length())):
        if devices % spatial:
            continue
        groups = devices // spatial
        samples = batch // groups
        per_sample = sample_bytes / spatial
        micro_batch = _largest_micro_batch(samples, per_sample, free)
        reason = None
        if batch % groups:
            reason = f"the batch of {batch} does not split over {groups} data groups"
        elif edge % (spatial * 2 ** len(filters)):
            reason = (f"slabs of {edge / spatial:g} rows do not hold whole pooling windows "
                      f"through {len(filters)} blocks")
        elif cluster.devices_per_host % spatial and spatial % cluster.devices_per_host:
            reason = f"groups of {spatial} straddle hosts of {cluster.devices_per_host}"
        elif micro_batch == 0:
            reason = (f"does not fit: a sample needs {per_sample / 2 ** 30:.1f} GiB per device "
                      f"besides {parameter_state_bytes(parameters, dtype_bytes) / 2 ** 30:.1f} "
                      f"GiB of parameter state, of {cluster.memory_bytes / 2 ** 30:.1f} GiB")
        if reason:
            ruled_out.append(SplitChoice(groups, spatial, None, micro_batch, None, reason))
            continue
        local = groups_per_host(spatial, groups, cluster.devices_per_host)
        for algorithm in ALLREDUCE_ALGORITHMS:
            if algorithm == "recursive_halving" and not (
                    _power_of_two(local) and _power_of_two(math.ceil(groups / local))):
                ruled_out.append(SplitChoice(groups, spatial, algorithm, micro_batch, None,
                                             "recursive halving needs powers of two"))
                continue
            cost = cluster_step_cost(edge, channels, filters, batch, spatial, groups, cluster,
                                     parameters, algorithm, math.ceil(samples / micro_batch),
                                     dtype_bytes)
            ranked.append(SplitChoice(groups, spatial, algorithm, micro_batch, cost, ""))
    if not ranked:
        raise ValueError(f"no split of {devices} devices runs a batch of {batch} at {edge}^3: "
                         + "; ".join(sorted({choice.verdict for choice in ruled_out})))
    ranked.sort(key=lambda choice: choice.cost.step_s)  # stable: ties keep the order above
    best = ranked[0]
    chosen = dataclasses.replace(best, verdict="chosen")
    alternatives = [dataclasses.replace(choice, verdict=_why_slower(choice.cost, best.cost))
                    for choice in ranked[1:]] + ruled_out
    one_device = cluster_step_cost(edge, channels, filters, batch, 1, 1, cluster, parameters,
                                   dtype_bytes=dtype_bytes).step_s
    return Recommendation(devices=devices, edge=edge, batch=batch, parameters=parameters,
                          sample_bytes=sample_bytes, chosen=chosen, alternatives=alternatives,
                          one_device_step_s=one_device, one_device_fits=sample_bytes <= free,
                          efficiency=one_device / (devices * best.cost.step_s))


def _why_slower(cost: StepCost, best: StepCost) -> str:
    """The part of the step that costs it most against the best."""
    def parts(step: StepCost) -> dict:
        exposed_halo = step.step_s - step.compute_s - step.allreduce_s
        return {"compute": step.compute_s, "exposed halo": exposed_halo,
                "all-reduce": step.allreduce_s}
    mine, theirs = parts(cost), parts(best)
    worst = max(mine, key=lambda part: mine[part] - theirs[part])
    if cost.step_s <= best.step_s:
        return "as fast as the chosen; ties go to less spatial, then the earlier algorithm"
    return (f"slower: {cost.step_s * 1e3:.3f} ms a step against {best.step_s * 1e3:.3f} ms, "
            f"most from its {worst} ({mine[worst] * 1e3:.3f} ms against "
            f"{theirs[worst] * 1e3:.3f} ms)")
