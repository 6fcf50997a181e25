"""Predicted training steps of CosmoFlow beyond one host: for 8, 64 and 512 GPUs, 4 a host, at
128^3 and 512^3, the data x spatial split and all-reduce algorithm the scaling model recommends
(`tf_ucudnn.parallel.scaling.recommend_split`), with every alternative and why it lost. Pure
arithmetic: it runs anywhere in a second.

    python benchmarks/scaling_predictions.py --out benchmarks/results/scaling_predictions.json

The global batch is one sample per GPU (weak scaling: each data group of `spatial` GPUs takes
`spatial` samples). The convolutions' speed is the one measured on one H200 (the same SMs as an
H100 SXM) in benchmarks/results/spatial_scaling_h200x2.json.
"""

from __future__ import annotations

import argparse
import json

from tf_ucudnn.parallel.scaling import Cluster, Connection, recommend_split

FILTERS = (16, 32, 64, 128, 256)  # as benchmarks/spatial_scaling.py, which measured the speed
CHANNELS = 4
GIB = 2 ** 30


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--devices", type=int, nargs="+", default=[8, 64, 512])
    parser.add_argument("--edges", type=int, nargs="+", default=[128, 512])
    parser.add_argument("--devices-per-host", type=int, default=4)
    parser.add_argument("--measured", default="benchmarks/results/spatial_scaling_h200x2.json",
                        help="a spatial_scaling result whose scaling_model.flops is the speed")
    parser.add_argument("--nvlink-gb-s", type=float, default=400.0)
    parser.add_argument("--nvlink-latency-us", type=float, default=5.0)
    parser.add_argument("--nics-per-host", type=int, default=4)
    parser.add_argument("--nic-gbit-s", type=float, default=400.0)
    parser.add_argument("--network-latency-us", type=float, default=15.0)
    parser.add_argument("--memory-gib", type=float, default=80.0)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    with open(args.measured) as measured:
        flops = json.load(measured)["scaling_model"]["flops"]
    cluster = Cluster(
        flops=flops, devices_per_host=args.devices_per_host,
        intra_host=Connection(args.nvlink_gb_s * 1e9, args.nvlink_latency_us * 1e-6),
        inter_host=Connection(args.nics_per_host * args.nic_gbit_s * 1e9 / 8,
                              args.network_latency_us * 1e-6),
        memory_bytes=args.memory_gib * GIB)
    results = {
        "benchmark": "scaling_predictions",
        "assumptions": {
            "gpu": f"H100 SXM, {args.memory_gib:g} GiB; convolutions at {flops / 1e12:.2f} "
                   f"TFLOP/s (fp32), measured on one H200 ({args.measured})",
            "intra_host": f"{args.nvlink_gb_s:g} GB/s effective NVLink per GPU each way, "
                          f"{args.nvlink_latency_us:g} us a message",
            "inter_host": f"{args.nics_per_host} x {args.nic_gbit_s:g} Gb/s InfiniBand per host "
                          f"({cluster.inter_host.bandwidth / 1e9:g} GB/s, each GPU a "
                          f"1/{args.devices_per_host} share), {args.network_latency_us:g} us a "
                          "message",
            "batch": "global batch = GPUs (one sample per GPU; a data group of `spatial` GPUs "
                     "takes `spatial` samples, in micro-batches where they do not fit at once)",
            "model": f"CosmoFlow, {CHANNELS} channels, filters {list(FILTERS)}, dense (128, 64) "
                     "-> 4, fp32, Adam state; halos hidden behind compute, all-reduce not",
            "memory": "activation_bytes: per block 2 C_in + 2 C_out values a voxel kept, plus "
                      "the largest block's input and output gradients",
        },
        "cluster": cluster.to_json(), "rows": []}
    for edge in args.edges:
        for devices in args.devices:
            recommendation = recommend_split(devices, edge, CHANNELS, FILTERS, devices, cluster)
            chosen, cost = recommendation.chosen, recommendation.chosen.cost
            row = {"edge": edge, "devices": devices, "hosts": -(-devices // args.devices_per_host),
                   "batch": devices, "data": chosen.data, "spatial": chosen.spatial,
                   "algorithm": chosen.algorithm, "micro_batch": chosen.micro_batch,
                   "compute_s": cost.compute_s, "halo_s": cost.halo_s,
                   "allreduce_s": cost.allreduce_s, "step_s": cost.step_s,
                   "efficiency": recommendation.efficiency,
                   "one_gpu_fits_a_sample": recommendation.one_device_fits,
                   "sample_gib": recommendation.sample_bytes / GIB,
                   "recommendation": recommendation.to_json()}
            results["rows"].append(row)
            print(f"{edge}^3 on {devices:4d} GPUs: {chosen.data} x {chosen.spatial} "
                  f"{chosen.algorithm:17s} step {cost.step_s * 1e3:8.2f} ms (compute "
                  f"{cost.compute_s * 1e3:.2f}, halo {cost.halo_s * 1e3:.2f}, all-reduce "
                  f"{cost.allreduce_s * 1e3:.2f}), efficiency {recommendation.efficiency:.3f}")
    with open(args.out, "w") as out:
        json.dump(results, out, indent=1)


if __name__ == "__main__":
    main()
