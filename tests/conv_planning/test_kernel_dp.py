import dataclasses
import math
import random

import pytest

from tf_ucudnn.conv_planning import (
    NoFeasiblePlanError,
    fastest_configuration,
    is_deterministic,
    pareto_configurations,
)
from tf_ucudnn.core.plan import (
    DIRECT,
    SPACE_TO_DEPTH,
    SUBSAMPLED,
    Algorithm,
    KernelPlan,
    MicroBatch,
)
from tf_ucudnn.core.units import MIB
from tf_ucudnn.profiling import AlgorithmTiming


def test_alexnet_conv2_forward_at_64_mib(fp32_tables):
    """The figure quoted in shared/profiles/README.md, reproduced from the measurements."""
    table = fp32_tables[("alexnet.conv2", "fwd")]
    undivided = fastest_configuration("fwd", table, 256, 64 * MIB, micro_batch_sizes=[256])
    # Every faster algorithm needs >= 261 MiB at batch 256; only algo 0 (no workspace) fits.
    assert undivided.plan == KernelPlan((MicroBatch(256, Algorithm(0, "default")),))
    assert undivided.time_ms == 9.97571 and undivided.workspace_bytes == 0

    best = fastest_configuration("fwd", table, 256, 64 * MIB)
    assert best.plan == KernelPlan.uniform(256, 32, Algorithm(1, "default"))
    assert best.time_ms == pytest.approx(8 * 0.19747)  # 1.57976 ms
    assert best.workspace_bytes == 43168403  # 41.2 MiB
    assert undivided.time_ms / best.time_ms == pytest.approx(6.3147, abs=1e-4)


def test_no_limit_means_the_fastest_measured(fp32_tables):
    table = fp32_tables[("alexnet.conv2", "fwd")]
    best = fastest_configuration("fwd", table, 256)
    assert best.plan == KernelPlan((MicroBatch(256, Algorithm(5, "default")),))
    assert (best.time_ms, best.workspace_bytes) == (0.88352, 499122176)


def test_time_never_rises_with_the_limit(fp32_tables):
    for (layer, kernel), table in fp32_tables.items():
        times = [fastest_configuration(kernel, table, 256, limit * MIB).time_ms
                 for limit in (0, 1, 8, 64, 256, 1024, 4096)]
        assert times == sorted(times, reverse=True), (layer, kernel)


def test_pareto_fronts_of_the_measurements(fp32_tables):
    for (layer, kernel), table in fp32_tables.items():
        front = pareto_configurations(kernel, table, 256)
        workspaces = [c.workspace_bytes for c in front]
        times = [c.time_ms for c in front]
        assert workspaces == sorted(set(workspaces)), (layer, kernel)  # strictly increasing
        assert times == sorted(set(times), reverse=True), (layer, kernel)  # strictly decreasing
        for configuration in front:
            assert configuration.plan.batch_size == 256
            at_its_limit = fastest_configuration(kernel, table, 256, configuration.workspace_bytes)
            assert at_its_limit.time_ms == pytest.approx(configuration.time_ms)
        assert times[-1] == pytest.approx(fastest_configuration(kernel, table, 256).time_ms)
        smallest = min(t.workspace_bytes for timings in table.values() for t in timings)
        assert workspaces[0] == smallest


def test_deterministic_only_avoids_atomics(fp32_tables):
    assert not is_deterministic("bwd_data", 0) and is_deterministic("bwd_data", 1)
    assert not is_deterministic("bwd_filter", 0) and not is_deterministic("bwd_filter", 3)
    assert all(is_deterministic("fwd", algo) for algo in range(8))
    for (layer, kernel), table in fp32_tables.items():
        for limit in (0, 64 * MIB, None):
            free = fastest_configuration(kernel, table, 256, limit)
            try:
                strict = fastest_configuration(kernel, table, 256, limit, deterministic_only=True)
            except NoFeasiblePlanError:
                # At limit 0 the zero-workspace backward algorithms are the atomic ones.
                assert limit == 0 and kernel != "fwd", (layer, kernel)
                continue
            assert all(is_deterministic(kernel, mb.algorithm.algo)
                       for mb in strict.plan.micro_batches)
            assert strict.time_ms >= free.time_ms - 1e-12
            if kernel == "fwd":
                assert strict == free


