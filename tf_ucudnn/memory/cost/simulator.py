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
import os
from typing import Mapping, NamedTuple, Optional, Sequence

import numpy as np

from tf_ucudnn.memory.analysis.tensor_use import TensorUse
from tf_ucudnn.memory.cost.device_model import DeviceModel
from tf_ucudnn.memory.cost.op_start_peaks import OpStartPeaks
from tf_ucudnn.memory.cost.peaks import peak_from_op_events, swept_peak
from tf_ucudnn.memory.cost.tensor_table import PREPARED_KEPT, PreparedRecomputes, TensorTable

try:  # `StepSimulator.predict`'s inner loop, compiled (cc/memory/step_simulator.cc)
    from tf_ucudnn import _step_simulator
except ImportError:  # not built (pybind11 was missing when tf_ucudnn was): numpy predicts alone
    _step_simulator = None


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


def predict(op_ms: Sequence[float], tensors: Sequence[TensorUse], device_model: DeviceModel,
            swaps: Sequence[SwapDecision] = (), persistent_bytes: int = 0,
            recomputes: Sequence[RecomputeDecision] = ()) -> Prediction:
    """Step time and peak memory of the ops (in execution order) with these decisions.

    The ops run one after another, as on one stream; tensors on different devices (their
    `device`) count towards their own device's peak, and the highest is the step's. Variables
    (`persistent_bytes`) count on every device, as each holds the weights it uses. A search
    predicting many sets of decisions for the same step keeps a StepSimulator instead."""
    return StepSimulator(op_ms, tensors, device_model).predict(swaps, persistent_bytes,
                                                               recomputes)


