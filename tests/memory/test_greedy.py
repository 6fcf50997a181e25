"""The performance model on small steps worked out by hand (times in ms, sizes in bytes)."""

import dataclasses
import gc

import pytest
import tensorflow as tf

from tf_ucudnn.memory.analysis.tensor_use import TensorUse
from tf_ucudnn.memory.cost.device_model import DeviceModel
from tf_ucudnn.memory.cost.simulator import (
    RecomputeDecision,
    SwapDecision,
    latest_hiding_prefetch,
    predict,
)
from tf_ucudnn.memory.search.greedy import BudgetError, plan_memory

# 100 bytes per ms each way.
LINK = DeviceModel("test", device_to_host=1e5, host_to_device=1e5)


def _chain():
    """op0 makes A (100 B) read by op1 and, in the backward pass, by op3; op1 makes B (50 B)
    read by op2; op2 makes C (10 B) read by op3. Each op takes 1 ms."""
    return [1.0] * 4, [
        TensorUse("A", 100, producer=0, consumers=(1, 3), backward_consumers=(3,)),
        TensorUse("B", 50, producer=1, consumers=(2,)),
        TensorUse("C", 10, producer=2, consumers=(3,)),
    ]


def test_without_swaps_everything_stays():
    op_ms, tensors = _chain()
    prediction = predict(op_ms, tensors, LINK, persistent_bytes=7)
    # At t=2 (op2) A, B and C are all held: 160 bytes, plus the persistent 7.
    assert prediction.step_ms == 4.0 and prediction.compute_ms == 4.0
    assert prediction.peak_bytes == 167 and prediction.peak_op == 2
    assert prediction.exposed_transfer_ms == 0.0 and prediction.transfer_ms == 0.0


def test_each_device_has_its_own_peak():
    """op0 makes A (100 B) read by op1 and, backward, op5; op1 makes B (80 B, on a second
    device) read by op2 and, backward, op4; op2 makes C (30 B) read by op3. 1 ms an op."""
    op_ms = [1.0] * 6
    tensors = [TensorUse("A", 100, producer=0, consumers=(1, 5), backward_consumers=(5,)),
               TensorUse("B", 80, producer=1, consumers=(2, 4), backward_consumers=(4,),
                         device="/GPU:1"),
               TensorUse("C", 30, producer=2, consumers=(3,))]
    prediction = predict(op_ms, tensors, LINK, persistent_bytes=7)
    # The first device holds A and C at op2 (130 B), the second B (80 B); each with the 7 B.
    assert prediction.peak_bytes == 137 and prediction.peak_device == ""
    assert prediction.peak_op == 2
    # Under 120 B a device (not 217 summed), swapping A alone is enough: its copy out ends at
    # t=2, before C is made, and it comes back after op3, so the first device holds 107 B.
    plan = plan_memory(op_ms, tensors, LINK, 120, persistent_bytes=7)
    assert [d.tensor for d in plan.swaps] == ["A"] and plan.recomputes == ()
    assert plan.prediction.peak_bytes == 107
    with pytest.raises(BudgetError, match="at op"):
        plan_memory(op_ms, tensors, LINK, 10, persistent_bytes=7)


def test_a_swap_in_started_too_early_saves_nothing():
    op_ms, tensors = _chain()
    # Out during op1 (t=1..2); in right after op1 (t=2..3): back before op2 even starts.
    prediction = predict(op_ms, tensors, LINK, [SwapDecision("A", prefetch_after=1)])
    assert prediction.step_ms == 4.0 and prediction.peak_bytes == 160
    assert prediction.transfer_ms == 2.0


def test_a_late_swap_in_frees_memory_and_shows_its_cost():
    op_ms, tensors = _chain()
    # In after op2 (t=3..4): op3 waits until 4 and ends at 5. A is gone during op2 (t=2..3),
    # so the peak is A + B = 150 during op1.
    prediction = predict(op_ms, tensors, LINK, [SwapDecision("A", prefetch_after=2)])
    assert prediction.step_ms == 5.0 and prediction.exposed_transfer_ms == 1.0
    assert prediction.peak_bytes == 150 and prediction.peak_op == 1
    # A's copy out ends at t=2, when op2 starts: op2 must wait for it, as the model assumes.
    assert prediction.copied_out_before == (("A", 2),)


