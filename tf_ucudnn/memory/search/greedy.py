"""The memory decision: which tensors a training step swaps to the host and which it recomputes,
so that its peak fits a budget at the least predicted time (a greedy search over the simulator's
predictions, as AccUDNN and SuperNeurons plan).
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import itertools
from typing import Callable, Collection, Mapping, Optional, Sequence

from tf_ucudnn.core.errors import TfUcudnnError
from tf_ucudnn.core.units import format_bytes
from tf_ucudnn.memory.analysis.tensor_use import TensorUse
from tf_ucudnn.memory.cost.device_model import DeviceModel
from tf_ucudnn.memory.cost.simulator import (
    Prediction,
    RecomputeDecision,
    StepSimulator,
    SwapDecision,
    latest_hiding_prefetch,
    needed_by,
)


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
# these in turn: its path turns on near-ties of cost per byte freed, so a change in the op times
# far below their precision can decide whether a plan under a tight budget is found at all.
_RESTART_SCALES = (0.995, 1.005, 0.99, 1.01, 0.98, 1.02)


def without_cycle_collection(search):
    """`search` with Python's cycle collector paused while it runs: planning makes millions
    of short-lived objects and no reference cycles, and the collector, set off by their count,
    would walk every object the caller holds (traced TensorFlow graphs) again and again for
    nothing (0.7 s of planning ResNet-152 after two other models). Cycles made meanwhile are
    collected once it is back on."""
    @functools.wraps(search)
    def paused(*args, **kwargs):
        was_enabled = gc.isenabled()
        gc.disable()
        try:
            return search(*args, **kwargs)
        finally:
            if was_enabled:
                gc.enable()
    return paused


@without_cycle_collection
def plan_memory(op_ms: Sequence[float], tensors: Sequence[TensorUse], device_model: DeviceModel,
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
    def recomputing_at(scale: float) -> Recomputing:
        return Recomputing({t.name: t for t in tensors},
                           {name: ms * scale for name, ms in (recompute_ms or {}).items()},
                           recompute_reads or {}, direct_reads or {}, transient_bytes or {})
    recomputing = recomputing_at(1.0)
    simulator = StepSimulator(op_ms, tensors, device_model)

    def greedy_plans(scale: float) -> tuple[list[MemoryDecisions], list[BudgetError]]:
        """The plans the greedy choice finds from each start with the op times scaled, each
        predicted with the op times as they are (and dropped if it then misses the budget)."""
        scaled = recomputing_at(scale) if scale != 1.0 else recomputing
        scaled_simulator = simulator if scale == 1.0 else \
            StepSimulator([ms * scale for ms in op_ms], tensors, device_model)
        starts = [[]]
        cheap = _cheaper_than_a_swap_in(tensors, device_model, scaled, candidates)
        if cheap:
            starts.append(cheap)
        found, failed = [], []
        for recomputed in starts:
            try:
                plan = _greedy(scaled_simulator, budget_bytes, persistent_bytes, scaled,
                               candidates, prefetch_point, candidates_per_round, recomputed)
            except BudgetError as error:
                failed.append(error)
                continue
            if scale != 1.0:
                made = recomputing.decisions([d.tensor for d in plan.recomputes],
                                             {d.tensor for d in plan.swaps})[0]
                prediction = simulator.predict(plan.swaps, persistent_bytes, made)
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
        return _without_small_swaps(best, simulator, budget_bytes, persistent_bytes,
                                    budget_bytes // 10_000 if min_swap_bytes is None
                                    else min_swap_bytes)
    raise min(errors, key=lambda error: error.shortfall_bytes)


def _without_small_swaps(plan: MemoryDecisions, simulator: StepSimulator, budget_bytes: int,
                         persistent_bytes: int, min_swap_bytes: int) -> MemoryDecisions:
    """The plan less its swaps of tensors under `min_swap_bytes` that no recomputation reads
    back, all at once if it still fits the budget no slower, else one by one where it does."""
    by_name = simulator.table.by_name
    read_back = {read for d in plan.recomputes for read in d.swapped_reads}
    small = [d for d in plan.swaps if by_name[d.tensor].bytes < min_swap_bytes
             and d.tensor not in read_back]

    def without(dropped) -> Optional[MemoryDecisions]:
        swaps = tuple(d for d in plan.swaps if d not in dropped)
        prediction = simulator.predict(swaps, persistent_bytes, plan.recomputes)
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
class Recomputing:
    """What the planner knows of each tensor's recomputation, and how a set of them combine."""

    by_name: Mapping[str, TensorUse]
    cost_ms: Mapping[str, float]
    reads: Mapping[str, Collection[str]]
    direct_reads: Mapping[str, Collection[str]]
    transient_bytes: Mapping[str, int]
    # Sets of recomputations worked out, and their decisions: a round of the search predicts
    # its options over the same set, each with a swap more or less, and the next round starts
    # from the set of one of them.
    combined: dict = dataclasses.field(default_factory=dict, compare=False, repr=False)
    made: dict = dataclasses.field(default_factory=dict, compare=False, repr=False)

    def decisions(self, recomputed: Collection[str], swapped: Collection[str]):
        """The recomputations of `recomputed` in the order they run, each with its cost, the
        swapped tensors it reads and the one it is made with; and the tensors they read that
        must stay on the device. None if they cannot be made together: a tensor read through
        an alias is swapped or recomputed."""
        chosen = frozenset(recomputed)
        if chosen not in self.combined:
            _forget_beyond(self.combined, _REMEMBERED)
            # An option recomputes one tensor more than its round: from the round's set, worked
            # out already, only the recomputations linked to that one are worked out again.
            before = self.combined.get(frozenset(recomputed[:-1])) \
                if isinstance(recomputed, (list, tuple)) and recomputed else None
            extended = self._with_one_more(before, chosen, recomputed[-1]) \
                if before is not None else None
            self.combined[chosen] = extended if extended is not None else self._combine(chosen)
        combination = self.combined[chosen]
        if combination is None:
            return None
        swapped_reads = combination.every_read.intersection(swapped)
        if not combination.pinned.isdisjoint(swapped_reads):
            return None
        key = (chosen, swapped_reads)
        if key not in self.made:
            _forget_beyond(self.made, _REMEMBERED)
            # Most read nothing swapped: their decisions as made without swaps serve.
            self.made[key] = tuple(
                decision if held.isdisjoint(swapped_reads) else dataclasses.replace(
                    decision, swapped_reads=tuple(sorted(held & swapped_reads)))
                for decision, held, _ in combination.steps)
        return self.made[key], combination.pinned

    @functools.cached_property
    def running_order(self) -> dict[str, tuple[int, int]]:
        """The order recomputations run in, by tensor: before its first backward reader, in
        the order of the producers."""
        return {name: (tensor.backward_consumers[0], tensor.producer)
                for name, tensor in self.by_name.items() if tensor.backward_consumers}

    @functools.cached_property
    def readers(self) -> dict[str, set]:
        """The tensors whose recomputation reads each tensor."""
        readers: dict[str, set] = {}
        for name, reads in self.reads.items():
            for read in reads:
                readers.setdefault(read, set()).add(name)
        return readers

    def _combine(self, chosen: frozenset) -> Optional["_Combination"]:
        """How the recomputations of `chosen` combine, whatever is swapped: in the order they
        run, each's decision were nothing swapped, with the tensors it reads that are not
        recomputed and those of them it reads through an alias. None if one read through an
        alias is recomputed."""
        order = sorted(chosen, key=self.running_order.__getitem__)
        steps = self._steps(order, chosen, {name: i for i, name in enumerate(order)})
        return None if steps is None else _Combination(steps, order)

    def _steps(self, names: list, chosen: frozenset, rank: Mapping[str, int]) -> Optional[list]:
        """`_combine`'s steps of `names` (in the order they run), tensors of `chosen` whose
        recomputations read no recomputed tensor but theirs, nor are read by another's; None as
        there."""
        made_with: dict[str, str] = {}
        steps = []
        for name in names:
            if name in made_with:
                steps.append((RecomputeDecision(name, 0.0, made_with=made_with[name]),
                              frozenset(), frozenset()))
                continue
            cost, transient, held, pinned, making = 0.0, 0, set(), set(), [name]
            while making:
                current = making.pop()
                cost += self.cost_ms[current]
                transient = max(transient, self.transient_bytes.get(current, 0))
                direct = self.direct_reads.get(current, ())
                for read in self.reads.get(current, ()):
                    if read not in direct and read in chosen:
                        return None
                    if read not in chosen:
                        held.add(read)
                        if read not in direct:
                            pinned.add(read)
                    elif read not in made_with and rank[read] > rank[name]:
                        made_with[read] = name
                        making.append(read)
            steps.append((RecomputeDecision(name, cost, transient_bytes=transient),
                          frozenset(held), frozenset(pinned)))
        return steps

    def _with_one_more(self, before: "_Combination", chosen: frozenset,
                       added: str) -> Optional["_Combination"]:
        """`_combine(chosen)` from `before`, the combination of `chosen` less `added`, where the
        others keep their order (ties of the running order are in the set's order): only the
        recomputations linked to `added` (reading it or read by it, and so on) are worked out
        again, as those of other tensors neither make nor read them. None where the order
        changed, or where they cannot be made together (`_combine` then says so)."""
        order = sorted(chosen, key=self.running_order.__getitem__)
        position = order.index(added)
        if added in before.order or order[:position] + order[position + 1:] != before.order:
            return None
        linked, reached = {added}, [added]
        while reached:
            name = reached.pop()
            for other in (*self.reads.get(name, ()), *self.readers.get(name, ())):
                if other in chosen and other not in linked:
                    linked.add(other)
                    reached.append(other)
        rank = {name: i for i, name in enumerate(order)}
        worked_out = self._steps(sorted(linked, key=rank.__getitem__), chosen, rank)
        if worked_out is None:
            return None
        again = {step[0].tensor: step for step in worked_out}
        was = dict(zip(before.order, before.steps))
        return _Combination([again.get(name) or was[name] for name in order], order)