class StepSimulator:
    """`predict` for one step's ops and tensors, with what does not depend on the decisions made
    once (the op times as arrays, each op's allocations and frees): a search predicts thousands
    of sets of decisions for the same step.

    Two implementations predict alike, to the bit: the compiled one (`native`, used where it was
    built), as numpy spends most of a prediction in call overheads, and the numpy one here, the
    reference that one is tested against and the fallback where it is not built (or where
    TF_UCUDNN_SIMULATOR=numpy asks for it, to compare the two)."""

    def __init__(self, op_ms: Sequence[float], tensors: Sequence[TensorUse],
                 device_model: DeviceModel):
        self.device_model = device_model
        self.table = TensorTable.of(tensors)
        self.durations = np.asarray(op_ms, dtype=float)
        self.prefix = np.concatenate([[0.0], np.cumsum(self.durations)])
        self.compute_ms = float(self.durations.sum())
        self.shortest_ms = float(self.durations.min(initial=np.inf))
        # The event loop reads a few of these at a time: Python floats are quicker to read, and
        # their arithmetic is the arrays' (IEEE doubles).
        self.durations_list = self.durations.tolist()
        self.prefix_list = self.prefix.tolist()
        self.prepared: dict[int, tuple] = {}  # id of a tuple of recomputations -> `_prepared`
        self.native = _native_step(self.durations, self.prefix, self.table, device_model)

    # What only the numpy predictions read, made when they first need it (the compiled simulator
    # keeps its own): per device, the bytes each op allocates (of the tensors it makes) and frees
    # (of those it reads last), as if every tensor were held from its producer to its last
    # reader, and their running sums, for each prediction's peak without a pass over the ops.
    @functools.cached_property
    def allocated_and_freed(self) -> tuple[np.ndarray, np.ndarray]:
        shape = (len(self.table.device_names), len(self.durations))
        allocated, freed = np.zeros(shape, np.int64), np.zeros(shape, np.int64)
        np.add.at(allocated, (self.table.devices, self.table.producers), self.table.sizes)
        np.add.at(freed, (self.table.devices, self.table.lasts), self.table.sizes)
        return allocated, freed

    @functools.cached_property
    def op_start_peaks(self) -> list[OpStartPeaks]:
        return [OpStartPeaks(allocated, freed)
                for allocated, freed in zip(*self.allocated_and_freed)]

    def predict(self, swaps: Sequence[SwapDecision] = (), persistent_bytes: int = 0,
                recomputes: Sequence[RecomputeDecision] = (), check: bool = True) -> Prediction:
        """As the module's `predict`, for this step. `check=False` skips checking that the
        decisions can be made (the planner's own, made so): checking takes a tenth of the time
        of a prediction the search makes thousands of."""
        if check:
            self._check(swaps, recomputes)
        made = self._prepared(recomputes)
        if self.native is not None:
            step_ms, peak, peak_op, transfer_ms, copied_out_before, peak_device = \
                self.native.predict(swaps, made)
            return Prediction(step_ms=step_ms, compute_ms=self.compute_ms + made.cost_ms,
                              peak_bytes=peak + persistent_bytes, peak_op=peak_op,
                              transfer_ms=transfer_ms, copied_out_before=copied_out_before,
                              peak_device=self.table.device_names[peak_device])
        return self._predict_with_numpy(swaps, persistent_bytes, made)

    def live_bytes(self, swaps: Sequence[SwapDecision] = (), persistent_bytes: int = 0,
                   recomputes: Sequence[RecomputeDecision] = ()) -> list[int]:
        """The bytes held on the device of the predicted peak while each op runs, with these
        decisions and `persistent_bytes` of variables: the most held from the end of the op
        before to its own end (a wait or recomputation before an op is that op's, as for
        `Prediction.peak_op`). Its most is `predict`'s peak: the curve a plan's timeline draws."""
        device = self.table.device_names.index(
            self.predict(swaps, persistent_bytes, recomputes).peak_device)
        # The numpy schedule, whichever predicts: the two predict alike.
        made = PreparedRecomputes.of(self.table, recomputes)
        schedule = self._schedule(swaps, made)
        table, start, end = self.table, schedule.start, schedule.end
        plain = np.ones(len(table.sizes), dtype=bool)
        plain[schedule.moved] = False
        plain &= table.devices == device
        pieces = schedule.piece_devices == device
        starts = np.concatenate([start[table.producers[plain]], schedule.piece_starts[pieces]])
        ends = np.concatenate([end[table.lasts[plain]], schedule.piece_ends[pieces]])
        sizes = np.concatenate([table.sizes[plain], schedule.piece_sizes[pieces]])
        held = ends > starts  # as in `swept_peak`, what is held for no time is left out
        if not held.any():
            return [persistent_bytes] * len(end)
        times = np.concatenate([starts[held], ends[held]])
        changes = np.concatenate([sizes[held], -sizes[held]])
        order = np.argsort(times, kind="stable")
        times, totals = times[order], np.cumsum(changes[order])
        # What is held at a time is the total after all that happens then.
        settled = np.append(times[1:] != times[:-1], True)
        times, totals = times[settled], totals[settled]
        # Each op's stretch of time starts where the op before ends; what is held as it starts
        # is what the events before left, where none happens at that very time.
        stretch_starts = np.concatenate([[-np.inf], end[:-1]])
        before = np.searchsorted(times, stretch_starts, "left")
        curve = np.where(before > 0, totals[np.maximum(before - 1, 0)], 0)
        curve[times[np.minimum(before, len(times) - 1)] == stretch_starts] = 0
        owner = np.minimum(np.searchsorted(end, times, "right"), len(end) - 1)
        np.maximum.at(curve, owner, totals)
        return (curve + persistent_bytes).tolist()

    def _predict_with_numpy(self, swaps: Sequence[SwapDecision], persistent_bytes: int,
                            made: "PreparedRecomputes") -> Prediction:
        table, by_name = self.table, self.table.by_name
        (start, end, ordered, moved, piece_starts, piece_ends, piece_sizes, piece_devices,
         chosen, out_done, transfer) = self._schedule(swaps, made)
        if len(table.device_names) == 1:
            (peak, peak_time), peak_device = self._device_peak(
                0, start, end, ordered, moved, piece_starts, piece_ends, piece_sizes), 0
        else:
            peak, peak_time, peak_device = max(
                (*self._device_peak(d, start, end, ordered, moved, *(
                    pieces[piece_devices == d]
                    for pieces in (piece_starts, piece_ends, piece_sizes))), d)
                for d in range(len(table.device_names)))
        # The op running at the peak or, in a wait or recomputation before an op, that op.
        running = int(np.searchsorted(end, peak_time, "right")) if ordered else \
            int(np.argmax(peak_time < end)) if np.any(peak_time < end) else len(end)
        peak_op = min(running, len(end) - 1)
        copied_out = np.searchsorted(start, np.array([out_done[name] for name in chosen],
                                                     dtype=float) - 1e-9).tolist()
        copied_out_before = tuple(
            (name, min(max(after, by_name[name].last_forward_use + 1),
                       by_name[name].backward_consumers[0]))
            for name, after in zip(chosen, copied_out))
        return Prediction(step_ms=float(end[-1]) if len(end) else 0.0,
                          compute_ms=self.compute_ms + made.cost_ms,
                          peak_bytes=peak + persistent_bytes, peak_op=peak_op,
                          transfer_ms=transfer, copied_out_before=copied_out_before,
                          peak_device=table.device_names[peak_device])

    def _schedule(self, swaps: Sequence[SwapDecision],
                  made: "PreparedRecomputes") -> "_Schedule":
        """When each op runs with these decisions, and the pieces the swapped and recomputed
        tensors are held in (the numpy prediction's, and `live_bytes`')."""
        table, by_name, device_model = self.table, self.table.by_name, self.device_model
        chosen = {swap.tensor: swap for swap in swaps}
        produced_by: dict[int, list[TensorUse]] = {}
        prefetched_at: dict[int, list[TensorUse]] = {}
        waits = dict(made.waits)
        for name, swap in chosen.items():
            tensor = by_name[name]
            produced_by.setdefault(tensor.producer, []).append(tensor)
            prefetched_at.setdefault(swap.prefetch_after, []).append(tensor)
            for consumer in tensor.backward_consumers:
                waits[consumer] = [*waits.get(consumer, ()), name]

        # Only ops that wait, or start or end a transfer, need a look of their own; the others
        # run back to back, so times are prefix sums shifted by the waits before them.
        durations, prefix = self.durations_list, self.prefix_list
        recomputed_before = made.recomputed_before
        # The shift after each op that waits: the ops from it to the next such op share it.
        delayed, shifts, recomputed_at = [0], [0.0], []
        shift = 0.0
        out_done, in_start, in_done = {}, {}, {}
        d2h_free = h2d_free = transfer = 0.0
        for i in sorted({*waits, *recomputed_before, *produced_by, *prefetched_at}):
            clock = prefix[i] + shift
            ready = clock
            for name in waits.get(i, ()):
                if in_done[name] > ready:
                    ready = in_done[name]
            for cost in recomputed_before.get(i, ()):
                recomputed_at.append(ready)
                ready += cost
            if ready != clock:
                shift += ready - clock
                delayed.append(i)
                shifts.append(shift)
            end_i = ready + durations[i]
            for tensor in produced_by.get(i, ()):
                copy = tensor.bytes / device_model.device_to_host * 1e3
                out_done[tensor.name] = d2h_free = max(d2h_free, end_i) + copy
                transfer += copy
            for tensor in prefetched_at.get(i, ()):
                copy = tensor.bytes / device_model.host_to_device * 1e3
                begin = max(h2d_free, end_i, out_done[tensor.name])
                in_start[tensor.name], in_done[tensor.name] = begin, begin + copy
                h2d_free = begin + copy
                transfer += copy
        # (The shifts are the running sums of the waits, as np.cumsum would add them.)
        start = self.prefix[:-1] + np.repeat(shifts, np.diff([*delayed, len(durations)]))
        end = start + self.durations
        ordered = OpStartPeaks.in_order(self.shortest_ms, start, end)
        # A tensor made with another is recomputed when that one is.
        recomputed_at.extend(recomputed_at[owner] for owner in made.owners)

        # The swapped and recomputed tensors are held in two spans each (and a recomputation's
        # transient tensor briefly): pieces of their own, in place of their whole lives.
        swapped_rows = np.array([table.index[name] for name in chosen], dtype=int)
        moved = np.concatenate([swapped_rows, made.rows])
        held_until = np.concatenate([  # a swapped tensor also until a recomputation reads it
            np.maximum(table.lasts[swapped_rows],
                       np.array([made.due.get(name, -1) for name in chosen], dtype=int)),
            table.lasts[made.rows]])
        out_until = end[table.last_forward_uses[moved]]
        out_until[:len(chosen)] = np.maximum(out_until[:len(chosen)],
                                             [out_done[name] for name in chosen])
        back_from = np.array([*(in_start[name] for name in chosen), *recomputed_at],
                             dtype=float)
        transient_from = back_from[len(chosen) + made.transient_positions]
        piece_starts = np.concatenate([start[table.producers[moved]], back_from, transient_from])
        piece_ends = np.concatenate([out_until, end[held_until],
                                     transient_from + made.transient_ms])
        piece_sizes = np.concatenate([table.sizes[moved], table.sizes[moved],
                                      made.transient_bytes])
        piece_devices = np.concatenate([table.devices[moved], table.devices[moved],
                                        table.devices[made.transient_rows]])
        return _Schedule(start, end, ordered, moved, piece_starts, piece_ends, piece_sizes,
                         piece_devices, chosen, out_done, transfer)

    def due_times(self, recomputes: Sequence[RecomputeDecision]) -> dict[str, int]:
        """The module's `due_times` for these recomputations (worked out once per tuple)."""
        return self._prepared(recomputes).due

    def _check(self, swaps: Sequence[SwapDecision], recomputes: Sequence[RecomputeDecision]):
        """Raises ValueError where the decisions cannot be made together."""
        by_name = self.table.by_name
        swapped = {swap.tensor for swap in swaps}
        made_with = {}
        for decision in recomputes:
            tensor = by_name.get(decision.tensor)
            if tensor is None or not tensor.backward_consumers:
                raise ValueError(f"{decision.tensor}: not a tensor kept for the backward pass")
            if decision.tensor in swapped:
                raise ValueError(f"{decision.tensor}: both swapped and recomputed")
            if decision.made_with is not None:
                made_with[decision.tensor] = decision.made_with
        recomputed = {d.tensor for d in recomputes}
        for name, owner in made_with.items():
            maker = by_name.get(owner)
            if owner in made_with or owner not in recomputed or \
                    maker.backward_consumers[0] > by_name[name].backward_consumers[0]:
                raise ValueError(f"{name}: made with {owner}, which must be a tensor recomputed "
                                 "on its own, no later than this one is needed")
        due = due_times(by_name, recomputes)
        for swap in swaps:
            tensor = by_name.get(swap.tensor)
            if tensor is None or not tensor.backward_consumers:
                raise ValueError(f"{swap.tensor}: not a tensor kept for the backward pass")
            first_backward = needed_by(tensor, due)
            if not tensor.last_forward_use <= swap.prefetch_after < first_backward:
                raise ValueError(f"{swap.tensor}: the prefetch op must come after its last "
                                 f"forward use ({tensor.last_forward_use}) and before its first "
                                 f"backward use ({first_backward}), got {swap.prefetch_after}")
        for decision in recomputes:
            for read in decision.swapped_reads:
                if read not in swapped:
                    raise ValueError(f"{decision.tensor}: its recomputation reads {read} back "
                                     "from the host, but it is not swapped")

    def _prepared(self, recomputes: Sequence[RecomputeDecision]) -> "PreparedRecomputes":
        """What the recomputations alone decide, kept for the last few tuples asked about: a
        round of the search predicts most of its options with the same tuple. (A list may
        change between calls: worked out anew.)"""
        if not isinstance(recomputes, tuple):
            return self._prepare(recomputes)
        key = id(recomputes)
        found = self.prepared.get(key)
        if found is not None and found[0] is recomputes:
            return found[1]
        if len(self.prepared) >= PREPARED_KEPT:
            self.prepared.clear()
        made = self._prepare(recomputes)
        self.prepared[key] = (recomputes, made)  # the tuple kept too: its id stays its own
        return made

    def _prepare(self, recomputes: Sequence[RecomputeDecision]):
        """`PreparedRecomputes.of`, or the compiled loop's own (with the same `due` and
        `cost_ms`)."""
        if self.native is not None:
            return self.native.prepare(recomputes)
        return PreparedRecomputes.of(self.table, recomputes)

    def _device_peak(self, device: int, start: np.ndarray, end: np.ndarray, ordered: bool,
                     moved: np.ndarray, piece_starts: np.ndarray, piece_ends: np.ndarray,
                     piece_sizes: np.ndarray) -> tuple[int, float]:
        """One device's peak and when, as `swept_peak` finds it: the tensors but `moved` (rows
        of the table) held from their producer's start to their last reader's end, and the
        pieces of the others. `ordered`: the ops' times are in order (`OpStartPeaks.in_order`)."""
        table = self.table
        moved = moved[table.devices[moved] == device]
        found = self.op_start_peaks[device].peak(
            start, end, ordered, table.producers[moved], table.lasts[moved], table.sizes[moved],
            piece_starts, piece_ends, piece_sizes)
        if found is not None:
            return found
        allocated, freed = (per_device[device].copy() for per_device in self.allocated_and_freed)
        np.subtract.at(allocated, table.producers[moved], table.sizes[moved])
        np.subtract.at(freed, table.lasts[moved], table.sizes[moved])
        found = peak_from_op_events(start, end, allocated, freed, piece_starts, piece_ends,
                                    piece_sizes)
        if found is not None:
            return found
        plain = np.ones(len(table.sizes), dtype=bool)
        plain[moved] = False
        plain &= table.devices == device
        return swept_peak(np.concatenate([start[table.producers[plain]], piece_starts]),
                          np.concatenate([end[table.lasts[plain]], piece_ends]),
                          np.concatenate([table.sizes[plain], piece_sizes]))