def test_only_sizes_in_the_table_are_used():
    table = {4: [AlgorithmTiming(0, "default", 1.0, 0)], 3: [AlgorithmTiming(0, "default", 0.1, 0)]}
    # 10 = 4 + 3 + 3 is the only way; there is no size 1 or 2.
    best = fastest_configuration("fwd", table, 10)
    assert best.plan.sizes == (4, 3, 3) and best.time_ms == pytest.approx(1.2)
    with pytest.raises(NoFeasiblePlanError, match=r"sizes \[3, 4\] sum to 5"):
        fastest_configuration("fwd", table, 5)
    with pytest.raises(NoFeasiblePlanError, match="sizes \\(none measured\\)"):
        fastest_configuration("fwd", table, 2)


def test_nothing_fits_a_small_limit():
    table = {2: [AlgorithmTiming(1, "default", 1.0, 100)]}
    with pytest.raises(NoFeasiblePlanError, match="workspace <= 99 bytes"):
        fastest_configuration("fwd", table, 4, 99)
    assert fastest_configuration("fwd", table, 4, 100).plan.sizes == (2, 2)


def test_equal_times_prefer_fewer_micro_batches():
    # 2 x 1 and 1 x 2 take the same time: keep the undivided one.
    table = {1: [AlgorithmTiming(0, "default", 0.5, 0)], 2: [AlgorithmTiming(0, "default", 1.0, 0)]}
    assert fastest_configuration("fwd", table, 2).plan.sizes == (2,)


def _all_plans(table, batch_size, limit):
    """Every multiset of (size, algorithm) summing to batch_size: (time, workspace) pairs."""
    options = [(size, t) for size, timings in table.items() if size <= batch_size
               for t in timings if t.workspace_bytes <= limit]
    results = []

    def extend(remaining, start, time_ms, workspace):
        if remaining == 0:
            results.append((time_ms, workspace))
            return
        for i in range(start, len(options)):
            size, timing = options[i]
            if size <= remaining:
                extend(remaining - size, i, time_ms + timing.time_ms,
                       max(workspace, timing.workspace_bytes))

    extend(batch_size, 0, 0.0, 0)
    return results


def _random_table(rng, batch_size):
    sizes = sorted(rng.sample(range(1, batch_size + 1), rng.randint(1, min(batch_size, 5))))
    return {size: [AlgorithmTiming(algo, rng.choice(["default", "tensor_op"]),
                                   round(rng.uniform(0.1, 1.0) * size ** rng.uniform(0.5, 1.2), 6),
                                   rng.choice([0, 16, 64, 256, 1024]) * size)
                   for algo in rng.sample(range(8), rng.randint(1, 3))]
            for size in sizes}


def _check_plan(kernel_table, configuration, batch_size, limit):
    """The plan is made of measured entries that fit, and its predictions add up."""
    assert configuration.plan.batch_size == batch_size
    entries = []
    for mb in configuration.plan.micro_batches:
        [timing] = [t for t in kernel_table[mb.size] if t.algorithm == mb.algorithm]
        assert timing.workspace_bytes <= limit
        entries.append(timing)
    assert configuration.time_ms == pytest.approx(sum(t.time_ms for t in entries))
    assert configuration.workspace_bytes == max(t.workspace_bytes for t in entries)


