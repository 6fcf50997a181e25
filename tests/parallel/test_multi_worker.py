"""Multi-worker data x spatial training on TensorFlow's runtime, all on the CPU: worker processes
on loopback ports (each with its TF_CONFIG), each splitting its samples over two logical CPUs of
its own, trained against one device training on the whole batch. Every cluster is stopped when
its test ends, and every wait is bounded."""

import json
import os
import re
import subprocess
import sys
import time

import h5py
import numpy as np
import pytest
import tensorflow as tf

from tf_ucudnn.parallel import SpatialSplitError
from tf_ucudnn.parallel.cosmoflow import SpatialCosmoFlow
from tf_ucudnn.parallel.data import make_synthetic_volumes, slab_dataset
from tf_ucudnn.parallel.local_cluster import LocalCluster, tf_config
from tf_ucudnn.parallel.multi_worker import WorkerLayout, join_cluster

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SAMPLES, EDGE, CHANNELS, OUTPUTS = 16, 8, 2, 3
FILTERS, DENSE = (4, 8), (8,)
GLOBAL_BATCH, LEARNING_RATE = 4, 0.05
# Initial weights whose leaky ReLUs' inputs stay over 1e-6 from the kink for 40 steps: at seed
# 3 one comes within 1e-9 of it in step 1, where the rounding of a split sum picks the slope.
SEED = 1
RUN_TIMEOUT_S = 180  # one cluster's run; four workers on two cores take about 10 s
# Worker processes on the CPU whatever the machine, their log without TensorFlow's INFO lines.
WORKER_ENV = {"CUDA_VISIBLE_DEVICES": "", "TF_CPP_MIN_LOG_LEVEL": "1"}


@pytest.fixture(scope="module")
def volumes(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("volumes") / "volumes.h5")
    make_synthetic_volumes(path, SAMPLES, EDGE, CHANNELS, OUTPUTS, seed=4)
    return path


def _reference(path, steps):
    """One device training on the whole global batch: each step's loss, and the weights."""
    with h5py.File(path, "r") as file:
        x, y = file["volumes"][:], file["targets"][:]
    tf.keras.utils.set_random_seed(SEED)
    model = SpatialCosmoFlow(EDGE, CHANNELS, FILTERS, DENSE, OUTPUTS, mesh=[["/CPU:0"]])
    optimizer = tf.keras.optimizers.SGD(LEARNING_RATE)
    losses = []
    for step in range(steps):
        first = step * GLOBAL_BATCH % SAMPLES  # epoch after epoch
        batch = slice(first, first + GLOBAL_BATCH)
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(x[batch]) - y[batch]))
        optimizer.apply_gradients(zip(tape.gradient(loss, model.trainable_variables),
                                      model.trainable_variables))
        losses.append(float(loss))
    return losses, model.get_weights()


def _worker_command(data, out_dir, steps, *options):
    return lambda index: [
        sys.executable, "-m", "tf_ucudnn.parallel.multi_worker", data, "--spatial-split", "2",
        "--global-batch", str(GLOBAL_BATCH), "--steps", str(steps),
        "--filters", *map(str, FILTERS), "--dense", *map(str, DENSE),
        "--learning-rate", str(LEARNING_RATE), "--seed", str(SEED),
        "--out", os.path.join(out_dir, "run_{index}.json"),
        "--save-weights", os.path.join(out_dir, "weights_{index}.npz"), *options]


def _cluster(workers, data, out_dir, steps, *options):
    return LocalCluster(_worker_command(data, str(out_dir), steps, *options), workers,
                        str(out_dir / "logs"), env=lambda index: WORKER_ENV)


