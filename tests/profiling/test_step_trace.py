"""step_trace: a traced step read from synthetic XSpaces built here, and from a real CPU trace."""

import dataclasses
import json

import pytest
import tensorflow as tf
from tensorflow.tsl.profiler.protobuf import xplane_pb2

from tf_ucudnn.profiling import step_trace
from tf_ucudnn.profiling.step_trace import Span

MS = 10**9  # picoseconds
US = 10**6


class _Plane:
    """An XPlane written as TensorFlow's profiler writes one: names stored once in the plane's
    metadata, events at offsets from their line's timestamp."""

    def __init__(self, space, name):
        self.plane = space.planes.add(name=name)

    def _metadata(self, table, name):
        for key, metadata in table.items():
            if metadata.name == name:
                return key
        key = len(table) + 1
        table[key].id, table[key].name = key, name
        return key

    def line(self, name, timestamp_ns):
        return self.plane.lines.add(name=name, timestamp_ns=timestamp_ns)

    def event(self, line, name, offset_ps, duration_ps, ref=(), **values):
        """Stats named in `ref` go in as the plane's strings (`ref_value`), as the device tracer
        stores its `tf_op` and `memcpy_details`; other strings as `str_value`."""
        event = line.events.add(metadata_id=self._metadata(self.plane.event_metadata, name),
                                offset_ps=offset_ps, duration_ps=duration_ps)
        for key, value in values.items():
            stat = event.stats.add(metadata_id=self._metadata(self.plane.stat_metadata, key))
            if key in ref:
                stat.ref_value = self._metadata(self.plane.stat_metadata, value)
            elif isinstance(value, str):
                stat.str_value = value
            else:
                stat.int64_value = value


def _kernel(plane, line, op, start_ms, end_ms, name="kernel"):
    plane.event(line, name, round(start_ms * MS), round((end_ms - start_ms) * MS),
                ref=("tf_op",), tf_op=op)


def _copy(plane, line, op, kind, start_ms, end_ms, size=None):
    details = {"memcpy_details": f"kind_src:device kind_dst:device size:{size} dest:1 async:1"}
    plane.event(line, kind, round(start_ms * MS), round((end_ms - start_ms) * MS),
                ref=("tf_op", "memcpy_details"), tf_op=op, **(details if size else {}))