def _check_fastest(table, plans, batch_size, limit):
    """The DP's plan is the fastest of `plans` (brute force's), or there is none."""
    dp_limit = None if limit == math.inf else limit
    if not plans:
        with pytest.raises(NoFeasiblePlanError):
            fastest_configuration("fwd", table, batch_size, dp_limit)
        return
    best = fastest_configuration("fwd", table, batch_size, dp_limit)
    assert best.time_ms == pytest.approx(min(time for time, _ in plans))
    _check_plan(table, best, batch_size, limit)


def test_dp_matches_brute_force_on_random_tables():
    rng = random.Random(1234)
    for _ in range(150):
        batch_size = rng.randint(1, 9)
        table = _random_table(rng, batch_size)
        limit = rng.choice([0, 100, 1000, 5000, math.inf])
        plans = _all_plans(table, batch_size, limit)
        _check_fastest(table, plans, batch_size, limit)


def test_pareto_front_matches_brute_force_on_random_tables():
    rng = random.Random(99)
    for _ in range(150):
        batch_size = rng.randint(1, 9)
        table = _random_table(rng, batch_size)
        plans = _all_plans(table, batch_size, math.inf)
        if not plans:
            with pytest.raises(NoFeasiblePlanError):
                pareto_configurations("fwd", table, batch_size)
            continue
        expected = []
        for time_ms, workspace in sorted(plans, key=lambda p: (p[1], p[0])):
            if not expected or time_ms < expected[-1][0] - 1e-9:
                expected.append((time_ms, workspace))
        front = pareto_configurations("fwd", table, batch_size)
        assert [c.workspace_bytes for c in front] == [w for _, w in expected]
        assert [c.time_ms for c in front] == pytest.approx([t for t, _ in expected])
        for configuration in front:
            _check_plan(table, configuration, batch_size, configuration.workspace_bytes)


def test_bad_arguments():
    table = {1: [AlgorithmTiming(0, "default", 1.0, 0)]}
    with pytest.raises(ValueError, match="kernel"):
        fastest_configuration("forward", table, 1)
    with pytest.raises(ValueError, match="batch size"):
        fastest_configuration("fwd", table, 0)


def test_call_overhead_favours_fewer_micro_batches():
    """Each micro-batch costs a fixed host time on top of cuDNN's: with enough of it, splitting
    stops paying, and the predicted time counts it once per micro-batch."""
    from tf_ucudnn.profiling.records import AlgorithmTiming
    table = {8: (AlgorithmTiming(0, "default", 8.0, 0),),
             4: (AlgorithmTiming(1, "default", 3.0, 0),)}  # 2 x 3.0 beats 8.0 without overhead
    split = fastest_configuration("fwd", table, 8)
    assert split.plan.sizes == (4, 4) and split.time_ms == 6.0
    # With 2.5 ms a call: 8.0 + 2.5 = 10.5 undivided against 2 x (3.0 + 2.5) = 11.0 split.
    costly = fastest_configuration("fwd", table, 8, call_overhead_ms=2.5)
    assert costly.plan.sizes == (8,) and costly.time_ms == 10.5
    with pytest.raises(ValueError, match="non-negative"):
        fastest_configuration("fwd", table, 8, call_overhead_ms=-1.0)


def engine(engine_id, time_ms, workspace_bytes, **knobs):
    return AlgorithmTiming.from_algorithm(Algorithm(engine=engine_id, knobs=knobs), time_ms,
                                          workspace_bytes)


