"""The memory timeline: the data it draws, and the picture."""

import pytest
from training_steps import SLOW_LINK, conv_training_step

from tf_ucudnn.memory.analysis.liveness import analyze
from tf_ucudnn.memory.timeline import memory_timeline, write_timeline_png
from tf_ucudnn.memory.cost.device_model import DeviceModel
from tf_ucudnn.memory.search.step_plan import plan_step_memory

# A link as fast as the device's memory: the planner swaps rather than recomputes.
FAST_LINK = DeviceModel("fast link", device_to_host=1e11, host_to_device=1e11,
                        memory_bandwidth=1e11, peak_flops=1e12, launch_ms=0.001)


def _plan(link):
    step = conv_training_step()
    written = analyze(step)
    budget = int(0.85 * (written.peak_bytes + written.persistent_bytes))
    return plan_step_memory(step, budget, link), written


@pytest.mark.parametrize("link, swapped", [(SLOW_LINK, False), (FAST_LINK, True)],
                         ids=["recomputed", "swapped"])
def test_the_planned_curve_is_the_plan_under_its_budget(link, swapped):
    plan, written = _plan(link)
    assert bool(plan.swaps) == swapped and bool(plan.recomputes) != swapped
    timeline = memory_timeline(plan, written)
    planned = timeline.planned
    # The plan's own curve, after its swaps or recomputations: its most is the predicted peak,
    # within the budget; the step as written goes over it.
    assert len(planned.bytes) == len(plan.liveness.ops) == len(planned.shares)
    assert planned.peak_bytes == plan.decisions.prediction.peak_bytes <= timeline.budget_bytes
    assert timeline.written.peak_bytes == written.peak_bytes + written.persistent_bytes
    assert timeline.written.peak_bytes > timeline.budget_bytes == plan.budget_bytes
    assert planned.label.startswith(f"the planned step ({len(plan.decisions.swaps)} swap(s), "
                                    f"{len(plan.decisions.recomputes)} recomputation(s))")
    assert 0 <= planned.shares[0] < planned.shares[-1] < 1
    start, end = timeline.backward
    assert 0 < start < end < 1
    assert timeline.unit == "MiB"  # under a GiB


def test_without_decisions_the_planned_curve_is_the_liveness():
    step = conv_training_step()
    plan = plan_step_memory(step, 1 << 40, SLOW_LINK)
    assert not plan.swaps and not plan.recomputes
    written = plan.liveness
    assert plan.live_bytes == [op.live_bytes + written.persistent_bytes for op in written.ops]
    assert memory_timeline(plan, written).unit == "GiB"  # the budget, 1 TiB, is the largest


def test_a_timeline_is_a_png(tmp_path):
    plan, written = _plan(FAST_LINK)
    path = write_timeline_png(str(tmp_path / "timeline.png"), memory_timeline(plan, written),
                              title="a step")
    data = open(path, "rb").read()
    assert data.startswith(b"\x89PNG\r\n\x1a\n") and len(data) > 5000
    assert [p.name for p in tmp_path.iterdir()] == ["timeline.png"]


def test_a_failed_write_leaves_nothing(tmp_path):
    plan, _ = _plan(SLOW_LINK)
    with pytest.raises(OSError):
        write_timeline_png(str(tmp_path / "missing" / "timeline.png"), memory_timeline(plan))
    assert list(tmp_path.iterdir()) == []
