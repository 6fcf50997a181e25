"""What the entry points report, as plain data: each convolution planned with its plan, each one
left alone with the reason, and the memory plan and step trial where they ran."""

from __future__ import annotations

import dataclasses
import statistics
from typing import Optional

from tf_ucudnn.core.conv_layer import ConvLayer
from tf_ucudnn.core.plan import LayerPlan
from tf_ucudnn.core.step_memory_plan import StepMemoryPlan


@dataclasses.dataclass(frozen=True)
class RewrittenLayer:
    layer: ConvLayer
    scope: str  # "" for the main graph, else the library function's name
    nodes: dict  # kernel -> node name
    plan: LayerPlan

    def to_json(self) -> dict:
        return {"layer": self.layer.name, "scope": self.scope, "nodes": self.nodes,
                "plan": self.plan.to_json()}


@dataclasses.dataclass(frozen=True)
class LeftAlone:
    node: str
    scope: str
    reason: str


@dataclasses.dataclass(frozen=True)
class FusedLayer:
    """A planned convolution that runs with its bias and activation as one fused op."""

    layer: str  # the convolution's node (rewrite) or the Keras layer's path (callback)
    scope: str
    activation: str  # "relu" or "identity"
    # The rewrite's fused node, named as the last node it replaced so that its readers, fetches
    # and control dependencies still find it, and the nodes it replaced; empty in the callback.
    node: str = ""
    replaced: tuple = ()


@dataclasses.dataclass(frozen=True)
class NotFused:
    """A planned convolution whose bias and activation (if any) stay separate ops, and why."""

    layer: str
    scope: str
    reason: str


@dataclasses.dataclass(frozen=True)
class StrategyChoice:
    """One decision the Keras callback made once for a training run, and why."""

    name: str
    reason: str


@dataclasses.dataclass
class RewriteReport:
    layers: list = dataclasses.field(default_factory=list)
    left_alone: list = dataclasses.field(default_factory=list)
    # Of the planned layers: those fused with their bias and activation (FusedLayer) and the
    # others with why (NotFused).
    fused: list = dataclasses.field(default_factory=list)
    not_fused: list = dataclasses.field(default_factory=list)
    spatial: list = dataclasses.field(default_factory=list)  # graph.spatial_split.SplitLayer
    # The memory plan, when one was made (a tf_ucudnn.core.step_memory_plan.StepMemoryPlan).
    memory: Optional[StepMemoryPlan] = None
    # With a MemoryPlan, a tf_ucudnn.memory.search.prefix_search.PrefixStepPlan: the ops run in
    # micro-batches, if any, and the choices passed over.
    memory_prefix: Optional[object] = None
    # A tf_ucudnn.memory.search.workspace_choice.WorkspacePlan: the planned kernels given less
    # workspace than their plan above for the memory budget (the graph runs those).
    memory_workspaces: Optional[object] = None
    # A StepTrial (below): the callback's training step timed with the plans and without.
    trial: Optional[object] = None
    # The kernel the callback's step trains batch normalization with ("cudnn", "xla", "ucudnn"),
    # or None for Keras's own.
    batch_norm_kernel: Optional[str] = None
    # From the callback: where its input batches were copied ahead of their steps, or why not.
    input_prefetch: Optional[str] = None
    # From the callback: each decision ("convolutions", "memory", ...) with its StrategyChoice.
    strategies: dict = dataclasses.field(default_factory=dict)

    def to_json(self) -> dict:
        return {"layers": [layer.to_json() for layer in self.layers],
                "left_alone": [dataclasses.asdict(item) for item in self.left_alone],
                "fused": [dataclasses.asdict(item) for item in self.fused],
                "not_fused": [dataclasses.asdict(item) for item in self.not_fused],
                "spatial": [item.to_json() for item in self.spatial],
                "memory": self.memory.to_json() if self.memory else None,
                "memory_prefix": self.memory_prefix.to_json() if self.memory_prefix else None,
                "memory_workspaces": (self.memory_workspaces.to_json()
                                      if self.memory_workspaces else None),
                "trial": self.trial.to_json() if self.trial else None,
                "batch_norm_kernel": self.batch_norm_kernel,
                "input_prefetch": self.input_prefetch,
                "strategies": {decision: dataclasses.asdict(choice)
                               for decision, choice in self.strategies.items()}}

    def to_text(self) -> str:
        lines = [f"tf_ucudnn rewrite: {len(self.layers)} layer(s) rewritten, "
                 + (f"{len(self.spatial)} split over devices, " if self.spatial else "")
                 + f"{len(self.left_alone)} convolution node(s) left alone"]
        for item in self.layers:
            where = f" (in {item.scope})" if item.scope else ""
            lines.append(f"  {item.layer.name}{where}: {item.plan.dumps()}")
        for item in self.spatial:
            lines.append(f"  {item.layer}: split over {', '.join(item.devices)} "
                         f"(slabs of {list(item.slab_rows)} rows)")
        for item in self.left_alone:
            where = f" (in {item.scope})" if item.scope else ""
            lines.append(f"  left alone {item.node}{where}: {item.reason}")
        for item in self.fused:
            where = f" (in {item.scope})" if item.scope else ""
            lines.append(f"  fused {item.layer}{where} with its bias and {item.activation}")
        for item in self.not_fused:
            where = f" (in {item.scope})" if item.scope else ""
            lines.append(f"  not fused {item.layer}{where}: {item.reason}")
        if self.memory:
            lines.append(self.memory.to_text())
        if self.memory_prefix and self.memory_prefix.cut:
            lines.append(self.memory_prefix.to_text())
        if self.memory_workspaces:
            lines.append(self.memory_workspaces.to_text())
        if self.batch_norm_kernel:
            lines.append(f"  batch normalization trained with the {self.batch_norm_kernel!r} "
                         f"kernel")
        if self.input_prefetch:
            lines.append(f"  {self.input_prefetch}")
        if self.trial:
            lines.append(self.trial.to_text())
        lines += [f"  {decision}: {choice.name} ({choice.reason})"
                  for decision, choice in self.strategies.items()]
        return "\n".join(lines)



@dataclasses.dataclass
class StepTrial:
    """The training step timed with the plans and as Keras made it before them (with `own`, the
    convolutions XLA or TensorFlow run), `steps` steps each, and which one training kept."""

    steps: int
    own: str  # "XLA's own convolutions" where XLA compiles the step, else TensorFlow's
    planned_ms: list = dataclasses.field(default_factory=list)
    unplanned_ms: list = dataclasses.field(default_factory=list)
    kept: Optional[str] = None  # "plans" or `own`, once decided

    @property
    def planned_median_ms(self) -> Optional[float]:
        return statistics.median(self.planned_ms) if self.planned_ms else None

    @property
    def unplanned_median_ms(self) -> Optional[float]:
        return statistics.median(self.unplanned_ms) if self.unplanned_ms else None

    def to_json(self) -> dict:
        return {"steps": self.steps, "own": self.own, "planned_ms": self.planned_ms,
                "unplanned_ms": self.unplanned_ms, "kept": self.kept}

    def to_text(self) -> str:
        if self.kept is None:
            return (f"  step trial unfinished: {len(self.planned_ms)} planned and "
                    f"{len(self.unplanned_ms)} unplanned step(s) of {self.steps} timed")
        return (f"  step trial: {self.planned_median_ms:.2f} ms with the plans, "
                f"{self.unplanned_median_ms:.2f} ms with {self.own} "
                f"(median of {self.steps}); kept {self.kept}")

