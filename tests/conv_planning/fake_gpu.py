"""A GPU for the planner's tests without one: `measure` answers with real measured records (those
of the kind, form, kernel and sizes asked), counts its calls and moves a clock."""

import collections
import dataclasses

from tf_ucudnn.core.conv_layer import ConvLayer
from tf_ucudnn.core.geometry import ConvGeometry
from tf_ucudnn.profiling import profiler


@dataclasses.dataclass(frozen=True)
class MeasureCall:
    geometry: ConvGeometry
    kernel: str
    sizes: tuple[int, ...]
    candidates: str
    form: str


class FakeGpu:
    def __init__(self, records, seconds_per_call: float = 0.0):
        self._records = collections.defaultdict(list)
        for record in records:
            self._records[(record.geometry, record.kernel, record.engine is not None,
                           record.form)].append(record)
        self.seconds_per_call = seconds_per_call
        self.calls: list[MeasureCall] = []
        self.now = 0.0

    def clock(self) -> float:
        return self.now

    def measure(self, geometry, kernel, sizes, machine, workspace_limit=None, device=None,
                layer=None, candidates=profiler.LEGACY, form=profiler.DIRECT):
        self.calls.append(MeasureCall(geometry, kernel, tuple(sizes), candidates, form))
        self.now += self.seconds_per_call
        return [r for r in self._records[(geometry, kernel, candidates == profiler.ENGINES, form)]
                if r.batch_size in sizes]

    def install(self, monkeypatch, engines: bool) -> "FakeGpu":
        """Makes the profiler measure here, engine configurations too where `engines`."""
        monkeypatch.setattr(profiler, "measure", self.measure)
        monkeypatch.setattr(profiler, "engines_available", lambda: engines)
        return self


def conv_layer(geometry: ConvGeometry, batch_size: int, name: str) -> ConvLayer:
    """The 2-D layer cuDNN runs as `geometry`, as TensorFlow gives it; no input gradient where
    it reads the images (three channels)."""
    channels_last = geometry.layout == "NHWC"
    def in_layout(batch, channels, spatial):
        return (batch, *spatial, channels) if channels_last else (batch, channels, *spatial)
    paddings = in_layout((0, 0), (0, 0), [(pad, pad) for pad in geometry.pads])
    layer = ConvLayer(
        name, "Conv2D", in_layout(batch_size, geometry.in_channels, geometry.input_dims),
        (*geometry.filter_dims, geometry.filter_in_channels, geometry.out_channels),
        in_layout(1, 1, geometry.strides), in_layout(1, 1, geometry.dilations), "EXPLICIT",
        tuple(value for pair in paddings for value in pair), geometry.layout,
        geometry.dtype, groups=geometry.groups, input_gradient=geometry.in_channels != 3)
    assert layer.cudnn_geometry() == geometry
    return layer