def test_swaps_wait_for_each_other_on_one_copy_engine():
    op_ms = [1.0] * 6
    tensors = [TensorUse("A", 200, 0, (1, 5), (5,)), TensorUse("B", 200, 1, (2, 4), (4,))]
    # B alone: out t=2..4, in after op3 (t=4) -> 4..6; op4 waits until 6, op5 ends at 8.
    alone = predict(op_ms, tensors, LINK, [SwapDecision("B", 3)])
    assert alone.step_ms == 8.0 and alone.transfer_ms == 4.0
    both = predict(op_ms, tensors, LINK, [SwapDecision("A", 2), SwapDecision("B", 3)])
    # A: out 1..3, in after op2 (t=3) -> 3..5. B: out 3..5, in after op3 (t=4) -> waits for the
    # engine (5) and its out (5) -> 5..7. op4 (reads B) starts at 7, op5 at 8, ends at 9.
    assert both.step_ms == 9.0


def test_prefetch_points_are_checked():
    op_ms, tensors = _chain()
    with pytest.raises(ValueError, match="after its last forward use"):
        predict(op_ms, tensors, LINK, [SwapDecision("A", prefetch_after=0)])
    with pytest.raises(ValueError, match="not a tensor kept for the backward pass"):
        predict(op_ms, tensors, LINK, [SwapDecision("B", prefetch_after=1)])


def test_latest_hiding_prefetch():
    tensor = TensorUse("A", 200, 0, (1, 6), (6,))
    # The copy takes 2 ms; ops 2..5 take 1 ms each: starting after op3 leaves ops 4 and 5.
    assert latest_hiding_prefetch(tensor, [1.0] * 7, LINK) == 3
    # Too little compute in between: as early as allowed, after the last forward use.
    assert latest_hiding_prefetch(tensor, [1.0, 1.0, 0.1, 0.1, 0.1, 0.1, 1.0], LINK) == 1


def test_plan_memory_meets_a_budget_and_says_when_it_cannot():
    op_ms = [1.0] * 8
    tensors = [TensorUse("A", 100, 0, (1, 7), (7,)), TensorUse("B", 100, 1, (2, 6), (6,)),
               TensorUse("C", 10, 2, (3,))]
    plain = predict(op_ms, tensors, LINK)
    assert plain.peak_bytes == 210
    decisions = plan_memory(op_ms, tensors, LINK, budget_bytes=200)
    # Swapping A hides behind ops 2-6 (1 ms of copy each way): no slower, 100 bytes less.
    assert [swap.tensor for swap in decisions.swaps] == ["A"] and not decisions.recomputes
    assert decisions.prediction.peak_bytes == 200 and decisions.prediction.step_ms == 8.0
    with pytest.raises(BudgetError, match="cannot be met") as error:
        plan_memory(op_ms, tensors, LINK, budget_bytes=150)
    # A and B are both needed by op1 in the forward pass: 200 bytes cannot go below that.
    assert error.value.shortfall_bytes == 50


def test_swaps_too_small_to_pay_for_their_copies_are_dropped_where_the_plan_fits():
    """A (100 B) and T (2 B) are held from ops 0 and 1 to the backward pass (ops 9 and 8);
    B (100 B) and C (10 B) are made at ops 3 and 4 and read at once. 1 ms an op."""
    op_ms = [1.0] * 10
    tensors = [TensorUse("A", 100, 0, (1, 9), (9,)), TensorUse("T", 2, 1, (2, 8), (8,)),
               TensorUse("B", 100, 3, (4,)), TensorUse("C", 10, 4, (5,))]
    assert predict(op_ms, tensors, LINK).peak_bytes == 212
    # Both swaps hide, so the greedy choice takes them together (peak 110: B and C at op4).
    both = plan_memory(op_ms, tensors, LINK, budget_bytes=200, min_swap_bytes=0)
    assert [d.tensor for d in both.swaps] == ["A", "T"] and both.prediction.peak_bytes == 110
    # T is under min_swap_bytes and the plan fits without it (112 bytes), as fast.
    plan = plan_memory(op_ms, tensors, LINK, budget_bytes=200, min_swap_bytes=3)
    assert [d.tensor for d in plan.swaps] == ["A"] and plan.prediction.peak_bytes == 112
    assert plan.prediction.step_ms == both.prediction.step_ms
    # Unless the budget needs it.
    tight = plan_memory(op_ms, tensors, LINK, budget_bytes=110, min_swap_bytes=3)
    assert [d.tensor for d in tight.swaps] == ["A", "T"]


