"""The `tf-ucudnn` command.

    tf-ucudnn plan MODEL --batch 256 [--workspace-limit 64MiB | --workspace-budget 512MiB --mode MODE]

prints, per layer and kernel, the micro-batches and algorithms chosen, their predicted time and
workspace, against the best undivided algorithm under the same limit.

    tf-ucudnn convert IN_DIR OUT_DIR --batch-size 128 --workspace-limit 64MiB

converts a SavedModel (see `tf_ucudnn.Converter`). Measurements come from the profile database
(and any --profiles JSON-lines files imported into it); on a GPU the missing ones are measured
first.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Optional, Sequence

import tensorflow as tf
from tensorflow.python.framework import config as tf_config

from tf_ucudnn.conv_planning.database_planner import resolve_machine
from tf_ucudnn.conv_planning.kernel_dp import NoFeasiblePlanError, pareto_configurations
from tf_ucudnn.conv_planning.network_ilp import (
    DYNAMIC_ALLOCATOR,
    MODES,
    InfeasibleBudgetError,
    KernelOptions,
    optimize_network,
)
from tf_ucudnn.conv_planning.plan_report import PlanReport, kernel_limit_report, network_report
from tf_ucudnn.core.conv_layer import ConvLayer
from tf_ucudnn.core.errors import TfUcudnnError
from tf_ucudnn.core.plan import KERNELS
from tf_ucudnn.graph.conv_layers import find_conv_layers, trace_model
from tf_ucudnn.keras import models
from tf_ucudnn.options import Options
from tf_ucudnn.profiling import POLICIES, POWER_OF_TWO, ProfileDatabase
from tf_ucudnn.profiling.profiler import Machine, profile
from tf_ucudnn.savedmodel.converter import Converter

PER_KERNEL = "per_kernel"


class PlanError(TfUcudnnError, RuntimeError):
    """Why no plan could be made, for the command line to print."""


def _layer_label(layer: ConvLayer) -> str:
    return layer.name.removesuffix("/convolution").removesuffix("/Conv2D")


def make_report(layers: Sequence[ConvLayer], database: ProfileDatabase, machine: Machine, *,
                batch_size: int, mode: str, limit_bytes: int, deterministic: bool,
                live_bytes: Optional[dict] = None, call_overhead_ms: float = 0.0) -> PlanReport:
    """Plans every kernel of every layer from the database's measurements."""
    tables, missing = {}, []
    for layer in layers:
        geometry = layer.cudnn_geometry()
        for kernel in KERNELS:
            timings = database.timings(machine.device, machine.cudnn_version, geometry, kernel)
            if batch_size not in timings:
                missing.append(f"{_layer_label(layer)}/{kernel} ({geometry})")
            tables[(_layer_label(layer), kernel)] = timings
    if missing:
        raise PlanError(f"no measurements of {len(missing)} kernel(s) at batch {batch_size} on "
                        f"{machine.device} (cuDNN {machine.cudnn_version}), e.g. "
                        f"{'; '.join(missing[:3])}. Measure them with this command on that GPU, "
                        "or import a profile file with --profiles")
    if mode == PER_KERNEL:
        return kernel_limit_report(tables, batch_size, limit_bytes,
                                   deterministic_only=deterministic,
                                   call_overhead_ms=call_overhead_ms)

    def options(undivided: bool):
        sizes = [batch_size] if undivided else None
        return [KernelOptions(layer, kernel, pareto_configurations(
                    kernel, timings, batch_size, deterministic_only=deterministic,
                    micro_batch_sizes=sizes, call_overhead_ms=call_overhead_ms),
                    (live_bytes or {}).get((layer, kernel), 0))
                for (layer, kernel), timings in tables.items()]

    plan = optimize_network(options(False), limit_bytes, mode)
    try:
        baseline = optimize_network(options(True), limit_bytes, mode)
    except (InfeasibleBudgetError, NoFeasiblePlanError):
        baseline = None
    return network_report(plan, baseline)


def training_live_bytes(layers: Sequence[ConvLayer]) -> dict:
    """Bytes of tensors live at each kernel of a training step, for the dynamic_allocator mode.

    A simple model: the forward pass keeps each convolution's input for the backward pass; the
    backward pass runs in reverse, freeing them. Each kernel also holds its own operands and
    result. Issue-level memory planning refines this with real liveness.
    """
    def size(shape, dtype):
        count = 1
        for dim in shape:
            count *= dim
        return count * tf.as_dtype(dtype).size

    inputs = [size(layer.input_shape, layer.dtype) for layer in layers]
    outputs = []
    for layer in layers:
        channels_last = layer.channels_last
        spatial = layer.output_spatial()
        shape = ((layer.batch_size, *spatial, layer.filter_shape[-1]) if channels_last
                 else (layer.batch_size, layer.filter_shape[-1], *spatial))
        outputs.append(size(shape, layer.dtype))
    live = {}
    for i, layer in enumerate(layers):
        kept = sum(inputs[:i + 1])
        label = _layer_label(layer)
        live[(label, "fwd")] = kept + outputs[i]
        live[(label, "bwd_data")] = kept + outputs[i] + inputs[i]
        live[(label, "bwd_filter")] = kept + outputs[i] + size(layer.filter_shape, layer.dtype)
    return live


