"""The simulator: predicted step time and peak memory of a training step for a set of swap
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
from typing import Mapping, Optional, Sequence

import numpy as np

from tf_ucudnn.memory.cost.device_model import DeviceModel


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
    table = TensorTable.of(tensors)
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
    due = due_times(by_name, recomputes)
    chosen = {}
    for swap in swaps:
        tensor = by_name.get(swap.tensor)
        if tensor is None or not tensor.backward_consumers:
            raise ValueError(f"{swap.tensor}: not a tensor kept for the backward pass")
        first_backward = needed_by(tensor, due)
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
class TensorTable:
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
    def of(cls, tensors: Sequence[TensorUse]) -> "TensorTable":
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


_last_table: Optional[TensorTable] = None  # the planner's tensors, predicted over and over


def needed_by(tensor: TensorUse, due: Mapping[str, int]) -> int:
    """The first op that needs a swapped tensor back: `due`'s, or its first backward reader."""
    return due.get(tensor.name, tensor.backward_consumers[0])


def due_times(by_name: Mapping[str, TensorUse], recomputes) -> dict[str, int]:
    """For each swapped tensor a recomputation reads, the first op it is needed by: its own
    first backward reader, or the reader of a tensor recomputed from it, if earlier."""
    due: dict[str, int] = {}
    for decision in recomputes:
        when = by_name[decision.tensor].backward_consumers[0]
        for read in decision.swapped_reads:
            due[read] = min(needed_by(by_name[read], due), when)
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

