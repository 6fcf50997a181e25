"""The settings every entry point takes, parsed and checked once, with the one set of defaults.

    options = tf_ucudnn.Options(workspace_limit="64MiB", memory_budget="16GiB")
    step, report = tf_ucudnn.rewrite(fn, options=options)
    step, report = tf_ucudnn.rewrite(fn, options=options, memory_budget="12GiB")  # an override
    callback = tf_ucudnn.MicroBatchCallback(options=tf_ucudnn.KerasOptions(trial_steps=0))

`tf_ucudnn.rewrite`, `Converter`, `MicroBatchCallback`, `tune_keras_batch_size` and the
`tf-ucudnn` command each fold their `options=` and keyword overrides into one `Options`
(`Options.resolve`) and hand it on; sizes are read from bytes or text such as "64MiB" here and
nowhere else, and the layers below take plain numbers.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Optional, Sequence, Union

from tf_ucudnn.core.errors import TfUcudnnError
from tf_ucudnn.core.units import MIB, parse_bytes

Size = Union[int, str, None]

DEFAULT_WORKSPACE_LIMIT = 64 * MIB
# The micro-batch counts the first layers may run in under a memory budget.
DEFAULT_MICRO_BATCHES = (4, 8)
# How batch normalization takes its statistics when a step runs in micro-batches: the whole
# batch's (the same update), or each micro-batch's own (ghost batch normalization).
BATCH_NORM_STATISTICS = ("batch", "micro_batch")
# The kernels a BatchNormalization layer may train with (tf_ucudnn.keras.batch_norm_forms).
BATCH_NORM_KERNELS = ("cudnn", "xla", "ucudnn")


def default_database() -> str:
    """The profile database file: $TF_UCUDNN_DATABASE, else ~/.cache/tf_ucudnn/profiles.sqlite."""
    return os.environ.get("TF_UCUDNN_DATABASE") or os.path.join(
        os.path.expanduser("~"), ".cache", "tf_ucudnn", "profiles.sqlite")


class OptionsError(TfUcudnnError, ValueError):
    """An option that cannot be used; names it and says why."""


@dataclasses.dataclass(frozen=True)
class Options:
    """What to plan and within which limits.

    workspace_limit: each convolution kernel's cuDNN workspace, bytes or a size such as "64MiB";
      None leaves the convolutions to TensorFlow.
    workspace_budget: optionally, all kernels' workspaces together (μ-cuDNN's network-wide ILP).
    memory_budget: optionally, the device memory a training step must fit in (swaps,
      recomputations and micro-batched first layers are planned for it).
    micro_batches: the micro-batch counts the first layers may run in under a memory budget.
    database: the profile database file (`default_database()` if None).
    profiles: JSON-lines profile files imported into the database first.
    device, cudnn_version: whose measurements to plan with, where the database holds several
      machines' and this process cannot measure.
    profiling_seconds: optionally, how long measuring missing profiles may take before the
      layers still unmeasured are left alone (measured later, where the entry point can).
    """

    workspace_limit: Size = DEFAULT_WORKSPACE_LIMIT
    workspace_budget: Size = None
    memory_budget: Size = None
    micro_batches: Sequence[int] = DEFAULT_MICRO_BATCHES
    database: Optional[str] = None
    profiles: Sequence[str] = ()
    device: Optional[str] = None
    cudnn_version: Optional[int] = None
    profiling_seconds: Optional[float] = None

    # The settings only tf_ucudnn's own planner reads: a planner given by the caller ignores them.
    PLANNER_SETTINGS = ("workspace_budget", "database", "profiles", "device", "cudnn_version",
                        "profiling_seconds")

    def __post_init__(self):
        for name in ("workspace_limit", "workspace_budget", "memory_budget"):
            value = getattr(self, name)
            if value is not None:
                try:
                    object.__setattr__(self, name, parse_bytes(value))
                except ValueError as error:
                    raise OptionsError(f"{name}: {error}") from None
        if isinstance(self.profiles, (str, os.PathLike)):
            raise OptionsError(f"profiles: a list of files, not the single path {self.profiles!r}")
        object.__setattr__(self, "profiles", tuple(os.fspath(p) for p in self.profiles))
        micro_batches = tuple(self.micro_batches)
        if any(not isinstance(count, int) or count < 2 for count in micro_batches):
            raise OptionsError(f"micro_batches: counts of 2 or more, got {list(micro_batches)}")
        object.__setattr__(self, "micro_batches", micro_batches)
        object.__setattr__(self, "database", self.database or default_database())
        if self.profiling_seconds is not None and not self.profiling_seconds > 0:
            raise OptionsError(f"profiling_seconds: a positive number of seconds or None, got "
                               f"{self.profiling_seconds!r}")

    @classmethod
    def resolve(cls, options: Optional["Options"] = None, **overrides) -> "Options":
        """`options` (the defaults if None) with `overrides` set; a name that is no setting of
        this class is an error naming it. Entry points call this with their keyword arguments."""
        if options is not None and not isinstance(options, cls):
            raise OptionsError(f"options: a {cls.__name__} is needed, got a {type(options).__name__}")
        fields = {field.name for field in dataclasses.fields(cls)}
        unknown = sorted(set(overrides) - fields)
        if unknown:
            raise OptionsError(f"{', '.join(unknown)}: not a setting of {cls.__name__} (its "
                               f"settings: {', '.join(sorted(fields))})")
        return dataclasses.replace(options or cls(), **overrides)

    @property
    def plans_convolutions(self) -> bool:
        return self.workspace_limit is not None or self.workspace_budget is not None

    def check_planner(self, planner) -> None:
        """A given planner plans by its own settings: any of ours that only our planner reads is
        an error naming both, rather than silently unused."""
        if planner is None:
            return
        default = type(self)()
        given = [name for name in self.PLANNER_SETTINGS
                 if getattr(self, name) != getattr(default, name)]
        if given:
            raise OptionsError(f"{', '.join(given)} and planner=: those settings are read only "
                               f"by tf_ucudnn's own planner: they are for the default planner, "
                               f"which a given planner replaces")

    def describe_workspace(self) -> str:
        """The workspace limits in words, for summaries."""
        if not self.plans_convolutions:
            return "convolutions left to TensorFlow"
        parts = []
        if self.workspace_limit is not None:
            parts.append(f"{self.workspace_limit / MIB:g} MiB of workspace per kernel")
        if self.workspace_budget is not None:
            parts.append(f"{self.workspace_budget / MIB:g} MiB for all kernels together")
        return ", ".join(parts)


@dataclasses.dataclass(frozen=True)
class KerasOptions(Options):
    """`Options` with what only the Keras callback decides (see `MicroBatchCallback`).

    accumulate_gradients: under a memory budget, whether the whole step may run in
      micro-batches with its gradients summed where that is the same update.
    batch_norm_statistics: one of `BATCH_NORM_STATISTICS`: "micro_batch" lets a model with batch
      normalization run in micro-batches, each normalized by its own statistics.
    whole_batches: False runs the first layers in micro-batches even where a plan in whole
      batches fits.
    fuse_batch_norm: train BatchNormalization layers with one of `BATCH_NORM_KERNELS` (True:
      "cudnn"); None leaves it to the step trial; False keeps Keras's own.
    stream_conv_batch_norm: a count of micro-batches for each convolution and batch
      normalization pair's backward pass, 0 for none (needs workspace_limit=None).
    trial_steps: steps timed each way by the step trial; 0 keeps the plans untimed.
    prefetch_batches: batches copied to the GPU ahead of their steps; 0 for none.
    profiling_share: with profiling_seconds unset, the share of the first epoch's estimated
      time that measuring missing profiles may take; what is left is measured at the ends of
      later epochs. None measures everything at once.
    verbose: 1 prints the plans when they are made, 0 nothing.
    """

    accumulate_gradients: bool = True
    batch_norm_statistics: str = "batch"
    whole_batches: bool = True
    fuse_batch_norm: Union[bool, str, None] = None
    stream_conv_batch_norm: int = 0
    trial_steps: int = 10
    prefetch_batches: int = 2
    profiling_share: Optional[float] = 0.25
    verbose: int = 1

    def __post_init__(self):
        super().__post_init__()
        if self.batch_norm_statistics not in BATCH_NORM_STATISTICS:
            raise OptionsError(f"batch_norm_statistics must be one of {BATCH_NORM_STATISTICS}, "
                               f"not {self.batch_norm_statistics!r}")
        if self.fuse_batch_norm not in (None, False, True, *BATCH_NORM_KERNELS):
            raise OptionsError(f"fuse_batch_norm={self.fuse_batch_norm!r}: the kernels are "
                               f"{', '.join(BATCH_NORM_KERNELS)} (True means cudnn)")
        for name in ("stream_conv_batch_norm", "trial_steps", "prefetch_batches"):
            if getattr(self, name) < 0:
                raise OptionsError(f"{name} must be 0 or more, got {getattr(self, name)}")
        if self.stream_conv_batch_norm and self.workspace_limit is not None:
            raise OptionsError(
                f"stream_conv_batch_norm={self.stream_conv_batch_norm} and workspace_limit="
                f"{self.workspace_limit}: the streamed pairs' gradients are TensorFlow's "
                f"convolutions, not planned ones; give workspace_limit=None")
        if self.profiling_share is not None and not 0 < self.profiling_share <= 1:
            raise OptionsError(f"profiling_share: a share in (0, 1] or None, got "
                               f"{self.profiling_share!r}")

    @property
    def batch_norm_kernel(self) -> Optional[str]:
        """The kernel `fuse_batch_norm` asks for: None for False or None, "cudnn" for True."""
        if self.fuse_batch_norm in (None, False):
            return None
        return "cudnn" if self.fuse_batch_norm is True else self.fuse_batch_norm
