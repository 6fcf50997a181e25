"""How fast the offline optimizer is: the network ILP at ResNet-152 size and the DP with every size.

    python benchmarks/optimizer_speed.py [--profiles DIR] [--output FILE]

Inputs are the measured H100 fp32 profiles (shared/profiles). Two parts are synthetic, and the
output says so:

* ResNet-152's 155 convolutions are not measured; each reuses the tables of a measured layer of the
  same role (stem -> resnet18.conv1, the 3x3 conv of stage i -> resnet18.l<i>, 1x1 and projection
  convs -> the AlexNet conv2-5 tables in turn), giving 465 kernels of real timing tables.
* The measurements have power-of-two micro-batch sizes only; the `all` policy table for the DP fills
  every other size by interpolating each algorithm's time and workspace linearly between the
  neighbouring measured powers of two.

* Because the network reuses 27 tables, its repeated kernels have identical Pareto fronts, which
  the ILP solves as counts (as it would for ResNet-152's own repeated blocks). To time the ILP
  without that help too, a stress variant scales each kernel's times and workspaces by a few
  percent (a different factor per kernel), so that all 465 fronts differ.

Targets: ILP < 1 s, one DP at batch 256 with the `all` policy < 0.1 s.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import pulp

from tf_ucudnn.conv_planning import (
    DYNAMIC_ALLOCATOR,
    SHARED_WORKSPACE,
    KernelOptions,
    fastest_configuration,
    optimize_network,
    pareto_configurations,
)
from tf_ucudnn.conv_planning.plan_report import summarize
from tf_ucudnn.core.plan import BACKPROP_FILTER, BACKPROP_INPUT, FORWARD
from tf_ucudnn.core.units import MIB
from tf_ucudnn.profiling import AlgorithmTiming, group_by_kernel, micro_batch_sizes, read_jsonl

REPO = Path(__file__).resolve().parents[1]
BATCH_SIZE = 256
GIB = 1 << 30
REPEATS = 3
SHARED_BUDGETS = (GIB // 2, 4 * GIB, 16 * GIB)

# ResNet-152: bottleneck blocks per stage.
RESNET152_BLOCKS = (3, 8, 36, 3)
ONE_BY_ONE_STAND_INS = ("alexnet.conv2", "alexnet.conv3", "alexnet.conv4", "alexnet.conv5")


def resnet152_layers() -> list[tuple[str, str]]:
    """(layer name, measured layer whose tables it reuses), in forward order: 155 convolutions."""
    layers = [("conv1", "resnet18.conv1")]
    one_by_one = 0

    def stand_in():
        nonlocal one_by_one
        one_by_one += 1
        return ONE_BY_ONE_STAND_INS[(one_by_one - 1) % len(ONE_BY_ONE_STAND_INS)]

    for stage, blocks in enumerate(RESNET152_BLOCKS, start=1):
        for block in range(blocks):
            name = f"stage{stage}.block{block}"
            if block == 0:
                layers.append((f"{name}.projection", stand_in()))
            layers += [(f"{name}.reduce", stand_in()), (f"{name}.conv3x3", f"resnet18.l{stage}"),
                       (f"{name}.expand", stand_in())]
    return layers


def load_tables(profiles_dir: Path) -> dict:
    records = read_jsonl(profiles_dir / "h100-cudnn9.14-fp32-nchw.jsonl")
    names = {r.geometry: r.layer for r in records}
    return {(names[key.geometry], key.kernel): table
            for key, table in group_by_kernel(records).items()}


def timed(function, repeats=REPEATS):
    """(result, [seconds per run])."""
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        result = function()
        seconds.append(time.perf_counter() - start)
    return result, seconds


def summary(seconds) -> dict:
    return {"min_s": min(seconds), "median_s": statistics.median(seconds), "runs": len(seconds)}


def network_options(tables, layers, fronts) -> tuple[list[KernelOptions], list[KernelOptions]]:
    """Training-step kernels in execution order, without and with synthetic live bytes.

    Live bytes rise linearly over the forward pass from 0 to 60 GiB (stored activations) and fall
    back over the backward pass, for a 64 GiB budget.
    """
    order = [(layer, source, FORWARD) for layer, source in layers]
    for layer, source in reversed(layers):
        order += [(layer, source, BACKPROP_INPUT), (layer, source, BACKPROP_FILTER)]
    peak, forward_steps = 60 * GIB, len(layers)
    shared, dynamic = [], []
    for step, (layer, source, kernel) in enumerate(order):
        configurations = fronts[(source, kernel)]
        if step < forward_steps:
            live = peak * step // forward_steps
        else:
            live = peak * (len(order) - step) // (len(order) - forward_steps)
        shared.append(KernelOptions(layer, kernel, configurations))
        dynamic.append(KernelOptions(layer, kernel, configurations, live_bytes=live))
    return shared, dynamic


def distinct_fronts(options: list[KernelOptions]) -> list[KernelOptions]:
    """The same network with every kernel's front perturbed a little, so that none repeats."""
    return [dataclasses.replace(o, configurations=tuple(
                dataclasses.replace(c, time_ms=c.time_ms * (1 + 0.01 * (j % 17)),
                                    workspace_bytes=int(c.workspace_bytes * (1 + 0.013 * (j % 13))))
                for c in o.configurations))
            for j, o in enumerate(options)]


