"""A planned step's memory timeline as a picture: the bytes held while each op runs, in execution
order, of the step as planned (after its swaps and recomputations, as the simulator predicts it
runs) and of the step as written, beside the budget. For reading a plan, not for deciding one.

`memory_timeline` gives what is drawn, as plain data; `write_timeline_png` draws it.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from tf_ucudnn.core.files import written_whole
from tf_ucudnn.core.units import UNITS
from tf_ucudnn.memory.analysis.liveness import LivenessReport
from tf_ucudnn.memory.search.step_plan import MemoryPlan


@dataclasses.dataclass(frozen=True)
class Curve:
    """A step's bytes held while each op runs, variables included, each op placed at its share
    of the step's ops (steps of different op counts share the x axis)."""

    label: str
    shares: tuple[float, ...]
    bytes: tuple[int, ...]

    @classmethod
    def of(cls, label: str, held: list[int]) -> "Curve":
        count = max(len(held), 1)
        return cls(label, tuple(i / count for i in range(len(held))), tuple(held))

    @property
    def peak_bytes(self) -> int:
        return max(self.bytes, default=0)


@dataclasses.dataclass(frozen=True)
class Timeline:
    planned: Curve
    written: Optional[Curve]  # the step before planning, if given
    budget_bytes: int
    backward: Optional[tuple[float, float]]  # the planned step's backward pass, as shares

    @property
    def unit(self) -> str:
        """One unit for the axis and the legend: GiB, or MiB for a small step."""
        largest = max(self.budget_bytes, self.planned.peak_bytes,
                      self.written.peak_bytes if self.written else 0)
        return "GiB" if largest >= UNITS["gib"] else "MiB"


def memory_timeline(plan: MemoryPlan, written: Optional[LivenessReport] = None) -> Timeline:
    """The timeline of `plan`'s step (`MemoryPlan.live_bytes`: after its swaps and
    recomputations, whose most is the predicted peak) and, if given, of the step as `written`
    (its liveness)."""
    swaps, recomputes = len(plan.decisions.swaps), len(plan.decisions.recomputes)
    planned = Curve.of(f"the planned step ({swaps} swap(s), {recomputes} recomputation(s))",
                       plan.live_bytes)
    unplanned = None if written is None else Curve.of(
        "the step as written",
        [op.live_bytes + written.persistent_bytes for op in written.ops])
    backward = [share for share, op in zip(planned.shares, plan.liveness.ops) if op.backward]
    return Timeline(planned, unplanned, plan.budget_bytes,
                    (backward[0], backward[-1]) if backward else None)


def write_timeline_png(path: str, timeline: Timeline, title: str = "") -> str:
    """Draws `timeline`: the planned step in blue, the step as written in grey, the budget as a
    dashed line, the planned step's backward pass shaded. Writes a PNG at `path`, whole or not
    at all, and returns it."""
    import matplotlib  # only this picture needs it

    matplotlib.use("Agg")
    from matplotlib import pyplot

    unit = timeline.unit
    scale = UNITS[unit.lower()]

    def amount(size: int) -> str:
        return f"{size / scale:.4g} {unit}"

    figure, axes = pyplot.subplots(figsize=(10, 5), dpi=100)
    try:
        if timeline.backward is not None:
            axes.axvspan(*timeline.backward, color="0.93", label="the planned step's backward pass")
        for curve, colour in ((timeline.written, "0.55"), (timeline.planned, "tab:blue")):
            if curve is not None:
                axes.plot(curve.shares, [size / scale for size in curve.bytes], color=colour,
                          linewidth=1.2, label=f"{curve.label}, peak {amount(curve.peak_bytes)}")
        axes.axhline(timeline.budget_bytes / scale, color="tab:red", linestyle="--",
                     label=f"budget {amount(timeline.budget_bytes)}")
        axes.set_xlim(0, 1)
        axes.set_ylim(bottom=0)
        axes.set_xlabel("share of the step's ops, in execution order")
        axes.set_ylabel(f"held on the device, {unit}")
        axes.set_title(title or "memory timeline")
        # Below the axes: inside, it would hide the curves where they are highest.
        axes.legend(loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=2, fontsize="small",
                    frameon=False)
        figure.tight_layout()
        with written_whole(path) as partial:
            figure.savefig(partial, format="png")
    finally:
        pyplot.close(figure)
    return path
