"""The performance model: predicted step time and peak memory of a training step for a set of swap
and recomputation decisions, from op times and tensor sizes, as AccUDNN and SuperNeurons plan with.

The step is modelled as three queues working side by side, as on a GPU: the compute stream runs
the ops one after another in execution order; a device-to-host copy engine runs the swap-outs in
the order their tensors are produced; a host-to-device copy engine runs the swap-ins in the order
their prefetch points are reached. An op waits for the swap-ins of the tensors it reads; a
swap-in waits for its tensor's swap-out and for its prefetch op. A tensor occupies device memory
from the start of its producer to the end of its last consumer; a swapped one instead until the
later of its last forward use and its swap-out, and again from its swap-in's start to its last
backward use; a recomputed one until its last forward use, and again from its recomputation,
which the compute stream runs just before the tensor's first backward use.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Callable, Collection, Mapping, Optional, Sequence

import numpy as np
import tensorflow as tf
from tensorflow.core.framework import attr_value_pb2

GB = 1e9
_SLICES = {"Slice", "StridedSlice"}


@dataclasses.dataclass(frozen=True)
class DeviceModel:
    """What the model assumes of the machine: copy bandwidths in bytes per second, and for the
    ops without measurements a roofline (device memory bandwidth, peak FLOP/s, launch cost)."""

    name: str
    device_to_host: float
    host_to_device: float
    memory_bandwidth: float = 3.35e12  # H100 SXM HBM3, datasheet
    peak_flops: float = 4.9e14  # H100 SXM dense TF32 tensor cores, datasheet
    launch_ms: float = 0.005

    def op_ms(self, op: tf.Operation) -> float:
        """A roofline estimate of one op's time: its FLOPs at peak or its bytes at the memory
        bandwidth, whichever is longer, plus a launch; tensors of unknown shape count as none.
        A slice reads only the part it copies."""
        moved = sum(tensor_bytes(t) or 0 for t in (
            *(op.outputs if op.type in _SLICES else op.inputs), *op.outputs))
        return self.launch_ms + 1e3 * max(_flops(op) / self.peak_flops,
                                          moved / self.memory_bandwidth)

    @classmethod
    def measure(cls, device: str = "/GPU:0", size_bytes: int = 1 << 30,
                repeats: int = 5) -> "DeviceModel":
        """Times copies of a `size_bytes` tensor between the host and `device` the way the swap
        nodes make them: out to the host, and back from what came out. TensorFlow receives a
        device's tensor on the host in pinned memory, so the swap-in copies from pinned memory;
        a tensor made on the host is pageable, and copies from it run several times slower."""
        if not tf.config.list_logical_devices("GPU"):
            raise RuntimeError("no GPU to measure host-device bandwidth on; give a DeviceModel "
                               "with the bandwidths instead")
        count = size_bytes // 4

        def kept(x):
            # Kept as the swap nodes are: Grappler may drop an Identity it sees through.
            x.op._set_attr("_grappler_do_not_remove", attr_value_pb2.AttrValue(b=True))
            return x

        def copies(back_whole: bool):
            """Out to the host, then back whole, or only one value back; summed on the device
            so that what the caller receives (unpinned, and timed too) is one number."""
            @tf.function(autograph=False)
            def run(x):
                with tf.device("/CPU:0"):
                    x = kept(tf.identity(x))
                    if not back_whole:
                        x = x[:1]
                with tf.device(device):
                    return tf.reduce_sum(kept(tf.identity(x)))
            return run

        def best_seconds(run):
            # A fresh tensor each time: eager tensors keep a mirror on a device they were copied
            # to once.
            best = float("inf")
            for repeat in range(repeats + 1):
                with tf.device(device):
                    data = tf.random.stateless_uniform([count], seed=[repeat, 0])
                data[:1].numpy()  # made before the clock starts
                start = time.perf_counter()
                run(data).numpy()
                if repeat:  # the first call traces
                    best = min(best, time.perf_counter() - start)
            return best

        out = best_seconds(copies(back_whole=False))
        round_trip = best_seconds(copies(back_whole=True))
        if round_trip <= out:
            raise RuntimeError(f"copying {size_bytes} bytes out and back in to {device} took "
                               f"{round_trip * 1e3:.3f} ms, no longer than out alone "
                               f"({out * 1e3:.3f} ms): the copies did not run as timed")
        name = tf.config.experimental.get_device_details(
            tf.config.list_physical_devices("GPU")[0]).get("device_name", device)
        return cls(name, device_to_host=size_bytes / out,
                   host_to_device=size_bytes / (round_trip - out))


def tensor_bytes(tensor) -> Optional[int]:
    """A tensor's size on the device: 0 for handles (resources, variants), None if unknown."""
    if tensor.dtype in (tf.resource, tf.variant):
        return 0
    if not tensor.shape.is_fully_defined():
        return None
    return tensor.shape.num_elements() * tensor.dtype.size