def test_recomputation_frees_memory_at_the_cost_of_compute():
    op_ms, tensors = _chain()
    # A recomputed (0.5 ms) just before op3: gone after op1 (t=2), back at t=3..3.5, op3 ends 4.5.
    prediction = predict(op_ms, tensors, LINK, recomputes=[RecomputeDecision("A", 0.5)])
    assert prediction.step_ms == 4.5 and prediction.compute_ms == 4.5
    assert prediction.exposed_transfer_ms == 0.0
    # Peak: A + B = 150 during op1; during op2 only B + C = 60; from 3, A + C = 110.
    assert prediction.peak_bytes == 150 and prediction.peak_op == 1
    with pytest.raises(ValueError, match="both swapped and recomputed"):
        predict(op_ms, tensors, LINK, [SwapDecision("A", 2)], recomputes=[
            RecomputeDecision("A", 0.5)])


def test_a_peak_while_an_op_waits_for_a_recomputation_is_that_op_s():
    op_ms, tensors = _chain()
    op_ms.append(1.0)
    tensors.append(TensorUse("D", 10, producer=3, consumers=(4,)))
    # A made again at t=3..3.5 with a 500 B buffer on the way, before op3 starts: A + C + 500.
    prediction = predict(op_ms, tensors, LINK,
                         recomputes=[RecomputeDecision("A", 0.5, transient_bytes=500)])
    assert prediction.peak_bytes == 610 and prediction.peak_op == 3


def test_plan_memory_recomputes_where_a_swap_cannot_hide():
    # op1 reads A and makes B; op2 (0.2 ms) makes C from B; op3 reads A in the backward pass.
    # A + B + C = 210 during op2; A + B = 200 during op1 cannot be helped.
    op_ms = [1.0, 1.0, 0.2, 1.0]
    tensors = [TensorUse("A", 100, 0, (1, 3), (3,)), TensorUse("B", 100, 1, (2,)),
               TensorUse("C", 10, 2, (3,))]
    # Recomputing A (0.1 ms) just before op3: gone during op2, step 3.2 + 0.1.
    decisions = plan_memory(op_ms, tensors, LINK, budget_bytes=205, recompute_ms={"A": 0.1})
    assert [r.tensor for r in decisions.recomputes] == ["A"] and not decisions.swaps
    assert decisions.prediction.step_ms == pytest.approx(3.3)
    assert decisions.prediction.peak_bytes == 200
    # A swap cannot hide behind 0.2 ms: in after op2 (t=2.2..3.2), op3 ends at 4.2.
    swapped = plan_memory(op_ms, tensors, LINK, budget_bytes=205)
    assert swapped.swaps == (SwapDecision("A", 2),) and not swapped.recomputes
    assert swapped.prediction.step_ms == pytest.approx(4.2)


def test_a_tensor_a_recomputation_reads_is_not_freed_as_well():
    # op1 makes B from A; op3 makes D (100 B) while A and B wait for the backward ops 6 and 5.
    # Freeing 105 bytes at op3 takes both A and B; swaps over this link cost 100 ms each.
    slow = DeviceModel("slow", device_to_host=1e3, host_to_device=1e3)
    op_ms = [1.0] * 7
    tensors = [TensorUse("A", 100, 0, (1, 6), (6,)), TensorUse("B", 100, 1, (2, 5), (5,)),
               TensorUse("C", 10, 2, (3,)), TensorUse("D", 100, 3, (4,)),
               TensorUse("E", 1, 4, (5,))]
    cheap = {"A": 0.1, "B": 0.1}
    both = plan_memory(op_ms, tensors, slow, budget_bytes=205, recompute_ms=cheap)
    assert {r.tensor for r in both.recomputes} == {"A", "B"}
    # But B's recomputation reads A: A stays until then, and the budget cannot be met.
    with pytest.raises(BudgetError):
        plan_memory(op_ms, tensors, slow, budget_bytes=205, recompute_ms=cheap,
                    recompute_reads={"B": {"A"}})
    one = plan_memory(op_ms, tensors, slow, budget_bytes=210, recompute_ms=cheap,
                      recompute_reads={"B": {"A"}})
    assert len(one.recomputes) == 1 and one.prediction.peak_bytes <= 210


