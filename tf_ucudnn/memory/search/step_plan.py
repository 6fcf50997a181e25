"""The memory planner: a training step's swaps and recomputations under a memory budget, made.

From the step's liveness (tensors, sizes, execution order) and each op's time (measured where
given, else the device model's roofline), `plan_memory` chooses what to swap and what to recompute
so that the predicted peak fits the budget at the least predicted step time; the swap and
recomputation passes then change the graph accordingly. A budget that cannot be met raises
BudgetError, saying by how much, before anything runs.

Where no such plan fits, the step's first ops may run in micro-batches too: that search is
`memory.search.prefix_search`.
"""

from __future__ import annotations

import dataclasses
import os
import warnings
from typing import Mapping, NamedTuple, Optional

import tensorflow as tf
from tensorflow.core.framework import graph_pb2

from tf_ucudnn.core.step_memory_plan import StepMemoryPlan
from tf_ucudnn.core.units import format_bytes
from tf_ucudnn.graph.functions import callable_over
from tf_ucudnn.memory.analysis.liveness import (
    LivenessReport,
    analyze,
    buffer_of,
    kernel_scratch_bytes,
)
from tf_ucudnn.memory.analysis.tensor_use import tensor_bytes
from tf_ucudnn.memory.cost.device_model import DeviceModel
from tf_ucudnn.memory.cost.simulator import StepSimulator
from tf_ucudnn.memory.passes.recompute import CLONE, Recompute, insert_recomputes, recomputable
from tf_ucudnn.memory.passes.swap import Swap, insert_swaps
from tf_ucudnn.memory.search.greedy import (
    MemoryDecisions,
    plan_memory,
    without_cycle_collection,
)


@dataclasses.dataclass
class MemoryPlan(StepMemoryPlan):
    """The swaps and recomputations decided, and the predictions before and after."""

    budget_bytes: int
    liveness: LivenessReport
    decisions: MemoryDecisions
    swaps: list[Swap]
    recomputes: list[Recompute]
    # The bytes the simulator predicts held while each op of `liveness` runs, after the swaps
    # and recomputations, variables included: the planned step's own memory curve, whose most
    # is the predicted peak.
    live_bytes: list[int] = dataclasses.field(default_factory=list)

    kind = "swaps_and_recomputations"

    @property
    def predicted_peak_bytes(self) -> int:
        return self.decisions.prediction.peak_bytes

    def to_json(self) -> dict:
        return {"kind": self.kind, "budget_bytes": self.budget_bytes, "unplanned_peak_bytes":
                self.liveness.peak_bytes + self.liveness.persistent_bytes,
                "decisions": self.decisions.to_json(),
                "swaps": [dataclasses.asdict(s) for s in self.swaps],
                "recomputes": [dataclasses.asdict(r) for r in self.recomputes]}

    def to_text(self) -> str:
        prediction = self.decisions.prediction
        before = self.liveness.peak_bytes + self.liveness.persistent_bytes
        if self.swaps or self.recomputes:
            how = (f"{len(self.swaps)} swap(s) and {len(self.recomputes)} recomputation(s) lower "
                   f"the peak from {format_bytes(before)} to {format_bytes(prediction.peak_bytes)}")
        else:
            how = f"the peak of {format_bytes(prediction.peak_bytes)} fits, nothing swapped or " \
                  "recomputed"
        return (f"memory plan for a {format_bytes(self.budget_bytes)} budget: {how}; predicted "
                f"step {prediction.step_ms:.3f} ms, of which {prediction.exposed_transfer_ms:.3f} "
                "ms waiting for transfers")


