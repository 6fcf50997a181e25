"""Batches copied to the GPU ahead of the steps that train them.

Keras's step copies its batch from the host at its start, and TensorFlow's copy to the GPU first
waits for the work already queued there, so the GPU computes nothing while the batch crosses (for
a batch of float32 images in pageable host memory, a large part of a fast step). An
`InputPrefetch` copies the batches from a thread of its own, `depth` batches ahead, so each copy
overlaps the steps before the one that trains it. The batches are the ones
Keras would train, in its order: an iterator Keras hands over again (an infinite dataset with
`steps_per_epoch`) goes on from the batches copied already, and a new one starts afresh.
"""
import queue
import threading
from typing import Optional

import tensorflow as tf

from tf_ucudnn.options import KerasOptions

# The dtypes copied ahead; other tensors (strings, variants) stay where the dataset made them.
_COPIED_DTYPES = (tf.float16, tf.bfloat16, tf.float32, tf.float64, tf.int8, tf.uint8, tf.int16,
                  tf.int32, tf.int64, tf.bool)


class _End:
    """The iterator has no batch left."""


class InputPrefetch:
    """Trains each batch of a Keras iterator from a copy on `device` made while earlier steps
    ran. Call it with Keras's train function and the iterator Keras passes that function."""

    def __init__(self, device: str, depth: int = KerasOptions.prefetch_batches):
        if depth < 1:
            raise ValueError(f"depth must be 1 or more, got {depth}")
        self.device = device
        self.depth = depth
        self._iterator = None
        self._batches: Optional[queue.Queue] = None
        self._stop: Optional[threading.Event] = None
        self._thread: Optional[threading.Thread] = None
        # Why a call's batches were not copied ahead (a distribution strategy's iterator places
        # them itself), or None.
        self.passed_over: Optional[str] = None

    @staticmethod
    def default_device() -> Optional[str]:
        """The device Keras's default strategy trains on, if it is a GPU: the first one."""
        gpus = tf.config.list_logical_devices("GPU")
        return gpus[0].name if gpus else None

    def __call__(self, train_function, iterator):
        if not isinstance(iterator, tf.data.Iterator):
            if not isinstance(iterator, (list, tuple)):  # batches handed over: nothing to copy
                self.passed_over = (f"the train function was given a "
                                    f"{type(iterator).__name__}, not a tf.data iterator")
            return train_function(iterator)
        if iterator is not self._iterator:
            self._start(iterator)
        batch = self._batches.get()
        if isinstance(batch, _End):
            self._batches.put(batch)  # later calls end too
            raise StopIteration
        if isinstance(batch, BaseException):
            self.close()
            raise batch
        return train_function([batch])  # Keras trains an iterable of batches one by one

    def close(self) -> None:
        """Stops the copying thread; batches it copied and no step took are dropped."""
        if self._stop is not None:
            self._stop.set()
            _drain(self._batches)  # a thread blocked on a full queue sees the stop
            self._thread.join(timeout=10)
        self._iterator = self._batches = self._stop = self._thread = None

    def _start(self, iterator) -> None:
        self.close()
        self._iterator = iterator
        self._batches = queue.Queue(maxsize=self.depth)
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._copy, args=(iterator, self._batches, self._stop),
            name="tf_ucudnn_input_prefetch", daemon=True)
        self._thread.start()

    def _copy(self, iterator, batches: queue.Queue, stop: threading.Event) -> None:
        def to_device(tensor):
            if isinstance(tensor, tf.Tensor) and tensor.dtype in _COPIED_DTYPES:
                return tf.identity(tensor)
            return tensor

        while not stop.is_set():
            try:
                next_batch = iterator.get_next_as_optional()
                if not next_batch.has_value():
                    _put(batches, _End(), stop)
                    return
                with tf.device(self.device):
                    batch = tf.nest.map_structure(to_device, next_batch.get_value())
            except BaseException as error:  # raised in the step that would have taken the batch
                _put(batches, error, stop)
                return
            _put(batches, batch, stop)


def _put(batches: queue.Queue, item, stop: threading.Event) -> None:
    while not stop.is_set():
        try:
            batches.put(item, timeout=0.1)
            return
        except queue.Full:
            continue


def _drain(batches: queue.Queue) -> None:
    while True:
        try:
            batches.get_nowait()
        except queue.Empty:
            return