def test_a_swap_whose_copy_out_lags_behind_is_recomputed_instead():
    # A (100 B) is read by op1 (0.2 ms) and back by op6; X (150 B) lives over op2..op3 and
    # Y (200 B) over op4..op5. Swapped, A is still being copied out (t=1..2) when X arrives.
    op_ms = [1.0, 0.2, 1.0, 1.0, 1.0, 1.0, 1.0]
    tensors = [TensorUse("A", 100, 0, (1, 6), (6,)), TensorUse("X", 150, 2, (3,)),
               TensorUse("Y", 200, 4, (5,))]
    # First the swap with the late swap-in (1 ms for 50 bytes at op4) beats recomputing (3 ms
    # for 100); then the peak is A in transit plus X, which only recomputing A lowers.
    decisions = plan_memory(op_ms, tensors, LINK, budget_bytes=240, recompute_ms={"A": 3.0})
    assert not decisions.swaps and [r.tensor for r in decisions.recomputes] == ["A"]
    assert decisions.prediction.peak_bytes == 200
    assert predict(op_ms, tensors, LINK, [SwapDecision("A", 5)]).peak_bytes == 250


def test_roofline_estimates_of_op_times():
    model = DeviceModel("test", 1e9, 1e9, memory_bandwidth=1e9, peak_flops=1e12, launch_ms=0.0)

    @tf.function
    def ops(a, b, x, w):
        return (tf.matmul(a, b), tf.nn.relu(a), tf.nn.conv2d(x, w, 1, "VALID"),
                tf.slice(a, [0, 0], [10, -1]))

    graph = ops.get_concrete_function(
        tf.TensorSpec([100, 200]), tf.TensorSpec([200, 300]), tf.TensorSpec([2, 5, 5, 3]),
        tf.TensorSpec([3, 3, 3, 4])).graph
    by_type = {op.type: op for op in graph.get_operations()}
    # MatMul: 2 * 100 * 300 * 200 = 1.2e7 FLOPs -> 12 us; bytes (2e4 + 6e4 + 3e4) * 4 -> 440 us.
    assert model.op_ms(by_type["MatMul"]) == pytest.approx(0.44)
    # Relu: 2e4 floats in and out: 1.6e5 bytes -> 160 us.
    assert model.op_ms(by_type["Relu"]) == pytest.approx(0.16)
    # Slice: reads only the 10 rows it copies (2e3 floats), not the whole input.
    assert model.op_ms(by_type["Slice"]) == pytest.approx(0.016)
    # Conv2D: output 2x3x3x4 = 72 elements x 27 multiply-adds x 2 = 3888 FLOPs; bytes dominate.
    conv_bytes = (2 * 25 * 3 + 108 + 72) * 4
    assert model.op_ms(by_type["Conv2D"]) == pytest.approx(conv_bytes / 1e9 * 1e3)
    fast_memory = DeviceModel("test", 1e9, 1e9, memory_bandwidth=1e15, peak_flops=1e9,
                              launch_ms=0.0)
    assert fast_memory.op_ms(by_type["Conv2D"]) == pytest.approx(3888 / 1e9 * 1e3)
    # All ops at once (each tensor's size asked for once): the same times.
    for each in (model, fast_memory):
        operations = graph.get_operations()
        assert each.ops_ms(operations) == [each.op_ms(op) for op in operations]


