"""A step's memory timeline as a picture: the bytes its tensors hold while each op runs, in
execution order, beside the budget and the peak the plan predicts. For reading a plan, not for
deciding one."""

from __future__ import annotations

from typing import Optional

from tf_ucudnn.core.files import written_whole
from tf_ucudnn.core.units import format_bytes
from tf_ucudnn.memory.analysis.liveness import LivenessReport


def write_timeline_png(path: str, liveness: LivenessReport, budget_bytes: Optional[int] = None,
                       planned_peak_bytes: Optional[int] = None, title: str = "",
                       unplanned: Optional[LivenessReport] = None) -> str:
    """Draws `liveness` (the planned step's graph, variables included, before its swaps and
    recomputations) with the budget and the planned peak as lines, the backward pass shaded,
    and, if given, the `unplanned` step's in grey. Steps of different op counts share the x
    axis as shares of their ops. Writes a PNG at `path`, whole or not at all, and returns it."""
    import matplotlib  # only this picture needs it

    matplotlib.use("Agg")
    from matplotlib import pyplot

    figure, axes = pyplot.subplots(figsize=(10, 4), dpi=100)
    try:
        if unplanned is not None:
            axes.plot(*_curve(unplanned), color="0.55", linewidth=1,
                      label=f"the step as written, peak {format_bytes(_peak(unplanned))}")
        axes.plot(*_curve(liveness), color="tab:blue", linewidth=1,
                  label=f"the planned step, peak {format_bytes(_peak(liveness))} before swaps")
        backward = [i for i, op in enumerate(liveness.ops) if op.backward]
        if backward:
            axes.axvspan(backward[0] / len(liveness.ops), backward[-1] / len(liveness.ops),
                         color="0.92", label="its backward pass")
        if budget_bytes is not None:
            axes.axhline(budget_bytes / 2**20, color="tab:red", linestyle="--",
                         label=f"budget {format_bytes(budget_bytes)}")
        if planned_peak_bytes is not None:
            axes.axhline(planned_peak_bytes / 2**20, color="tab:green",
                         label=f"planned peak {format_bytes(planned_peak_bytes)}")
        axes.set_xlabel("share of the step's ops, in execution order")
        axes.set_ylabel("MiB")
        axes.set_title(title or "memory timeline")
        axes.legend(loc="upper left", fontsize="small")
        figure.tight_layout()
        with written_whole(path) as partial:
            figure.savefig(partial, format="png")
    finally:
        pyplot.close(figure)
    return path


def _peak(liveness: LivenessReport) -> int:
    return liveness.peak_bytes + liveness.persistent_bytes


def _curve(liveness: LivenessReport):
    count = max(len(liveness.ops), 1)
    return ([i / count for i in range(len(liveness.ops))],
            [(op.live_bytes + liveness.persistent_bytes) / 2**20 for op in liveness.ops])
