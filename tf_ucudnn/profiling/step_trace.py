"""What a traced TensorFlow step did, read from the profile TensorFlow's profiler wrote (an XSpace:
`tf.profiler.experimental.start(logdir, options=ProfilerOptions(host_tracer_level=3,
device_tracer_level=1))`, the step, then `stop()`).

* the allocator's events, replayed: its peak and the buffers alive then (`alive_at_peak`);
* each op's time: its GPU kernels, which the device tracer tags with the op that launched them,
  or its run on the CPU executor's threads (`measured_op_ms`); each GPU's kernels and copies by
  name, labelled or not (XLA's are not), and the time its streams were busy (`gpu_activity`);
* each GPU's timeline: every op's first start and last end per device, on one clock for all
  GPUs (`gpu_events`, `op_spans`), the time no kernel ran and the longest such gaps with the
  ops around them (`device_timeline`, `gpu_timeline`), and the copies between devices
  (`cross_device_copies`);
* each CPU device's ops, for logical CPU devices that share the host's threads: the placed
  partition graphs say which device ran an op (`placed_ops`) and which tensors crossed between
  devices (`transfers`), and the host's executor threads when it ran (`host_op_spans`, which
  `device_timeline` reads as it reads a GPU's spans).

Results are plain data: dicts that `json.dump` takes, and frozen dataclasses for
`dataclasses.asdict`.
"""

from __future__ import annotations

import dataclasses
import glob
import os
import re
from typing import Iterable, Mapping, Optional

import tensorflow as tf
from tensorflow.tsl.profiler.protobuf import xplane_pb2

GPU_PLANE = "/device:GPU"
# The ops through which TensorFlow's runtime moves a tensor to another device.
TRANSFER_OPS = ("_Send", "_Recv")
# CUPTI's names for copies between device memories (MemcpyD2D, MemcpyP2P) and others' spellings.
_DEVICE_COPY = re.compile(r"d2d|p2p|dtod|peer|device.?to.?device", re.IGNORECASE)


@dataclasses.dataclass(frozen=True)
class GpuEvent:
    """One kernel or copy on a GPU. Times in ms from the first op's event over all GPUs."""

    device: str  # the plane: "/device:GPU:0"
    op: str
    op_type: str
    name: str  # the kernel's, or the copy's kind ("MemcpyH2D", "MemcpyP2P", ...)
    start_ms: float
    end_ms: float
    copy: bool
    bytes: Optional[int] = None  # a copy's size, where the tracer recorded it


@dataclasses.dataclass(frozen=True)
class Transfer:
    """A tensor that TensorFlow's runtime moves from one device to another inside a function
    (one _Send/_Recv pair of its partition graphs)."""

    tensor: str  # the sent tensor: "op" or "op:1"
    source: str  # "/device:CPU:0"
    target: str
    bytes: Optional[int]  # where the graph knows its shape (a function's argument, say)


@dataclasses.dataclass(frozen=True)
class Span:
    """One op's GPU activity on one device: its first start and last end, kernels and copies
    alike, and whether any of it was a copy."""

    first_ms: float
    last_ms: float
    copy: bool


def stats(plane: xplane_pb2.XPlane, event: xplane_pb2.XEvent) -> dict:
    """An event's stats by name; a string stored once in the plane (`ref_value`) as that
    string."""
    values = {}
    for stat in event.stats:
        kind = stat.WhichOneof("value")
        values[plane.stat_metadata[stat.metadata_id].name] = (
            plane.stat_metadata[stat.ref_value].name if kind == "ref_value"
            else getattr(stat, kind))
    return values


def read_profile(path: str) -> xplane_pb2.XSpace:
    """The XSpace in `path`: an .xplane.pb file, or the log directory the profiler wrote one
    into (exactly one)."""
    if os.path.isdir(path):
        found = glob.glob(os.path.join(path, "**", "*.xplane.pb"), recursive=True)
        if len(found) != 1:
            raise ValueError(f"{path}: {len(found)} .xplane.pb files, expected one profile")
        (path,) = found
    space = xplane_pb2.XSpace()
    with open(path, "rb") as file:
        space.ParseFromString(file.read())
    return space


def _op(tf_op: str) -> Optional[tuple[str, str]]:
    """(op, type) from a "name:Type" label; None for a runtime's "Class::method" or no label."""
    if ":" not in tf_op or "::" in tf_op:
        return None
    op, op_type = tf_op.rsplit(":", 1)
    return op, op_type