def test_a_recomputation_may_read_a_tensor_swapped_back_for_it():
    # R (op0) is read by op1, which makes X; both are read back by the backward pass (X at op6,
    # R at op8). Y (150 B) over op3..op4 needs both gone: X recomputed (0.5 ms) from R, and R
    # swapped out, back in time for X's recomputation at op6, not just for op8.
    op_ms = [1.0] * 9
    tensors = [TensorUse("R", 100, 0, (1, 8), (8,)), TensorUse("X", 100, 1, (2, 6), (6,)),
               TensorUse("Y", 150, 3, (4,))]
    x_from_r = RecomputeDecision("X", 0.5, swapped_reads=("R",))
    with pytest.raises(ValueError, match="before its first backward use \\(6\\)"):
        predict(op_ms, tensors, LINK, [SwapDecision("R", 6)], recomputes=[x_from_r])
    with pytest.raises(ValueError, match="reads R back from the host, but it is not swapped"):
        predict(op_ms, tensors, LINK, recomputes=[x_from_r])
    # In after op4 (t=5..6): X is recomputed at t=6, op6 runs 6.5..7.5, the step ends at 9.5.
    both = predict(op_ms, tensors, LINK, [SwapDecision("R", 4)], recomputes=[x_from_r])
    assert both.peak_bytes == 200 and both.step_ms == pytest.approx(9.5)
    # Back only after op5 (t=6..7), R holds X's recomputation up by a millisecond.
    late = predict(op_ms, tensors, LINK, [SwapDecision("R", 5)], recomputes=[x_from_r])
    assert late.step_ms == pytest.approx(10.5)

    # X cannot be swapped here (no op to time its swap-in): it must be recomputed.
    options = dict(recompute_ms={"X": 0.5}, recompute_reads={"X": {"R"}},
                   prefetch_point=lambda tensor, index: index if tensor.name == "R" else -1)
    with pytest.raises(BudgetError):  # read as it is, R would have to stay
        plan_memory(op_ms, tensors, LINK, budget_bytes=210, **options)
    plan = plan_memory(op_ms, tensors, LINK, budget_bytes=210, direct_reads={"X": {"R"}},
                       **options)
    assert [s.tensor for s in plan.swaps] == ["R"] and plan.swaps[0].prefetch_after < 6
    assert plan.recomputes == (x_from_r,) and plan.prediction.peak_bytes <= 210


def _segment():
    """X (10 B, op0) is kept for op9; A (op1, from X) for op8; B (op2, from A) for op7. C (op3)
    and Y (150 B, op4) make the forward peak. Each op takes 1 ms; the link is too slow to swap."""
    op_ms = [1.0] * 10
    tensors = [TensorUse("X", 10, 0, (1, 9), (9,)), TensorUse("A", 100, 1, (2, 8), (8,)),
               TensorUse("B", 100, 2, (3, 7), (7,)), TensorUse("C", 10, 3, (4,)),
               TensorUse("Y", 150, 4, (5,)), TensorUse("Z", 1, 5, (6,))]
    return op_ms, tensors


def test_a_segment_is_recomputed_in_one_go_from_its_checkpoint():
    op_ms, tensors = _segment()
    slow = DeviceModel("slow", device_to_host=1e3, host_to_device=1e3)
    assert predict(op_ms, tensors, slow).peak_bytes == 370  # X, A, B, C and Y at op4
    # B's recomputation (before op7, at t=7) makes A on its way (1 ms for both): A is held
    # from then until op8, B until op7. The forward peak is X, C and Y.
    segment = [RecomputeDecision("B", 1.0), RecomputeDecision("A", 0.0, made_with="B")]
    both = predict(op_ms, tensors, slow, recomputes=segment)
    assert both.step_ms == pytest.approx(11.0) and both.compute_ms == pytest.approx(11.0)
    assert both.peak_bytes == 210  # X, A and B at op7
    # A 50-byte tensor made on the way and freed at once is held while the recomputation runs.
    transient = [dataclasses.replace(segment[0], transient_bytes=50), segment[1]]
    assert predict(op_ms, tensors, slow, recomputes=transient).peak_bytes == 260
    with pytest.raises(ValueError, match="A: made with B"):
        predict(op_ms, tensors, slow, recomputes=[RecomputeDecision("A", 0.0, made_with="B")])
    with pytest.raises(ValueError, match="B: made with A"):  # A is needed after B
        predict(op_ms, tensors, slow, recomputes=[RecomputeDecision("A", 0.5),
                                                  RecomputeDecision("B", 0.0, made_with="A")])

    # Each alone frees 100 bytes; the budget needs both. Read as it is, A is made along.
    options = dict(recompute_ms={"A": 0.5, "B": 0.5}, recompute_reads={"A": {"X"}, "B": {"A"}})
    plan = plan_memory(op_ms, tensors, slow, budget_bytes=215,
                       direct_reads={"A": {"X"}, "B": {"A"}}, **options)
    assert not plan.swaps and set(plan.recomputes) == set(segment)
    assert plan.prediction.peak_bytes == 210 and plan.prediction.step_ms == pytest.approx(11.0)
    with pytest.raises(BudgetError):  # read through an alias, A must stay for B's recomputation
        plan_memory(op_ms, tensors, slow, budget_bytes=215, **options)