def op_times(graph: tf.Graph, device_model: DeviceModel,
             measured_ms: Optional[Mapping[str, float]],
              step_ms: Optional[float]) -> list[float]:
    """Each op's time: measured where given, else the device model's roofline, scaled so that
    the step takes `step_ms` (a measurement of the whole step) if that is given."""
    measured_ms = measured_ms or {}
    operations = graph.get_operations()
    unmeasured = [op for op in operations if op.name not in measured_ms]
    estimated = dict(zip((op.name for op in unmeasured), device_model.ops_ms(unmeasured)))
    scale = 1.0
    if step_ms is not None and estimated:
        rest = step_ms - sum(measured_ms.get(op.name, 0.0) for op in operations)
        scale = max(rest, 0.0) / sum(estimated.values())
    return [measured_ms[op.name] if op.name in measured_ms else estimated[op.name] * scale
            for op in operations]


MAX_CHAIN = 8  # ops recomputed for one tensor at most (a batch norm and its activation fit)


class RecomputeChain(NamedTuple):
    cost_ms: float
    ops: tuple[str, ...]  # before the producer, in execution order
    reads: frozenset  # the held tensors (buffers) the chain reads: they must stay on the device
    # Those it reads as they are only, never through an alias: or be swapped, or made again too.
    direct_reads: frozenset
    # The largest output of its ops before the producer, not written over, or kernel buffer.
    transient_bytes: int


def _recompute_chains(graph: tf.Graph, report: LivenessReport,
                      op_ms) -> dict[str, RecomputeChain]:
    """For each kept tensor that can be made again: its cost and the ops before its producer to
    run again too (a chain back to tensors held until then anyway, or variables), read directly
    (not through an alias) by its backward readers."""
    operations = graph.get_operations()
    index = {op.name: i for i, op in enumerate(operations)}
    by_name = {t.name: t for t in report.tensors}
    chains = {}
    for tensor in report.kept():
        first_backward = tensor.backward_consumers[0]
        if not all(any(read.name == tensor.name for read in operations[i].inputs)
                   for i in tensor.backward_consumers):
            continue

        def held(read) -> bool:
            buffer = by_name.get(buffer_of(read))
            return (buffer is None or buffer.bytes == 0  # variables, constants, resources
                    or max(buffer.consumers, default=buffer.producer) >= first_backward)

        chain, reads, aliased, frontier, ok = [], set(), set(), [operations[tensor.producer]], True
        while frontier and ok:
            op = frontier.pop()
            if op.name in chain:
                continue
            if recomputable(op) is not None or len(chain) == MAX_CHAIN:
                ok = False
                break
            chain.append(op.name)
            frontier += [read.op for read in op.inputs if not held(read)]
            reads.update(buffer_of(read) for read in op.inputs if held(read))
            aliased.update(buffer_of(read) for read in op.inputs
                           if held(read) and buffer_of(read) != read.name)
        if ok:
            ordered = sorted(chain, key=index.get)
            cost = sum(op_ms[index[name]] for name in ordered)
            reads &= set(by_name)
            in_chain = set(ordered)
            transient = max([tensor_bytes(t) or 0 for name in ordered[:-1]
                             for t in operations[index[name]].outputs
                             if not _written_over(t, in_chain)]
                            + [kernel_scratch_bytes(operations[index[name]])
                               for name in ordered], default=0)
            chains[tensor.name] = RecomputeChain(cost, tuple(ordered[:-1]), frozenset(reads),
                                                 frozenset(reads - aliased), transient)
    return chains


