"""SpatialCosmoFlow trained over worker processes: the data dimension across the workers through
TensorFlow's MultiWorkerMirroredStrategy (its collectives all-reduce the gradients), the spatial
one inside each worker, over its own devices, as `SpatialCosmoFlow` splits a sample.

    # on every worker, TF_CONFIG naming the cluster and the worker's place in it:
    python -m tf_ucudnn.parallel.multi_worker volumes.h5 --spatial-split 2 --global-batch 8 \\
        --steps 1000 --checkpoint-dir /shared/checkpoints

A spatial group stays inside one worker: its slabs exchange halos at every convolution, forward
and backward, which TensorFlow copies between the worker's own devices, while across workers
only the gradients move, once a step. Each worker reads only its own samples' slabs
(`slab_dataset`'s sharding). A worker lost mid-step ends the others' step with a
`WorkerLostError` naming it and the step, not a hang: a dead worker's peers fail at once (its
connections are refused), a silent one's when the coordination service misses its heartbeats or
the collectives time out. Checkpoints hold the weights, the optimizer and the step, not the
worker count, so training resumes on any number of workers with the same global batch, as if it
had not stopped.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import sys
import time
from typing import Callable, Optional, Sequence

import h5py
import keras
import numpy as np
import tensorflow as tf
from tensorflow.python.eager import context as eager_context

from tf_ucudnn.core.errors import TfUcudnnError
from tf_ucudnn.parallel.cosmoflow import SpatialCosmoFlow
from tf_ucudnn.parallel.data import TARGETS, VOLUMES, slab_dataset
from tf_ucudnn.parallel.spatial import SpatialSplitError

# How long a step's all-reduce waits for a worker that neither answers nor fails (one that
# has died fails at once); long enough for the slowest worker's first step, which traces.
COLLECTIVE_TIMEOUT_S = 300.0
# After a failed step, how long each other worker has to answer a health check.
PROBE_TIMEOUT_S = 5.0


class WorkerLostError(TfUcudnnError, RuntimeError):
    """Another worker stopped answering mid-training: names it (index, address and task) and
    the step that failed."""

    def __init__(self, message: str, tasks: tuple[str, ...], step: int):
        super().__init__(message)
        self.tasks = tasks
        self.step = step


@dataclasses.dataclass(frozen=True)
class WorkerLayout:
    """This worker's place in its cluster and its share of the work: the global batch split
    evenly over the workers (data), each worker's samples split over `spatial_split` of its own
    devices (spatial)."""

    addresses: tuple[str, ...]  # every worker's host:port, by index
    index: int  # this worker's
    local_devices: tuple[str, ...]  # this worker's devices, fully named
    spatial_split: int
    global_batch: int
    job: str = "worker"  # "localhost" for a process with no cluster

    def __post_init__(self):
        if self.global_batch % self.num_workers:
            raise ValueError(f"a global batch of {self.global_batch} does not split evenly "
                             f"over {self.num_workers} workers")
        if not 1 <= self.spatial_split <= len(self.local_devices):
            devices = ", ".join(device.split("/device:")[-1] for device in self.local_devices)
            raise SpatialSplitError(
                f"a spatial split over {self.spatial_split} devices needs {self.spatial_split} "
                f"devices on each worker; {self.worker_name(self.index)} has "
                f"{len(self.local_devices)} ({devices}). A spatial group stays inside one "
                f"worker: split over at most {len(self.local_devices)}, or give each worker "
                "more devices")

    @property
    def num_workers(self) -> int:
        return len(self.addresses)

    @property
    def worker_batch(self) -> int:
        return self.global_batch // self.num_workers

    @property
    def is_chief(self) -> bool:
        return self.index == 0

    @property
    def spatial_devices(self) -> tuple[str, ...]:
        return self.local_devices[:self.spatial_split]

    def task(self, index: int) -> str:
        return f"/job:{self.job}/replica:0/task:{index}"

    def worker_name(self, index: int) -> str:
        return f"worker {index} ({self.addresses[index]}, {self.task(index)})"

    def describe(self) -> dict:
        """The layout as plain data, to print or write as JSON."""
        return {**dataclasses.asdict(self), "num_workers": self.num_workers,
                "worker_batch": self.worker_batch, "spatial_devices": self.spatial_devices}


def use_logical_cpus(count: int) -> None:
    """`count` logical CPU devices in this process where there is no GPU, for a spatial split
    on the CPU. Before TensorFlow's runtime starts, so before `join_cluster`."""
    if not tf.config.list_physical_devices("GPU"):
        tf.config.set_logical_device_configuration(
            tf.config.list_physical_devices("CPU")[0],
            [tf.config.LogicalDeviceConfiguration()] * count)


