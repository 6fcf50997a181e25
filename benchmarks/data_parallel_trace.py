"""Why data parallelism of SpatialCosmoFlow is slow (issue 25): one Keras training step traced on
one device and under a MirroredStrategy over two at the same per-device batch, with what each
device ran and when, what crossed between devices, and the step times.

    python benchmarks/data_parallel_trace.py --out /tmp/data_parallel_trace.json  # logical CPUs
    python benchmarks/data_parallel_trace.py --gpus --edge 128 --batch 2 \\
        --filters 16 32 64 128 256 --out benchmarks/results/data_parallel_trace_h200x2.json

The same model and weights run three ways:

* `one_device`: `train_on_batch` on `--batch` samples on the first device;
* `whole_batch_each`: two replicas, each handed the whole global batch (2 x `--batch` samples,
  on the first device), as Keras 3's `train_on_batch` hands a batch to every replica (what
  SpatialCosmoFlow's did before it split the batch itself);
* `train_on_batch`: two replicas, `train_on_batch` on the global batch.

Without `--gpus` the devices are two logical CPUs, which share the host's cores: their speed-up
means nothing, their structure (the rows each replica trains, the ops on each device, the
transfers, the all-reduce, the eager work around the step) is the GPUs'. With `--gpus` each
device's timeline is its kernels' (`step_trace.gpu_events`); on CPUs it is its ops' runs on the
host's executor threads (`step_trace.host_op_spans`).
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import shutil
import statistics
import tempfile
import time

import numpy as np
import tensorflow as tf
from tensorflow.python.eager import context

RUNS = ("one_device", "whole_batch_each", "train_on_batch")
REPLICA_SCOPE = re.compile(r"(?:^|/)replica_(\d+)[/_]")
# The eager work Python dispatches around a step, as the profiler's python line names it.
EAGER_EVENTS = ("EagerLocalExecute", "EagerCopyToDevice")


def setup_devices(gpus: bool) -> list[str]:
    """Two GPUs, or two logical CPUs (the first two, where the runtime already has more)."""
    if gpus:
        found = tf.config.list_physical_devices("GPU")
        if len(found) < 2:
            raise SystemExit(f"--gpus needs two GPUs, TensorFlow sees {len(found)}")
        return ["/GPU:0", "/GPU:1"]
    cpu = tf.config.list_physical_devices("CPU")[0]
    if not tf.config.get_logical_device_configuration(cpu):
        tf.config.set_logical_device_configuration(
            cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
    if len(tf.config.list_logical_devices("CPU")) < 2:
        raise SystemExit("TensorFlow started with one CPU device: run this in a fresh process")
    return ["/CPU:0", "/CPU:1"]


def category(op: str, op_type: str, optimizer: str) -> str:
    """Where an op's time goes: the gradients' all-reduce, a transfer between devices, the
    optimizer (its update and the all-reduce's packing: ops under its scope, "sgd" or "sgd_1_2"
    for an optimizer named "SGD"), the backward pass, or the rest (the forward pass, the loss and
    the metrics)."""
    from tf_ucudnn.profiling.step_trace import TRANSFER_OPS

    if op_type.startswith("Collective") or op_type.startswith("Nccl"):
        return "all_reduce"
    if op_type in TRANSFER_OPS:
        return "transfer"
    if re.fullmatch(re.escape(optimizer.lower()) + r"(_\d+)*", op.split("/")[0]):
        return "optimizer"
    if "gradient_tape/" in op:
        return "backward"
    return "forward"


def replica_of(op: str) -> int:
    """The replica whose step an op belongs to: MirroredStrategy scopes replica k's ops (k > 0)
    under "replica_k/" (their resource arguments "replica_k_..."), replica 0's under none."""
    found = REPLICA_SCOPE.search(op)
    return int(found.group(1)) if found else 0


def misplaced_ops(placed: dict, groups: list[list[str]], scopes: tuple[str, ...]) -> list[dict]:
    """The model's, its gradients' and its loss's ops (names under `scopes`) on a device outside
    their replica's group: work one replica does for the others."""
    from tf_ucudnn.profiling.step_trace import short_device

    devices = [{short_device(tf.DeviceSpec.from_string(d).to_string()) for d in group}
               for group in groups]
    return [{"op": op, "device": device, "replica": replica_of(op)}
            for op, device in sorted(placed.items())
            if any(scope in op for scope in scopes) and replica_of(op) < len(devices)
            and device not in devices[replica_of(op)]]