def _flops(op: tf.Operation) -> float:
    """Multiply-adds x 2 of the matrix and convolution ops, from their static shapes."""
    shapes = [t.shape for t in (*op.inputs, *op.outputs)]
    if not all(shape.is_fully_defined() for shape in shapes):
        return 0.0
    if op.type in ("MatMul", "BatchMatMulV2", "BatchMatMulV3"):
        a = op.inputs[0].shape
        k = a[-2] if op.get_attr("transpose_a" if op.type == "MatMul" else "adj_x") else a[-1]
        return 2.0 * op.outputs[0].shape.num_elements() * k
    if op.type.startswith(("Conv2D", "Conv3D", "UcudnnConv")):
        # All three kernels of a convolution do the forward's work: for each output element,
        # one multiply-add per filter element of its output channel.
        backprop_filter = "BackpropFilter" in op.type
        outputs = op.inputs[2] if "Backprop" in op.type else op.outputs[0]
        filters = op.outputs[0] if backprop_filter else op.inputs[1]
        return 2.0 * outputs.shape.num_elements() * (filters.shape.num_elements()
                                                     // filters.shape[-1])
    return 0.0


@dataclasses.dataclass(frozen=True)
class TensorUse:
    """A tensor of the step: its size, the op producing it and the ops reading it (indices into
    the execution order). `backward_consumers` are the readers after the forward pass."""

    name: str
    bytes: int
    producer: int
    consumers: tuple[int, ...]
    backward_consumers: tuple[int, ...] = ()
    device: str = ""  # where its buffer is; each device's peak is its own

    def __post_init__(self):
        object.__setattr__(self, "consumers", tuple(sorted(self.consumers)))
        object.__setattr__(self, "backward_consumers", tuple(sorted(self.backward_consumers)))
        if not set(self.backward_consumers) <= set(self.consumers):
            raise ValueError(f"{self.name}: backward consumers must be among its consumers")

    @functools.cached_property
    def last_forward_use(self) -> int:
        forward = [c for c in self.consumers if c not in self.backward_consumers]
        return max(forward, default=self.producer)


@dataclasses.dataclass(frozen=True)
class SwapDecision:
    tensor: str
    prefetch_after: int  # the swap-in starts once this op (an index) has finished


@dataclasses.dataclass(frozen=True)
class RecomputeDecision:
    tensor: str
    cost_ms: float  # the time of the ops that recompute it, and the tensors it makes on its way
    swapped_reads: tuple[str, ...] = ()  # swapped tensors it reads: back before it runs
    # The recomputed tensor whose recomputation makes this one on its way (a checkpointed
    # segment made again in one go): this one then costs nothing and is held from then on.
    made_with: Optional[str] = None
    # The largest tensor its ops make on the way that nobody keeps: held while they run.
    transient_bytes: int = 0


@dataclasses.dataclass(frozen=True)
class Prediction:
    step_ms: float
    compute_ms: float
    peak_bytes: int  # on the device with the highest peak, variables included
    peak_op: int  # the op running when the peak is reached, or waiting to run
    transfer_ms: float  # copy engines' busy time, hidden or not
    # Per swapped tensor, the first op to start after its copy out ends: the model frees the
    # device buffer there, so the graph must not run that op sooner.
    copied_out_before: tuple[tuple[str, int], ...] = ()
    peak_device: str = ""  # the device of that peak (TensorUse.device)

    @property
    def exposed_transfer_ms(self) -> float:
        return max(self.step_ms - self.compute_ms, 0.0)  # not -0.0 from rounding

    def to_json(self) -> dict:
        return dataclasses.asdict(self) | {"exposed_transfer_ms": self.exposed_transfer_ms}


def predict(op_ms: Sequence[float], tensors: Sequence[TensorUse], model: DeviceModel,
            swaps: Sequence[SwapDecision] = (), persistent_bytes: int = 0,
            recomputes: Sequence[RecomputeDecision] = ()) -> Prediction:
    """Step time and peak memory of the ops (in execution order) with these decisions.

    The ops run one after another, as on one stream; tensors on different devices (their
    `device`) count towards their own device's peak, and the highest is the step's. Variables
    (`persistent_bytes`) count on every device, as each holds the weights it uses."""
    table = _TensorTable.of(tensors)
    by_name = table.by_name
    recomputed_before: dict[int, list[RecomputeDecision]] = {}
    made_with = {}
    for decision in recomputes:
        tensor = by_name.get(decision.tensor)
        if tensor is None or not tensor.backward_consumers:
            raise ValueError(f"{decision.tensor}: not a tensor kept for the backward pass")
        if decision.tensor in {swap.tensor for swap in swaps}:
            raise ValueError(f"{decision.tensor}: both swapped and recomputed")
        if decision.made_with is None:
            recomputed_before.setdefault(tensor.backward_consumers[0], []).append(decision)
        else:
            made_with[decision.tensor] = decision.made_with
    recomputed = {d.tensor for d in recomputes}
    for name, owner in made_with.items():
        maker = by_name.get(owner)
        if owner in made_with or owner not in recomputed or \
                maker.backward_consumers[0] > by_name[name].backward_consumers[0]:
            raise ValueError(f"{name}: made with {owner}, which must be a tensor recomputed on "
                             "its own, no later than this one is needed")
    due = _due(by_name, recomputes)
    chosen = {}
    for swap in swaps:
        tensor = by_name.get(swap.tensor)
        if tensor is None or not tensor.backward_consumers:
            raise ValueError(f"{swap.tensor}: not a tensor kept for the backward pass")
        first_backward = _needed_by(tensor, due)
        if not tensor.last_forward_use <= swap.prefetch_after < first_backward:
            raise ValueError(f"{swap.tensor}: the prefetch op must come after its last forward "
                             f"use ({tensor.last_forward_use}) and before its first backward "
                             f"use ({first_backward}), got {swap.prefetch_after}")
        chosen[swap.tensor] = swap

    produced_by: dict[int, list[TensorUse]] = {}
    prefetched_at: dict[int, list[TensorUse]] = {}
    waits: dict[int, list[str]] = {}
    for name, swap in chosen.items():
        tensor = by_name[name]
        produced_by.setdefault(tensor.producer, []).append(tensor)
        prefetched_at.setdefault(swap.prefetch_after, []).append(tensor)
        for consumer in tensor.backward_consumers:
            waits.setdefault(consumer, []).append(name)
    for decision in recomputes:
        for read in decision.swapped_reads:
            if read not in chosen:
                raise ValueError(f"{decision.tensor}: its recomputation reads {read} back from "
                                 "the host, but it is not swapped")
            waits.setdefault(by_name[decision.tensor].backward_consumers[0], []).append(read)

    # Only ops that wait, or start or end a transfer, need a look of their own; the others run
    # back to back, so times are prefix sums shifted by the waits before them.
    durations = np.asarray(op_ms, dtype=float)
    prefix = np.concatenate([[0.0], np.cumsum(durations)])
    delay = np.zeros(len(durations))
    shift = 0.0
    out_done, in_start, in_done, recomputed_at = {}, {}, {}, {}
    d2h_free = h2d_free = transfer = 0.0
    for i in sorted(set(waits) | set(recomputed_before) | set(produced_by) | set(prefetched_at)):
        clock = prefix[i] + shift
        ready = max([clock] + [in_done[name] for name in waits.get(i, ())])
        for decision in recomputed_before.get(i, ()):
            recomputed_at[decision.tensor] = ready
            ready += decision.cost_ms
        delay[i] = ready - clock
        shift += delay[i]
        end_i = ready + durations[i]
        for tensor in produced_by.get(i, ()):
            copy = tensor.bytes / model.device_to_host * 1e3
            out_done[tensor.name] = d2h_free = max(d2h_free, end_i) + copy
            transfer += copy
        for tensor in prefetched_at.get(i, ()):
            copy = tensor.bytes / model.host_to_device * 1e3
            begin = max(h2d_free, end_i, out_done[tensor.name])
            in_start[tensor.name], in_done[tensor.name] = begin, begin + copy
            h2d_free = begin + copy
            transfer += copy
    start = prefix[:-1] + np.cumsum(delay)
    end = start + durations
    for name, owner in made_with.items():
        recomputed_at[name] = recomputed_at[owner]

    transient = {d.tensor: (d.transient_bytes, d.cost_ms) for d in recomputes
                 if d.transient_bytes}
    plain = np.ones(len(tensors), dtype=bool)
    plain[[table.index[name] for name in (*chosen, *recomputed_at)]] = False
    pieces, piece_devices = [], []  # (start, end, bytes) of tensors held in two spans, or briefly
    for tensor in (by_name[name] for name in (*chosen, *recomputed_at)):
        last = table.lasts[table.index[tensor.name]]
        if tensor.name in chosen:
            last = max(last, due.get(tensor.name, last))
            pieces += [(start[tensor.producer],
                        max(end[tensor.last_forward_use], out_done[tensor.name]), tensor.bytes),
                       (in_start[tensor.name], end[last], tensor.bytes)]
        else:
            made_at = recomputed_at[tensor.name]
            pieces += [(start[tensor.producer], end[tensor.last_forward_use], tensor.bytes),
                       (made_at, end[last], tensor.bytes)]
            if tensor.name in transient:
                size, duration = transient[tensor.name]
                pieces.append((made_at, made_at + duration, size))
        piece_devices += [table.devices[table.index[tensor.name]]] * \
            (len(pieces) - len(piece_devices))
    spans = np.array(pieces, dtype=float).reshape(-1, 3)
    starts = np.concatenate([start[table.producers[plain]], spans[:, 0]])
    ends = np.concatenate([end[table.lasts[plain]], spans[:, 1]])
    sizes = np.concatenate([table.sizes[plain], spans[:, 2].astype(np.int64)])
    devices = np.concatenate([table.devices[plain], np.array(piece_devices, dtype=int)])
    peak, peak_time, peak_device = max(
        (*_peak(starts[devices == d], ends[devices == d], sizes[devices == d]), d)
        for d in range(len(table.device_names)))
    # The op running at the peak or, in a wait or recomputation before an op, that op.
    running = np.nonzero(peak_time < end)[0]
    peak_op = int(running[0]) if len(running) else len(durations) - 1
    compute = float(durations.sum()) + sum(decision.cost_ms for decision in recomputes)
    copied_out_before = tuple(
        (name, min(max(int(np.searchsorted(start, out_done[name] - 1e-9)),
                       by_name[name].last_forward_use + 1), by_name[name].backward_consumers[0]))
        for name in chosen)
    return Prediction(step_ms=float(end[-1]) if len(end) else 0.0, compute_ms=compute,
                      peak_bytes=peak + persistent_bytes, peak_op=peak_op,
                      transfer_ms=transfer, copied_out_before=copied_out_before,
                      peak_device=table.device_names[peak_device])


@dataclasses.dataclass(frozen=True)
class _TensorTable:
    """The tensors' names, producers, last readers and sizes, as arrays: made once per list of
    tensors, as the planner predicts for many decisions over the same ones."""

    tensors: Sequence[TensorUse]
    by_name: Mapping[str, TensorUse]
    index: Mapping[str, int]
    producers: np.ndarray
    lasts: np.ndarray
    sizes: np.ndarray
    device_names: tuple[str, ...]
    devices: np.ndarray  # indices into device_names

    @classmethod
    def of(cls, tensors: Sequence[TensorUse]) -> "_TensorTable":
        global _last_table
        if _last_table is not None and _last_table.tensors is tensors:
            return _last_table
        names = tuple(sorted({t.device for t in tensors})) or ("",)
        _last_table = cls(
            tensors, {t.name: t for t in tensors}, {t.name: i for i, t in enumerate(tensors)},
            np.array([t.producer for t in tensors], dtype=int),
            np.array([max(t.consumers, default=t.producer) for t in tensors], dtype=int),
            np.array([t.bytes for t in tensors], dtype=np.int64), names,
            np.array([names.index(t.device) for t in tensors], dtype=int))
        return _last_table


_last_table: Optional[_TensorTable] = None  # the planner's tensors, predicted over and over


def _needed_by(tensor: TensorUse, due: Mapping[str, int]) -> int:
    """The first op that needs a swapped tensor back: `due`'s, or its first backward reader."""
    return due.get(tensor.name, tensor.backward_consumers[0])


def _due(by_name: Mapping[str, TensorUse], recomputes) -> dict[str, int]:
    """For each swapped tensor a recomputation reads, the first op it is needed by: its own
    first backward reader, or the reader of a tensor recomputed from it, if earlier."""
    due: dict[str, int] = {}
    for decision in recomputes:
        when = by_name[decision.tensor].backward_consumers[0]
        for read in decision.swapped_reads:
            due[read] = min(_needed_by(by_name[read], due), when)
    return due


def _peak(starts: np.ndarray, ends: np.ndarray, sizes: np.ndarray) -> tuple[int, float]:
    """Most bytes held at once by half-open [start, end) intervals, and when."""
    held = ends > starts
    starts, ends, sizes = starts[held], ends[held], sizes[held]
    if not len(sizes):
        return 0, 0.0
    times = np.concatenate([starts, ends])
    changes = np.concatenate([sizes, -sizes])
    # At equal times frees come before allocations: a buffer freed as another is taken.
    order = np.lexsort((changes > 0, times))
    totals = np.cumsum(changes[order])
    best = int(np.argmax(totals))
    return int(max(totals[best], 0)), float(times[order][best])


def latest_hiding_prefetch(tensor: TensorUse, op_ms: Sequence[float],
                           model: DeviceModel, due: Optional[int] = None) -> int:
    """The latest op after which the swap-in still ends before the first backward use (or the
    op `due`), on an idle copy engine: as late as possible to hold the memory briefly, early
    enough to hide."""
    copy = tensor.bytes / model.host_to_device * 1e3
    covered = 0.0
    first_use = tensor.backward_consumers[0] if due is None else due
    for prefetch in range(first_use - 1, tensor.last_forward_use - 1, -1):
        if covered >= copy:
            return prefetch
        covered += op_ms[prefetch]
    return tensor.last_forward_use


@dataclasses.dataclass(frozen=True)
class MemoryDecisions:
    swaps: tuple[SwapDecision, ...]
    recomputes: tuple[RecomputeDecision, ...]
    prediction: Prediction

    def to_json(self) -> dict:
        return {"swaps": [dataclasses.asdict(s) for s in self.swaps],
                "recomputes": [dataclasses.asdict(r) for r in self.recomputes],
                "prediction": self.prediction.to_json()}


# Where the greedy choice finds no plan, it starts again with every op time scaled by each of
# these in turn: its path turns on near-ties of cost per byte freed. ResNet-50 at batch 768
# (streamed pairs, XLA batch norm), planned under 12207.5 MiB with the step calibrated to
# 327.6908 ms, fits at 12152 MiB; calibrated to 327.69 ms, it misses by 1414 MiB.
_RESTART_SCALES = (0.995, 1.005, 0.99, 1.01, 0.98, 1.02)


def plan_memory(op_ms: Sequence[float], tensors: Sequence[TensorUse], model: DeviceModel,
                budget_bytes: int, persistent_bytes: int = 0,
                recompute_ms: Optional[Mapping[str, float]] = None,
                recompute_reads: Optional[Mapping[str, Collection[str]]] = None,
                direct_reads: Optional[Mapping[str, Collection[str]]] = None,
                transient_bytes: Optional[Mapping[str, int]] = None,
                candidates: Optional[Collection[str]] = None,
                prefetch_point: Optional[Callable[[TensorUse, int], int]] = None,
                candidates_per_round: int = 8,
                min_swap_bytes: Optional[int] = None) -> MemoryDecisions:
    """Swaps and recomputations chosen greedily until the predicted peak fits the budget.

    Each round looks at the largest kept tensors alive at the predicted peak and takes, of the
    choices that lower the peak (swapping with the latest prefetch that hides the copy, or with
    the latest prefetch of all; recomputing where `recompute_ms` gives its cost; bringing an
    already swapped tensor back later, or recomputing one whose copy out has not ended by the
    peak), the one that costs the least predicted step time per byte it frees.

    A recomputation reads the tensors named in `recompute_reads`. Those it reads through an
    alias stay on the device. Those named in `direct_reads` (read as they are) may instead be
    swapped, and come back in time for it, or be recomputed too: then the first recomputation
    to need one makes it on its way and keeps it for its own readers (SuperNeurons' segments,
    recomputed from a checkpoint in one go).
    `transient_bytes` gives the largest tensor a recomputation's ops make on the way that
    nobody keeps, held while it runs.

    The greedy choice starts twice, from no decisions and from SuperNeurons' (every tensor
    recomputed that is cheaper to make again than to copy back in); the plan that fits with the
    shorter predicted step wins. When no choice lowers the peak, the one raising it least is
    taken. If neither start fits, both start again with the op times scaled slightly
    (`_RESTART_SCALES`), until a plan fits as predicted with the op times as they are. Raises
    BudgetError, saying by how much the budget is missed (the smallest shortfall of any round
    of either start at the op times as they are), when no kept tensor alive at the peak is left
    to choose.
    `candidates` limits the choice to these tensors (default: every kept tensor of nonzero
    size); `prefetch_point(tensor, index)` moves a proposed prefetch op to one the graph can use
    (or before the tensor's last forward use, if there is none).

    Swaps of tensors under `min_swap_bytes` (default: a ten-thousandth of the budget; a batch
    norm's statistics, scalars), which the greedy choice takes when they cost nothing, are then
    dropped where the plan fits without them: they free too little to pay for two copies and
    the ops that order them.
    """
    def recomputing_at(scale: float) -> _Recomputing:
        return _Recomputing({t.name: t for t in tensors},
                            {name: ms * scale for name, ms in (recompute_ms or {}).items()},
                            recompute_reads or {}, direct_reads or {}, transient_bytes or {})
    recomputing = recomputing_at(1.0)

    def greedy_plans(scale: float) -> tuple[list[MemoryDecisions], list[BudgetError]]:
        """The plans the greedy choice finds from each start with the op times scaled, each
        predicted with the op times as they are (and dropped if it then misses the budget)."""
        scaled = recomputing_at(scale) if scale != 1.0 else recomputing
        times = op_ms if scale == 1.0 else [ms * scale for ms in op_ms]
        starts = [[]]
        cheap = _cheaper_than_a_swap_in(tensors, model, scaled, candidates)
        if cheap:
            starts.append(cheap)
        found, failed = [], []
        for recomputed in starts:
            try:
                plan = _greedy(times, tensors, model, budget_bytes, persistent_bytes, scaled,
                               candidates, prefetch_point, candidates_per_round, recomputed)
            except BudgetError as error:
                failed.append(error)
                continue
            if scale != 1.0:
                made = recomputing.decisions([d.tensor for d in plan.recomputes],
                                             {d.tensor for d in plan.swaps})[0]
                prediction = predict(op_ms, tensors, model, plan.swaps, persistent_bytes, made)
                if prediction.peak_bytes > budget_bytes:
                    continue
                plan = MemoryDecisions(plan.swaps, tuple(made), prediction)
            found.append(plan)
        return found, failed

    plans, errors = greedy_plans(1.0)
    for scale in _RESTART_SCALES:
        if plans:
            break
        plans = greedy_plans(scale)[0]  # its shortfalls are in scaled times: not reported
    if plans:
        best = min(plans, key=lambda plan: plan.prediction.step_ms)
        return _without_small_swaps(best, op_ms, tensors, model, budget_bytes, persistent_bytes,
                                    budget_bytes // 10_000 if min_swap_bytes is None
                                    else min_swap_bytes)
    raise min(errors, key=lambda error: error.shortfall_bytes)


def _without_small_swaps(plan: MemoryDecisions, op_ms, tensors, model, budget_bytes: int,
                         persistent_bytes: int, min_swap_bytes: int) -> MemoryDecisions:
    """The plan less its swaps of tensors under `min_swap_bytes` that no recomputation reads
    back, all at once if it still fits the budget no slower, else one by one where it does."""
    by_name = _TensorTable.of(tensors).by_name
    read_back = {read for d in plan.recomputes for read in d.swapped_reads}
    small = [d for d in plan.swaps if by_name[d.tensor].bytes < min_swap_bytes
             and d.tensor not in read_back]

    def without(dropped) -> Optional[MemoryDecisions]:
        swaps = tuple(d for d in plan.swaps if d not in dropped)
        prediction = predict(op_ms, tensors, model, swaps, persistent_bytes, plan.recomputes)
        if prediction.peak_bytes > budget_bytes or \
                prediction.step_ms > plan.prediction.step_ms + 1e-9:
            return None
        return MemoryDecisions(swaps, plan.recomputes, prediction)

    if small and (fewer := without(small)) is not None:
        return fewer
    for swap in small:
        plan = without([swap]) or plan
    return plan


@dataclasses.dataclass(frozen=True)
class _Recomputing:
    """What the planner knows of each tensor's recomputation, and how a set of them combine."""

    by_name: Mapping[str, TensorUse]
    cost_ms: Mapping[str, float]
    reads: Mapping[str, Collection[str]]
    direct_reads: Mapping[str, Collection[str]]
    transient_bytes: Mapping[str, int]

    def decisions(self, recomputed: Collection[str], swapped: Collection[str]):
        """The recomputations of `recomputed` in the order they run, each with its cost, the
        swapped tensors it reads and the one it is made with; and the tensors they read that
        must stay on the device. None if they cannot be made together: a tensor read through
        an alias is swapped or recomputed."""
        chosen = set(recomputed)
        order = sorted(chosen, key=lambda n: (self.by_name[n].backward_consumers[0],
                                               self.by_name[n].producer))
        rank = {name: i for i, name in enumerate(order)}
        made_with: dict[str, str] = {}
        decisions, pinned = [], set()
        for name in order:
            if name in made_with:
                decisions.append(RecomputeDecision(name, 0.0, made_with=made_with[name]))
                continue
            cost, transient, held, making = 0.0, 0, set(), [name]
            while making:
                current = making.pop()
                cost += self.cost_ms[current]
                transient = max(transient, self.transient_bytes.get(current, 0))
                direct = self.direct_reads.get(current, ())
                for read in self.reads.get(current, ()):
                    if read not in direct and (read in chosen or read in swapped):
                        return None
                    if read not in chosen:
                        held.add(read)
                        if read not in direct:
                            pinned.add(read)
                    elif read not in made_with and rank[read] > rank[name]:
                        made_with[read] = name
                        making.append(read)
            decisions.append(RecomputeDecision(name, cost, tuple(sorted(held & set(swapped))),
                                               transient_bytes=transient))
        return decisions, pinned


def _cheaper_than_a_swap_in(tensors, model, recomputing: _Recomputing, candidates) -> list[str]:
    """SuperNeurons' start: every kept tensor whose recomputation takes less time than copying
    it back in (activations and normalizations; on an H100 over PCIe, convolution outputs too),
    largest first, unless what it reads is itself recomputed."""
    chosen, pinned = [], set()
    for tensor in sorted(tensors, key=lambda t: -t.bytes):
        cost = recomputing.cost_ms.get(tensor.name)
        reads = set(recomputing.reads.get(tensor.name, ()))
        if cost is None or not tensor.bytes or tensor.name in pinned or \
                (candidates is not None and tensor.name not in candidates) or \
                cost >= tensor.bytes / model.host_to_device * 1e3 or reads & set(chosen):
            continue
        chosen.append(tensor.name)
        pinned |= reads
    return chosen


def _greedy(op_ms, tensors, model, budget_bytes, persistent_bytes, recomputing: _Recomputing,
            candidates, prefetch_point, candidates_per_round,
            recomputed: list[str]) -> MemoryDecisions:
    by_name = recomputing.by_name

    def outcome(swaps, recomputed):
        """The prediction with these swaps and recomputations, and the decisions as made (the
        swaps a recomputation reads brought back in time for it); None if they cannot be."""
        made = recomputing.decisions(recomputed, {d.tensor for d in swaps})
        if made is None:
            return None
        decisions = made[0]
        due = _due(by_name, decisions)
        swaps = [d if d.prefetch_after < _needed_by(by_name[d.tensor], due)
                 else SwapDecision(d.tensor, bring_back(by_name[d.tensor], due[d.tensor] - 1))
                 for d in swaps]
        if any(d.prefetch_after < by_name[d.tensor].last_forward_use for d in swaps):
            return None
        return (predict(op_ms, tensors, model, swaps, persistent_bytes, decisions), swaps,
                recomputed, made[1])

    def bring_back(tensor, index):
        return prefetch_point(tensor, index) if prefetch_point is not None else index

    first = outcome([], recomputed)
    if first is None:
        raise ValueError("the recomputations to start from cannot be made together")
    prediction, swaps, recomputed, pinned = first
    lowest = prediction  # what a BudgetError reports: the smallest shortfall of any round
    while prediction.peak_bytes > budget_bytes:
        lowest = min(lowest, prediction, key=lambda p: p.peak_bytes)
        swapped = {d.tensor for d in swaps}
        due = _due(by_name, recomputing.decisions(recomputed, swapped)[0])
        alive = sorted((t for t in tensors if t.backward_consumers and t.bytes
                        and t.device == prediction.peak_device
                        and (candidates is None or t.name in candidates)
                        and t.name not in swapped and t.name not in recomputed
                        and t.name not in pinned
                        and t.producer <= prediction.peak_op <= t.consumers[-1]),
                       key=lambda t: -t.bytes)[:candidates_per_round]
        options = []
        for i, decision in enumerate(swaps):
            tensor = by_name[decision.tensor]
            if tensor.device != prediction.peak_device:
                continue
            first_use = _needed_by(tensor, due)
            # A swapped tensor already back at the peak may come back later instead.
            if decision.prefetch_after < prediction.peak_op < first_use:
                later = bring_back(tensor, first_use - 1)
                if later > decision.prefetch_after:
                    options.append(([*swaps[:i], *swaps[i + 1:], SwapDecision(tensor.name, later)],
                                    recomputed))
            # One still on the device at the peak, its copy out not done (the forward pass makes
            # tensors faster than the link drains them), may be recomputed instead.
            if tensor.producer <= prediction.peak_op < first_use and \
                    tensor.name in recomputing.cost_ms:
                options.append(([*swaps[:i], *swaps[i + 1:]], [*recomputed, tensor.name]))
        if not alive and not options:
            raise BudgetError(budget_bytes, lowest)
        for tensor in alive:
            first_use = _needed_by(tensor, due)
            for prefetch in {latest_hiding_prefetch(tensor, op_ms, model, first_use),
                             first_use - 1}:
                prefetch = bring_back(tensor, prefetch)
                if prefetch < tensor.last_forward_use:
                    continue  # no op the graph can use between its forward and backward uses
                options.append(([*swaps, SwapDecision(tensor.name, prefetch)], recomputed))
            if tensor.name in recomputing.cost_ms:
                options.append((swaps, [*recomputed, tensor.name]))
        outcomes = [o for o in (outcome(s, r) for s, r in options) if o is not None]
        if not outcomes:
            raise BudgetError(budget_bytes, lowest)

        # Choices that lower the peak first, cheapest per byte they free, then the shortest step;
        # if none does, the one that raises it least (a recomputation keeps what it reads).
        def value(outcome):
            freed = prediction.peak_bytes - outcome[0].peak_bytes
            cost = max(outcome[0].step_ms - prediction.step_ms, 0.0)
            return (freed <= 0, cost / freed if freed > 0 else -freed, outcome[0].step_ms)
        best = min(outcomes, key=value)
        # Swaps that each lower the peak at no cost are taken together, if together they still
        # cost nothing: one round instead of one each, when many transfers hide.
        free = {o[1][-1].tensor: o[1][-1] for o in outcomes
                if len(o[1]) > len(swaps) and len(o[2]) == len(recomputed)  # new swaps only
                and o[0].peak_bytes < prediction.peak_bytes
                and o[0].step_ms <= prediction.step_ms + 1e-9}
        if len(free) > 1:
            together = outcome([*swaps, *free.values()], recomputed)
            if together is not None and together[0].step_ms <= prediction.step_ms + 1e-9 and \
                    together[0].peak_bytes < best[0].peak_bytes:
                best = together
        prediction, swaps, recomputed, pinned = best
    decisions = recomputing.decisions(recomputed, {d.tensor for d in swaps})[0]
    return MemoryDecisions(tuple(swaps), tuple(decisions), prediction)


class BudgetError(ValueError):
    """The budget cannot be met; says by how much it is missed."""

    def __init__(self, budget_bytes: int, prediction: Prediction, tried: str = ""):
        self.budget_bytes = budget_bytes
        self.shortfall_bytes = prediction.peak_bytes - budget_bytes
        self.prediction = prediction
        super().__init__(
            f"the memory budget of {budget_bytes / 2**20:.1f} MiB cannot be met: "
            f"the predicted peak is {prediction.peak_bytes / 2**20:.1f} MiB at op "
            f"{prediction.peak_op}"
            + (f" on {prediction.peak_device}" if prediction.peak_device else "")
            + f", {self.shortfall_bytes / 2**20:.1f} MiB over, the lowest any choice of "
            "swaps and recomputations reached"
            + (f" (tried: {tried})" if tried else ""))