def alive_at_peak(space: xplane_pb2.XSpace, device_allocator: bool, top: int = 40) -> dict:
    """Replays the allocator events of one profile, the GPU's (`device_allocator`) or the
    host's: the peak (`peak_bytes`), the op at it (`peak_op`), the number of events replayed,
    and the `top` largest buffers alive then (`largest_alive`), with the op that allocated
    each."""
    events = []
    for plane in space.planes:
        for line in plane.lines:
            for event in line.events:
                kind = plane.event_metadata[event.metadata_id].name
                if kind not in ("MemoryAllocation", "MemoryDeallocation"):
                    continue
                values = stats(plane, event)
                if ("GPU" in str(values.get("allocator_name", ""))) == device_allocator:
                    events.append((line.timestamp_ns * 1000 + event.offset_ps, kind, values))
    events.sort(key=lambda e: e[0])
    live, peak, at_peak, peak_op = {}, -1, {}, None
    for _, kind, values in events:
        if kind == "MemoryAllocation":
            live[values.get("addr")] = (int(values.get("requested_bytes", 0)),
                                        str(values.get("tf_op", "")))
        else:
            live.pop(values.get("addr"), None)
        in_use = int(values.get("bytes_allocated", 0))
        if in_use > peak:
            peak, at_peak, peak_op = in_use, dict(live), str(values.get("tf_op", ""))
    largest = sorted(at_peak.values(), key=lambda v: -v[0])[:top]
    return {"peak_bytes": peak, "peak_op": peak_op, "events": len(events),
            "largest_alive": [{"bytes": size, "op": op} for size, op in largest]}


def measured_op_ms(space: xplane_pb2.XSpace, on_gpu: bool) -> dict[str, float]:
    """Each op's time in one profile, in ms: on the GPUs, its kernels' and copies' (summed over
    the devices); on the CPU, its own run on the executor's threads (the host plane's
    tf_Compute lines)."""
    times: dict = {}
    for plane in space.planes:
        if on_gpu != plane.name.startswith(GPU_PLANE):
            continue
        for line in plane.lines:
            if not on_gpu and not line.name.startswith("tf_Compute"):
                continue
            for event in line.events:
                op = _op(str(stats(plane, event).get("tf_op", "")) if on_gpu
                         else plane.event_metadata[event.metadata_id].name)
                if op:
                    times[op[0]] = times.get(op[0], 0.0) + event.duration_ps / 1e9
    return times


def _copy_bytes(values: dict) -> Optional[int]:
    # CUPTI's copies carry "kind_src:device kind_dst:device size:1024 dest:1 async:1".
    size = re.search(r"\bsize:(\d+)", str(values.get("memcpy_details", "")))
    return int(size.group(1)) if size else None


def gpu_events(space: xplane_pb2.XSpace) -> list[GpuEvent]:
    """The kernels and copies on every GPU plane that an op launched, by start time. The
    tracer puts all devices on one clock, so times count from the first of them on any GPU."""
    found = []
    for plane in space.planes:
        if not plane.name.startswith(GPU_PLANE):
            continue
        for line in plane.lines:
            for event in line.events:
                values = stats(plane, event)
                op = _op(str(values.get("tf_op", "")))
                if not op:
                    continue
                start_ps = line.timestamp_ns * 1000 + event.offset_ps  # exact, as integers
                name = plane.event_metadata[event.metadata_id].name
                copy = "memcpy" in name.lower()
                found.append((start_ps, start_ps + event.duration_ps, plane.name, op, name, copy,
                              _copy_bytes(values) if copy else None))
    origin = min((start for start, *_ in found), default=0)
    return sorted((GpuEvent(device, op, op_type, name, (start - origin) / 1e9,
                            (end - origin) / 1e9, copy, size)
                   for start, end, device, (op, op_type), name, copy, size in found),
                  key=lambda event: event.start_ms)


def op_spans(events: list[GpuEvent]) -> dict[str, dict[str, Span]]:
    """Each op's span on each device: {"/device:GPU:0": {op: Span}}."""
    spans: dict = {}
    for event in events:
        device = spans.setdefault(event.device, {})
        span = device.get(event.op, Span(event.start_ms, event.end_ms, event.copy))
        device[event.op] = Span(min(span.first_ms, event.start_ms),
                                max(span.last_ms, event.end_ms), span.copy or event.copy)
    return spans


