"""Which kernel the callback's step trains batch normalization with: Keras's own ops, a fused
kernel asked for (`fuse_batch_norm`, from the first step), or, where the choice is left to the
callback, `TRIAL_BATCH_NORM_KERNEL` tried by the step trial with the plans and kept only with them;
and, with `stream_conv_batch_norm`, each convolution and the batch normalization reading it
trained as one op whose backward pass runs in micro-batches (`tf_ucudnn.keras.streamed_conv_bn`).
"""

from __future__ import annotations

import contextlib

import keras

from tf_ucudnn.keras.batch_norm_forms import batch_norm_layers, fused_batch_norm
from tf_ucudnn.keras.streamed_conv_bn import streamed_conv_batch_norm
from tf_ucudnn.keras.strategies.base import Strategy
from tf_ucudnn.options import KerasOptions

# The kernel the step trial tries where `fuse_batch_norm` is left to the callback and XLA does not
# compile the step: one XLA computation each way, where Keras runs about twenty ops. Inside XLA's
# step it reads each activation once less than Keras's moments, yet ResNet-50's step was no faster
# with it (docs/results.md), so it is not tried there.
TRIAL_BATCH_NORM_KERNEL = "xla"
LEFT_TO_TRIAL = "left_to_trial"


class BatchNormTraining(Strategy):
    """`kernel`: the kernel training now (after training, the last one trained with), None for
    Keras's own; `unfused` and `unstreamed`: the layers it left as they are, with why."""

    def __init__(self, name: str, reason: str, model: keras.Model, options: KerasOptions):
        super().__init__(name, reason)
        self.model, self.options = model, options
        self.kernel = None
        self.unfused, self.unstreamed = [], []
        self._trial_kernel = contextlib.ExitStack()  # undone alone if Keras's step wins

    def begin(self) -> None:
        asked = self.options.batch_norm_kernel
        if asked:
            self.kernel = asked
            self.unfused = self.undo.enter_context(fused_batch_norm(self.model, asked))
        if self.options.stream_conv_batch_norm:
            self.unstreamed = self.undo.enter_context(
                streamed_conv_batch_norm(self.model, self.options.stream_conv_batch_norm))
        self.undo.enter_context(self._trial_kernel)

    def try_trial_kernel(self) -> bool:
        """Where the trial decides, switches the layers to `TRIAL_BATCH_NORM_KERNEL` for the
        planned step; whether some layer is switched."""
        if self.name != LEFT_TO_TRIAL:
            return False
        if self.kernel is not None:  # switched for an earlier trial, and kept
            return True
        left_alone = self._trial_kernel.enter_context(
            fused_batch_norm(self.model, TRIAL_BATCH_NORM_KERNEL))
        if len(left_alone) == len(batch_norm_layers(self.model)):
            self._trial_kernel.close()
            return False
        self.kernel, self.unfused = TRIAL_BATCH_NORM_KERNEL, left_alone
        if self.options.verbose:
            print(f"tf_ucudnn: the step trial tries batch normalization with the "
                  f"{TRIAL_BATCH_NORM_KERNEL!r} kernel; {len(left_alone)} layer(s) left to Keras",
                  flush=True)
        return True

    def drop_trial_kernel(self) -> None:
        """Keras's normalization again, where the trial's kernel lost."""
        if self.name == LEFT_TO_TRIAL:
            self._trial_kernel.close()
            self.kernel, self.unfused = None, []

    def summary_lines(self) -> list[str]:
        lines = []
        if self.kernel:
            lines.append(f"  {len(self.unfused)} batch normalization layer(s) left unfused")
            lines += [f"    {u.layer}: {u.reason}" for u in self.unfused]
        if self.options.stream_conv_batch_norm:
            lines.append(f"  convolutions trained with their batch normalization, backward in "
                         f"{self.options.stream_conv_batch_norm} micro-batches; "
                         f"{len(self.unstreamed)} layer(s) not paired")
            lines += [f"    {u.layer}: {u.reason}" for u in self.unstreamed]
        return lines


def choose_batch_norm(model: keras.Model, options: KerasOptions) -> BatchNormTraining:
    asked = options.batch_norm_kernel
    if asked:
        name, reason = "fused", f"fuse_batch_norm={options.fuse_batch_norm!r}: the {asked!r} kernel"
    elif options.fuse_batch_norm is False:
        name, reason = "keras", "fuse_batch_norm=False"
    elif not batch_norm_layers(model):
        name, reason = "keras", "no BatchNormalization layer"
    elif not options.trial_steps:
        name, reason = "keras", "trial_steps=0: no kernel goes untimed into the step"
    elif options.memory_budget is not None:
        name, reason = "keras", "under a memory budget, where no step trial runs"
    elif model.jit_compile:
        name, reason = "keras", (f"compiled by XLA, where the {TRIAL_BATCH_NORM_KERNEL!r} kernel "
                                 f"was no faster")
    else:
        name, reason = LEFT_TO_TRIAL, f"the step trial tries the {TRIAL_BATCH_NORM_KERNEL!r} kernel"
    if options.stream_conv_batch_norm:
        reason += (f"; convolutions and their batch normalization streamed in "
                   f"{options.stream_conv_batch_norm} micro-batches")
    return BatchNormTraining(name, reason, model, options)
