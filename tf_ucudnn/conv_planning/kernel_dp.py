"""The per-kernel dynamic program of μ-cuDNN: how to split one mini-batch into micro-batches.

With t(b, a) the measured time of algorithm a at micro-batch size b, the fastest way to run a
mini-batch of B samples under a workspace limit W is T(B), where

    T(0) = 0,    T(b) = min over sizes b' <= b and algorithms a with workspace(b', a) <= W
                        of T(b - b') + t(b', a).

Only the micro-batch sizes present in the timing table are used. Micro-batches run one after
another and share one workspace, so a plan needs the largest workspace of its micro-batches.
A plan runs all its micro-batches in one form (they share cuDNN's view of the op's tensors; see
`tf_ucudnn.core.plan.FORMS`), so the DP runs once over each form's timings, and the best wins.

The Pareto front of (time, workspace) over all limits is exact when the DP is run at every
distinct workspace value in the table: any plan whose largest workspace is w is no faster than
T under limit w, whose plan needs at most w. All those limits are solved in one vectorized pass.
"""

from __future__ import annotations

import dataclasses
from typing import Iterable, Optional, Sequence

import numpy as np

from tf_ucudnn.core.errors import TfUcudnnError
from tf_ucudnn.core.plan import (
    BACKPROP_FILTER,
    BACKPROP_INPUT,
    DIRECT,
    FORMS,
    FORWARD,
    KERNELS,
    KernelPlan,
    MicroBatch,
)
from tf_ucudnn.profiling.records import AlgorithmTiming, KernelTimings

# Algorithms whose results vary from run to run (they accumulate with atomics), per the cuDNN API
# reference's descriptions of cudnnConvolutionBwdDataAlgo_t and cudnnConvolutionBwdFilterAlgo_t;
# TensorFlow excludes the same ones when determinism is required. All forward algorithms are
# deterministic.
NONDETERMINISTIC_ALGORITHMS = {
    FORWARD: frozenset(),
    BACKPROP_INPUT: frozenset({0}),
    BACKPROP_FILTER: frozenset({0, 3}),
}


def is_deterministic(kernel: str, algo: int) -> bool:
    return algo not in NONDETERMINISTIC_ALGORITHMS[kernel]


def _usable_when_deterministic(kernel: str, timing: AlgorithmTiming) -> bool:
    # An engine configuration's determinism is what cuDNN's notes said when it was profiled;
    # one profiled before that was recorded is not trusted to be.
    if timing.algorithm.is_engine:
        return timing.deterministic is True
    return is_deterministic(kernel, timing.algo)


class NoFeasiblePlanError(TfUcudnnError, ValueError):
    """No sequence of measured micro-batches sums to the batch size within the workspace limit."""


@dataclasses.dataclass(frozen=True)
class KernelConfiguration:
    """A kernel plan with the time and workspace the measurements predict for it."""

    plan: KernelPlan
    time_ms: float
    workspace_bytes: int

    def to_json(self) -> dict:
        return {"plan": self.plan.to_json(), "time_ms": self.time_ms,
                "workspace_bytes": self.workspace_bytes}

    @classmethod
    def from_json(cls, data) -> "KernelConfiguration":
        return cls(KernelPlan.from_json(data["plan"]), float(data["time_ms"]),
                   int(data["workspace_bytes"]))


