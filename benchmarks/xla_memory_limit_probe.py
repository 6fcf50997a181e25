"""Does XLA's own rematerialization fit Keras's step under a memory cap? XLA's GPU compiler
rematerializes (recomputes, compresses, and with host offloading on, moves buffers to the host)
until its schedule fits a memory limit: 80% of the device's memory scaled by
`--xla_gpu_memory_limit_slop_factor` percent. A cap smaller than the device is invisible to it,
so this probe sets the factor from the cap. Keras's `model.fit` (XLA, Keras's default) at each
batch, each in a fresh process under the cap, with XLA's defaults and with the limit set:

    python benchmarks/xla_memory_limit_probe.py --model resnet50 --batches 192 768 \\
        --limit-gib 13.6 --out FILE
"""

from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import sys

from beyond_memory import in_child


def device_memory_bytes() -> int:
    answer = subprocess.run(["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,"
                             "nounits", "-i", "0"], capture_output=True, text=True, check=True)
    return int(answer.stdout.split()[0]) << 20


def slop_factor(limit_bytes: int, device_bytes: int) -> int:
    """XLA's percent of 80% of the device that is `limit_bytes` (rounded down)."""
    return max(1, int(100 * limit_bytes / (0.8 * device_bytes)))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="resnet50")
    parser.add_argument("--batches", type=int, nargs="+", default=[192, 768])
    parser.add_argument("--memory-limit-gib", type=float, default=16.0)
    parser.add_argument("--limit-gib", type=float, nargs="+", default=[13.6],
                        help="XLA's memory limits to try at the larger batches")
    parser.add_argument("--host-offload", action="store_true",
                        help="also try each limit with XLA's host memory offloading")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    device = device_memory_bytes()
    variants = [("xla defaults", None)]
    for limit in args.limit_gib:
        factor = slop_factor(int(limit * (1 << 30)), device)
        variants.append((f"limit {limit} GiB", f"--xla_gpu_memory_limit_slop_factor={factor}"))
        if args.host_offload:
            variants.append((f"limit {limit} GiB, host offload",
                             f"--xla_gpu_memory_limit_slop_factor={factor} "
                             "--xla_gpu_enable_host_memory_offloading=true"))
    results = {"benchmark": "xla_memory_limit_probe", "date": datetime.date.today().isoformat(),
               "command": " ".join(sys.argv), "device_memory_bytes": device,
               "memory_limit_gib": args.memory_limit_gib, "model": args.model, "runs": []}
    for batch in args.batches:
        for name, flags in variants:
            if flags is None and batch != min(args.batches):
                continue  # XLA's defaults only where Keras fits
            environment = {"TF_GPU_ALLOCATOR": "cuda_malloc_async",
                           "TF_CPP_VMODULE": "gpu_compiler=1,hlo_rematerialization=1"}
            if flags:
                environment["XLA_FLAGS"] = flags
            answer, failure, stderr = in_child(
                ["--keras-fit-child", args.model, str(batch), str(args.steps),
                 "--trial-allocator", "cuda_malloc_async"], args.memory_limit_gib, environment)
            run = {"batch": batch, "variant": name, "xla_flags": flags, **answer,
                   "failure": failure,
                   "remat_log": [line[-300:] for line in stderr.splitlines()
                                 if "emat" in line][-6:]}
            results["runs"].append(run)
            print("probe", json.dumps(run)[:900], flush=True)
            with open(args.out, "w") as f:
                json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
