"""The scaling model, checked by hand on small networks and clusters."""

import dataclasses
import json

import pytest

from tf_ucudnn.parallel.scaling import (
    Cluster,
    Connection,
    Link,
    activation_bytes,
    allreduce_seconds,
    cluster_step_cost,
    cosmoflow_parameters,
    cosmoflow_step_cost,
    recommend_split,
    strong_scaling,
)

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


# Beyond one host: hosts of 4 GPUs, NVLink at 100 GB/s and 1 us, the host's NICs at 20 GB/s
# (5 GB/s a GPU) and 10 us.

NVLINK = Connection(bandwidth=1e11, latency=1e-6)
NETWORK = Connection(bandwidth=2e10, latency=1e-5)
CLUSTER = Cluster(flops=1e13, devices_per_host=4, intra_host=NVLINK, inter_host=NETWORK,
                  memory_bytes=80 * 2 ** 30)


def test_all_reduce_formulas_by_hand():
    # 8 participants, 4 a host on 2 hosts, 8 MB; the 4 participants' NIC shares give 20 GB/s.
    ring = allreduce_seconds("ring", 8e6, 8, 4, CLUSTER)
    # 14 steps of 1 MB chunks, each as slow as the hop between hosts: 10 us + 1e6 / 2e10.
    assert ring == pytest.approx(14 * (1e-5 + 1e6 / 2e10))
    hierarchical = allreduce_seconds("hierarchical", 8e6, 8, 4, CLUSTER)
    assert hierarchical == pytest.approx(2 * 3 * (1e-6 + 2e6 / 1e11) + 2 * (1e-5 + 4e6 / 2e10))
    # 16 participants on 4 hosts, 16 MB: halving 8 and 4 MB in the host, then 8 and 4 MB across.
    halving = allreduce_seconds("recursive_halving", 16e6, 16, 4, CLUSTER)
    assert halving == pytest.approx(2 * (2e-6 + 12e6 / 1e11 + 2e-5 + 12e6 / 2e10))
    assert allreduce_seconds("ring", 8e6, 1, 1, CLUSTER) == 0.0
    with pytest.raises(ValueError, match="power-of-two"):
        allreduce_seconds("recursive_halving", 8e6, 12, 4, CLUSTER)


def test_hierarchical_beats_the_flat_ring_when_the_link_between_hosts_is_slow():
    slow = dataclasses.replace(CLUSTER, inter_host=Connection(2e9, 2e-5))
    # 4 hosts x 2 GB/s is far below NVLink's 100 GB/s: the flat ring's 30 steps each wait on
    # the network, the hierarchical ring crosses it in 6.
    assert (allreduce_seconds("hierarchical", 64e6, 16, 4, slow)
            < 0.85 * allreduce_seconds("ring", 64e6, 16, 4, slow))
    # In one host there is no difference.
    assert allreduce_seconds("hierarchical", 64e6, 4, 4, slow) == pytest.approx(
        allreduce_seconds("ring", 64e6, 4, 4, slow))


def test_latency_dominates_tiny_messages():
    ring = allreduce_seconds("ring", 4, 512, 4, CLUSTER)
    assert ring == pytest.approx(2 * 511 * 1e-5, rel=1e-3)
    halving = allreduce_seconds("recursive_halving", 4, 512, 4, CLUSTER)
    assert halving == pytest.approx(2 * (2 * 1e-6 + 7 * 1e-5), rel=1e-3)
    assert halving < ring / 50


def test_one_host_without_latency_is_the_one_host_model():
    one_host = Cluster(flops=1e12, devices_per_host=8, intra_host=Connection(1e9, 0.0),
                       inter_host=NETWORK, memory_bytes=1e12)
    for spatial, groups in ((1, 4), (2, 2), (4, 2)):
        cluster_cost = cluster_step_cost(16, 2, [4, 8], 4, spatial, groups, one_host, 1000)
        link_cost = cosmoflow_step_cost(16, 2, [4, 8], 4, spatial, groups, LINK, 1000)
        for field in ("compute_s", "halo_bytes", "halo_s", "allreduce_bytes", "allreduce_s",
                      "step_s"):
            assert getattr(cluster_cost, field) == pytest.approx(getattr(link_cost, field))