def test_a_budget_that_cannot_be_met_is_missed_by_the_lowest_peak_reached():
    # A (100 B) and X (150 B) are both held at op1: 250 bytes whatever is done with A. Over a
    # 10-byte/ms link A's copy out outlasts X, so swapping it frees nothing; recomputing A is
    # quick but holds 400 bytes at the backward pass. Neither lowers the peak; the error is
    # about the 250 bytes, not the 500 a recomputation would reach.
    slow = DeviceModel("slow", device_to_host=1e1, host_to_device=1e1)
    op_ms = [1.0] * 7
    tensors = [TensorUse("A", 100, 0, (1, 6), (6,)), TensorUse("X", 150, 1, (2,)),
               TensorUse("Y", 10, 3, (4,))]
    with pytest.raises(BudgetError, match="the lowest any choice") as error:
        plan_memory(op_ms, tensors, slow, budget_bytes=200, recompute_ms={"A": 0.1},
                    transient_bytes={"A": 400})
    assert error.value.prediction.peak_bytes == 250 and error.value.shortfall_bytes == 50
    assert predict(op_ms, tensors, slow, [], recomputes=[
        RecomputeDecision("A", 0.1, transient_bytes=400)]).peak_bytes == 500


def _restarting_greedy(monkeypatch, plan_at_scaled_times):
    """`_greedy` replaced: no plan at the op times as given, `plan_at_scaled_times` (a swap of
    A) at any others; returns the first op's time of each call."""
    from tf_ucudnn.memory.search import greedy as search

    calls = []

    def greedy(simulator, budget_bytes, persistent_bytes, *rest):
        calls.append(simulator.durations_list[0])
        if simulator.durations_list[0] == 1.0:
            raise BudgetError(budget_bytes, simulator.predict())
        swaps = (plan_at_scaled_times,)
        return search.MemoryDecisions(swaps, (), simulator.predict(swaps))
    monkeypatch.setattr(search, "_greedy", greedy)
    return calls


def test_where_the_greedy_choice_finds_no_plan_it_starts_again_at_scaled_op_times(monkeypatch):
    op_ms = [1.0] * 8
    tensors = [TensorUse("A", 100, 0, (1, 7), (7,)), TensorUse("B", 100, 1, (2, 6), (6,)),
               TensorUse("C", 10, 2, (3,))]
    calls = _restarting_greedy(monkeypatch, SwapDecision("A", 5))
    decisions = plan_memory(op_ms, tensors, LINK, budget_bytes=200)
    assert calls == [1.0, 0.995]  # the first restart fits: no more
    assert decisions.swaps == (SwapDecision("A", 5),)
    # Predicted again with the op times as they are.
    assert decisions.prediction == predict(op_ms, tensors, LINK, decisions.swaps)
    assert decisions.prediction.step_ms == 8.0 and decisions.prediction.peak_bytes == 200


def test_a_restart_s_plan_that_misses_the_budget_at_the_real_op_times_is_not_taken(monkeypatch):
    op_ms = [1.0] * 8
    tensors = [TensorUse("A", 100, 0, (1, 7), (7,)), TensorUse("B", 100, 1, (2, 6), (6,)),
               TensorUse("C", 10, 2, (3,))]
    # Copied back right after its copy out, A is on the device beside B again: 210 bytes.
    calls = _restarting_greedy(monkeypatch, SwapDecision("A", 1))
    with pytest.raises(BudgetError) as error:
        plan_memory(op_ms, tensors, LINK, budget_bytes=200)
    assert calls == [1.0, 0.995, 1.005, 0.99, 1.01, 0.98, 1.02]
    assert error.value.shortfall_bytes == 10  # the unscaled run's


def test_the_search_pauses_the_cycle_collector_and_leaves_it_as_found():
    op_ms = [1.0, 0.2, 1.0, 1.0, 1.0, 1.0, 1.0]
    tensors = [TensorUse("A", 100, 0, (1, 6), (6,)), TensorUse("X", 150, 2, (3,)),
               TensorUse("Y", 200, 4, (5,))]
    during = []

    def prefetch_point(tensor, index):
        during.append(gc.isenabled())
        return index
    for enabled in (True, False):
        (gc.enable if enabled else gc.disable)()
        try:
            try:
                plan_memory(op_ms, tensors, LINK, budget_bytes=240,
                            prefetch_point=prefetch_point)
            except BudgetError:
                pass  # planned all the same
            assert gc.isenabled() == enabled
        finally:
            gc.enable()
    assert during and not any(during)