def fastest_configuration(kernel: str, timings: KernelTimings, batch_size: int,
                          workspace_limit: Optional[int] = None, *,
                          deterministic_only: bool = False,
                          micro_batch_sizes: Optional[Iterable[int]] = None,
                          call_overhead_ms: float = 0.0,
                          form: Optional[str] = None) -> KernelConfiguration:
    """The fastest plan for `batch_size` samples, each micro-batch within `workspace_limit` bytes.

    `micro_batch_sizes` restricts the sizes used (e.g. `[batch_size]` for the best undivided run);
    by default every size in `timings` may be used. `call_overhead_ms` is added per micro-batch:
    the host time of one call, which cuDNN's own timings leave out. `form` restricts the plan to
    that form (DIRECT: as TensorFlow's own convolution runs). Raises NoFeasiblePlanError if
    nothing fits.
    """
    tables = _candidate_tables(kernel, timings, batch_size, deterministic_only, micro_batch_sizes,
                               call_overhead_ms, form)
    limit = (max(table.largest_workspace for table in tables) if workspace_limit is None
             else workspace_limit)
    feasible = [c for table in tables for c in table.solve(np.array([limit], dtype=np.int64))
                if c is not None]
    if not feasible:
        table = tables[0]
        raise NoFeasiblePlanError(
            f"{kernel}: no micro-batches of sizes {table.sizes_text} sum to {batch_size} with "
            f"workspace <= {limit} bytes{table.filter_text}")
    return min(feasible, key=lambda c: (c.time_ms, c.workspace_bytes, FORMS.index(c.plan.form)))


def pareto_configurations(kernel: str, timings: KernelTimings, batch_size: int, *,
                          deterministic_only: bool = False,
                          micro_batch_sizes: Optional[Iterable[int]] = None,
                          call_overhead_ms: float = 0.0,
                          form: Optional[str] = None) -> tuple[KernelConfiguration, ...]:
    """The (time, workspace) Pareto front over all workspace limits: μ-cuDNN's desirable set,
    of plans in `form` where given (else in any).

    Sorted by workspace ascending, hence by time descending; no entry is dominated by another.
    """
    tables = _candidate_tables(kernel, timings, batch_size, deterministic_only, micro_batch_sizes,
                               call_overhead_ms, form)
    feasible = [c for table in tables for c in table.solve(table.distinct_workspaces)
                if c is not None]
    if not feasible:
        table = tables[0]
        raise NoFeasiblePlanError(f"{kernel}: no micro-batches of sizes {table.sizes_text} sum "
                                  f"to {batch_size}{table.filter_text}")
    front = []
    for configuration in sorted(feasible, key=lambda c: (c.workspace_bytes, c.time_ms,
                                                         FORMS.index(c.plan.form))):
        if not front or configuration.time_ms < front[-1].time_ms:
            front.append(configuration)
    return tuple(front)


def _candidate_tables(kernel: str, timings: KernelTimings, batch_size: int,
                      deterministic_only: bool, micro_batch_sizes: Optional[Iterable[int]],
                      call_overhead_ms: float,
                      form: Optional[str]) -> list["_CandidateTable"]:
    """One table per form a plan may take (in FORMS' order), each form's timings alone; `form`
    keeps that form only."""
    measured = {t.algorithm.form for ts in timings.values() for t in ts}
    forms = [form] if form is not None else [f for f in FORMS if f in measured] or [DIRECT]
    return [_CandidateTable(kernel, timings, batch_size, deterministic_only, micro_batch_sizes,
                            call_overhead_ms, each) for each in forms]