@without_cycle_collection
def plan_step_memory(function, budget_bytes: int, device_model: DeviceModel,
                     measured_ms: Optional[Mapping[str, float]] = None,
                     step_ms: Optional[float] = None) -> MemoryPlan:
    """Plans a training step's memory (a ConcreteFunction with its gradient ops). `measured_ms`
    gives ops' measured times; `step_ms`, the measured time of the whole step without swaps,
    calibrates the others."""
    graph = function.graph
    report = analyze(function)
    op_ms = op_times(graph, device_model, measured_ms, step_ms)
    chains = _recompute_chains(graph, report, op_ms)
    operations = graph.get_operations()

    readers_inputs: dict[tuple, set] = {}  # asked once per option per round: read once
    after_forward = _after_forward(operations, report, op_ms)
    by_name = {t.name: t for t in report.tensors}
    # The readers of what a swap-in or recomputation feeds: the tensor's own, and those of the
    # tensors whose recomputation reads it (an anchor fused with one of these closes a cycle).
    fed_readers = {t.name: set(t.backward_consumers) for t in report.tensors}
    for name, chain in chains.items():
        for read in chain.reads:
            fed_readers[read] |= set(by_name[name].backward_consumers)
    fed_readers = {name: tuple(sorted(readers)) for name, readers in fed_readers.items()}

    def anchored(index: int, consumers: tuple) -> int:
        """The op at `index`, or the last one before it fit to start a swap-in or recomputation
        after. Not ops that can run before the forward pass ends (a shape read off a forward
        tensor is ready early, however late it comes in the graph's order, and TensorFlow's
        executor runs what is ready); not ops without inputs (constants run whenever the
        executor likes, so they time nothing); not stateful ones (variable reads get ordering
        edges of their own from tf.function); not ops sharing an input with a reader of the
        swapped tensor (TensorFlow's fusions, such as oneDNN's filter gradient with bias
        gradient, would merge the two and close a cycle through the swap-in)."""
        shared = readers_inputs.get(consumers)
        if shared is None:
            shared = readers_inputs[consumers] = {t.name for i in consumers
                                                  for t in operations[i].inputs}

        def unfit(op):
            return (op.name not in after_forward or not op.inputs or op.op_def.is_stateful
                    or any(t.dtype in (tf.resource, tf.variant) for t in op.inputs)
                    or any(t.name in shared for t in op.inputs))
        while index > 0 and unfit(operations[index]):
            index -= 1
        return index

    decisions = plan_memory(op_ms, report.tensors, device_model, budget_bytes,
                            persistent_bytes=report.persistent_bytes,
                            recompute_ms={name: chain.cost_ms for name, chain in chains.items()},
                            recompute_reads={name: chain.reads for name, chain in chains.items()},
                            direct_reads={name: chain.direct_reads
                                          for name, chain in chains.items()},
                            transient_bytes={name: chain.transient_bytes
                                             for name, chain in chains.items()},
                            candidates={t.name for t in report.kept()},
                            prefetch_point=lambda t, i: anchored(i, fed_readers[t.name]))

    position = {op.name: i for i, op in enumerate(operations)}

    def readers(buffer: str):
        """Backward readers of a buffer, grouped by the tensor (buffer or alias) they read; not
        the readers of an alias the backward pass makes (it reads the replacement itself)."""
        tensor = by_name[buffer]
        groups: dict[str, list[str]] = {}
        for index in tensor.backward_consumers:
            op = operations[index]
            for read in op.inputs:
                if buffer_of(read) == buffer and not report.ops[position[read.op.name]].backward:
                    groups.setdefault(read.name, []).append(op.name)
        return groups

    copied_out_before = dict(decisions.prediction.copied_out_before)
    latest = latest_inputs(operations)
    swaps = [Swap(read, tuple(dict.fromkeys(names)), operations[decision.prefetch_after].name,
                  _gate(operations, copied_out_before[decision.tensor]),
                  held_back(operations, latest, decision.prefetch_after))
             for decision in decisions.swaps
             for read, names in readers(decision.tensor).items()]
    made_along: dict[str, set] = {}  # a recomputation's ops for the tensors made on its way
    along_readers: dict[str, set] = {}  # and the readers of what those feed
    for along in decisions.recomputes:
        if along.made_with is not None:
            made_along.setdefault(along.made_with, set()).update(
                chains[along.tensor].ops, {operations[by_name[along.tensor].producer].name})
            along_readers.setdefault(along.made_with, set()).update(fed_readers[along.tensor])
    recomputes = []
    for decision in decisions.recomputes:  # in the order they run: makers before made along
        tensor = by_name[decision.tensor]
        if decision.made_with is None:
            chain = set(chains[decision.tensor].ops) | made_along.get(decision.tensor, set())
            fed = tuple(sorted({*fed_readers[decision.tensor],
                                *along_readers.get(decision.tensor, ())}))
            trigger = operations[anchored(tensor.backward_consumers[0] - 1, fed)].name
            chain = tuple(sorted(chain, key=position.get))
        else:
            trigger, chain = None, ()
        recomputes += [Recompute(read, tuple(dict.fromkeys(names)), trigger, chain)
                       for read, names in readers(decision.tensor).items()]
    live_bytes = StepSimulator(op_ms, report.tensors, device_model).live_bytes(
        decisions.swaps, report.persistent_bytes, decisions.recomputes)
    return MemoryPlan(budget_bytes, report, decisions, swaps, recomputes, live_bytes)


