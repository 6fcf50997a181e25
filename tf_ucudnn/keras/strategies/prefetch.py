"""Whether the callback's train function trains batches copied to the GPU ahead of their steps
(`tf_ucudnn.keras.input_prefetch`): Keras's step would otherwise wait for its batch to cross.
Not under a memory budget (each batch ahead holds GPU memory), nor where Keras's train function
takes several batches a call; a distribution strategy's iterator is passed over as it comes."""

from __future__ import annotations

from typing import Optional

import keras

from tf_ucudnn.keras.input_prefetch import InputPrefetch
from tf_ucudnn.keras.strategies.base import Strategy
from tf_ucudnn.options import KerasOptions


class InputCopies(Strategy):
    def __init__(self, prefetch: Optional[InputPrefetch], reason: str):
        super().__init__("copied_ahead" if prefetch else "not_copied_ahead", reason)
        self.prefetch = prefetch
        if prefetch is not None:
            self.undo.callback(prefetch.close)

    def train(self, train_function, iterator):
        """`train_function(iterator)`, its batch copied ahead where chosen."""
        if self.prefetch is None:
            return train_function(iterator)
        return self.prefetch(train_function, iterator)

    @property
    def report_text(self) -> str:
        """Where the batches were copied ahead, or why not (learnt at a step, for an iterator
        passed over)."""
        passed_over = self.prefetch.passed_over if self.prefetch else None
        if passed_over:
            return f"batches not copied ahead: {passed_over}"
        return self.reason if self.prefetch else f"batches not copied ahead: {self.reason}"


def choose_input_prefetch(model: keras.Model, options: KerasOptions) -> InputCopies:
    device = InputPrefetch.default_device()
    refusal = ("prefetch_batches=0" if not options.prefetch_batches else
               "no GPU" if device is None else
               "under a memory budget (each batch ahead holds GPU memory)"
               if options.memory_budget is not None else
               f"steps_per_execution={model.steps_per_execution} (Keras's train function takes "
               f"several batches a call)" if model.steps_per_execution != 1 else None)
    if refusal:
        return InputCopies(None, refusal)
    return InputCopies(InputPrefetch(device, options.prefetch_batches),
                       f"batches copied to {device} up to {options.prefetch_batches} step(s) "
                       f"ahead")
