"""The compiled step simulator (cc/memory/step_simulator.cc) against the numpy one it stands in
for: the same predictions to the bit, on random steps and sets of decisions (swaps with any
prefetch point, recomputations made alone or with another, reading swapped tensors, with
transient tensors; several devices, ops of no time, ties) and along searches on a real step."""

import dataclasses

import numpy as np
import pytest
from training_steps import SLOW_LINK, conv_training_step

from tf_ucudnn.memory.analysis.liveness import analyze
from tf_ucudnn.memory.analysis.tensor_use import TensorUse
from tf_ucudnn.memory.cost.device_model import DeviceModel
from tf_ucudnn.memory.cost.simulator import (
    RecomputeDecision,
    StepSimulator,
    SwapDecision,
    due_times,
    latest_hiding_prefetch,
    needed_by,
)
from tf_ucudnn.memory.search.greedy import BudgetError, MemoryDecisions, plan_memory
from tf_ucudnn.memory.search.step_plan import op_times, plan_step_memory

# Slow links make transfers wait; fast ones hide them.
LINKS = [DeviceModel("slow", device_to_host=1e5, host_to_device=2e5),
         DeviceModel("fast", device_to_host=3e7, host_to_device=2.5e7)]


@pytest.fixture
def simulators(monkeypatch):
    """make(op_ms, tensors, model): the compiled simulator and the numpy one, for one step."""
    monkeypatch.delenv("TF_UCUDNN_SIMULATOR", raising=False)

    def make(op_ms, tensors, model):
        native = StepSimulator(op_ms, tensors, model)
        if native.native is None:
            pytest.skip("the compiled step simulator is not built (pybind11 was missing when "
                        "tf_ucudnn was built)")
        with monkeypatch.context() as numpy_only:
            numpy_only.setenv("TF_UCUDNN_SIMULATOR", "numpy")
            reference = StepSimulator(op_ms, tensors, model)
        assert reference.native is None
        return native, reference
    return make


def assert_same(found, expected):
    """Equal, and as printed: the same doubles bit for bit (0.0 and -0.0 too)."""
    assert found == expected
    assert repr(found) == repr(expected)
    assert [type(v) for v in dataclasses.astuple(found)] == \
        [type(v) for v in dataclasses.astuple(expected)]


def _random_step(rng, zero_durations: bool, devices: int):
    """Ops of a forward pass then a backward pass; tensors read forward and, some, backward."""
    ops = int(rng.integers(2, 70))
    backward_from = int(rng.integers(1, ops))
    if rng.random() < 0.5:
        op_ms = rng.uniform(0.001, 3.0, ops)
    else:  # a few times: ties of starts, ends and sums
        op_ms = rng.choice([0.1, 0.25, 0.5, 1.0, 1.5], ops)
    if zero_durations:
        op_ms[rng.random(ops) < 0.2] = 0.0
    names = ["", "/GPU:1", "/GPU:2"][:devices]
    tensors = []
    for i in range(int(rng.integers(1, 80))):
        producer = int(rng.integers(0, ops))
        forward = rng.integers(producer + 1, backward_from + 1, int(rng.integers(0, 3))) \
            if producer + 1 <= backward_from else []
        forward = [int(c) for c in forward if c < backward_from]
        backward = []
        if producer < backward_from and rng.random() < 0.7:
            backward = sorted({int(c) for c in rng.integers(backward_from, ops,
                                                             int(rng.integers(1, 4)))})
        size = int(rng.choice([0, 64, 100, int(rng.integers(1, 5000))]))
        tensors.append(TensorUse(f"t{i}", size, producer, (*forward, *backward), tuple(backward),
                                 device=str(rng.choice(names))))
    return [float(ms) for ms in op_ms], tensors