def device_timeline(spans: Mapping[str, Span], top: int = 10) -> dict:
    """One device's step, from its ops' spans: when its last op ended (`wall_ms`, from the
    spans' origin), when its first kernel started, the time some kernel ran (`busy_ms`) and
    the time between its first and last kernels when none ran (`idle_ms`), and the `top`
    longest such gaps with the ops before and after. Ops that copied are left aside: a copy
    runs beside the kernels, on its own stream."""
    kernels = sorted((span.first_ms, span.last_ms, op) for op, span in spans.items()
                     if not span.copy)
    busy, gaps = _busy_and_gaps(kernels)
    return {"wall_ms": max((span.last_ms for span in spans.values()), default=0.0),
            "first_kernel_ms": kernels[0][0] if kernels else None,
            "busy_ms": busy, "idle_ms": sum(gap["ms"] for gap in gaps),
            "longest_gaps": sorted(({**gap, "ms": round(gap["ms"], 2),
                                     "at_ms": round(gap["at_ms"], 2)} for gap in gaps),
                                   key=lambda gap: -gap["ms"])[:top]}


def _busy_and_gaps(intervals) -> tuple[float, list[dict]]:
    """Of (first, last, label) intervals sorted by first: the time at least one ran, and each
    time between the first and the last when none did ({"ms", "at_ms", "after", "before"}, the
    labels of the intervals around it)."""
    busy, gaps = 0.0, []
    reached, before = (intervals[0][0], None) if intervals else (0.0, None)
    for first, last, label in intervals:
        if first > reached:
            gaps.append({"ms": first - reached, "at_ms": reached, "after": before,
                         "before": label})
        if last > reached:
            busy += last - max(first, reached)
            reached, before = last, label
    return busy, gaps


def gpu_timeline(spans: Mapping[str, Mapping[str, Span]], top: int = 10) -> dict[str, dict]:
    """`device_timeline` of each device in `op_spans`' result."""
    return {device: device_timeline(device_spans, top) for device, device_spans in spans.items()}


def kernel_ms_by_op_type(events: list[GpuEvent]) -> dict[str, dict[str, float]]:
    """Each GPU's kernel time per op type, largest first: where a step's work goes, summed
    over kernels even where they overlap (copies left out)."""
    by_device: dict = {}
    for event in events:
        if not event.copy:
            types = by_device.setdefault(event.device, {})
            types[event.op_type] = types.get(event.op_type, 0.0) + event.end_ms - event.start_ms
    return {device: dict(sorted(types.items(), key=lambda item: -item[1]))
            for device, types in by_device.items()}


@dataclasses.dataclass(frozen=True)
class GpuActivity:
    """What one GPU's streams did in a trace, labelled by an op or not (XLA's kernels and custom
    calls carry none). Kernels and copies by name, largest total first, each {"ms", "count"};
    `busy_ms` the time at least one of them ran, `wall_ms` from the first start to the last end."""

    wall_ms: float
    busy_ms: float
    kernels: dict
    copies: dict


def gpu_activity(space: xplane_pb2.XSpace) -> dict[str, GpuActivity]:
    """Each GPU's `GpuActivity`, read from its stream lines only: the profiler's derived lines
    ("XLA Ops", "Steps") repeat the same time."""
    activity = {}
    for plane in space.planes:
        if not plane.name.startswith(GPU_PLANE):
            continue
        kernels: dict = {}
        copies: dict = {}
        spans = []
        for line in plane.lines:
            if not line.name.startswith("Stream"):
                continue
            for event in line.events:
                name = plane.event_metadata[event.metadata_id].name
                start_ms = (line.timestamp_ns * 1000 + event.offset_ps) / 1e9
                spans.append((start_ms, start_ms + event.duration_ps / 1e9, name))
                table = copies if re.search("memcpy|memset", name, re.IGNORECASE) else kernels
                entry = table.setdefault(name, {"ms": 0.0, "count": 0})
                entry["ms"] += event.duration_ps / 1e9
                entry["count"] += 1
        spans.sort()
        busy_ms, _ = _busy_and_gaps(spans)
        wall_ms = max(last for _, last, _ in spans) - spans[0][0] if spans else 0.0
        activity[plane.name] = GpuActivity(wall_ms, busy_ms, _largest_first(kernels),
                                           _largest_first(copies))
    return activity