# Element-wise kernels that write their output over an input nobody else reads (TensorFlow's
# buffer forwarding), so that the input costs no memory of its own.
_IN_PLACE = {"Relu", "Relu6", "Elu", "Selu", "LeakyRelu", "BiasAdd", "Add", "AddV2", "Mul",
             "Sub", "Sigmoid", "Tanh"}


def _written_over(tensor: tf.Tensor, in_chain: set) -> bool:
    """Whether the chain's only reader of `tensor` writes its output over it: over one input
    the chain makes (of an addition of two, the other is held), the same shape as its output."""
    readers = [op for op in tensor.consumers() if op.name in in_chain]
    if len(readers) != 1 or readers[0].type not in _IN_PLACE:
        return False
    made = [t for t in readers[0].inputs if t.op.name in in_chain]
    return made[0].name == tensor.name and readers[0].outputs[0].shape == tensor.shape


def latest_inputs(operations) -> list[Optional[int]]:
    """For each op, the position of the last op it reads (data or control; -1 for none), not
    counting constants and what is made of them alone, which can run at any time: None for
    those."""
    position = {op.name: i for i, op in enumerate(operations)}
    latest: list[Optional[int]] = []
    for op in operations:
        reads = [position[o.name] for o in (*(t.op for t in op.inputs), *op.control_inputs)]
        # A control edge may come from an op made later (tf.function's automatic ones).
        made = [j for j in reads if j >= len(latest) or latest[j] is not None]
        constant = op.type != "Placeholder" and not made
        latest.append(None if constant else max(made, default=-1))
    return latest


def held_back(operations, latest: list[Optional[int]], index: int) -> tuple[str, ...]:
    """The ops after the one at `index` that read nothing made after it but constants: every
    later op but those constants waits for one of them, so holding these back holds back the
    rest of the step."""
    return tuple(operations[j].name for j in range(index + 1, len(operations))
                 if latest[j] is not None and latest[j] <= index)


def _gate(operations, index: int) -> Optional[str]:
    """The op at `index`, or the first after it that the executor cannot run at once."""
    while index < len(operations) and (not operations[index].inputs
                                       or operations[index].op_def.is_stateful):
        index += 1
    return operations[index].name if index < len(operations) else None


def _after_forward(operations, report: LivenessReport, op_ms) -> set:
    """The ops that cannot start before the forward pass ends: their earliest start, over their
    data and control inputs with these op times, is no earlier than the earliest the forward
    pass can end, but for the loss's own reduction (the gradient starts from the op before it:
    a 2% margin)."""
    index = {op.name: i for i, op in enumerate(operations)}
    earliest = [0.0] * len(operations)
    for i, op in enumerate(operations):
        before = [index[t.op.name] for t in op.inputs] + [index[c.name] for c in op.control_inputs]
        earliest[i] = max((earliest[j] + op_ms[j] for j in before), default=0.0)
    forward_end = max((earliest[i] + op_ms[i] for i, op in enumerate(report.ops)
                       if not op.backward), default=0.0)
    return {op.name for i, op in enumerate(operations) if earliest[i] >= 0.98 * forward_end}