def _random_decisions(rng, op_ms, tensors, model):
    """Swaps and recomputations that can be made together, in a random order."""
    kept = [t for t in tensors if t.backward_consumers]
    rng.shuffle(kept)
    swapped = kept[:int(rng.integers(0, len(kept) + 1))]
    recomputed = [t for t in kept if t not in swapped and rng.random() < 0.5]
    swapped_names = {t.name for t in swapped}
    alone, recomputes = [], []
    for tensor in recomputed:
        first = tensor.backward_consumers[0]
        owners = [o for o in alone if o.backward_consumers[0] <= first]
        made_with = owners[int(rng.integers(0, len(owners)))].name \
            if owners and rng.random() < 0.3 else None
        if made_with is None:
            alone.append(tensor)
        # It may read swapped tensors that can be back before it runs.
        reads = tuple(t.name for t in swapped
                      if t.last_forward_use < first and rng.random() < 0.3)
        cost = 0.0 if made_with is not None and rng.random() < 0.7 else \
            float(rng.choice([0.0, 0.5, float(rng.uniform(0.0, 2.0))]))
        transient = int(rng.choice([0, 0, 30, int(rng.integers(1, 3000))]))
        recomputes.append(RecomputeDecision(tensor.name, cost, reads, made_with, transient))
    rng.shuffle(recomputes)
    due = due_times({t.name: t for t in tensors}, recomputes)
    swaps = []
    for tensor in swapped:
        latest = needed_by(tensor, due) - 1
        prefetch = int(rng.choice([tensor.last_forward_use, latest,
                                   int(rng.integers(tensor.last_forward_use, latest + 1)),
                                   latest_hiding_prefetch(tensor, op_ms, model,
                                                          needed_by(tensor, due))]))
        swaps.append(SwapDecision(tensor.name, prefetch))
        if rng.random() < 0.05:  # the same tensor again: the last prefetch point holds
            swaps.append(SwapDecision(tensor.name, latest if prefetch != latest
                                      else tensor.last_forward_use))
    assert swapped_names >= {r for d in recomputes for r in d.swapped_reads}
    return swaps, recomputes


@pytest.mark.parametrize("zero_durations", [False, True])
@pytest.mark.parametrize("devices", [1, 3])
def test_random_decisions_are_predicted_alike(simulators, zero_durations, devices):
    rng = np.random.default_rng(17 + 2 * devices + zero_durations)
    predictions = waited = moved_peak = elsewhere = 0
    for _ in range(150):
        op_ms, tensors = _random_step(rng, zero_durations, devices)
        model = LINKS[int(rng.integers(0, 2))]
        native, reference = simulators(op_ms, tensors, model)
        for _ in range(6):
            swaps, recomputes = _random_decisions(rng, op_ms, tensors, model)
            persistent = int(rng.integers(0, 100))
            # Checked, unchecked, and with the recomputations kept by their tuple.
            for check, kind in ((True, list), (False, tuple), (False, tuple)):
                expected = reference.predict(swaps, persistent, kind(recomputes), check)
                found = native.predict(swaps, persistent, kind(recomputes), check)
                assert_same(found, expected)
            assert native.due_times(tuple(recomputes)) == reference.due_times(recomputes)
            predictions += 1
            waited += expected.step_ms > expected.compute_ms
            moved_peak += bool(swaps or recomputes)
            elsewhere += expected.peak_device != ""
    assert predictions == 900
    # The cases the randomness is there for, each many times.
    assert waited > 100 and moved_peak > 500
    assert (elsewhere > 100) == (devices > 1)


def test_steps_of_nothing_and_of_empty_tensors_are_predicted_alike(simulators):
    """No ops at all; tensors of no bytes (the sweep's own peak of 0 and its time); a device
    with no tensor."""
    native, reference = simulators([], [], LINKS[0])
    assert_same(native.predict(), reference.predict())
    op_ms = [1.0, 0.0, 2.0, 0.5]
    empty = [TensorUse("A", 0, 1, (2, 3), (3,)), TensorUse("B", 0, 0, (1,), device="/GPU:1")]
    native, reference = simulators(op_ms, empty, LINKS[0])
    for swaps, recomputes in [((), ()), ((SwapDecision("A", 2),), ()),
                              ((), (RecomputeDecision("A", 0.5, transient_bytes=7),))]:
        assert_same(native.predict(swaps, 3, recomputes), reference.predict(swaps, 3, recomputes))