def _train(workers, data, out_dir, steps, *options):
    """Each worker's run (its JSON) and trained weights."""
    out_dir.mkdir()
    with _cluster(workers, data, out_dir, steps, *options) as cluster:
        statuses = cluster.wait(RUN_TIMEOUT_S)
        for index, status in enumerate(statuses):
            assert status == 0, f"worker {index} exited with {status}:\n" + \
                cluster.output(index)[-3000:]
    runs = [json.loads((out_dir / f"run_{index}.json").read_text()) for index in range(workers)]
    weights = []
    for index in range(workers):
        with np.load(out_dir / f"weights_{index}.npz") as arrays:
            weights.append([arrays[f"arr_{i}"] for i in range(len(arrays.files))])
    return runs, weights


def _assert_trained_as_one_device(runs, weights, reference_losses, reference_weights):
    for run in runs:
        np.testing.assert_allclose(run["losses"], reference_losses, rtol=1e-5)
    for trained in weights:
        assert len(trained) == len(reference_weights)
        for a, b in zip(trained, reference_weights):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    for trained in weights[1:]:  # the replicas hold the same weights, bit for bit
        for a, b in zip(trained, weights[0]):
            np.testing.assert_array_equal(a, b)


def _wait_for(cluster, index, pattern, timeout_s=RUN_TIMEOUT_S):
    """The first match of `pattern` in worker `index`'s output, waiting at most timeout_s."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = re.search(pattern, cluster.output(index))
        if found:
            return found
        if cluster.processes[index].poll() is not None:
            break
        time.sleep(0.05)
    pytest.fail(f"worker {index} did not print {pattern!r}:\n" + cluster.output(index)[-3000:])


def test_the_layout_keeps_spatial_groups_inside_a_worker(monkeypatch):
    workers = ("localhost:2222", "localhost:2223")
    devices = tuple(f"/job:worker/replica:0/task:1/device:CPU:{i}" for i in range(2))
    layout = WorkerLayout(workers, 1, devices, spatial_split=2, global_batch=8)
    assert layout.describe() == {
        "addresses": workers, "index": 1, "local_devices": devices, "spatial_split": 2,
        "global_batch": 8, "job": "worker", "num_workers": 2, "worker_batch": 4,
        "spatial_devices": devices}
    assert not layout.is_chief and layout.worker_name(0) == \
        "worker 0 (localhost:2222, /job:worker/replica:0/task:0)"
    with pytest.raises(SpatialSplitError, match=re.escape(
            "a spatial split over 3 devices needs 3 devices on each worker; worker 1 "
            "(localhost:2223, /job:worker/replica:0/task:1) has 2 (CPU:0, CPU:1)")):
        WorkerLayout(workers, 1, devices, spatial_split=3, global_batch=8)
    with pytest.raises(ValueError, match="a global batch of 5 does not split evenly over 2"):
        WorkerLayout(workers, 0, devices, spatial_split=2, global_batch=5)
    # join_cluster reads TF_CONFIG and this process's devices (conftest's 4 logical CPUs, where
    # there is no GPU), and refuses the layout before it makes a strategy.
    monkeypatch.setenv("TF_CONFIG", tf_config(workers, 1))
    devices = ("(CPU:0, CPU:1, CPU:2, CPU:3)" if not tf.config.list_physical_devices("GPU")
               else "(GPU:0")
    with pytest.raises(SpatialSplitError, match=re.escape(
            "a spatial split over 99 devices needs 99 devices on each worker; worker 1 "
            "(localhost:2223, /job:worker/replica:0/task:1) has ") + r"\d+ " + re.escape(devices)):
        join_cluster(spatial_split=99, global_batch=8)
    monkeypatch.setenv("TF_CONFIG", json.dumps({
        "cluster": {"chief": ["localhost:2221"], "worker": list(workers)},
        "task": {"type": "worker", "index": 0}}))
    with pytest.raises(ValueError, match=r"the jobs \['chief', 'worker'\]; .* 'worker' tasks"):
        join_cluster(spatial_split=2, global_batch=8)


class _CountedReads:
    """h5py.File, noting the samples each read of the volumes or targets takes."""

    def __init__(self, reads):
        self.reads = reads
        self.open = h5py.File

    def __call__(self, *args, **kwargs):
        return _CountedFile(self.open(*args, **kwargs), self.reads)


class _CountedFile:
    def __init__(self, file, reads):
        self.file, self.reads = file, reads

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        self.file.close()

    def __getitem__(self, name):
        return _CountedDataset(self.file[name], name, self.reads)


class _CountedDataset:
    def __init__(self, dataset, name, reads):
        self.dataset, self.name, self.reads = dataset, name, reads
        self.shape, self.dtype = dataset.shape, dataset.dtype

    def __getitem__(self, key):
        sample = key[0] if isinstance(key, tuple) else key
        self.reads.append((self.name, int(sample)))
        return self.dataset[key]


def test_each_worker_reads_only_its_own_samples(tmp_path, monkeypatch):
    path = str(tmp_path / "volumes.h5")
    make_synthetic_volumes(path, samples=10, size=8, channels=1, outputs=2, seed=1)
    with h5py.File(path, "r") as file:
        x, y = file["volumes"][:], file["targets"][:]
    reads = []
    monkeypatch.setattr(h5py, "File", _CountedReads(reads))
    # Global batches of 2 workers x 2 samples: 8 of the 10 samples, the second batch (4-7) on.
    for worker, samples in ((0, [4, 6]), (1, [5, 7])):
        del reads[:]
        batches = list(slab_dataset(path, devices=2, batch_size=2, num_workers=2,
                                    worker_index=worker, first_batch=1))
        assert len(batches) == 1
        (first, second), targets = batches[0]
        np.testing.assert_array_equal(first.numpy(), x[samples, :4])
        np.testing.assert_array_equal(second.numpy(), x[samples, 4:])
        np.testing.assert_array_equal(targets.numpy(), y[samples])
        assert sorted(reads) == sorted([("targets", s) for s in samples] +
                                       [("volumes", s) for s in samples for _ in range(2)])
    # Repeated, global batch 3 is the first of the second epoch.
    del reads[:]
    (first, _), targets = next(iter(slab_dataset(path, devices=2, batch_size=2, num_workers=2,
                                                 worker_index=1, first_batch=3, repeat=True)))
    np.testing.assert_array_equal(targets.numpy(), y[[5, 7]])
    assert {sample for _, sample in reads} <= {1, 3, 5, 7, 9}  # prefetched, but its own
    with pytest.raises(ValueError, match="worker_index 2 is not one of 2 workers"):
        slab_dataset(path, num_workers=2, worker_index=2)
    with pytest.raises(ValueError, match=r"a global batch of 12 samples \(3 worker\(s\) x 4\) "
                       "is more than the 10 samples"):
        slab_dataset(path, batch_size=4, num_workers=3)


@pytest.mark.parametrize("workers", [2, 4])
def test_data_x_spatial_training_over_workers_equals_one_device(workers, volumes, tmp_path):
    steps = 6  # past the first epoch of 4 global batches
    runs, weights = _train(workers, volumes, tmp_path / "run", steps)
    _assert_trained_as_one_device(runs, weights, *_reference(volumes, steps))
    for index, run in enumerate(runs):
        layout = run["layout"]
        assert (layout["index"], layout["num_workers"]) == (index, workers)
        assert layout["worker_batch"] == GLOBAL_BATCH // workers
        assert layout["spatial_devices"] == [
            f"/job:worker/replica:0/task:{index}/device:CPU:{i}" for i in range(2)]
        assert run["first_step"] == 0


def test_checkpoints_resume_on_any_worker_count(volumes, tmp_path):
    checkpoints = str(tmp_path / "checkpoints")
    reference_losses, reference_weights = _reference(volumes, 6)
    runs = []
    # Saved by 2 workers, resumed by 1, then by 4: the same steps as one uninterrupted run.
    for workers, steps in ((2, 2), (1, 4), (4, 6)):
        runs, weights = _train(workers, volumes, tmp_path / f"to_step_{steps}", steps,
                               "--checkpoint-dir", checkpoints, "--checkpoint-every", "1")
        for run in runs:
            assert run["first_step"] == steps - 2
            np.testing.assert_allclose(run["losses"], reference_losses[steps - 2:steps],
                                       rtol=1e-5)
    _assert_trained_as_one_device([], weights, reference_losses, reference_weights)
    assert tf.train.latest_checkpoint(checkpoints).endswith("ckpt-6")
    assert not [name for name in os.listdir(checkpoints) if name.startswith("workertemp")]


def test_a_killed_worker_is_named_by_the_survivor_and_training_resumes(volumes, tmp_path):
    checkpoints = str(tmp_path / "checkpoints")
    out = tmp_path / "killed"
    out.mkdir()
    with _cluster(2, volumes, out, 100000, "--checkpoint-dir", checkpoints,
                  "--checkpoint-every", "1") as cluster:
        _wait_for(cluster, 1, r'"step": 3,')
        cluster.kill(1)
        killed = time.monotonic()
        assert cluster.wait(60, workers=[0]) == [1]
        noticed_s = time.monotonic() - killed
        output = cluster.output(0)
    address = cluster.addresses[1]
    error = re.search(r"error: worker 1 \(" + re.escape(address) +
                      r", /job:worker/replica:0/task:1\) is down: training stopped at step "
                      r"(\d+) on worker 0 \(", output)
    assert error, output[-3000:]
    assert noticed_s < 30
    last_step = json.loads(output.split('"step": ')[-1].split(",")[0])  # the survivor's last
    assert int(error.group(1)) == last_step + 1 >= 4
    # Restarted from the last checkpoint (each step's), it goes on as if never stopped.
    resumed_from = int(tf.train.latest_checkpoint(checkpoints).rsplit("-", 1)[1])
    assert resumed_from == last_step + 1
    steps = resumed_from + 2
    runs, weights = _train(2, volumes, tmp_path / "resumed", steps,
                           "--checkpoint-dir", checkpoints)
    reference_losses, reference_weights = _reference(volumes, steps)
    assert [run["first_step"] for run in runs] == [resumed_from] * 2
    _assert_trained_as_one_device(runs, weights, reference_losses[resumed_from:],
                                  reference_weights)


def test_a_silent_worker_is_named_after_the_collective_timeout(volumes, tmp_path):
    out = tmp_path / "silent"
    out.mkdir()
    with _cluster(2, volumes, out, 100000, "--collective-timeout-s", "10") as cluster:
        _wait_for(cluster, 1, r'"step": 2,')
        os.kill(cluster.processes[1].pid, 19)  # SIGSTOP: alive, never answering
        assert cluster.wait(60, workers=[0]) == [1]
        output = cluster.output(0)
        cluster.kill(1)  # at once: a stopped process takes no SIGTERM
    # The step fails at the collectives' timeout (DeadlineExceeded) or, when it comes first, at
    # the coordination service's report of missing heartbeats (Unavailable).
    assert re.search(r"error: worker 1 \(" + re.escape(cluster.addresses[1]) +
                     r", /job:worker/replica:0/task:1\) did not answer within 5 s: training "
                     r"stopped at step \d+ on worker 0 .*\((DeadlineExceeded|Unavailable)Error: ",
                     output), output[-3000:]


def test_the_scaling_benchmark_runs_workers_on_the_cpu(tmp_path):
    out = tmp_path / "workers.json"
    result = subprocess.run(
        [sys.executable, os.path.join(REPO, "benchmarks", "spatial_scaling.py"), "--smoke",
         "--workers", "2", "--edge", "16", "--batch", "1", "--steps", "2", "--out", str(out)],
        capture_output=True, text=True, timeout=RUN_TIMEOUT_S, env={**os.environ, **WORKER_ENV})
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    report = json.loads(out.read_text())
    (row,) = report["workers"]
    assert (row["workers"], row["spatial"], row["global_batch"]) == (2, 2, 2)
    assert row["images_per_s"] > 0
    assert row["images_per_s_per_worker"] == pytest.approx(row["images_per_s"] / 2)