class _Schedule(NamedTuple):
    """`StepSimulator._schedule`'s answer: each op's start and end, whether they are surely in
    order, the rows of the swapped and recomputed tensors, the pieces these are held in, the
    swaps by tensor, when each copy out ends, and the copy engines' busy time."""

    start: np.ndarray
    end: np.ndarray
    ordered: bool
    moved: np.ndarray
    piece_starts: np.ndarray
    piece_ends: np.ndarray
    piece_sizes: np.ndarray
    piece_devices: np.ndarray
    chosen: dict
    out_done: dict
    transfer: float


def _native_step(durations: np.ndarray, prefix: np.ndarray, table: TensorTable,
                 device_model: DeviceModel):
    """The compiled simulator's copy of what does not depend on the decisions; None where it is
    not built, or TF_UCUDNN_SIMULATOR=numpy asks for the numpy one."""
    if _step_simulator is None or os.environ.get("TF_UCUDNN_SIMULATOR") == "numpy":
        return None
    backward = [t.backward_consumers for t in table.tensors]
    return _step_simulator.Step(
        durations, prefix, table.producers, table.lasts, table.sizes, table.last_forward_uses,
        np.cumsum([0, *map(len, backward)]), [op for ops in backward for op in ops],
        table.devices, len(table.device_names), dict(table.index),
        [t.name for t in table.tensors], device_model.device_to_host,
        device_model.host_to_device)


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


def latest_hiding_prefetch(tensor: TensorUse, op_ms: Sequence[float],
                           device_model: DeviceModel, due: Optional[int] = None) -> int:
    """The latest op after which the swap-in still ends before the first backward use (or the
    op `due`), on an idle copy engine: as late as possible to hold the memory briefly, early
    enough to hide."""
    copy = tensor.bytes / device_model.host_to_device * 1e3
    covered = 0.0
    first_use = tensor.backward_consumers[0] if due is None else due
    for prefetch in range(first_use - 1, tensor.last_forward_use - 1, -1):
        if covered >= copy:
            return prefetch
        covered += op_ms[prefetch]
    return tensor.last_forward_use