def test_a_spatial_group_spanning_hosts_pays_the_inter_host_halo():
    # Edge 16, 2 channels -> 4 filters, one sample over 8 devices: faces of 2048 bytes forward
    # (2 channels) and 4096 backward. On hosts of 4, devices 3 and 4 exchange through their NICs.
    spanning = cluster_step_cost(16, 2, [4], 1, 8, 1, CLUSTER, 0)
    assert spanning.halo_crosses_hosts
    assert spanning.halo_s == pytest.approx((1e-5 + 2048 / 5e9) + (1e-5 + 4096 / 5e9))
    one_host = cluster_step_cost(16, 2, [4], 1, 8, 1,
                                 dataclasses.replace(CLUSTER, devices_per_host=8), 0)
    assert not one_host.halo_crosses_hosts
    assert one_host.halo_s == pytest.approx((1e-6 + 2 * 2048 / 1e11) + (1e-6 + 2 * 4096 / 1e11))
    # Groups of 4 stay in their hosts.
    assert not cluster_step_cost(16, 2, [4], 2, 4, 2, CLUSTER, 0).halo_crosses_hosts


def test_memory_and_parameters_by_hand():
    # 8^3 x 2 channels -> 4 filters, over 2 devices: 256 voxels each, 2 (2 + 4) values kept and
    # the 2 + 4 gradients.
    assert activation_bytes(8, 2, [4], spatial=2) == (256 * 12 + 256 * 6) * 4
    # The model measured in spatial_scaling_h200x2.json (its all-reduce moved 13132240 bytes).
    assert cosmoflow_parameters(128, 4, [16, 32, 64, 128, 256]) == 13132240 // 4


def test_spatial_when_a_sample_does_not_fit():
    small = dataclasses.replace(CLUSTER, memory_bytes=16 * 2 ** 30)
    recommendation = recommend_split(64, 512, 4, [16, 32, 64, 128, 256], 64, small)
    assert recommendation.sample_bytes > small.memory_bytes
    assert not recommendation.one_device_fits
    assert recommendation.chosen.spatial > 1
    pure_data = [choice for choice in recommendation.alternatives if choice.spatial == 1]
    assert pure_data and all("does not fit" in choice.verdict for choice in pure_data)
    chosen = recommendation.chosen  # its micro-batch fits
    assert chosen.micro_batch * recommendation.sample_bytes / chosen.spatial < small.memory_bytes


def test_pure_data_parallelism_when_everything_fits_and_communication_is_cheap():
    # The model divides the work perfectly: with communication free, every split ties and the
    # least spatial wins the tie.
    cheap = dataclasses.replace(CLUSTER, intra_host=Connection(float("inf"), 0.0),
                                inter_host=Connection(float("inf"), 0.0))
    recommendation = recommend_split(64, 128, 4, [16, 32, 64, 128, 256], 64, cheap)
    assert (recommendation.chosen.data, recommendation.chosen.spatial) == (64, 1)
    assert recommendation.efficiency == pytest.approx(1.0, rel=1e-3)
    # At 128^3 five poolings leave slabs too thin beyond 4 devices.
    assert any("pooling windows" in choice.verdict for choice in recommendation.alternatives)


def test_spatial_in_a_host_saves_the_all_reduce_of_a_large_dense_head():
    # A 512^3 sample fits 80 GB, but on one host with slow links one group of 4 (no all-reduce)
    # beats 4 groups all-reducing the 134M-parameter dense head: 2 x 3/4 x 537 MB at 10 GB/s.
    slow = dataclasses.replace(CLUSTER, intra_host=Connection(1e10, 1e-6))
    recommendation = recommend_split(4, 512, 4, [16, 32, 64, 128, 256], 4, slow)
    assert recommendation.one_device_fits
    assert (recommendation.chosen.data, recommendation.chosen.spatial) == (1, 4)
    assert recommendation.chosen.cost.allreduce_s == 0.0
    pure_data = [choice for choice in recommendation.alternatives if choice.spatial == 1]
    assert all("all-reduce" in choice.verdict for choice in pure_data)
    assert json.dumps(recommendation.to_json())
