"""The peak of a step's memory from when its buffers are taken and freed: a sweep over
intervals, and the faster sweep over ops' allocations in execution order that the simulator
tries first."""

from __future__ import annotations

from typing import Optional

import numpy as np


def swept_peak(starts: np.ndarray, ends: np.ndarray, sizes: np.ndarray) -> tuple[int, float]:
    """Most bytes held at once by half-open [start, end) intervals, and when (the earliest
    time they are held), by a sweep over every allocation and free in time order."""
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


def peak_from_op_events(start: np.ndarray, end: np.ndarray, allocated: np.ndarray,
                        freed: np.ndarray, piece_starts: np.ndarray, piece_ends: np.ndarray,
                        piece_sizes: np.ndarray) -> Optional[tuple[int, float]]:
    """`swept_peak` of the tensors that ops allocate (`allocated[i]` bytes at `start[i]`) and
    free (`freed[i]` at `end[i]`), and of pieces held from `piece_starts` to `piece_ends`,
    without sorting the tensors: None where it cannot tell (op times out of order, or no bytes
    held).

    The bytes held at a time T, after what happens at T, are those allocated by T less those
    freed by T (an interval that starts and ends at once adds nothing). Their most is first
    reached at an allocation, at an op's start or a piece's: so the bytes held at each op's start
    and each piece's start are all the sweep needs. Where the ops' times interleave (each starts
    before it ends, and ends before the next starts) as they do but for ties, rounding or ops of
    no duration, the allocations by op i's start are ops 0..i's, and the frees ops 0..i-1's; the
    exceptions are looked up in the sorted times."""
    count = len(start)
    if not count or np.any(start[1:] < start[:-1]) or np.any(end[1:] < end[:-1]) or \
            np.any(end < start):
        return None
    held = piece_ends > piece_starts  # as in the sweep, pieces not held at all left out
    piece_starts, piece_ends, piece_sizes = piece_starts[held], piece_ends[held], piece_sizes[held]
    allocated_by = np.concatenate([[0], np.cumsum(allocated)])
    freed_by = np.concatenate([[0], np.cumsum(freed)])
    started, ended = np.arange(1, count + 1), np.arange(count)
    tied = np.flatnonzero(start[1:] == start[:-1])
    started[tied] = np.searchsorted(start, start[tied], "right")
    overlapping = np.flatnonzero((end <= start) | np.concatenate([[False], end[:-1] > start[1:]]))
    ended[overlapping] = np.searchsorted(end, start[overlapping], "right")
    held = allocated_by[started] - freed_by[ended]
    # The pieces held at each op's start: from the first op starting at or after each piece's
    # start, to the first at or after its end.
    change = np.zeros(count + 1, dtype=np.int64)
    np.add.at(change, np.searchsorted(start, piece_starts, "left"), piece_sizes)
    np.add.at(change, np.searchsorted(start, piece_ends, "left"), -piece_sizes)
    held += np.cumsum(change[:-1])
    # And at each piece's start: the ops' tensors and the pieces held then.
    by_start, by_end = np.argsort(piece_starts), np.argsort(piece_ends)
    pieces_started = np.concatenate([[0], np.cumsum(piece_sizes[by_start])])
    pieces_ended = np.concatenate([[0], np.cumsum(piece_sizes[by_end])])
    held_at_pieces = (
        allocated_by[np.searchsorted(start, piece_starts, "right")]
        - freed_by[np.searchsorted(end, piece_starts, "right")]
        + pieces_started[np.searchsorted(piece_starts[by_start], piece_starts, "right")]
        - pieces_ended[np.searchsorted(piece_ends[by_end], piece_starts, "right")])
    times = np.concatenate([start, piece_starts])
    held = np.concatenate([held, held_at_pieces])
    peak = int(held.max())
    if peak <= 0:
        return None
    return peak, float(times[held == peak].min())