def local_devices(task: str) -> tuple[str, ...]:
    """This process's GPUs, or without any its logical CPUs, as `task`'s devices: counted from
    the device configuration, without starting TensorFlow's runtime (the strategy starts it)."""
    for kind in ("GPU", "CPU"):
        count = sum(len(tf.config.get_logical_device_configuration(device) or [device])
                    for device in tf.config.list_physical_devices(kind))
        if count:
            return tuple(f"{task}/device:{kind}:{index}" for index in range(count))
    raise RuntimeError("TensorFlow sees no device")


def join_cluster(spatial_split: int, global_batch: int,
                 collective_timeout_s: float = COLLECTIVE_TIMEOUT_S,
                 ) -> tuple[WorkerLayout, tf.distribute.MultiWorkerMirroredStrategy]:
    """This worker's layout, read from TF_CONFIG (without one, a cluster of this process alone),
    and the MultiWorkerMirroredStrategy of its cluster, one replica per worker on its first
    device, which leads the worker's spatial group. Call it at the program's start, after
    `use_logical_cpus`: the strategy starts TensorFlow's runtime with this worker's server."""
    resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
    cluster = resolver.cluster_spec()
    if cluster.jobs:
        if cluster.jobs != ["worker"]:
            raise ValueError(f"TF_CONFIG's cluster has the jobs {cluster.jobs}; multi-worker "
                             "training takes 'worker' tasks only (worker 0 is the chief)")
        addresses, index, job = tuple(cluster.job_tasks("worker")), resolver.task_id, "worker"
    else:
        addresses, index, job = ("localhost",), 0, "localhost"
    layout = WorkerLayout(addresses, index, local_devices(f"/job:{job}/replica:0/task:{index}"),
                          spatial_split, global_batch, job)
    gpus = bool(tf.config.list_physical_devices("GPU"))
    # One replica per worker even where it has several GPUs: the others are its spatial group's
    # (TFConfigClusterResolver would make every GPU a replica).
    replicas = tf.distribute.cluster_resolver.SimpleClusterResolver(
        cluster, task_type=resolver.task_type, task_id=resolver.task_id,
        num_accelerators={"GPU": 1} if gpus else {}, rpc_layer=resolver.rpc_layer or "grpc")
    implementation = tf.distribute.experimental.CommunicationImplementation
    communication = tf.distribute.experimental.CommunicationOptions(
        implementation=implementation.AUTO if gpus else implementation.RING,
        timeout_seconds=collective_timeout_s)
    return layout, tf.distribute.MultiWorkerMirroredStrategy(
        replicas, communication_options=communication)


def lost_worker_error(layout: WorkerLayout, step: int,
                      error: tf.errors.OpError) -> Optional[WorkerLostError]:
    """For a step that failed with `error`: a WorkerLostError naming the other workers that do
    not answer TensorFlow's health check (the one the strategy's own check uses), or None if
    they all answer."""
    lost = []
    for index in range(layout.num_workers):
        if index == layout.index:
            continue
        try:
            eager_context.context().check_collective_ops_peer_health(
                layout.task(index), timeout_in_ms=int(PROBE_TIMEOUT_S * 1000))
        except tf.errors.DeadlineExceededError:
            lost.append((index, f"did not answer within {PROBE_TIMEOUT_S:.0f} s"))
        except tf.errors.FailedPreconditionError:
            lost.append((index, "has restarted"))
        except tf.errors.UnavailableError:
            lost.append((index, "is down"))
    if not lost:
        return None
    workers = "; ".join(f"{layout.worker_name(index)} {why}" for index, why in lost)
    return WorkerLostError(
        f"{workers}: training stopped at step {step} on {layout.worker_name(layout.index)} "
        f"({type(error).__name__}: {_reason(error)})",
        tuple(layout.task(index) for index, _ in lost), step)


def _reason(error: tf.errors.OpError) -> str:
    """TensorFlow's reason for `error`, without the Python stack it puts before it."""
    lines = [line.strip() for line in error.message.splitlines()
             if line.strip() and not line[0].isspace()
             and not line.startswith(("Graph execution error", "Detected at node"))]
    return lines[0] if lines else error.message.strip()


