"""A convolution's geometry as cuDNN runs it: the key of every profile and plan."""

from __future__ import annotations

import dataclasses
import json

# Layouts by number of spatial dimensions; the first letter after N says channels-first or -last.
LAYOUTS = {2: ("NCHW", "NHWC"), 3: ("NCDHW", "NDHWC")}
# The most input channels a convolution in space-to-depth blocks has (`can_space_to_depth`).
SPACE_TO_DEPTH_CHANNELS = 64


@dataclasses.dataclass(frozen=True)
class ConvGeometry:
    """Everything about a convolution layer that its cuDNN timings depend on, except the batch size.

    Spatial tuples are in (depth,) height, width order; `pads` are symmetric per dimension, as
    cuDNN's convolution descriptor takes them. `in_channels` are the input's; a grouped
    convolution's filter has `in_channels // groups` of them, and each group makes
    `out_channels // groups` outputs (a depthwise one has `groups == in_channels`).
    """

    in_channels: int
    out_channels: int
    input_dims: tuple[int, ...]
    filter_dims: tuple[int, ...]
    pads: tuple[int, ...]
    strides: tuple[int, ...]
    dilations: tuple[int, ...]
    dtype: str
    layout: str
    groups: int = 1

    def __post_init__(self):
        for name in ("input_dims", "filter_dims", "pads", "strides", "dilations"):
            object.__setattr__(self, name, tuple(int(v) for v in getattr(self, name)))
        rank = len(self.input_dims)
        if rank not in LAYOUTS:
            raise ValueError(f"a convolution has 2 or 3 spatial dimensions, got {self.input_dims}")
        for name in ("filter_dims", "pads", "strides", "dilations"):
            if len(getattr(self, name)) != rank:
                raise ValueError(f"{name} {getattr(self, name)} does not match the {rank} spatial "
                                 f"dimensions of input_dims {self.input_dims}")
        if self.layout not in LAYOUTS[rank]:
            raise ValueError(f"layout of a {rank}-D convolution must be one of {LAYOUTS[rank]}, "
                             f"got {self.layout!r}")
        positive = (self.in_channels, self.out_channels, *self.input_dims, *self.filter_dims,
                    *self.strides, *self.dilations)
        if min(positive) <= 0 or min(self.pads) < 0:
            raise ValueError(f"channels, dims, strides and dilations must be positive and pads "
                             f"non-negative: {self}")
        if self.groups <= 0 or self.in_channels % self.groups or self.out_channels % self.groups:
            raise ValueError(f"groups must be positive and divide the input and output channels: "
                             f"{self}")

    @property
    def conv_kind(self) -> str:
        return f"conv{len(self.input_dims)}d"

    @property
    def can_subsample(self) -> bool:
        """Whether it can run subsampled (`tf_ucudnn.core.plan.Algorithm`): a 1x1 filter, no
        padding and a stride above 1, so that the output reads the input's strided samples only."""
        return (all(k == 1 for k in self.filter_dims) and not any(self.pads)
                and any(s > 1 for s in self.strides))

    @property
    def can_space_to_depth(self) -> bool:
        """Whether it can run in space-to-depth blocks of its stride and may gain by it: a 2-D
        convolution of one stride above 1, a filter of more than one tap, no dilation or groups,
        and few input channels (at most SPACE_TO_DEPTH_CHANNELS in the blocks). cuDNN's kernels
        starve on a network's first layers, of three channels; in blocks they get 12 or 48."""
        return (len(self.strides) == 2 and self.strides[0] == self.strides[1] > 1
                and max(self.filter_dims) > 1 and set(self.dilations) == {1} and self.groups == 1
                and self.in_channels * self.strides[0] ** 2 <= SPACE_TO_DEPTH_CHANNELS)

    @property
    def can_run_channels_first(self) -> bool:
        """Whether to measure it on channels-first copies of its tensors (the `channels_first`
        form): a channels-last grouped convolution. cuDNN's channels-last grouped and depthwise
        kernels run several times slower than its channels-first ones, by more than the copies
        cost; its channels-last kernels for ungrouped convolutions are its fast ones, so those are
        not measured again."""
        return self.layout[1] != "C" and self.groups > 1

    @property
    def filter_in_channels(self) -> int:
        return self.in_channels // self.groups

    def shape_key(self) -> str:
        """Canonical text of the geometry without dtype and layout: the database's geometry key.
        Groups are in it only where there are several, so the keys of ungrouped geometries
        stay those of databases written before groups were."""
        fields = {name: getattr(self, name) for name in
                  ("in_channels", "out_channels", "input_dims", "filter_dims", "pads", "strides",
                   "dilations")}
        if self.groups != 1:
            fields["groups"] = self.groups
        return json.dumps(fields, sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_shape_key(cls, key: str, dtype: str, layout: str) -> "ConvGeometry":
        return cls(**json.loads(key), dtype=dtype, layout=layout)

    def __str__(self) -> str:
        def dims(values):
            return "x".join(map(str, values))
        groups = f" groups {self.groups}" if self.groups != 1 else ""
        return (f"{self.conv_kind} {self.in_channels}->{self.out_channels}{groups}"
                f" input {dims(self.input_dims)} filter {dims(self.filter_dims)}"
                f" pad {dims(self.pads)} stride {dims(self.strides)}"
                f" dilation {dims(self.dilations)} {self.dtype} {self.layout}")