def apply_memory_plan(function, plan: MemoryPlan):
    """The step with the plan's recomputations and swaps made, as a tf.function (see
    `planned_graph_def` for how to run it on a GPU)."""
    return callable_over(planned_graph_def(function, plan), function)


def planned_graph_def(function, plan: MemoryPlan) -> graph_pb2.GraphDef:
    """The step's graph with the plan's recomputations and swaps made.

    On a GPU, run it with Grappler's layout optimizer off
    (`tf.config.optimizer.set_experimental_options({"layout_optimizer": False})`): it turns the
    step to NCHW and keeps NHWC copies of the tensors around the swap nodes, which the plan does
    not count. And with TF_DISABLE_RZ_CHECK=1: the first step autotunes each of TensorFlow's
    convolutions into a copy of its output (with guard bytes, to catch cuDNN writing out of
    bounds), taken while memory allows and held beside the output, enough to put a planned step
    out of memory. And with TF_CUDNN_USE_AUTOTUNE=0, or room left beside the budget: the first
    step's autotuning takes scratch memory as the device allows, so that step peaks well above
    the plan, where a step without autotuning keeps to it. A warning says so when any of these
    is left on."""
    if tf.config.list_logical_devices("GPU"):
        if tf.config.optimizer.get_experimental_options().get("layout_optimizer", True):
            warnings.warn("Grappler's layout optimizer is on: on a GPU it adds copies the "
                          "memory plan does not count; turn it off with tf.config.optimizer."
                          "set_experimental_options({'layout_optimizer': False})")
        if os.environ.get("TF_DISABLE_RZ_CHECK") != "1":
            warnings.warn("TensorFlow's convolution autotuning holds a copy of each output the "
                          "memory plan does not count; set TF_DISABLE_RZ_CHECK=1 to go without")
        if os.environ.get("TF_CUDNN_USE_AUTOTUNE", "").lower() not in ("0", "false"):
            warnings.warn("TensorFlow's convolution autotuning takes scratch memory the memory "
                          "plan does not count in the first step; leave room beside the budget, "
                          "or set TF_CUDNN_USE_AUTOTUNE=0 (cuDNN's heuristics choose instead)")
    graph_def = insert_recomputes(function.graph.as_graph_def(), plan.recomputes, function.graph)
    return insert_swaps(graph_def, _with_clone_readers(
        graph_def, plan, function.graph.get_operations()))


def _with_clone_readers(graph_def, plan: MemoryPlan, operations) -> list[Swap]:
    """The plan's swaps, a swapped tensor's copy back also read by the recomputations that read
    it (their clones read the original, which is off the device by then)."""
    swapped_reads = {read for d in plan.decisions.recomputes for read in d.swapped_reads}
    if not swapped_reads:
        return list(plan.swaps)
    by_tensor = {swap.tensor: swap for swap in plan.swaps}
    decision = {d.tensor: d for d in plan.decisions.swaps}
    copied_out_before = dict(plan.decisions.prediction.copied_out_before)
    swaps, latest = list(plan.swaps), None
    for read in swapped_reads:
        probe = Swap(read, ())
        clones = tuple(node.name for node in graph_def.node
                       if CLONE in node.name and probe.input_names() & set(node.input))
        if not clones:
            continue
        if read in by_tensor:
            own = by_tensor[read]
            swaps[swaps.index(own)] = dataclasses.replace(
                own, backward_consumers=own.backward_consumers + clones)
        else:
            latest = latest if latest is not None else latest_inputs(operations)
            swaps.append(Swap(read, clones, operations[decision[read].prefetch_after].name,
                              _gate(operations, copied_out_before[read]),
                              held_back(operations, latest, decision[read].prefetch_after)))
    return swaps