def test_an_engine_configuration_faster_within_the_limit_is_chosen():
    table = {8: [AlgorithmTiming(1, "default", 2.0, 0), engine(12, 1.5, 10 * MIB, SPLIT_K_SLC=2),
                 engine(30, 0.5, 100 * MIB)],
             4: [AlgorithmTiming(1, "default", 1.0, 0), engine(7, 0.6, 20 * MIB)]}
    chosen = fastest_configuration("fwd", table, 8, 10 * MIB)
    assert str(chosen.plan) == "8@engine=12,knobs=SPLIT_K_SLC:2"
    assert (chosen.time_ms, chosen.workspace_bytes) == (1.5, 10 * MIB)
    # engine 30 needs more than the limit; engine 7 at size 4 fits a larger one.
    assert str(fastest_configuration("fwd", table, 8, 20 * MIB).plan) == "4@engine=7 + 4@engine=7"
    assert str(fastest_configuration("fwd", table, 8, 100 * MIB).plan) == "8@engine=30"
    assert str(fastest_configuration("fwd", table, 8, 0).plan) == "8@algo=1,math=default"
    front = pareto_configurations("fwd", table, 8)
    assert [str(c.plan) for c in front] == ["8@algo=1,math=default",
                                            "8@engine=12,knobs=SPLIT_K_SLC:2",
                                            "4@engine=7 + 4@engine=7", "8@engine=30"]
    # The plan's JSON carries the engine configuration, and reads back the same.
    assert KernelPlan.from_json(chosen.plan.to_json()) == chosen.plan
    assert chosen.plan.to_json()[0]["algorithm"] == "engine=12,knobs=SPLIT_K_SLC:2"


def test_ties_between_engines_and_legacy_algorithms_follow_the_algorithm_order():
    tied = [engine(10, 1.0, 0), engine(2, 1.0, 0, TILE_SIZE=1), engine(2, 1.0, 0),
            AlgorithmTiming(5, "tensor_op", 1.0, 0), AlgorithmTiming(5, "default", 1.0, 0)]
    expected = "8@algo=5,math=default"
    for order in (tied, tied[::-1], tied[2:] + tied[:2]):
        assert str(fastest_configuration("fwd", {8: order}, 8, 0).plan) == expected
    engines_only = [t for t in tied if t.algo is None]
    for order in (engines_only, engines_only[::-1]):
        assert str(fastest_configuration("fwd", {8: order}, 8).plan) == "8@engine=2"
    # Micro-batches of one size with equally fast choices come out in one order too.
    mixed = {4: [engine(3, 1.0, 0)], 2: [AlgorithmTiming(0, "default", 0.5, 0), engine(1, 0.5, 0)]}
    assert str(fastest_configuration("fwd", mixed, 6, 0).plan) == \
        "4@engine=3 + 2@algo=0,math=default"


def test_deterministic_requests_leave_out_engine_configurations_not_recorded_deterministic():
    """An engine configuration profiled before determinism was recorded, or noted
    nondeterministic, is left out; one cuDNN noted deterministic is a candidate."""
    table = {8: [AlgorithmTiming(1, "default", 2.0, 0), engine(12, 1.0, 0)]}
    assert str(fastest_configuration("bwd_filter", table, 8).plan) == "8@engine=12"
    assert str(fastest_configuration("bwd_filter", table, 8, deterministic_only=True).plan) == \
        "8@algo=1,math=default"
    with pytest.raises(NoFeasiblePlanError, match="deterministic algorithms only"):
        fastest_configuration("fwd", {8: [engine(12, 1.0, 0)]}, 8, deterministic_only=True)
    noted = {8: [AlgorithmTiming(1, "default", 2.0, 0),
                 dataclasses.replace(engine(12, 1.0, 0), deterministic=False),
                 dataclasses.replace(engine(14, 1.5, 0), deterministic=True)]}
    assert str(fastest_configuration("bwd_filter", noted, 8).plan) == "8@engine=12"
    assert str(fastest_configuration("bwd_filter", noted, 8, deterministic_only=True).plan) == \
        "8@engine=14"


def in_form(timing, form=SUBSAMPLED):
    return AlgorithmTiming.from_algorithm(
        dataclasses.replace(timing.algorithm, form=form), timing.time_ms, timing.workspace_bytes)