def eager_events(space) -> dict[str, int]:
    """The eager ops and copies Python dispatched during the trace: work around the step, each
    a launch (and, reading a value, a wait) on a GPU."""
    counts = collections.Counter()
    for plane in space.planes:
        for line in plane.lines:
            if line.name != "python":
                continue
            for event in line.events:
                name = plane.event_metadata[event.metadata_id].name
                if name.startswith(EAGER_EVENTS):
                    counts[name] += 1
    return dict(sorted(counts.items()))


def device_report(spans: dict, op_types: dict, optimizer: str, gaps: int) -> dict:
    """One device's timeline (busy, idle, longest gaps) and its ops' time per category and per
    type, summed over ops (overlaps counted twice)."""
    from tf_ucudnn.profiling import step_trace

    by_category, by_type = collections.Counter(), collections.Counter()
    for op, span in spans.items():
        ms = span.last_ms - span.first_ms
        by_category[category(op, op_types.get(op, ""), optimizer)] += ms
        by_type[op_types.get(op, "?")] += ms
    row = step_trace.device_timeline(spans, gaps)
    row["ops"] = len(spans)
    row["op_ms_by_category"] = {key: round(ms, 3) for key, ms in by_category.most_common()}
    row["op_ms_by_type"] = {key: round(ms, 3) for key, ms in by_type.most_common(12)}
    return row


class Run:
    """One way of running the step: its model, its data, and one step of it."""

    def __init__(self, name, devices, args, weights):
        from tf_ucudnn.parallel.cosmoflow import SpatialCosmoFlow

        self.name = name
        replicas = 1 if name == "one_device" else len(devices)
        self.groups = [[device] for device in devices[:replicas]]
        self.strategy = (tf.distribute.MirroredStrategy([g[0] for g in self.groups])
                         if replicas > 1 else tf.distribute.get_strategy())
        with self.strategy.scope():
            self.model = SpatialCosmoFlow(args.edge, args.channels, args.filters,
                                          mesh=self.groups)
            if weights is not None:
                self.model.set_weights(weights)
            self.model.compile(tf.keras.optimizers.SGD(1e-3), "mse")
        rows = args.batch * replicas
        with tf.device(devices[0]):  # where a loader without a strategy would leave it
            self.x = tf.random.stateless_uniform([rows, *[args.edge] * 3, args.channels], [1, 2])
            self.y = tf.random.stateless_uniform([rows, 4], [3, 4])
        if name == "whole_batch_each":
            with tf.device(devices[0]):  # one tensor per replica, or regroup would see one
                copies = [(tf.identity(self.x), tf.identity(self.y)) for _ in self.groups]
            self.per_replica = self.strategy.experimental_distribute_values_from_function(
                lambda context: copies[context.replica_id_in_sync_group])
        self.rows_seen = {}  # the rows each replica's step takes, by replica, when traced
        call = self.model.call

        def recording_call(x, training=False):
            replica = tf.distribute.get_replica_context()
            if replica is not None:  # not Keras's symbolic build, in the cross-replica context
                self.rows_seen[int(tf.get_static_value(replica.replica_id_in_sync_group))] = \
                    int(x.shape[0])
            return call(x, training)
        self.model.call = recording_call

    def step(self) -> dict:
        """One training step as `train_on_batch` runs it; its logs, read back (so the step has
        finished)."""
        if self.name != "whole_batch_each":
            return self.model.train_on_batch(self.x, self.y, return_dict=True)
        self.model.make_train_function()
        self.model.reset_metrics()
        x, y = self.per_replica
        return {key: float(value)
                for key, value in self.model.train_function([(x, y, None)]).items()}