@pytest.fixture
def space():
    """Two GPUs whose lines start at different times: GPU:0's ops from 1 ms after its line's
    start, GPU:1's line 0.5 ms later, so the ms below are from GPU:0's first op."""
    space = xplane_pb2.XSpace()
    gpu0 = _Plane(space, "/device:GPU:0")
    compute, side, copies = (gpu0.line(name, 1_000_000) for name in (
        "Stream #7(Kernel)", "Stream #9(Kernel)", "Stream #11(MemcpyH2D,MemcpyD2H)"))
    _kernel(gpu0, compute, "conv0:Conv3D", 0.0, 2.0)
    _kernel(gpu0, compute, "conv0:Conv3D", 2.5, 3.0, name="another_kernel")
    _kernel(gpu0, side, "small:Add", 1.0, 2.0)  # inside conv0: adds no busy time
    _kernel(gpu0, side, "bias0:BiasAdd", 2.0, 3.5)  # overlaps conv0's end
    _kernel(gpu0, compute, "relu0:Relu", 4.0, 5.0)
    _kernel(gpu0, compute, "relu1:Relu", 7.0, 8.0)
    _copy(gpu0, copies, "swap_in:Identity", "MemcpyH2D", 0.5, 1.5, size=64)
    # A halo sent through the host (no peer access): a device copy by its op, not its name.
    _copy(gpu0, copies, "halo/_5:_Send", "MemcpyD2H", 5.0, 6.0, size=4096)
    # Before every op's event, so it would move the origin if it were read.
    early = gpu0.line("Stream #13", 200_000)
    gpu0.event(early, "unlabelled_kernel", 0, 2 * MS)
    gpu0.event(early, "runtime_kernel", 0, 2 * MS, ref=("tf_op",), tf_op="Executor::Run")

    gpu1 = _Plane(space, "/device:GPU:1")
    compute, copies = gpu1.line("Stream #7(Kernel)", 1_500_000), \
        gpu1.line("Stream #14(MemcpyP2P,MemcpyD2D)", 1_500_000)
    _copy(gpu1, copies, "halo/_6:_Recv", "MemcpyP2P", 4.5, 5.0)  # no size recorded
    _copy(gpu1, copies, "concat:ConcatV2", "MemcpyD2D", 5.0, 5.1, size=128)
    _kernel(gpu1, compute, "conv0:Conv3D", 5.5, 6.5)
    _kernel(gpu1, compute, "pool:MaxPool", 6.75, 7.0)

    host = _Plane(space, "/host:CPU")
    executor, python = host.line("tf_Compute/1", 0), host.line("python", 0)
    host.event(executor, "mm:MatMul", 0, 2 * MS)
    host.event(executor, "ExecutorState::Process", 0, 5 * MS)
    host.event(executor, "mm:MatMul", 3 * MS, 1 * MS)
    host.event(executor, "act:Relu", 4 * MS, MS // 2)
    host.event(python, "fn:Foo", 0, 7 * MS)
    # The GPU allocator's events on two threads, so that only sorted by time is the peak's
    # set of buffers right: t1 a1 +100, t2 a2 +300, t3 a3 +200 (peak, 600), t4 -a1, t5 -a3.
    first, second = host.line("tf_Compute/2", 0), host.line("tf_Compute/3", 0)

    def memory(line, kind, t, addr, in_use, requested=0, op="", allocator="GPU_0_bfc"):
        host.event(line, kind, t * US, 0, addr=addr, bytes_allocated=in_use,
                   requested_bytes=requested, tf_op=op, allocator_name=allocator)
    memory(first, "MemoryAllocation", 1, 0xa1, 100, 100, "a")
    memory(first, "MemoryDeallocation", 4, 0xa1, 500)
    memory(first, "MemoryDeallocation", 5, 0xa3, 300)
    memory(second, "MemoryAllocation", 2, 0xa2, 400, 300, "b")
    memory(second, "MemoryAllocation", 3, 0xa3, 600, 200, "c")
    # The host allocator's, larger, which the GPU replay must leave out.
    memory(second, "MemoryAllocation", 2, 0xb1, 10_000, 10_000, "h", "mklcpu")
    memory(second, "MemoryDeallocation", 6, 0xb1, 0, allocator="mklcpu")
    return space


def test_alive_at_peak_replays_the_allocator_in_time_order(space):
    report = step_trace.alive_at_peak(space, device_allocator=True)
    assert report == {"peak_bytes": 600, "peak_op": "c", "events": 5,
                      "largest_alive": [{"bytes": 300, "op": "b"}, {"bytes": 200, "op": "c"},
                                        {"bytes": 100, "op": "a"}]}
    assert step_trace.alive_at_peak(space, True, top=1)["largest_alive"] == [
        {"bytes": 300, "op": "b"}]
    assert step_trace.alive_at_peak(space, device_allocator=False) == {
        "peak_bytes": 10_000, "peak_op": "h", "events": 2,
        "largest_alive": [{"bytes": 10_000, "op": "h"}]}


def test_measured_op_ms_sums_each_ops_events(space):
    assert step_trace.measured_op_ms(space, on_gpu=True) == pytest.approx({
        "conv0": 2.0 + 0.5 + 1.0, "small": 1.0, "bias0": 1.5, "relu0": 1.0, "relu1": 1.0,
        "swap_in": 1.0, "halo/_5": 1.0, "halo/_6": 0.5, "concat": 0.1, "pool": 0.25})
    assert step_trace.measured_op_ms(space, on_gpu=False) == pytest.approx(
        {"mm": 3.0, "act": 0.5})


def test_spans_per_device_on_one_clock(space):
    spans = step_trace.op_spans(step_trace.gpu_events(space))
    assert spans == {
        "/device:GPU:0": {"conv0": Span(0.0, 3.0, False), "small": Span(1.0, 2.0, False),
                          "bias0": Span(2.0, 3.5, False), "relu0": Span(4.0, 5.0, False),
                          "relu1": Span(7.0, 8.0, False), "swap_in": Span(0.5, 1.5, True),
                          "halo/_5": Span(5.0, 6.0, True)},
        # GPU:1's line starts 0.5 ms after GPU:0's.
        "/device:GPU:1": {"halo/_6": Span(5.0, 5.5, True), "concat": Span(5.5, 5.6, True),
                          "conv0": Span(6.0, 7.0, False), "pool": Span(7.25, 7.5, False)},
    }
    assert json.loads(json.dumps({op: dataclasses.asdict(span)
                                  for op, span in spans["/device:GPU:1"].items()}))["pool"] == \
        {"first_ms": 7.25, "last_ms": 7.5, "copy": False}


def test_timeline_per_device(space):
    timeline = step_trace.gpu_timeline(step_trace.op_spans(step_trace.gpu_events(space)))
    assert json.loads(json.dumps(timeline)) == timeline
    # GPU:0's kernels cover [0, 3.5], [4, 5], [7, 8]; the copy during [5, 6] is no kernel.
    assert timeline["/device:GPU:0"] == {
        "wall_ms": 8.0, "first_kernel_ms": 0.0, "busy_ms": pytest.approx(5.5),
        "idle_ms": pytest.approx(2.5),
        "longest_gaps": [{"ms": 2.0, "at_ms": 5.0, "after": "relu0", "before": "relu1"},
                         {"ms": 0.5, "at_ms": 3.5, "after": "bias0", "before": "relu0"}]}
    assert timeline["/device:GPU:1"] == {
        "wall_ms": 7.5, "first_kernel_ms": 6.0, "busy_ms": pytest.approx(1.25),
        "idle_ms": pytest.approx(0.25),
        "longest_gaps": [{"ms": 0.25, "at_ms": 7.0, "after": "conv0", "before": "pool"}]}
    shortest = step_trace.gpu_timeline(step_trace.op_spans(step_trace.gpu_events(space)), top=1)
    assert shortest["/device:GPU:0"]["longest_gaps"] == \
        timeline["/device:GPU:0"]["longest_gaps"][:1]


def test_kernel_time_per_op_type(space):
    by_type = step_trace.kernel_ms_by_op_type(step_trace.gpu_events(space))
    assert by_type == {
        "/device:GPU:0": {"Conv3D": pytest.approx(2.5), "Relu": pytest.approx(2.0),
                          "BiasAdd": pytest.approx(1.5), "Add": pytest.approx(1.0)},
        "/device:GPU:1": {"Conv3D": pytest.approx(1.0), "MaxPool": pytest.approx(0.25)}}
    assert list(by_type["/device:GPU:0"]) == ["Conv3D", "Relu", "BiasAdd", "Add"]


def test_gpu_activity_counts_unlabelled_kernels_once(space):
    # A line the profiler derives from the kernels (XLA's ops over them) must not count again.
    gpu0_plane = next(plane for plane in space.planes if plane.name == "/device:GPU:0")
    derived = gpu0_plane.lines.add(name="XLA Ops", timestamp_ns=1_000_000)
    derived.events.add(metadata_id=1, offset_ps=0, duration_ps=50 * MS)
    activity = step_trace.gpu_activity(space)
    gpu0 = activity["/device:GPU:0"]
    # Unlabelled kernels count (XLA's carry no op); copies are apart.
    assert list(gpu0.kernels) == ["kernel", "unlabelled_kernel", "runtime_kernel",
                                  "another_kernel"]
    assert gpu0.kernels["kernel"] == {"ms": pytest.approx(6.5), "count": 5}
    assert gpu0.kernels["unlabelled_kernel"] == {"ms": pytest.approx(2.0), "count": 1}
    assert gpu0.kernels["another_kernel"] == {"ms": pytest.approx(0.5), "count": 1}
    assert gpu0.copies == {"MemcpyH2D": {"ms": pytest.approx(1.0), "count": 1},
                           "MemcpyD2H": {"ms": pytest.approx(1.0), "count": 1}}
    # From the early line's start (0.2 ms) to relu1's end (9 ms); busy: 0.2-4.5 (the early
    # kernels, conv0, bias0), 5-7 (relu0, then the copy to the host), 8-9 (relu1).
    assert gpu0.wall_ms == pytest.approx(8.8)
    assert gpu0.busy_ms == pytest.approx(4.3 + 2.0 + 1.0)
    gpu1 = activity["/device:GPU:1"]
    assert sum(kernel["ms"] for kernel in gpu1.kernels.values()) == pytest.approx(sum(
        step_trace.kernel_ms_by_op_type(step_trace.gpu_events(space))["/device:GPU:1"].values()))
    assert json.loads(json.dumps(dataclasses.asdict(gpu1)))["busy_ms"] == pytest.approx(1.85)


def test_copies_told_from_kernels(space):
    events = step_trace.gpu_events(space)
    assert {event.op for event in events if event.copy} == {
        "swap_in", "halo/_5", "halo/_6", "concat"}
    assert step_trace.cross_device_copies(events) == {
        "/device:GPU:0": [{"op": "halo/_5:_Send", "kind": "MemcpyD2H", "start_ms": 5.0,
                           "end_ms": 6.0, "bytes": 4096}],
        "/device:GPU:1": [{"op": "halo/_6:_Recv", "kind": "MemcpyP2P", "start_ms": 5.0,
                           "end_ms": 5.5, "bytes": None},
                          {"op": "concat:ConcatV2", "kind": "MemcpyD2D", "start_ms": 5.5,
                           "end_ms": 5.6, "bytes": 128}]}


def test_read_profile_takes_the_file_or_its_directory(space, tmp_path):
    run = tmp_path / "plugins" / "profile" / "run"
    run.mkdir(parents=True)
    (run / "host.xplane.pb").write_bytes(space.SerializeToString())
    assert step_trace.read_profile(str(run / "host.xplane.pb")) == space
    assert step_trace.read_profile(str(tmp_path)) == space
    (run / "other.xplane.pb").write_bytes(space.SerializeToString())
    with pytest.raises(ValueError, match="2 .xplane.pb files"):
        step_trace.read_profile(str(tmp_path))


def test_measured_op_ms_on_a_cpu_trace(tmp_path):
    @tf.function
    def step(x, w):
        y = tf.matmul(x, w, name="traced_matmul")
        return tf.reduce_sum(tf.nn.relu(y, name="traced_relu"), name="traced_sum")

    x, w = tf.ones([64, 64]), tf.ones([64, 64])
    with tf.device("/CPU:0"):
        step(x, w)  # builds the function outside the trace
        tf.profiler.experimental.start(str(tmp_path), options=tf.profiler.experimental
                                       .ProfilerOptions(host_tracer_level=3))
        try:
            step(x, w).numpy()
        finally:
            tf.profiler.experimental.stop()
    measured = step_trace.measured_op_ms(step_trace.read_profile(str(tmp_path)), on_gpu=False)
    assert {"traced_matmul", "traced_relu", "traced_sum"} <= measured.keys()
    assert all(measured[op] > 0 for op in ("traced_matmul", "traced_relu", "traced_sum"))


def _partitioned(*graphs):
    """RunMetadata whose one function ran in `graphs`: (device, [(name, op, inputs, attrs)])."""
    from tensorflow.core.protobuf import config_pb2

    metadata = config_pb2.RunMetadata()
    function = metadata.function_graphs.add()
    for device, nodes in graphs:
        graph = function.partition_graphs.add()
        for name, op, inputs, attrs in nodes:
            node = graph.node.add(name=name, op=op, input=inputs, device=device)
            for key, value in attrs.items():
                node.attr[key].CopyFrom(value)
    return metadata


def _send(to):
    """A _Send's attributes, from CPU:0 to `to`."""
    task = b"/job:localhost/replica:0/task:0/"
    return {"send_device": tf.compat.v1.AttrValue(s=task + b"device:CPU:0"),
            "recv_device": tf.compat.v1.AttrValue(s=task + to)}


def test_placement_and_transfers_from_partition_graphs():
    cpu0, cpu1 = "/job:localhost/replica:0/task:0/device:CPU:0", \
        "/job:localhost/replica:0/task:0/device:CPU:1"
    shape = tf.compat.v1.AttrValue(list=tf.compat.v1.AttrValue.ListValue(
        shape=[tf.TensorShape([4, 8]).as_proto()]))
    unknown = tf.compat.v1.AttrValue(list=tf.compat.v1.AttrValue.ListValue(
        shape=[tf.TensorShape([None, 8]).as_proto()]))
    float32 = tf.compat.v1.AttrValue(type=tf.float32.as_datatype_enum)
    metadata = _partitioned(
        (cpu0, [("data", "_Arg", [], {"_output_shapes": shape, "T": float32}),
                ("rows", "_Arg", [], {"_output_shapes": unknown, "T": float32}),
                ("split", "SplitV", ["data"], {}),
                ("data/_1", "_Send", ["data"], _send(b"device:CPU:1")),
                ("rows/_3", "_Send", ["rows"], _send(b"device:CPU:1")),
                ("split/_5", "_Send", ["split:1"], _send(b"device:CPU:1")),
                ("ctrl/_7", "_Send", ["^split"], _send(b"device:CPU:1"))]),
        (cpu1, [("data/_2", "_Recv", [], {}), ("mm", "MatMul", ["data/_2"], {})]))
    assert step_trace.placed_ops(metadata.function_graphs) == {
        "data": "/device:CPU:0", "rows": "/device:CPU:0", "split": "/device:CPU:0",
        "data/_1": "/device:CPU:0", "rows/_3": "/device:CPU:0", "split/_5": "/device:CPU:0",
        "ctrl/_7": "/device:CPU:0", "data/_2": "/device:CPU:1", "mm": "/device:CPU:1"}
    assert step_trace.transfers(metadata.function_graphs) == [
        step_trace.Transfer("data", "/device:CPU:0", "/device:CPU:1", 4 * 8 * 4),
        step_trace.Transfer("rows", "/device:CPU:0", "/device:CPU:1", None),  # batch unknown
        step_trace.Transfer("split:1", "/device:CPU:0", "/device:CPU:1", None)]  # no shape


def test_host_op_spans_per_device():
    space = xplane_pb2.XSpace()
    host = _Plane(space, "/host:CPU")
    first, second = host.line("tf_Compute/1", 1_000_000), host.line("tf_Compute/2", 2_000_000)
    collective = host.line("collective_ops/7", 1_000_000)
    host.event(first, "conv:Conv3D", 0, 2 * MS)
    host.event(first, "ExecutorState::Process", 0, 5 * MS)  # the runtime's, no op
    host.event(second, "conv:Conv3D", 1 * MS, MS // 2)  # the same op again, later
    host.event(second, "replica_1/conv:Conv3D", 0, 3 * MS)
    host.event(first, "x/_1:_Send", 3 * MS, MS // 10)
    host.event(collective, "sgd/CollectiveReduceV2:CollectiveReduceV2", 4 * MS, MS)
    host.event(host.line("python", 0), "fn:Foo", 0, 9 * MS)  # Python's line, before the ops
    spans = step_trace.host_op_spans(space, {"conv": "/device:CPU:0", "x/_1": "/device:CPU:0",
                                             "replica_1/conv": "/device:CPU:1"})
    assert spans == {
        # tf_Compute/2 starts 1 ms after tf_Compute/1, whose first op starts the clock.
        "/device:CPU:0": {"conv": Span(0.0, 2.5, False), "x/_1": Span(3.0, 3.1, True)},
        "/device:CPU:1": {"replica_1/conv": Span(1.0, 4.0, False)},
        "unplaced": {"sgd/CollectiveReduceV2": Span(4.0, 5.0, False)}}
    timeline = step_trace.device_timeline(spans["/device:CPU:0"])
    assert (timeline["busy_ms"], timeline["idle_ms"]) == (2.5, 0.0)  # the send runs beside


def test_a_two_device_cpu_step_placed_and_traced(tmp_path):
    from tensorflow.python.eager import context

    @tf.function
    def step(x):
        with tf.device("/CPU:0"):
            y = tf.matmul(x, x, name="on_first")
        with tf.device("/CPU:1"):
            return tf.reduce_sum(tf.matmul(y, y, name="on_second"), name="summed")

    x = tf.ones([64, 64])
    context.enable_run_metadata()
    try:
        step(x)
        metadata = context.export_run_metadata()
    finally:
        context.disable_run_metadata()
    placed = step_trace.placed_ops(metadata.function_graphs)
    assert (placed["on_first"], placed["on_second"]) == ("/device:CPU:0", "/device:CPU:1")
    assert [(t.tensor, t.source, t.target) for t in step_trace.transfers(
        metadata.function_graphs)] == [("on_first", "/device:CPU:0", "/device:CPU:1")]
    tf.profiler.experimental.start(str(tmp_path), options=tf.profiler.experimental
                                   .ProfilerOptions(host_tracer_level=3))
    try:
        step(x).numpy()
    finally:
        tf.profiler.experimental.stop()
    spans = step_trace.host_op_spans(step_trace.read_profile(str(tmp_path)), placed)
    assert "on_first" in spans["/device:CPU:0"] and "on_second" in spans["/device:CPU:1"]
    assert spans["/device:CPU:0"]["on_first"].last_ms <= \
        spans["/device:CPU:1"]["on_second"].first_ms  # the second device waits for the first