def interpolated_all_sizes(table) -> dict:
    """Every size 1..256: measured powers of two as they are, others interpolated between them."""
    measured = sorted(table)
    result = {}
    for size in micro_batch_sizes(BATCH_SIZE, "all"):
        if size in table:
            result[size] = tuple(table[size])
            continue
        below = max(s for s in measured if s < size)
        above = min(s for s in measured if s > size)
        weight = (size - below) / (above - below)
        at_above = {t.algorithm: t for t in table[above]}
        result[size] = tuple(
            AlgorithmTiming.from_algorithm(
                t.algorithm,
                t.time_ms + weight * (at_above[t.algorithm].time_ms - t.time_ms),
                round(t.workspace_bytes + weight * (
                    at_above[t.algorithm].workspace_bytes - t.workspace_bytes)))
            for t in table[below] if t.algorithm in at_above)
    return result


def machine() -> dict:
    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as info:
            cpu = next(line.split(":", 1)[1].strip() for line in info
                       if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return {"cpu": cpu, "cpu_count": os.cpu_count(), "platform": platform.platform(),
            "python": sys.version.split()[0], "numpy": np.__version__, "pulp": pulp.__version__,
            "solver": "PuLP bundled CBC, serial, no optimality gap"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--profiles", type=Path, default=REPO.parent / "shared" / "profiles")
    parser.add_argument("--output", type=Path,
                        default=REPO / "benchmarks" / "results" / "optimizer_speed.json")
    args = parser.parse_args()

    tables = load_tables(args.profiles)
    layers = resnet152_layers()
    used = sorted({(source, kernel) for _, source in layers
                   for kernel in (FORWARD, BACKPROP_INPUT, BACKPROP_FILTER)})
    fronts, front_seconds = timed(
        lambda: {key: pareto_configurations(key[1], tables[key], BATCH_SIZE) for key in used}, 1)
    shared, dynamic = network_options(tables, layers, fronts)
    num_configurations = sum(len(o.configurations) for o in shared)

    distinct = distinct_fronts(shared)
    shared_runs = {}
    for name, network in (("repeated_fronts", shared), ("distinct_fronts", distinct)):
        for budget in SHARED_BUDGETS:
            plan, seconds = timed(lambda: optimize_network(network, budget, SHARED_WORKSPACE))
            shared_runs[f"{name}, budget {budget / GIB:g} GiB"] = {
                "budget_bytes": budget, **summary(seconds), "total_time_ms": plan.total_time_ms,
                "memory_bytes": plan.memory_bytes}
    dynamic_budget = 64 * GIB
    dynamic_plan, dynamic_seconds = timed(lambda: optimize_network(dynamic, dynamic_budget,
                                                                   DYNAMIC_ALLOCATOR))

    kernel_key = ("alexnet.conv2", FORWARD)
    all_sizes = interpolated_all_sizes(tables[kernel_key])
    dp_limit = 64 * MIB
    dp_best, dp_seconds = timed(lambda: fastest_configuration(FORWARD, all_sizes, BATCH_SIZE,
                                                              dp_limit))
    dp_front, dp_front_seconds = timed(lambda: pareto_configurations(FORWARD, all_sizes,
                                                                     BATCH_SIZE), 3)
    measured_best = fastest_configuration(FORWARD, tables[kernel_key], BATCH_SIZE, dp_limit)

    results = {
        "machine": machine(),
        "ilp": {
            "network": "ResNet-152 shape: 155 convolutions x 3 kernels, each reusing a measured "
                       "H100 fp32 layer's tables (synthetic network, real timing tables)",
            "kernels": len(shared),
            "configurations_offered": num_configurations,
            "distinct_kernel_tables": len(used),
            "pareto_fronts_seconds": front_seconds[0],
            "distinct_fronts": "stress variant: kernel j's times scaled by 1 + 0.01 (j mod 17) "
                               "and workspaces by 1 + 0.013 (j mod 13), so no two fronts are equal",
            "shared_workspace": shared_runs,
            "dynamic_allocator": {"budget_bytes": dynamic_budget,
                                  "live_bytes": "synthetic: 0 -> 60 GiB over forward, back to 0 "
                                                "over backward",
                                  **summary(dynamic_seconds),
                                  "total_time_ms": dynamic_plan.total_time_ms,
                                  "memory_bytes": dynamic_plan.memory_bytes},
            "target_s": 1.0,
        },
        "dp": {
            "kernel": "alexnet.conv2 fwd, batch 256, policy 'all'",
            "table": "SYNTHETIC: powers of two measured, the other 247 sizes interpolated "
                     "linearly per algorithm (time and workspace) between neighbouring powers",
            "micro_batch_sizes": len(all_sizes),
            "single_limit": {"workspace_limit_bytes": dp_limit, **summary(dp_seconds),
                             "plan": summarize(dp_best.plan), "time_ms": dp_best.time_ms,
                             "workspace_bytes": dp_best.workspace_bytes,
                             "power_of_two_plan": summarize(measured_best.plan),
                             "power_of_two_time_ms": measured_best.time_ms},
            "pareto_front": {**summary(dp_front_seconds), "configurations": len(dp_front)},
            "target_s": 0.1,
        },
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps(results, indent=2))
    print(f"\nILP, {len(shared)} kernels / {num_configurations} choices (target < 1 s):")
    for name, run in shared_runs.items():
        print(f"  shared_workspace, {name}: {run['min_s']:.3f} s (median {run['median_s']:.3f})")
    print(f"  dynamic_allocator, budget 64 GiB: {min(dynamic_seconds):.3f} s")
    print(f"DP, 'all' policy (synthetic interpolated table), batch 256: one limit "
          f"{min(dp_seconds) * 1000:.1f} ms (target < 100 ms); whole Pareto front "
          f"{min(dp_front_seconds) * 1000:.0f} ms")
    print(f"written to {args.output}")


if __name__ == "__main__":
    main()