@pytest.mark.parametrize("first_at, second_at, peak_device", [
    (1, 1, "/GPU:1"),  # the same bytes at the same time: the later device
    (2, 0, ""),  # the same bytes: the later time
    (0, 2, "/GPU:1")])
def test_devices_peaking_alike_are_told_apart_alike(simulators, first_at, second_at,
                                                    peak_device):
    """As max() over (peak, time, device) picks, on both."""
    tensors = [TensorUse("X", 100, first_at, (first_at + 1,)),
               TensorUse("Y", 100, second_at, (second_at + 1,), device="/GPU:1")]
    native, reference = simulators([1.0] * 4, tensors, LINKS[1])
    expected = reference.predict()
    assert expected.peak_device == peak_device and expected.peak_bytes == 100
    assert_same(native.predict(), expected)


def test_decisions_that_cannot_be_made_fail_alike_unchecked(simulators):
    op_ms = [1.0, 1.0, 1.0, 1.0]
    tensors = [TensorUse("A", 100, 1, (2, 3), (3,)), TensorUse("B", 50, 0, (1, 3), (3,))]
    native, reference = simulators(op_ms, tensors, LINKS[0])
    for swaps, recomputes in [
            ((SwapDecision("A", 0),), ()),  # brought back before it is made
            ((SwapDecision("nothing", 2),), ()),
            ((), (RecomputeDecision("A", 0.5, swapped_reads=("B",)),)),  # B is not swapped
            ((SwapDecision("B", 1),), (RecomputeDecision("A", 0.5, made_with="B"),))]:
        with pytest.raises(KeyError) as expected:
            reference.predict(swaps, 0, recomputes, check=False)
        with pytest.raises(KeyError) as found:
            native.predict(swaps, 0, recomputes, check=False)
        assert found.value.args == expected.value.args


@pytest.fixture(scope="module")
def real_step():
    """A traced training step (four convolutions), its op times and its tensors."""
    step = conv_training_step()
    return step, op_times(step.graph, SLOW_LINK, None, None), analyze(step)


def test_a_real_step_is_predicted_alike(simulators, real_step):
    _, op_ms, report = real_step
    native, reference = simulators(op_ms, report.tensors, SLOW_LINK)
    rng = np.random.default_rng(29)
    for _ in range(200):
        swaps, recomputes = _random_decisions(rng, op_ms, report.tensors, SLOW_LINK)
        assert_same(native.predict(swaps, report.persistent_bytes, recomputes),
                    reference.predict(swaps, report.persistent_bytes, recomputes))


def test_searches_on_a_real_step_choose_alike(simulators, real_step, monkeypatch):
    """Every prediction of a search alike, so the same plans (or the same shortfall): the greedy
    search alone at several budgets, and planning the step whole."""
    step, op_ms, report = real_step
    simulators(op_ms, report.tensors, SLOW_LINK)  # skips where not built
    unplanned = StepSimulator(op_ms, report.tensors, SLOW_LINK).predict(
        (), report.persistent_bytes)
    kept = {t.name for t in report.kept()}

    def outcome(plan):
        """The decisions, or by how much the budget is missed and the lowest prediction."""
        try:
            return plan()
        except BudgetError as error:
            return error.shortfall_bytes, error.prediction

    def plans(budget):
        return (outcome(lambda: plan_memory(op_ms, report.tensors, SLOW_LINK, budget,
                                            report.persistent_bytes, candidates=kept)),
                outcome(lambda: plan_step_memory(step, budget, SLOW_LINK).decisions))

    planned = missed = 0
    for share in (0.95, 0.85, 0.7):
        budget = int(unplanned.peak_bytes * share)
        found = plans(budget)
        monkeypatch.setenv("TF_UCUDNN_SIMULATOR", "numpy")
        expected = plans(budget)
        monkeypatch.delenv("TF_UCUDNN_SIMULATOR")
        assert found == expected
        planned += sum(isinstance(plan, MemoryDecisions) and bool(plan.swaps or plan.recomputes)
                       for plan in found)
        missed += sum(not isinstance(plan, MemoryDecisions) for plan in found)
    assert planned >= 4 and missed >= 1  # plans found, and budgets missed by as much