def _plan_command(args) -> int:
    dtype_policy = {"float32": None, "float16": "mixed_float16", "bfloat16": "mixed_bfloat16"}
    import keras
    previous_policy = keras.config.dtype_policy()
    if dtype_policy[args.dtype]:
        keras.config.set_dtype_policy(dtype_policy[args.dtype])
    try:
        model = models.load_model(args.model, args.data_format)
        layers, skipped = find_conv_layers(trace_model(model, args.batch))
    finally:
        keras.config.set_dtype_policy(previous_policy)
    for name, reason in skipped:
        print(f"left alone: {name}: {reason}", file=sys.stderr)
    if not layers:
        raise PlanError(f"{args.model} has no convolution tf_ucudnn can plan")

    options = _options(args)
    os.makedirs(os.path.dirname(os.path.abspath(options.database)), exist_ok=True)
    with ProfileDatabase(options.database) as database:
        for path in options.profiles:
            database.import_jsonl(path)
        machine, can_measure = resolve_machine(database, args.device, args.cudnn_version)
        if can_measure:
            unique = {}
            for layer in layers:
                unique.setdefault(layer.cudnn_geometry(), f"{args.model}.{_layer_label(layer)}")
            profile([(g, label) for g, label in unique.items()], args.batch, database,
                    policy=args.policy)
        mode = args.mode
        limit = options.workspace_limit if mode == PER_KERNEL else options.workspace_budget
        if limit is None:
            raise PlanError(f"mode {mode} needs "
                            + ("--workspace-limit" if mode == PER_KERNEL else "--workspace-budget"))
        report = make_report(
            layers, database, machine, batch_size=args.batch, mode=mode,
            limit_bytes=limit,
            deterministic=args.deterministic or tf_config.is_op_determinism_enabled(),
            live_bytes=training_live_bytes(layers) if mode == DYNAMIC_ALLOCATOR else None,
            call_overhead_ms=args.call_overhead_us / 1000)
    print(f"{args.model}, batch {args.batch}, {len(layers)} convolutions, measurements of "
          f"{machine.device} (cuDNN {machine.cudnn_version})")
    print(report.to_text())
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"model": args.model, "batch": args.batch, "device": machine.device,
                       "cudnn_version": machine.cudnn_version, **report.to_json()}, out, indent=1)
    return 0


def _options(args) -> Options:
    """The command's Options: every command spells and reads the sizes the same way."""
    return Options(workspace_limit=args.workspace_limit, workspace_budget=args.workspace_budget,
                   memory_budget=getattr(args, "memory_budget", None),
                   micro_batches=getattr(args, "micro_batches", (4, 8)), database=args.database,
                   profiles=args.profiles, device=args.device, cudnn_version=args.cudnn_version)


def _convert_command(args) -> int:
    converter = Converter(args.input_dir, batch_size=args.batch_size,
                          signature_keys=args.signatures, options=_options(args))
    converter.convert()
    converter.save(args.output_dir, overwrite=args.overwrite)
    print(converter.summary())
    print(f"saved {args.output_dir}")
    return 0


def _add_planning_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--database", help="the profile database file (default "
                        "$TF_UCUDNN_DATABASE or ~/.cache/tf_ucudnn/profiles.sqlite)")
    parser.add_argument("--workspace-limit", default="64MiB",
                        help="each kernel's cuDNN workspace limit, e.g. 64MiB (default)")
    parser.add_argument("--workspace-budget",
                        help="all kernels' workspaces together, e.g. 512MiB (the ILP plans them)")
    parser.add_argument("--profiles", nargs="*", default=[], help="JSON-lines files to import")
    parser.add_argument("--device", help="plan with this device's measurements")
    parser.add_argument("--cudnn-version", type=int)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tf-ucudnn", description="micro-batched cuDNN for "
                                     "TensorFlow")
    commands = parser.add_subparsers(dest="command", required=True)
    plan = commands.add_parser("plan", help="plan a model's convolutions and print the plan")
    plan.add_argument("model", help="'alexnet', a keras.applications name, or a .keras file")
    plan.add_argument("--batch", type=int, required=True)
    plan.add_argument("--data-format", choices=["channels_last", "channels_first"],
                      default="channels_last")
    plan.add_argument("--dtype", choices=["float32", "float16", "bfloat16"], default="float32")
    plan.add_argument("--mode", choices=[PER_KERNEL, *MODES], default=PER_KERNEL,
                      help="per_kernel: each kernel within --workspace-limit (μ-cuDNN's WR); "
                           "shared_workspace / dynamic_allocator: the ILP under --workspace-budget")
    plan.add_argument("--policy", choices=POLICIES, default=POWER_OF_TWO,
                      help="micro-batch sizes to measure on a GPU")
    plan.add_argument("--deterministic", action="store_true",
                      help="deterministic algorithms only (implied by TF's op determinism)")
    plan.add_argument("--call-overhead-us", type=float, default=0.0,
                      help="host time of one micro-batch's call, added to cuDNN's timings")
    _add_planning_arguments(plan)
    plan.add_argument("--json", help="also write the report here as JSON")

    convert = commands.add_parser("convert", help="convert a SavedModel's convolutions")
    convert.add_argument("input_dir")
    convert.add_argument("output_dir")
    convert.add_argument("--batch-size", type=int, required=True)
    convert.add_argument("--memory-budget",
                         help="device memory each signature must fit in at --batch-size")
    convert.add_argument("--micro-batches", nargs="+", type=int, default=[4, 8],
                         help="numbers of micro-batches to try for the ops up to a pooling "
                              "where the memory budget needs them (default 4 8)")
    convert.add_argument("--signatures", nargs="*", help="signature keys to convert (default all)")
    convert.add_argument("--overwrite", action="store_true",
                         help="replace OUTPUT_DIR if it exists")
    _add_planning_arguments(convert)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    command = {"plan": _plan_command, "convert": _convert_command}[args.command]
    try:
        return command(args)
    except (TfUcudnnError, ValueError) as error:
        print(f"tf-ucudnn {args.command}: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
