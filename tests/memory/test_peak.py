"""The simulator's peak from per-op allocations and frees against the plain sweep over every
tensor, on random steps: op times with waits between them (whose rounding lets an op end an ulp
after the next starts), ops of no duration, ties, and pieces held at any time."""

import numpy as np
import pytest

from tf_ucudnn.memory.analysis.tensor_use import TensorUse
from tf_ucudnn.memory.cost.device_model import DeviceModel
from tf_ucudnn.memory.cost.op_start_peaks import OpStartPeaks, RangeMax
from tf_ucudnn.memory.cost.peaks import peak_from_op_events, swept_peak
from tf_ucudnn.memory.cost.simulator import (
    RecomputeDecision,
    StepSimulator,
    SwapDecision,
    due_times,
    predict,
)


def _random_step(rng, ops: int, tensors: int, zero_durations: bool):
    durations = rng.uniform(0.001, 3.0, ops)
    if zero_durations:
        durations[rng.random(ops) < 0.2] = 0.0
    delay = np.where(rng.random(ops) < 0.1, rng.uniform(0.0, 5.0, ops), 0.0)
    start = np.concatenate([[0.0], np.cumsum(durations)])[:-1] + np.cumsum(delay)
    end = start + durations
    producers = rng.integers(0, ops, tensors)
    lasts = np.minimum(producers + rng.geometric(0.3, tensors) - 1, ops - 1)
    sizes = rng.integers(0, 1000, tensors).astype(np.int64)
    pieces = rng.integers(0, 30)
    piece_starts = rng.uniform(0.0, end[-1], pieces)
    # Some pieces start where an op does, and some end before they start (not held).
    piece_starts[: pieces // 3] = start[rng.integers(0, ops, pieces // 3)]
    piece_ends = piece_starts + rng.uniform(-1.0, 10.0, pieces)
    piece_sizes = rng.integers(1, 2000, pieces).astype(np.int64)
    return start, end, producers, lasts, sizes, piece_starts, piece_ends, piece_sizes


@pytest.mark.parametrize("zero_durations", [False, True])
def test_the_peak_from_op_events_is_the_sweep_s(zero_durations):
    rng = np.random.default_rng(7)
    checked = 0
    for _ in range(300):
        start, end, producers, lasts, sizes, piece_starts, piece_ends, piece_sizes = \
            _random_step(rng, int(rng.integers(1, 40)), int(rng.integers(1, 60)), zero_durations)
        allocated = np.bincount(producers, sizes, minlength=len(start)).astype(np.int64)
        freed = np.bincount(lasts, sizes, minlength=len(start)).astype(np.int64)
        found = peak_from_op_events(start, end, allocated, freed, piece_starts, piece_ends,
                                    piece_sizes)
        swept = swept_peak(np.concatenate([start[producers], piece_starts]),
                           np.concatenate([end[lasts], piece_ends]),
                           np.concatenate([sizes, piece_sizes]))
        if found is not None:
            assert found == swept
            checked += 1
    assert checked > 200  # None where ops of no duration end an ulp before the last one


def test_an_op_ending_an_ulp_after_the_next_starts_holds_both_s_tensors():
    """The sweep's times as computed: with the rounding of a wait, op 0 ends after op 1 starts,
    so what op 0 frees and op 1 allocates are held together for that ulp."""
    start = np.array([0.0, 0.30000000000000004])
    end = np.array([0.30000000000000010, 1.0])
    allocated, freed = np.array([100, 50]), np.array([100, 50])
    none = np.array([])
    assert peak_from_op_events(start, end, allocated, freed, none, none,
                               none.astype(np.int64)) == (150, start[1])
    assert swept_peak(np.array([0.0, start[1]]), end, np.array([100, 50])) == (150, start[1])


def test_times_out_of_order_are_left_to_the_sweep():
    start, end = np.array([0.0, 2.0]), np.array([3.0, 2.5])  # op 1 ends before op 0
    none = np.array([])
    assert peak_from_op_events(start, end, np.array([1, 1]), np.array([1, 1]), none, none,
                               none.astype(np.int64)) is None


def test_a_simulator_predicts_as_predict_does_for_each_set_of_decisions():
    """One StepSimulator, asked again and again, as a fresh prediction each time."""
    link = DeviceModel("test", device_to_host=1e5, host_to_device=1e5)
    op_ms = [1.0, 0.0, 2.0, 1.0, 0.5, 1.0, 1.0, 0.0]
    tensors = [TensorUse("A", 100, 0, (1, 6), (6,)), TensorUse("B", 80, 1, (2, 5), (5,)),
               TensorUse("C", 30, 2, (3, 4), (4,)), TensorUse("D", 0, 3, (7,)),
               TensorUse("E", 60, 2, (3,), device="/GPU:1")]
    simulator = StepSimulator(op_ms, tensors, link)
    decisions = [((), ()), ((SwapDecision("A", 3),), ()),
                 ((), (RecomputeDecision("B", 0.7, transient_bytes=40),)),
                 ((SwapDecision("A", 4),), (RecomputeDecision("C", 0.2),))]
    for swaps, recomputes in decisions * 2:
        assert simulator.predict(swaps, 5, recomputes) == \
            predict(op_ms, tensors, link, swaps, 5, recomputes)


def test_range_max_is_the_most_and_its_first_index_over_any_stretch():
    rng = np.random.default_rng(3)
    for length in (1, 2, 3, 7, 64, 100):
        values = rng.integers(-5, 5, length)  # ties: the first is wanted
        table = RangeMax(values)
        begins = rng.integers(0, length, 200)
        ends = begins + 1 + rng.integers(0, length - begins)
        most, first = table.query(begins, ends)
        for b, e, m, f in zip(begins, ends, most, first):
            assert m == values[b:e].max() and f == b + int(np.argmax(values[b:e]))


@pytest.mark.parametrize("waits", [False, True])
def test_the_peak_at_op_starts_is_the_peak_from_op_events_s(waits):
    """With tensors moved into pieces, on steps whose waits' rounding lets ops end an ulp after
    the next starts (checked to happen), and against the sweep where those events cannot tell."""
    rng = np.random.default_rng(11)
    late = checked = 0
    for _ in range(300):
        ops, count = int(rng.integers(1, 50)), int(rng.integers(1, 80))
        durations = rng.uniform(0.005, 3.0, ops)
        delay = np.where(rng.random(ops) < 0.3, rng.uniform(0.0, 5.0, ops), 0.0) if waits \
            else np.zeros(ops)
        start = np.concatenate([[0.0], np.cumsum(durations)])[:-1] + np.cumsum(delay)
        end = start + durations
        late += int(np.any(end[:-1] > start[1:]))
        producers = rng.integers(0, ops, count)
        lasts = np.minimum(producers + rng.geometric(0.3, count) - 1, ops - 1)
        sizes = rng.integers(0, 1000, count).astype(np.int64)
        allocated = np.bincount(producers, sizes, minlength=ops).astype(np.int64)
        freed = np.bincount(lasts, sizes, minlength=ops).astype(np.int64)
        moved = np.flatnonzero(rng.random(count) < 0.3)
        pieces = int(rng.integers(0, 20))
        piece_starts = rng.uniform(0.0, end[-1], pieces)
        piece_starts[: pieces // 2] = start[rng.integers(0, ops, pieces // 2)]
        piece_ends = piece_starts + rng.uniform(-1.0, 10.0, pieces)
        piece_ends[: pieces // 4] = end[rng.integers(0, ops, pieces // 4)]
        piece_sizes = rng.integers(1, 2000, pieces).astype(np.int64)
        ordered = OpStartPeaks.in_order(float(durations.min()), start, end)
        assert ordered  # as the passes below confirm
        assert not (np.any(end <= start) or np.any(start[1:] <= start[:-1])
                    or np.any(end[1:] < end[:-1]))
        found = OpStartPeaks(allocated, freed).peak(
            start, end, ordered, producers[moved], lasts[moved], sizes[moved], piece_starts,
            piece_ends, piece_sizes)
        kept_allocated, kept_freed = allocated.copy(), freed.copy()
        np.subtract.at(kept_allocated, producers[moved], sizes[moved])
        np.subtract.at(kept_freed, lasts[moved], sizes[moved])
        expected = peak_from_op_events(start, end, kept_allocated, kept_freed, piece_starts,
                                       piece_ends, piece_sizes)
        kept = np.setdiff1d(np.arange(count), moved)
        swept = swept_peak(np.concatenate([start[producers[kept]], piece_starts]),
                           np.concatenate([end[lasts[kept]], piece_ends]),
                           np.concatenate([sizes[kept], piece_sizes]))
        assert found == expected
        if found is not None:
            assert found == swept
            checked += 1
    assert checked > 250
    assert late > 20 if waits else late == 0


def test_times_out_of_order_are_not_answered_at_op_starts():
    start, end = np.array([0.0, 2.0]), np.array([3.0, 2.5])  # op 1 ends before op 0
    # Where an op may take no time, the times are not surely in order.
    assert not OpStartPeaks.in_order(0.0, start, end)
    assert not OpStartPeaks.in_order(0.0, np.array([0.0, 1.0]), np.array([1.0, 2.0]))
    assert OpStartPeaks.in_order(0.5, np.array([0.0, 1.0]), np.array([1.0, 2.0]))
    none = np.array([], dtype=int)
    assert OpStartPeaks(np.array([1, 1]), np.array([1, 1])).peak(
        start, end, False, none, none, none, np.array([]), np.array([]), none) is None


def test_a_simulator_predicts_alike_checked_or_not_and_with_decisions_kept_or_anew():
    """Unchecked, and with a tuple of recomputations asked about again (prepared once), as a
    list (prepared each time) and fresh."""
    link = DeviceModel("test", device_to_host=1e5, host_to_device=1e5)
    op_ms = [1.0, 0.5, 2.0, 1.0, 0.5, 1.0, 1.0, 0.3]
    tensors = [TensorUse("A", 100, 0, (1, 6), (6,)), TensorUse("B", 80, 1, (2, 4), (4,)),
               TensorUse("C", 30, 2, (3, 4, 5), (4, 5)), TensorUse("D", 0, 3, (7,))]
    simulator = StepSimulator(op_ms, tensors, link)
    cases = [((SwapDecision("A", 3),), (RecomputeDecision("B", 0.7, transient_bytes=40),
                                        RecomputeDecision("C", 0.0, made_with="B"))),
             ((SwapDecision("A", 4), SwapDecision("C", 3)),
              (RecomputeDecision("B", 0.2, swapped_reads=("C",)),))]
    for swaps, recomputes in cases * 2:
        fresh = predict(op_ms, tensors, link, swaps, 5, recomputes)
        assert simulator.predict(swaps, 5, recomputes, check=False) == fresh
        assert simulator.predict(list(swaps), 5, list(recomputes)) == fresh
        assert simulator.due_times(recomputes) == due_times(simulator.table.by_name, recomputes)


def test_an_op_starting_an_ulp_early_is_the_peak_where_it_ties_a_later_op():
    """Op 1 starts an ulp before op 0 ends, so op 0's tensor and op 1's are held together: as
    many bytes as op 2 holds later; the peak is the earlier."""
    start, end = np.array([0.0, 1.0, 2.0]), np.array([np.nextafter(1.0, 2.0), 2.0, 3.0])
    allocated, freed = np.array([100, 100, 100]), np.array([100, 0, 200])
    none = np.array([], dtype=int)
    assert OpStartPeaks.in_order(1.0, start, end)
    found = OpStartPeaks(allocated, freed).peak(start, end, True, none, none, none,
                                                np.array([]), np.array([]), none)
    assert found == peak_from_op_events(start, end, allocated, freed, np.array([]),
                                        np.array([]), none) == (200, 1.0)