def trace_run(run: Run, steps: int, gpus: bool, gaps: int) -> dict:
    """The step's placement (from its first run), its median time over `steps`, and one step
    traced."""
    from tf_ucudnn.profiling import step_trace

    context.enable_run_metadata()  # the partition graphs come with a function's first run
    try:
        run.step()
        first = context.export_run_metadata()
        run.step()  # builds a function only if the step is traced again
        again = context.export_run_metadata()
    finally:
        context.disable_run_metadata()
    seconds = []
    for _ in range(steps):
        start = time.perf_counter()
        run.step()
        seconds.append(time.perf_counter() - start)
    logdir = tempfile.mkdtemp(prefix="data_parallel_trace")
    tf.profiler.experimental.start(logdir, options=tf.profiler.experimental.ProfilerOptions(
        host_tracer_level=3, device_tracer_level=1 if gpus else 0))
    try:
        run.step()
    finally:
        tf.profiler.experimental.stop()
    space = step_trace.read_profile(logdir)
    shutil.rmtree(logdir)

    placed = step_trace.placed_ops(first.function_graphs)
    op_types = {node.name: node.op for function in first.function_graphs
                for graph in function.partition_graphs for node in graph.node}
    events = step_trace.gpu_events(space) if gpus else []
    spans = (step_trace.op_spans(events) if gpus else step_trace.host_op_spans(space, placed))
    optimizer = run.model.optimizer.name
    devices = {device: device_report(device_spans, op_types, optimizer, gaps)
               for device, device_spans in sorted(spans.items())}
    for device, copies in step_trace.cross_device_copies(events).items():
        devices[device]["cross_device_copies"] = copies  # the GPUs' copies, with their bytes
    moved = step_trace.transfers(first.function_graphs)
    per_device = collections.defaultdict(collections.Counter)
    for op, device in placed.items():
        per_device[device][op_types[op]] += 1
    return {
        "run": run.name, "replicas": len(run.groups),
        "rows_per_replica": [rows for _, rows in sorted(run.rows_seen.items())],
        "step_ms": statistics.median(seconds) * 1e3,
        "step_ms_each": [round(s * 1e3, 3) for s in seconds],
        "functions_built_after_first_step": len(again.function_graphs),
        "ops_per_device": {device: sum(types.values())
                           for device, types in sorted(per_device.items())},
        "all_reduce_ops_per_device": {
            device: sum(n for op_type, n in types.items() if op_type.startswith(("Collective",
                                                                                 "Nccl")))
            for device, types in sorted(per_device.items())},
        "transfers": [{"tensor": t.tensor, "from": t.source, "to": t.target, "bytes": t.bytes}
                      for t in moved],
        "misplaced_ops": misplaced_ops(placed, run.groups,
                                       (run.model.name, "gradient_tape/", "compile_loss/")),
        "eager_events_per_step": eager_events(space),
        "wall_ms": max((row["wall_ms"] for row in devices.values()), default=0.0),
        "devices": devices,
    }


def summary(results: dict) -> dict:
    """Each run's step against one device's at the same per-device batch, and its ops' time
    summed over the devices against one device's times the replicas (1.0: no work added)."""
    def op_ms(run):
        return sum(ms for row in run["devices"].values()
                   for ms in row["op_ms_by_category"].values())

    one = results["one_device"]
    return {name: {"step_ms": round(run["step_ms"], 3),
                   "step_vs_one_device": round(run["step_ms"] / one["step_ms"], 3),
                   "op_ms": round(op_ms(run), 3),
                   "op_ms_vs_one_device_per_replica": round(
                       op_ms(run) / (op_ms(one) * run["replicas"]), 3),
                   "transfer_bytes_known": sum(t["bytes"] or 0 for t in run["transfers"])}
            for name, run in results.items()}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gpus", action="store_true", help="two GPUs, not two logical CPUs")
    parser.add_argument("--edge", type=int, default=16)
    parser.add_argument("--channels", type=int, default=4)
    parser.add_argument("--filters", type=int, nargs="+", default=[8, 16])
    parser.add_argument("--batch", type=int, default=2, help="samples per device")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--gaps", type=int, default=5, help="longest gaps kept per device")
    parser.add_argument("--runs", nargs="+", choices=RUNS, default=list(RUNS))
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    devices = setup_devices(args.gpus)
    runs = ["one_device", *[name for name in args.runs if name != "one_device"]]

    results, weights = {}, None
    for name in runs:
        tf.keras.utils.set_random_seed(0)
        run = Run(name, devices, args, weights)
        weights = run.model.get_weights()
        results[name] = trace_run(run, args.steps, args.gpus, args.gaps)
        print(name, {key: results[name][key] for key in ("rows_per_replica", "step_ms")},
              flush=True)
    report = {"benchmark": "data_parallel_trace", "tensorflow": tf.__version__,
              "devices": devices, "edge": args.edge, "channels": args.channels,
              "filters": args.filters, "batch_per_device": args.batch, "steps": args.steps,
              "summary": summary(results), "runs": results}
    print(json.dumps(report["summary"], indent=1), flush=True)
    with open(args.out, "w") as out:
        json.dump(report, out, indent=1, default=lambda value: np.asarray(value).tolist())
    return report


if __name__ == "__main__":
    main()
