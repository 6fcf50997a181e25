"""A cluster of worker processes on this host, for trying multi-worker training on one machine and
for its tests: each process started with its TF_CONFIG (TensorFlow servers on free loopback ports),
its output in a file, and every process stopped when the cluster is left, whatever happened.

    with LocalCluster(lambda index: [sys.executable, "-m", "tf_ucudnn.parallel.multi_worker",
                                     "volumes.h5", "--global-batch", "8"], workers=2,
                      log_dir="logs") as cluster:
        cluster.wait(timeout_s=600)
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import time
from typing import Callable, Optional, Sequence

STOP_GRACE_S = 5.0  # after SIGTERM, before SIGKILL


def free_ports(count: int) -> list[int]:
    """Ports free on the loopback now, each asked of the kernel (held together, so distinct)."""
    sockets = [socket.socket() for _ in range(count)]
    try:
        for sock in sockets:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def tf_config(addresses: Sequence[str], index: int) -> str:
    """TF_CONFIG of worker `index` of a cluster of workers at `addresses`, as TensorFlow's
    multi-worker guide writes it."""
    return json.dumps({"cluster": {"worker": list(addresses)},
                       "task": {"type": "worker", "index": index}})


class LocalCluster:
    """`workers` processes, worker i running `command(i)` with this process's environment, its
    TF_CONFIG and `env(i)` (its own variables: CUDA_VISIBLE_DEVICES, say); output (stdout and
    stderr together) in `log_dir/worker_<i>.log`. Entering starts them, leaving stops them."""

    def __init__(self, command: Callable[[int], list[str]], workers: int, log_dir: str,
                 env: Optional[Callable[[int], dict]] = None):
        self.addresses = [f"localhost:{port}" for port in free_ports(workers)]
        self.command = command
        self.log_dir = log_dir
        self.env = env or (lambda index: {})
        self.processes: list[subprocess.Popen] = []

    def __enter__(self) -> "LocalCluster":
        os.makedirs(self.log_dir, exist_ok=True)
        try:
            for index in range(len(self.addresses)):
                env = {**os.environ, "TF_CONFIG": tf_config(self.addresses, index),
                       **self.env(index)}
                with open(self.log_path(index), "w") as log:
                    self.processes.append(subprocess.Popen(
                        self.command(index), stdout=log, stderr=subprocess.STDOUT, env=env))
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc_info) -> None:
        self.stop()

    def log_path(self, index: int) -> str:
        return os.path.join(self.log_dir, f"worker_{index}.log")

    def output(self, index: int) -> str:
        with open(self.log_path(index), errors="replace") as log:
            return log.read()

    def wait(self, timeout_s: float, workers: Optional[Sequence[int]] = None) -> list[int]:
        """The exit statuses of `workers` (default: all), waiting at most `timeout_s` in all;
        past it every worker is stopped and TimeoutError names those still running."""
        deadline = time.monotonic() + timeout_s
        indices = range(len(self.processes)) if workers is None else workers
        statuses = []
        for index in indices:
            try:
                statuses.append(self.processes[index].wait(
                    timeout=max(0.0, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                running = [i for i in indices if self.processes[i].poll() is None]
                self.stop()
                raise TimeoutError(f"workers {running} of {len(self.processes)} still running "
                                   f"after {timeout_s:.0f} s; logs in {self.log_dir}") from None
        return statuses

    def kill(self, index: int) -> None:
        """Worker `index` killed at once (SIGKILL), as a machine that fails."""
        self.processes[index].kill()
        self.processes[index].wait()

    def stop(self) -> None:
        """Every worker still running terminated, then killed if it has not ended in
        STOP_GRACE_S."""
        running = [process for process in self.processes if process.poll() is None]
        for process in running:
            process.terminate()
        deadline = time.monotonic() + STOP_GRACE_S
        for process in running:
            try:
                process.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