@dataclasses.dataclass(frozen=True)
class _Combination:
    """How a set of recomputations combine (`Recomputing._combine`)."""

    # In the order they run, each's decision were nothing swapped, with the tensors it reads
    # that are not recomputed and those of them it reads through an alias.
    steps: list
    order: list  # the recomputed tensors, in that order

    @functools.cached_property
    def pinned(self) -> frozenset:
        """The tensors read through an alias: these stay on the device."""
        return frozenset().union(*(pinned for _, _, pinned in self.steps))

    @functools.cached_property
    def every_read(self) -> frozenset:
        return frozenset().union(*(held for _, held, _ in self.steps))


_REMEMBERED = 256  # sets of recomputations (and their decisions) kept: a few rounds' options


def _forget_beyond(cache: dict, size: int) -> None:
    if len(cache) >= size:
        cache.clear()


def _cheaper_than_a_swap_in(tensors, device_model, recomputing: Recomputing,
                            candidates) -> list[str]:
    """SuperNeurons' start: every kept tensor whose recomputation takes less time than copying
    it back in (activations and normalizations; where the host link is slow next to the GPU's
    arithmetic, convolution outputs too), largest first, unless what it reads is itself
    recomputed."""
    chosen, pinned = [], set()
    for tensor in sorted(tensors, key=lambda t: -t.bytes):
        cost = recomputing.cost_ms.get(tensor.name)
        reads = set(recomputing.reads.get(tensor.name, ()))
        if cost is None or not tensor.bytes or tensor.name in pinned or \
                (candidates is not None and tensor.name not in candidates) or \
                cost >= tensor.bytes / device_model.host_to_device * 1e3 or reads & set(chosen):
            continue
        chosen.append(tensor.name)
        pinned |= reads
    return chosen