def test_a_plan_never_mixes_subsampled_and_direct_micro_batches():
    """Its micro-batches share the op's view of its tensors, so the fastest mix (4 subsampled at
    0.5 + 2 direct at 0.4) is no plan; the best of each form alone is (here: 3 x 2 direct)."""
    table = {4: [in_form(AlgorithmTiming(0, "default", 0.5, 8 * MIB))],
             2: [AlgorithmTiming(1, "default", 0.4, 0)],
             6: [AlgorithmTiming(1, "default", 3.0, 0)]}
    best = fastest_configuration("fwd", table, 6)
    assert str(best.plan) == "2@algo=1,math=default + 2@algo=1,math=default + " \
        "2@algo=1,math=default" and best.time_ms == pytest.approx(1.2)
    # Where subsampled micro-batches can make the batch alone, and are faster, they are chosen.
    table[2].append(in_form(AlgorithmTiming(0, "default", 0.3, 4 * MIB)))
    best = fastest_configuration("fwd", table, 6)
    assert best.plan.form == SUBSAMPLED and best.plan.sizes == (4, 2)
    assert best.time_ms == pytest.approx(0.8) and best.workspace_bytes == 8 * MIB
    within = fastest_configuration("fwd", table, 6, 4 * MIB)
    assert within.plan.form == SUBSAMPLED and within.plan.sizes == (2, 2, 2)
    assert fastest_configuration("fwd", table, 6, 0).plan.form == DIRECT
    front = pareto_configurations("fwd", table, 6)
    assert [(c.workspace_bytes, c.plan.form) for c in front] == \
        [(0, DIRECT), (4 * MIB, SUBSAMPLED), (8 * MIB, SUBSAMPLED)]
    assert [c.time_ms for c in front] == pytest.approx([1.2, 0.9, 0.8])


def test_each_form_can_be_asked_for_alone():
    table = {8: [AlgorithmTiming(1, "default", 2.0, 0),
                 in_form(AlgorithmTiming(1, "default", 1.0, 0)),
                 in_form(AlgorithmTiming(1, "default", 1.5, 0), SPACE_TO_DEPTH)]}
    assert fastest_configuration("fwd", table, 8).plan.form == SUBSAMPLED
    direct = fastest_configuration("fwd", table, 8, form=DIRECT)
    assert direct.plan.form == DIRECT and direct.time_ms == 2.0
    blocks = fastest_configuration("fwd", table, 8, form=SPACE_TO_DEPTH)
    assert blocks.plan.form == SPACE_TO_DEPTH and blocks.time_ms == 1.5
    assert [c.plan.form for c in pareto_configurations("fwd", table, 8, form=SUBSAMPLED)] \
        == [SUBSAMPLED]
    with pytest.raises(NoFeasiblePlanError):
        fastest_configuration("fwd", {8: [AlgorithmTiming(1, "default", 2.0, 0)]}, 8,
                              form=SUBSAMPLED)


def test_of_equally_fast_plans_the_direct_one_is_kept():
    table = {8: [in_form(AlgorithmTiming(1, "default", 1.0, 0), SPACE_TO_DEPTH),
                 AlgorithmTiming(1, "default", 1.0, 0)]}
    assert fastest_configuration("fwd", table, 8).plan.form == DIRECT
    assert [c.plan.form for c in pareto_configurations("fwd", table, 8)] == [DIRECT]


def test_dp_matches_brute_force_over_each_form_on_random_tables():
    rng = random.Random(4321)
    for _ in range(100):
        batch_size = rng.randint(1, 8)
        direct, other, blocks = (_random_table(rng, batch_size) for _ in range(3))
        table = {size: [*direct.get(size, ()), *map(in_form, other.get(size, ())),
                        *(in_form(t, SPACE_TO_DEPTH) for t in blocks.get(size, ()))]
                 for size in set(direct) | set(other) | set(blocks)}
        limit = rng.choice([0, 1000, 5000, math.inf])
        plans = (_all_plans(direct, batch_size, limit) + _all_plans(other, batch_size, limit)
                 + _all_plans(blocks, batch_size, limit))
        _check_fastest(table, plans, batch_size, limit)