@dataclasses.dataclass
class TrainingRun:
    """One worker's run: the global batch's loss of each step it ran, from `first_step` (its
    checkpoint's, or 0), and each step's seconds."""

    layout: dict
    first_step: int
    losses: list[float]
    step_seconds: list[float]

    @property
    def images_per_second(self) -> Optional[float]:
        """Of the whole cluster, over the steps after the first (which traces)."""
        timed = self.step_seconds[1:]
        return self.layout["global_batch"] * len(timed) / sum(timed) if timed else None

    def to_json(self) -> dict:
        return {**dataclasses.asdict(self), "images_per_second": self.images_per_second}


# (this worker's tf.distribute.InputContext, first global step) -> this worker's batches.
DatasetFn = Callable[[tf.distribute.InputContext, int], tf.data.Dataset]


def slab_batches(path: str, layout: WorkerLayout) -> DatasetFn:
    """This worker's samples of the HDF5 volumes at `path`, as slabs for its spatial group,
    epoch after epoch."""
    def batches(context: tf.distribute.InputContext, first_step: int) -> tf.data.Dataset:
        return slab_dataset(path, devices=layout.spatial_split,
                            batch_size=context.get_per_replica_batch_size(layout.global_batch),
                            num_workers=context.num_input_pipelines,
                            worker_index=context.input_pipeline_id, first_batch=first_step,
                            repeat=True)
    return batches


class CosmoFlowTrainer:
    """A SpatialCosmoFlow trained over the cluster by SGD on the mean squared error. Each
    step's loss is averaged over the global batch and the workers' gradients are summed, so
    the workers together take the step one device would take on the whole batch."""

    def __init__(self, layout: WorkerLayout, strategy: tf.distribute.Strategy,
                 learning_rate: float = 0.01, seed: int = 0, **model_args):
        self.layout, self.strategy = layout, strategy
        with strategy.scope():
            # The initial weights of a model made alone with this seed (the strategy copies
            # worker 0's to the others anyway).
            keras.utils.set_random_seed(seed)
            self.model = SpatialCosmoFlow(mesh=[list(layout.spatial_devices)], **model_args)
            self.optimizer = keras.optimizers.SGD(learning_rate)
            self.optimizer.build(self.model.trainable_variables)
        self.step = tf.Variable(0, dtype=tf.int64, trainable=False)  # the next step's number
        # The variables by position: Keras 3 models track lists of layers for Keras, not for
        # tf.train.Checkpoint.
        self.checkpoint = tf.train.Checkpoint(model=list(self.model.variables),
                                              optimizer=list(self.optimizer.variables),
                                              step=self.step)

    def fit(self, dataset_fn: DatasetFn, steps: int, checkpoint_dir: Optional[str] = None,
            checkpoint_every: int = 1,
            on_step: Optional[Callable[[int, float, float], None]] = None) -> TrainingRun:
        """Trains up to step `steps`, from the last checkpoint in `checkpoint_dir` if there is
        one, saving one every `checkpoint_every` steps and at the end. `on_step(step, loss,
        seconds)` after each step. A step that fails because another worker stopped answering
        raises WorkerLostError."""
        checkpoints = self._restore(checkpoint_dir)
        first_step = int(self.step.numpy())
        batches = iter(self.strategy.distribute_datasets_from_function(
            lambda context: dataset_fn(context, first_step)))
        train_step = self._train_step()
        run = TrainingRun(self.layout.describe(), first_step, [], [])
        for step in range(first_step, steps):
            started = time.perf_counter()
            try:
                loss = float(train_step(batches))
                self.step.assign(step + 1)
                if checkpoints is not None and (
                        (step + 1) % checkpoint_every == 0 or step + 1 == steps):
                    self._save(checkpoints)
            except tf.errors.OpError as error:
                lost = lost_worker_error(self.layout, step, error)
                if lost is None:
                    raise
                raise lost from error
            run.losses.append(loss)
            run.step_seconds.append(time.perf_counter() - started)
            if on_step:
                on_step(step, loss, run.step_seconds[-1])
        return run

    def _train_step(self):
        model, optimizer, strategy = self.model, self.optimizer, self.strategy
        global_batch = self.layout.global_batch

        def replica_step(slabs, targets):
            with tf.GradientTape() as tape:
                errors = tf.reduce_mean(tf.square(model(slabs, training=True) - targets), -1)
                loss = tf.nn.compute_average_loss(errors, global_batch_size=global_batch)
            gradients = tape.gradient(loss, model.trainable_variables)
            # Keras's optimizer sums the replicas' gradients through the strategy.
            optimizer.apply_gradients(zip(gradients, model.trainable_variables))
            return loss

        @tf.function
        def train_step(batches):
            slabs, targets = next(batches)
            losses = strategy.run(replica_step, args=(slabs, targets))
            return strategy.reduce(tf.distribute.ReduceOp.SUM, losses, axis=None)
        return train_step

    def _restore(self, checkpoint_dir: Optional[str]) -> Optional[tf.train.CheckpointManager]:
        """Restores the last checkpoint there is; the manager that saves the next ones. Worker 0
        writes them; the others save too (TensorFlow's multi-worker guide: the strategy may
        need every worker), each into a folder of its own, removed after."""
        if checkpoint_dir is None:
            return None
        latest = tf.train.latest_checkpoint(checkpoint_dir)
        if latest:
            self.checkpoint.restore(latest).assert_consumed()
        directory = (checkpoint_dir if self.layout.is_chief
                     else os.path.join(checkpoint_dir, f"workertemp_{self.layout.index}"))
        return tf.train.CheckpointManager(self.checkpoint, directory, max_to_keep=2)

    def _save(self, checkpoints: tf.train.CheckpointManager) -> None:
        checkpoints.save(checkpoint_number=int(self.step.numpy()))
        if not self.layout.is_chief:
            shutil.rmtree(checkpoints.directory, ignore_errors=True)


