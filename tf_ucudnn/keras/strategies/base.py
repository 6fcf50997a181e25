"""What every decision of the callback is: a named choice with its reason, which owns each change
it makes to global state (layers switched, Grappler's or Keras's settings) and undoes them all
when training ends."""

from __future__ import annotations

import contextlib

import keras

from tf_ucudnn.report import StrategyChoice


class Strategy:
    """A decision made once for a training run. Every change it makes that outlives a call is
    entered on `undo` (a context manager or a callback), which `close` unwinds at train end."""

    def __init__(self, name: str, reason: str):
        self.name = name
        self.reason = reason
        self.undo = contextlib.ExitStack()

    def choice(self) -> StrategyChoice:
        return StrategyChoice(self.name, self.reason)

    def begin(self) -> None:
        """Makes the changes this decision needs from the first step on."""

    def close(self) -> None:
        self.undo.close()


def retrace(model: keras.Model) -> None:
    """Keras's train function made again now, its test and predict functions when next needed,
    so that they run the layers and train step as they are switched now."""
    model.train_function = None
    model.make_train_function()
    model.test_function = None
    model.predict_function = None
