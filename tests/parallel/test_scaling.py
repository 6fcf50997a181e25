"""The scaling model, checked by hand on a one-block network."""

import pytest

from tf_ucudnn.parallel.scaling import Link, cosmoflow_step_cost, strong_scaling

LINK = Link(flops=1e12, halo_bandwidth=1e9, allreduce_bandwidth=1e9)


def test_one_block_by_hand():
    # Edge 8, 2 channels -> 4 filters, batch 2, split over 2 devices, one group.
    cost = cosmoflow_step_cost(8, 2, [4], batch=2, spatial=2, groups=1, link=LINK,
                               parameters=1000)
    flops = 3 * 2 * 2 * 8 ** 3 * 27 * 2 * 4 / 2
    assert cost.compute_s == pytest.approx(flops / 1e12)
    # One face: 2 samples x 8^2 x (2 inputs + 4 gradients) values of 4 bytes.
    assert cost.halo_bytes == 2 * 64 * 6 * 4
    assert cost.allreduce_bytes == 0  # one group: nothing to all-reduce
    # The halo (3.1 us) outlasts the compute (0.66 us): the step waits for it.
    assert cost.step_s == pytest.approx(cost.halo_s) and cost.halo_s > cost.compute_s
    fast = Link(flops=1e12, halo_bandwidth=1e12, allreduce_bandwidth=1e9)
    hidden = cosmoflow_step_cost(8, 2, [4], batch=2, spatial=2, groups=1, link=fast,
                                 parameters=1000)
    assert hidden.step_s == pytest.approx(hidden.compute_s)


def test_groups_pay_the_all_reduce_and_thin_slabs_expose_the_halo():
    hybrid = cosmoflow_step_cost(8, 2, [4], batch=4, spatial=2, groups=2, link=LINK,
                                 parameters=1000)
    assert hybrid.allreduce_bytes == 2 * (1 / 2) * 1000 * 4
    slow = Link(flops=1e15, halo_bandwidth=1e6, allreduce_bandwidth=1e9)
    exposed = cosmoflow_step_cost(8, 2, [4], batch=2, spatial=4, groups=1, link=slow,
                                  parameters=0)
    assert exposed.step_s == pytest.approx(exposed.halo_s)  # compute is negligible


def test_strong_scaling_efficiency_falls_with_more_devices():
    rows = strong_scaling(128, 4, [16, 32, 64, 128, 256], batch=1, device_counts=[1, 2, 4, 8],
                          link=Link(1e13, 1e8, 1e10), parameters=10 ** 6)
    efficiencies = [row["efficiency"] for row in rows]
    assert efficiencies[0] == pytest.approx(1.0)
    assert efficiencies == sorted(efficiencies, reverse=True)


def test_a_volume_twice_as_deep_over_twice_the_devices_costs_the_same_work_per_device():
    one = cosmoflow_step_cost(16, 2, [4, 8], batch=1, spatial=1, groups=1, link=LINK,
                              parameters=0)
    weak = cosmoflow_step_cost(16, 2, [4, 8], batch=1, spatial=2, groups=1, link=LINK,
                               parameters=0, depth=32)
    assert weak.compute_s == pytest.approx(one.compute_s)
    # The faces between slabs stay edge x edge, whatever the depth.
    assert weak.halo_bytes == (16 ** 2 * (2 + 4) + 8 ** 2 * (4 + 8)) * 4