def _largest_first(table: dict) -> dict:
    return dict(sorted(table.items(), key=lambda item: -item[1]["ms"]))


def cross_device_copies(events: list[GpuEvent]) -> dict[str, list[dict]]:
    """The copies between devices on each GPU, by start: those the runtime's _Send/_Recv made,
    and those CUPTI names device-to-device or peer-to-peer. Each with its op, kind, start and
    end in ms and its bytes (None where the tracer did not record them)."""
    copies: dict = {}
    for event in events:
        if event.copy and (event.op_type in TRANSFER_OPS or _DEVICE_COPY.search(event.name)):
            copies.setdefault(event.device, []).append(
                {"op": f"{event.op}:{event.op_type}", "kind": event.name,
                 "start_ms": event.start_ms, "end_ms": event.end_ms, "bytes": event.bytes})
    return copies


def short_device(name: str) -> str:
    """"/device:CPU:1" from "/job:localhost/replica:0/task:0/device:CPU:1", as profiles name
    their planes."""
    return "/device:" + name.split("/device:")[-1]


def placed_ops(function_graphs: Iterable) -> dict[str, str]:
    """Each op's device, from the partition graphs of the functions TensorFlow ran:
    `RunMetadata.function_graphs`, which the runtime fills when a function is first run
    (`tensorflow.python.eager.context.enable_run_metadata()` before that call,
    `export_run_metadata()` after)."""
    return {node.name: short_device(node.device) for function in function_graphs
            for graph in function.partition_graphs for node in graph.node}


def _tensor_bytes(node, output: int) -> Optional[int]:
    """The bytes of a node's output where the node records its shape and its one type."""
    shapes, dtype = node.attr["_output_shapes"].list.shape, node.attr["T"].type
    if len(shapes) <= output or not dtype or shapes[output].unknown_rank or \
            any(dim.size < 0 for dim in shapes[output].dim):
        return None
    size = tf.dtypes.as_dtype(dtype).size
    for dim in shapes[output].dim:
        size *= dim.size
    return size


def transfers(function_graphs: Iterable) -> list[Transfer]:
    """The tensors each function's partition graphs send from one device to another (control
    edges left out), with their bytes where the graph knows the sent tensor's shape."""
    found = []
    for function in function_graphs:
        for graph in function.partition_graphs:
            nodes = {node.name: node for node in graph.node}
            for node in graph.node:
                if node.op != "_Send" or node.input[0].startswith("^"):
                    continue
                name, _, output = node.input[0].partition(":")
                found.append(Transfer(
                    node.input[0], short_device(node.attr["send_device"].s.decode()),
                    short_device(node.attr["recv_device"].s.decode()),
                    _tensor_bytes(nodes[name], int(output or 0)) if name in nodes else None))
    return found


def host_op_spans(space: xplane_pb2.XSpace, placed: Mapping[str, str],
                  unplaced: str = "unplaced") -> dict[str, dict[str, Span]]:
    """Each op's run on the host's executor threads (tf_Compute lines, and the collective ops'
    own lines), per device by `placed` (an op it lacks goes under `unplaced`): {device: {op:
    Span}} in ms from the first op's start, as `op_spans` gives for GPUs. The runtime's
    transfers (_Send, _Recv) count as copies, which `device_timeline` leaves aside."""
    found = []
    for plane in space.planes:
        if plane.name.startswith(GPU_PLANE):
            continue
        for line in plane.lines:
            if not line.name.startswith(("tf_Compute", "collective_ops")):
                continue
            for event in line.events:
                op = _op(plane.event_metadata[event.metadata_id].name)
                if op:
                    start_ps = line.timestamp_ns * 1000 + event.offset_ps
                    found.append((start_ps, start_ps + event.duration_ps, op))
    origin = min((start for start, *_ in found), default=0)
    spans: dict = {}
    for start, end, (op, op_type) in found:
        device = spans.setdefault(placed.get(op, unplaced), {})
        first, last = (start - origin) / 1e9, (end - origin) / 1e9
        span = device.get(op, Span(first, last, op_type in TRANSFER_OPS))
        device[op] = Span(min(span.first_ms, first), max(span.last_ms, last), span.copy)
    return spans
