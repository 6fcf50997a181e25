"""benchmarks/data_parallel_trace.py: its smoke run on two logical CPUs, and how it reads ops."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

_PATH = Path(__file__).parents[2] / "benchmarks" / "data_parallel_trace.py"
_SPEC = importlib.util.spec_from_file_location("data_parallel_trace", _PATH)
data_parallel_trace = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(data_parallel_trace)

CPU0, CPU1 = "/device:CPU:0", "/device:CPU:1"


def test_ops_told_by_replica_and_category():
    replica_of, category = data_parallel_trace.replica_of, data_parallel_trace.category
    assert replica_of("gradient_tape/replica_1/model/conv0/Conv3D") == 1
    assert replica_of("replica_12_model_dense_readvariableop_resource") == 12
    assert replica_of("model/conv0/Conv3D") == replica_of("not_replica_1/x") == 0
    assert category("sgd/CollectiveReduceV2", "CollectiveReduceV2", "SGD") == "all_reduce"
    assert category("data/_1", "_Send", "SGD") == "transfer"
    assert category("sgd_1_2/update_0/AssignSubVariableOp", "AssignSubVariableOp",
                    "SGD") == "optimizer"
    assert category("sgd_old/x", "Mul", "SGD") == "forward"  # another scope, not the optimizer
    assert category("gradient_tape/model/conv0/Conv3DBackpropFilter", "Conv3DBackpropFilter",
                    "SGD") == "backward"
    misplaced = data_parallel_trace.misplaced_ops(
        {"model/head/MatMul": CPU1, "replica_1/model/head/MatMul": CPU1,
         "gradient_tape/replica_1/model/conv/Conv3D": CPU0, "sgd/update_1/Mul": CPU0},
        [["/CPU:0"], ["/CPU:1"]], ("model/", "gradient_tape/"))
    assert misplaced == [
        {"op": "gradient_tape/replica_1/model/conv/Conv3D", "device": CPU0, "replica": 1},
        {"op": "model/head/MatMul", "device": CPU1, "replica": 0}]


def test_smoke_run_on_two_logical_cpus(tmp_path):
    # Its own process: its two logical CPUs, and no other test's strategy holding the
    # collectives' first group key with other devices.
    out = tmp_path / "trace.json"
    subprocess.run([sys.executable, str(_PATH), "--edge", "16", "--channels", "2", "--filters",
                    "4", "8", "--batch", "2", "--steps", "2", "--out", str(out)],
                   check=True, capture_output=True, timeout=300)
    report = json.loads(out.read_text())
    runs = report["runs"]
    assert {name: run["rows_per_replica"] for name, run in runs.items()} == {
        "one_device": [2], "whole_batch_each": [4, 4], "train_on_batch": [2, 2]}
    batch_bytes = 4 * 16**3 * 2 * 4  # the whole batch's volumes, float32
    whole = [t for t in runs["whole_batch_each"]["transfers"] if t["bytes"] == batch_bytes]
    assert [(t["from"], t["to"]) for t in whole] == [(CPU0, CPU1)]
    # Shared out, each replica's rows come to its device before the step: only scalars cross.
    assert max(t["bytes"] or 0 for t in runs["train_on_batch"]["transfers"]) <= 8
    for name, run in runs.items():
        assert run["misplaced_ops"] == [], name  # each replica's head and loss on its device
        assert run["functions_built_after_first_step"] == 0, name
        expected = {CPU0: 1, CPU1: 1} if run["replicas"] == 2 else {CPU0: 0}
        assert run["all_reduce_ops_per_device"] == expected, name  # the gradients packed
    for device in (CPU0, CPU1):
        row = runs["train_on_batch"]["devices"][device]
        assert row["busy_ms"] > 0 and row["op_ms_by_category"]["backward"] > 0
    assert set(report["summary"]) == set(runs)
    assert report["summary"]["one_device"]["op_ms_vs_one_device_per_replica"] == \
        pytest.approx(1.0)
