"""A step's tensors as arrays, and a tuple of recomputations prepared once against them: what
the simulator reads for every prediction of a search, worked out ahead."""

from __future__ import annotations

import dataclasses
from typing import Mapping, Sequence

import numpy as np

from tf_ucudnn.memory.analysis.tensor_use import TensorUse


@dataclasses.dataclass(frozen=True)
class TensorTable:
    """The tensors' names, producers, last readers, sizes and last forward readers, as
    arrays."""

    tensors: Sequence[TensorUse]
    by_name: Mapping[str, TensorUse]
    index: Mapping[str, int]
    producers: np.ndarray
    lasts: np.ndarray
    sizes: np.ndarray
    last_forward_uses: np.ndarray
    device_names: tuple[str, ...]
    devices: np.ndarray  # indices into device_names
    first_backward: Mapping[str, int]  # of the tensors kept for the backward pass

    @classmethod
    def of(cls, tensors: Sequence[TensorUse]) -> "TensorTable":
        names = tuple(sorted({t.device for t in tensors})) or ("",)
        return cls(
            tensors, {t.name: t for t in tensors}, {t.name: i for i, t in enumerate(tensors)},
            np.array([t.producer for t in tensors], dtype=int),
            np.array([max(t.consumers, default=t.producer) for t in tensors], dtype=int),
            np.array([t.bytes for t in tensors], dtype=np.int64),
            np.array([t.last_forward_use for t in tensors], dtype=int), names,
            np.array([names.index(t.device) for t in tensors], dtype=int),
            {t.name: t.backward_consumers[0] for t in tensors if t.backward_consumers})


PREPARED_KEPT = 64  # tuples of recomputations prepared and kept: a round's few


@dataclasses.dataclass(frozen=True)
class PreparedRecomputes:
    """What a tuple of recomputations decides of a prediction, whatever is swapped: the costs of
    those run before each op, the swapped tensors each op waits for, and the rows and transient
    tensors of the pieces they are held in."""

    recomputed_before: Mapping[int, list[float]]  # op -> the costs of those run before it
    waits: Mapping[int, list[str]]  # op -> swapped tensors a recomputation before it reads
    # The recomputed tensors' rows in the table: those recomputed on their own in the order
    # they run, then those made with another, whose positions among the first are `owners`.
    rows: np.ndarray
    owners: tuple[int, ...]
    due: Mapping[str, int]
    cost_ms: float
    transient_positions: np.ndarray  # among `rows`, of those with a transient tensor
    transient_rows: np.ndarray
    transient_bytes: np.ndarray
    transient_ms: np.ndarray

    @classmethod
    def of(cls, table: TensorTable, recomputes: Sequence):  # simulator.RecomputeDecision
        first_backward, index = table.first_backward, table.index
        # One pass over the decisions, then one over those on their own in the order they run
        # (by the op they run before, in the order given for the same op): a search prepares
        # thousands of tuples of a few hundred.
        running, made_with, waits, cost_ms = [], [], {}, 0
        due: dict[str, int] = {}  # as due_times: most read nothing swapped, and are skipped
        for i, decision in enumerate(recomputes):
            cost_ms += decision.cost_ms  # in the order given, as sum() adds them
            if decision.made_with is None:
                running.append((first_backward[decision.tensor], i))
            else:
                made_with.append(decision)
            if decision.swapped_reads:
                when = first_backward[decision.tensor]
                for read in decision.swapped_reads:
                    waits.setdefault(when, []).append(read)
                    due[read] = min(due.get(read, first_backward[read]), when)
        running.sort()
        recomputed_before: dict[int, list[float]] = {}
        position, rows, transient = {}, [], []
        for rank, (op, i) in enumerate(running):
            decision = recomputes[i]
            recomputed_before.setdefault(op, []).append(decision.cost_ms)
            position[decision.tensor] = rank
            rows.append(index[decision.tensor])
            if decision.transient_bytes:
                transient.append((rank, decision))
        for rank, decision in enumerate(made_with, len(running)):
            rows.append(index[decision.tensor])
            if decision.transient_bytes:
                transient.append((rank, decision))
        return cls(
            recomputed_before, waits, np.array(rows, dtype=int),
            tuple(position[d.made_with] for d in made_with), due, cost_ms,
            np.array([i for i, _ in transient], dtype=int),
            np.array([index[d.tensor] for _, d in transient], dtype=int),
            np.array([d.transient_bytes for _, d in transient], dtype=np.int64),
            np.array([d.cost_ms for _, d in transient], dtype=float))
