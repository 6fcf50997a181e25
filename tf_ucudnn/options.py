"""The settings every entry point takes, parsed and checked once, with one set of defaults.

`tf_ucudnn.rewrite`, `MicroBatchCallback`, `Converter` and the `tf-ucudnn` command each build one
`Options` from their arguments and hand it to `tf_ucudnn.pipeline`; sizes are read from bytes or
text such as "64MiB" here and nowhere else.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Optional, Sequence, Union

from tf_ucudnn.core.errors import TfUcudnnError
from tf_ucudnn.core.units import MIB, parse_bytes

Size = Union[int, str, None]

DEFAULT_WORKSPACE_LIMIT = 64 * MIB


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
    """

    workspace_limit: Size = DEFAULT_WORKSPACE_LIMIT
    workspace_budget: Size = None
    memory_budget: Size = None
    micro_batches: Sequence[int] = (4, 8)
    database: Optional[str] = None
    profiles: Sequence[str] = ()
    device: Optional[str] = None
    cudnn_version: Optional[int] = None

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

    @property
    def plans_convolutions(self) -> bool:
        return self.workspace_limit is not None or self.workspace_budget is not None

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
