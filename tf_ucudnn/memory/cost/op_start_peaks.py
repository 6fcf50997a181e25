"""The simulator's peak without a pass over every op per prediction: the bytes held at each op's
start with no tensor moved are summed once per step, and a prediction only corrects them where
its few swapped and recomputed tensors and their pieces change them.

A prediction moves a few hundred tensors of tens of thousands of ops: the bytes held at op i's
start are then the unmoved step's, less the moved tensors alive at i, plus the pieces held at i,
a correction constant between the few ops where a moved tensor or a piece begins or ends. The
most over each such stretch is the unmoved step's most there (a sparse table answers it at
once) plus the stretch's correction.
"""

from __future__ import annotations

from typing import Optional

import numpy as np


class RangeMax:
    """The most of an array over any [begin, end) and its first index there, each in two looks
    (a sparse table: the most over every stretch of a power-of-two length)."""

    def __init__(self, values: np.ndarray):
        levels, firsts = [values], [np.arange(len(values))]
        width = 1
        while 2 * width <= len(values):
            left, right = levels[-1][:-width], levels[-1][width:]
            take_left = left >= right  # of equal values, the first
            levels.append(np.where(take_left, left, right))
            firsts.append(np.where(take_left, firsts[-1][:-width], firsts[-1][width:]))
            width *= 2
        # Padded into one table, so that many stretches of different lengths are looked up
        # together; a padding cell is never read (a stretch's two looks lie inside it).
        self.values = np.zeros((len(levels), len(values)), dtype=values.dtype)
        self.firsts = np.zeros((len(levels), len(values)), dtype=int)
        for level, (most, first) in enumerate(zip(levels, firsts)):
            self.values[level, :len(most)] = most
            self.firsts[level, :len(first)] = first

    def query(self, begins: np.ndarray, ends: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """For each non-empty [begin, end), the most and the first index holding it."""
        levels = np.frexp(ends - begins)[1] - 1  # the largest power of two within the length
        seconds = ends - (1 << levels)
        left, right = self.values[levels, begins], self.values[levels, seconds]
        take_left = left >= right
        return (np.where(take_left, left, right),
                np.where(take_left, self.firsts[levels, begins], self.firsts[levels, seconds]))


class OpStartPeaks:
    """`peak_from_op_events` for one device's allocations and frees less a few moved tensors'
    (the same peak and time), where the ops' times are surely in order (`in_order`); None where
    they are not, to be left to it."""

    def __init__(self, allocated: np.ndarray, freed: np.ndarray):
        self.allocated_by = np.concatenate([[0], np.cumsum(allocated)])
        self.freed_by = np.concatenate([[0], np.cumsum(freed)])
        # Held at op i's start: allocated by ops 0..i, less freed by ops 0..i-1.
        self.held = self.allocated_by[1:] - self.freed_by[:-1]
        self.range_max = RangeMax(self.held)
        # And were op i-1 still running (the rounding of a wait): less freed by ops 0..i-2.
        self.held_late = self.held + np.concatenate([[0], np.asarray(freed)[:-1]])
        self.late_range_max = RangeMax(self.held_late)

    @staticmethod
    def in_order(shortest_ms: float, start: np.ndarray, end: np.ndarray) -> bool:
        """Whether the ops' times (the shortest op taking `shortest_ms`, each starting after
        the waits before it) are surely in order, each op ending after it starts, starting after
        the one before ends but for the rounding of a unit in the last place, and ending after
        it ends: where every op takes more than a few units in the last place of the step's end,
        rounding the sums of times cannot break the order, and no pass over the ops is needed."""
        return bool(len(start)) and shortest_ms > abs(end[-1]) * 2.0 ** -44  # 256 units

    def peak(self, start: np.ndarray, end: np.ndarray, ordered: bool, moved_producers: np.ndarray,
             moved_lasts: np.ndarray, moved_sizes: np.ndarray, piece_starts: np.ndarray,
             piece_ends: np.ndarray, piece_sizes: np.ndarray) -> Optional[tuple[int, float]]:
        """The most bytes held and when, with the moved tensors (their producers, last readers
        and sizes) held only in the pieces given; `ordered`, whether the times are in order
        (`in_order`), else None."""
        count = len(start)
        if not ordered:
            return None
        held = piece_ends > piece_starts  # as in the sweep, pieces not held at all left out
        piece_starts, piece_ends = piece_starts[held], piece_ends[held]
        piece_sizes = piece_sizes[held]
        # The correction, by the op where each change takes effect: a moved tensor is not held
        # from its producer to its last reader; a piece is held at the starts of the ops from
        # the first starting at or after its start to the first at or after its end.
        piece_from = np.searchsorted(start, piece_starts, "left")
        at = np.concatenate([[0], moved_producers, moved_lasts + 1, piece_from,
                             np.searchsorted(start, piece_ends, "left"), [count]])
        changes = np.concatenate([[0], -moved_sizes, moved_sizes, piece_sizes, -piece_sizes, [0]])
        # In the order of the ops they take effect at: the stretches between are those where
        # the correction holds (each's correction is the sum up to its last change).
        by_op = np.argsort(at)
        at, correction = at[by_op], np.cumsum(changes[by_op])
        stretch = np.flatnonzero(at[:-1] < at[1:])
        begins, ends, correction = at[stretch], at[stretch + 1], correction[stretch]
        most, first = self.range_max.query(begins, ends)
        values, times = [most + correction], [start[first]]
        by_last = np.argsort(moved_lasts)
        lasts, sizes_by_last = moved_lasts[by_last], \
            np.concatenate([[0], np.cumsum(moved_sizes[by_last])])

        # At each piece's start: the ops' tensors allocated and freed by then (less the moved
        # ones'), and the pieces held then. Not where a piece starts as an op does: the bytes
        # held then are that op's.
        between = start[np.minimum(piece_from, count - 1)] != piece_starts
        if np.any(between):
            by_producer = np.argsort(moved_producers)
            producers = moved_producers[by_producer]
            sizes_by_producer = np.concatenate([[0], np.cumsum(moved_sizes[by_producer])])
            by_start, by_end = np.argsort(piece_starts), np.argsort(piece_ends)
            pieces_started = np.concatenate([[0], np.cumsum(piece_sizes[by_start])])
            pieces_ended = np.concatenate([[0], np.cumsum(piece_sizes[by_end])])
            looked_at = piece_starts[between]
            allocated = np.searchsorted(start, looked_at, "right")
            freed = np.searchsorted(end, looked_at, "right")
            values.append(
                self.allocated_by[allocated]
                - sizes_by_producer[np.searchsorted(producers, allocated, "left")]
                - self.freed_by[freed] + sizes_by_last[np.searchsorted(lasts, freed, "left")]
                + pieces_started[np.searchsorted(piece_starts[by_start], looked_at, "right")]
                - pieces_ended[np.searchsorted(piece_ends[by_end], looked_at, "right")])
            times.append(looked_at)

        # An op starting an ulp before the one before ends (the rounding of a wait) also holds
        # what that one frees (no earlier op's: each takes far longer than an ulp). Looked at
        # only in the stretches where that could reach the most found so far.
        floor = max(v.max() for v in values)
        late_most = self.late_range_max.query(begins, ends)[0] + correction
        hot = np.flatnonzero(late_most >= floor)
        late = np.concatenate([
            np.flatnonzero(end[b - 1:e - 1] > start[b:e]) + b
            for b, e in zip(np.maximum(begins[hot], 1).tolist(), ends[hot].tolist())] or
            [np.zeros(0, dtype=int)])
        if len(late):
            freed_then = sizes_by_last[np.searchsorted(lasts, late, "left")] - \
                sizes_by_last[np.searchsorted(lasts, late - 1, "left")]  # moved, last read there
            values.append(self.held_late[late] - freed_then
                          + correction[np.searchsorted(begins, late, "right") - 1])
            times.append(start[late])
        values, times = np.concatenate(values), np.concatenate(times)
        peak = int(values.max())
        if peak <= 0:
            return None
        return peak, float(times[values == peak].min())