class _CandidateTable:
    """The timings of one form that may be used, as arrays: sizes descending, each size's
    algorithms."""

    def __init__(self, kernel: str, timings: KernelTimings, batch_size: int,
                 deterministic_only: bool, micro_batch_sizes: Optional[Iterable[int]],
                 call_overhead_ms: float = 0.0, form: str = DIRECT):
        if kernel not in KERNELS:
            raise ValueError(f"kernel must be one of {KERNELS}, got {kernel!r}")
        if not isinstance(batch_size, int) or batch_size <= 0:
            raise ValueError(f"batch size must be a positive int, got {batch_size!r}")
        allowed = None if micro_batch_sizes is None else set(micro_batch_sizes)
        if call_overhead_ms < 0:
            raise ValueError(f"call overhead must be non-negative, got {call_overhead_ms}")
        self.kernel = kernel
        self.batch_size = batch_size
        self.call_overhead_ms = call_overhead_ms
        self.filter_text = " using deterministic algorithms only" if deterministic_only else ""
        # Descending, so that of equally fast plans the DP keeps the one with fewer micro-batches.
        self.sizes: list[int] = []
        self.algorithms: list[list[AlgorithmTiming]] = []
        for size in sorted(timings, reverse=True):
            if size > batch_size or (allowed is not None and size not in allowed):
                continue
            usable = [t for t in timings[size] if t.algorithm.form == form and (
                not deterministic_only or _usable_when_deterministic(kernel, t))]
            if usable:
                self.sizes.append(size)
                self.algorithms.append(sorted(usable, key=lambda t: (t.workspace_bytes, t.time_ms,
                                                                     t.algorithm.order_key)))
        workspaces = [t.workspace_bytes for algos in self.algorithms for t in algos]
        self.distinct_workspaces = np.unique(np.array(workspaces, dtype=np.int64))
        self.largest_workspace = int(self.distinct_workspaces[-1]) if workspaces else 0
        self.sizes_text = str(sorted(self.sizes)) if self.sizes else "(none measured)"

    def solve(self, limits: np.ndarray) -> list[Optional[KernelConfiguration]]:
        """The DP at each workspace limit at once; None where no plan fits."""
        num_limits = len(limits)
        if not self.sizes:
            return [None] * num_limits
        # best_time[s, l]: fastest algorithm of size s within limit l (inf if none fits), and which.
        best_time = np.full((len(self.sizes), num_limits), np.inf)
        best_algo = np.zeros((len(self.sizes), num_limits), dtype=np.int64)
        for s, algos in enumerate(self.algorithms):
            workspaces = np.array([t.workspace_bytes for t in algos], dtype=np.int64)
            times = np.array([t.time_ms for t in algos])
            # Algorithms are sorted by workspace; the fastest among the first k is a running argmin.
            running_best = np.zeros(len(algos), dtype=np.int64)
            for k in range(1, len(algos)):
                previous = running_best[k - 1]
                running_best[k] = k if times[k] < times[previous] else previous
            fitting = np.searchsorted(workspaces, limits, side="right") - 1
            fits = fitting >= 0
            best_algo[s, fits] = running_best[fitting[fits]]
            best_time[s, fits] = times[best_algo[s, fits]]

        sizes = np.array(self.sizes, dtype=np.int64)
        columns = np.arange(num_limits)
        total = np.full((self.batch_size + 1, num_limits), np.inf)
        total[0] = 0.0
        choice = np.zeros((self.batch_size + 1, num_limits), dtype=np.int64)
        for b in range(1, self.batch_size + 1):
            first = int(np.searchsorted(-sizes, -b))  # first (largest) size <= b
            if first == len(sizes):
                continue
            candidates = best_time[first:] + self.call_overhead_ms + total[b - sizes[first:]]
            picked = np.argmin(candidates, axis=0)
            total[b] = candidates[picked, columns]
            choice[b] = first + picked

        configurations: list[Optional[KernelConfiguration]] = []
        for column in range(num_limits):
            if not np.isfinite(total[self.batch_size, column]):
                configurations.append(None)
                continue
            micro_batches, remaining = [], self.batch_size
            while remaining:
                s = int(choice[remaining, column])
                timing = self.algorithms[s][best_algo[s, column]]
                micro_batches.append((self.sizes[s], timing))
                remaining -= self.sizes[s]
            configurations.append(_configuration(micro_batches, self.call_overhead_ms))
        return configurations


def _configuration(micro_batches: Sequence[tuple[int, AlgorithmTiming]],
                   call_overhead_ms: float) -> KernelConfiguration:
    # Largest micro-batches first: a canonical order (the order does not change time or workspace).
    ordered = sorted(micro_batches, key=lambda mb: (-mb[0], mb[1].algorithm.order_key))
    return KernelConfiguration(
        plan=KernelPlan(tuple(MicroBatch(size, t.algorithm, t.workspace_bytes)
                              for size, t in ordered)),
        time_ms=float(sum(t.time_ms + call_overhead_ms for _, t in ordered)),
        workspace_bytes=max(t.workspace_bytes for _, t in ordered))