def _volume_shape(path: str) -> dict:
    """The model arguments the HDF5 volumes at `path` set: input size, channels, outputs."""
    with h5py.File(path, "r") as file:
        shape = file[VOLUMES].shape
        return dict(input_size=tuple(shape[1:4]), channels=shape[4],
                    outputs=file[TARGETS].shape[1])


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m tf_ucudnn.parallel.multi_worker",
        description="Train SpatialCosmoFlow as one worker of the cluster TF_CONFIG names (or "
        "alone without it): data parallel across workers, each sample split along its depth "
        "over this worker's devices. `{index}` in --out and --save-weights is replaced by the "
        "worker's index.")
    parser.add_argument("data", help="HDF5 volumes and targets (parallel.data.write_volumes)")
    parser.add_argument("--spatial-split", type=int, default=1)
    parser.add_argument("--global-batch", type=int, required=True,
                        help="samples per step over all workers")
    parser.add_argument("--steps", type=int, required=True,
                        help="train up to this step (counting the checkpoint's)")
    parser.add_argument("--filters", type=int, nargs="+", default=[16, 32, 64, 128])
    parser.add_argument("--dense", type=int, nargs="+", default=[128, 64])
    parser.add_argument("--learning-rate", type=float, default=0.01)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--checkpoint-dir")
    parser.add_argument("--checkpoint-every", type=int, default=100)
    parser.add_argument("--collective-timeout-s", type=float, default=COLLECTIVE_TIMEOUT_S)
    parser.add_argument("--logical-cpus", type=int,
                        help="logical CPU devices where there is no GPU (default: the split)")
    parser.add_argument("--out", help="the run as JSON: layout, losses, step times, img/s")
    parser.add_argument("--save-weights", help="the trained weights, as a .npz of arrays")
    return parser


def main(argv: Optional[Sequence[str]] = None) -> TrainingRun:
    """Runs one worker; prints its layout and each step as JSON lines. Exits with status 2 for
    a layout the cluster cannot take, 1 when another worker is lost."""
    parser = _parser()
    args = parser.parse_args(argv)
    use_logical_cpus(args.logical_cpus or args.spatial_split)
    try:
        layout, strategy = join_cluster(args.spatial_split, args.global_batch,
                                        args.collective_timeout_s)
    except ValueError as error:  # SpatialSplitError too
        parser.exit(2, f"{parser.prog}: error: {error}\n")
    print(json.dumps({"layout": layout.describe()}), flush=True)
    trainer = CosmoFlowTrainer(layout, strategy, args.learning_rate, args.seed,
                               filters=args.filters, dense=args.dense,
                               **_volume_shape(args.data))

    def report(step, loss, seconds):
        print(json.dumps({"worker": layout.index, "step": step, "loss": loss,
                          "seconds": seconds}), flush=True)

    try:
        run = trainer.fit(slab_batches(args.data, layout), args.steps, args.checkpoint_dir,
                          args.checkpoint_every, report)
    except WorkerLostError as error:
        parser.exit(1, f"{parser.prog}: error: {error}\n")
    if args.save_weights:
        np.savez(args.save_weights.format(index=layout.index), *trainer.model.get_weights())
    if args.out:
        with open(args.out.format(index=layout.index), "w") as out:
            json.dump(run.to_json(), out, indent=1)
    return run


if __name__ == "__main__":
    main(sys.argv[1:])