def _greedy(simulator: StepSimulator, budget_bytes, persistent_bytes,
            recomputing: Recomputing, candidates, prefetch_point, candidates_per_round,
            recomputed: list[str]) -> MemoryDecisions:
    by_name = recomputing.by_name
    op_ms, device_model = simulator.durations_list, simulator.device_model
    # The tensors a round may choose from, largest first (of equal sizes, in the step's order):
    # each round takes the first few alive at its peak and not chosen yet.
    choosable = sorted((t for t in simulator.table.tensors if t.backward_consumers and t.bytes
                        and (candidates is None or t.name in candidates)),
                       key=lambda t: -t.bytes)

    def outcome(swaps, recomputed):
        """The prediction with these swaps and recomputations, and the decisions as made (the
        swaps a recomputation reads brought back in time for it); None if they cannot be."""
        made = recomputing.decisions(recomputed, {d.tensor for d in swaps})
        if made is None:
            return None
        decisions = made[0]
        due = simulator.due_times(decisions)
        swaps = [d if d.prefetch_after < needed_by(by_name[d.tensor], due)
                 else SwapDecision(d.tensor, bring_back(by_name[d.tensor], due[d.tensor] - 1))
                 for d in swaps]
        if any(d.prefetch_after < by_name[d.tensor].last_forward_use for d in swaps):
            return None
        return (simulator.predict(swaps, persistent_bytes, decisions, check=False), swaps,
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
        due = simulator.due_times(recomputing.decisions(recomputed, swapped)[0])
        taken = swapped | set(recomputed) | pinned
        alive = list(itertools.islice(
            (t for t in choosable if t.device == prediction.peak_device
             and t.name not in taken and t.producer <= prediction.peak_op <= t.consumers[-1]),
            candidates_per_round))
        options = []
        for i, decision in enumerate(swaps):
            tensor = by_name[decision.tensor]
            if tensor.device != prediction.peak_device:
                continue
            first_use = needed_by(tensor, due)
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
            first_use = needed_by(tensor, due)
            for prefetch in {latest_hiding_prefetch(tensor, op_ms, device_model, first_use),
                             first_use - 1}:
                prefetch = bring_back(tensor, prefetch)
                if prefetch < tensor.last_forward_use:
                    continue  # no op the graph can use between its forward and backward uses
                options.append(([*swaps, SwapDecision(tensor.name, prefetch)], recomputed))
            if tensor.name in recomputing.cost_ms:
                options.append((swaps, [*recomputed, tensor.name]))
        # The same option may come twice (two prefetch points brought back to one op): it is
        # predicted once, the first kept, as the choice below would keep it.
        unique: dict[tuple, tuple] = {}
        for option in options:
            unique.setdefault((tuple(option[0]), tuple(option[1])), option)
        outcomes = [o for o in (outcome(s, r) for s, r in unique.values()) if o is not None]
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


class BudgetError(TfUcudnnError, ValueError):
    """The budget cannot be met; says by how much it is missed."""

    def __init__(self, budget_bytes: int, prediction: Prediction, tried: str = ""):
        self.budget_bytes = budget_bytes
        self.shortfall_bytes = prediction.peak_bytes - budget_bytes
        self.prediction = prediction
        super().__init__(
            f"the memory budget of {format_bytes(budget_bytes)} cannot be met: "
            f"the predicted peak is {format_bytes(prediction.peak_bytes)} at op "
            f"{prediction.peak_op}"
            + (f" on {prediction.peak_device}" if prediction.peak_device else "")
            + f", {format_bytes(self.shortfall_bytes)} over, the lowest any choice of "
            "swaps and recomputations reached"
            + (f" (tried: {tried})" if tried else ""))
