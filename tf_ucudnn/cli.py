"""The `tf-ucudnn` command.

    tf-ucudnn plan MODEL --batch 256 [--workspace-limit 64MiB |
                                      --workspace-budget 512MiB --mode MODE] [--compare-with-xla]

prints, per layer and kernel, the micro-batches and algorithms chosen, their predicted time and
workspace, against the best undivided algorithm under the same limit, as the rewrite plans them
(`DatabasePlanner`); with --compare-with-xla, which layers keep XLA's own convolution. The
dynamic_allocator mode fits each kernel's workspace beside what the training step holds then.

    tf-ucudnn convert IN_DIR OUT_DIR --batch-size 128 --workspace-limit 64MiB

converts a SavedModel (see `tf_ucudnn.Converter`).

    tf-ucudnn profile MODEL --batch 128 [--policy power_of_two]
    tf-ucudnn profile --import FILE... | --export FILE [--device NAME] [--cudnn-version N]

measures a model's convolutions on this machine's GPU into the profile database, or copies
measurements between the database and JSON-lines files (gzipped where the name ends in .gz).

    tf-ucudnn memory MODEL --batch 256 --memory-budget 12GiB [--png timeline.png] [--json F]

prints what the model's training step keeps alive and its plan under the budget (swaps,
recomputations, the first layers in micro-batches), and draws the memory timeline. The device is
modelled from its datasheet figures and --link-gb-s, the host link's speed each way.

`plan` and `convert` plan from the database's measurements (and any --profiles files imported
into it); on a GPU the missing ones are measured first. Into an empty database, with no
--profiles, `plan` imports the H100 profiles packaged with tf_ucudnn (`packaged_profiles()`), so
that it works on a machine without a GPU.

A failure prints one line, `tf-ucudnn COMMAND: what failed and why`, and exits with status 2.
Output paths are checked before any work starts, and outputs are written whole or not at all.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Optional, Sequence

from tf_ucudnn.conv_planning.database_planner import DatabasePlanner, resolve_machine
from tf_ucudnn.conv_planning.network_ilp import DYNAMIC_ALLOCATOR, MODES
from tf_ucudnn.conv_planning.plan_report import PlanError, database_report, layer_label
from tf_ucudnn.core.conv_layer import ConvLayer
from tf_ucudnn.core.errors import TfUcudnnError
from tf_ucudnn.core.files import written_whole
from tf_ucudnn.core.units import format_bytes
from tf_ucudnn.graph.conv_layers import find_conv_layers, trace_model
from tf_ucudnn.keras import models
from tf_ucudnn.keras.planned_step import keras_training_step, plan_keras_step
from tf_ucudnn.memory.analysis.kernel_live_bytes import training_live_bytes
from tf_ucudnn.memory.analysis.liveness import analyze
from tf_ucudnn.memory.timeline import memory_timeline, write_timeline_png
from tf_ucudnn.memory.cost.device_model import DeviceModel
from tf_ucudnn.options import DEFAULT_WORKSPACE_LIMIT, Options, OptionsError
from tf_ucudnn.profiling import (
    POLICIES,
    POWER_OF_TWO,
    ProfileDatabase,
    ProfileDatabaseError,
    ProfileRecord,
    packaged_profiles,
    read_jsonl,
)
from tf_ucudnn.profiling.profiler import current_machine, profile
from tf_ucudnn.profiling.records import PACKAGED_PROFILES_DIR
from tf_ucudnn.savedmodel.converter import Converter

PER_KERNEL = "per_kernel"


def _conv_layers(args, training_step: bool = False) -> tuple[list[ConvLayer], Optional[object]]:
    """MODEL's convolutions at --batch in --dtype, as `plan` and `profile` see them: those of
    its forward pass or, with `training_step`, of its training step, which comes with them
    (the dynamic_allocator mode plans with its liveness)."""
    dtype_policy = {"float32": None, "float16": "mixed_float16", "bfloat16": "mixed_bfloat16"}
    import keras
    previous_policy = keras.config.dtype_policy()
    if dtype_policy[args.dtype]:
        keras.config.set_dtype_policy(dtype_policy[args.dtype])
    try:
        model = models.load_model(args.model, args.data_format)
        step = keras_training_step(model, args.batch) if training_step else None
        layers, skipped = find_conv_layers(trace_model(model, args.batch) if step is None
                                           else step.graph)
    finally:
        keras.config.set_dtype_policy(previous_policy)
    for name, reason in skipped:
        print(f"left alone: {name}: {reason}", file=sys.stderr)
    if not layers:
        raise PlanError(f"{args.model} has no convolution tf_ucudnn can plan")
    return layers, step


def _geometries(model: str, layers: Sequence[ConvLayer]) -> list:
    """(geometry, label) of each distinct convolution, labelled by its first layer."""
    unique = {}
    for layer in layers:
        unique.setdefault(layer.cudnn_geometry(), f"{model}.{layer_label(layer)}")
    return list(unique.items())


def _plan_command(args) -> int:
    options = _options(args)
    mode = args.mode
    limit = options.workspace_limit if mode == PER_KERNEL else options.workspace_budget
    if limit is None:
        raise OptionsError(f"mode {mode} needs "
                           + ("--workspace-limit" if mode == PER_KERNEL else "--workspace-budget"))
    if args.json:
        _check_output_file(args.json, "--json")
    profile_records = _read_profiles(options.profiles)
    layers, step = _conv_layers(args, training_step=mode == DYNAMIC_ALLOCATOR)
    with _open_database(options.database) as database:
        if options.profiles:
            database.insert(profile_records)
        elif len(database) == 0 and packaged_profiles():
            _import_packaged_profiles(database, args.device, args.cudnn_version)
        machine, can_measure = resolve_machine(database, args.device, args.cudnn_version)
        if can_measure:
            profile(_geometries(args.model, layers), args.batch, database, policy=args.policy)
        planner = DatabasePlanner(
            database, limit if mode == PER_KERNEL else None,
            workspace_budget_bytes=None if mode == PER_KERNEL else limit, machine=machine,
            measure=False, deterministic_only=args.deterministic or None,
            call_overhead_ms=args.call_overhead_us / 1000,
            compare_with_xla=args.compare_with_xla)
        report = database_report(layers, planner, mode, None if step is None
                                 else training_live_bytes(step, layers))
    print(f"{args.model}, batch {args.batch}, {len(layers)} convolutions, measurements of "
          f"{machine.device} (cuDNN {machine.cudnn_version})")
    print(report.to_text())
    if args.json:
        _write_json(args.json, {"model": args.model, "batch": args.batch,
                                "device": machine.device, "cudnn_version": machine.cudnn_version,
                                **report.to_json()})
    return 0


def _write_json(path: str, data: dict) -> None:
    """Writes `data` whole or not at all."""
    with written_whole(path) as partial, open(partial, "w") as out:
        json.dump(data, out, indent=1)


def _import_packaged_profiles(database: ProfileDatabase, device: Optional[str],
                              cudnn_version: Optional[int]) -> None:
    """Fills an empty database with one machine's packaged profiles (the one named, else the
    first by name), so that planning needs no GPU."""
    records = _read_profiles(packaged_profiles())
    machines = sorted({(r.device, r.cudnn_version) for r in records
                       if device in (None, r.device) and cudnn_version in (None, r.cudnn_version)})
    if not machines:
        return  # resolve_machine says which machines the database holds: none
    chosen = [r for r in records if (r.device, r.cudnn_version) == machines[0]]
    database.insert(chosen)
    others = sorted({(r.device, r.cudnn_version) for r in records} - {machines[0]})
    print(f"tf-ucudnn plan: {database.path} held no measurements and no --profiles were given: "
          f"imported the {len(chosen)} packaged ones of {_describe(machines[:1])} from "
          f"{PACKAGED_PROFILES_DIR}"
          + (f" (also packaged: {_describe(others)}; --device names another)" if others else ""),
          file=sys.stderr)


def _read_profiles(paths: Sequence[str], device: Optional[str] = None,
                   cudnn_version: Optional[int] = None) -> list[ProfileRecord]:
    """Every record of the files, all read before any is imported: a bad file imports none."""
    return [record for path in paths for record in read_jsonl(path, device, cudnn_version)]


def _describe(machines: Sequence[tuple[str, int]]) -> str:
    return "; ".join(f"{device} (cuDNN {version})" for device, version in machines) or "none"


def _open_database(path: str) -> ProfileDatabase:
    """The profile database, its directory created if new."""
    try:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    except OSError as error:
        raise ProfileDatabaseError(path, f"cannot create its directory: {error.strerror}") \
            from None
    return ProfileDatabase(path)


def _check_output_file(path: str, argument: str) -> None:
    """Fails, before any work starts, where `path` cannot be written as a file."""
    directory = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        reason = "a directory, not a file"
    elif not os.path.isdir(directory):
        reason = f"no directory {directory}"
    elif not os.access(directory, os.W_OK):
        reason = f"its directory {directory} is read-only"
    elif os.path.exists(path) and not os.access(path, os.W_OK):
        reason = "a read-only file"
    else:
        return
    raise OptionsError(f"{argument} {path}: {reason}")


def _check_output_dir(path: str, overwrite: bool) -> None:
    """Fails, before any work starts, where the converted SavedModel cannot be saved at `path`:
    the Converter writes it beside `path` (creating the folders above it), then renames it."""
    absolute = os.path.abspath(path)
    ancestor = os.path.dirname(absolute)
    while not os.path.exists(ancestor):
        ancestor = os.path.dirname(ancestor)
    if os.path.exists(absolute) and not os.path.isdir(absolute):
        reason = "a file, not a directory"
    elif os.path.isdir(absolute) and os.listdir(absolute) and not overwrite:
        reason = "exists and is not empty (--overwrite replaces it)"
    elif os.path.exists(absolute) and not os.access(absolute, os.W_OK):
        reason = "a read-only directory"
    elif not os.path.isdir(ancestor):
        reason = f"{ancestor} is a file, not a directory"
    elif not os.access(ancestor, os.W_OK):
        reason = f"its directory {ancestor} is read-only"
    else:
        return
    raise OptionsError(f"output directory {path}: {reason}")


def _options(args) -> Options:
    """The command's Options: every command spells and reads the sizes the same way."""
    return Options(workspace_limit=args.workspace_limit, workspace_budget=args.workspace_budget,
                   memory_budget=getattr(args, "memory_budget", None),
                   micro_batches=getattr(args, "micro_batches", Options().micro_batches),
                   database=args.database,
                   profiles=args.profiles, device=args.device, cudnn_version=args.cudnn_version)


def _convert_command(args) -> int:
    _check_output_dir(args.output_dir, args.overwrite)
    converter = Converter(args.input_dir, batch_size=args.batch_size,
                          signature_keys=args.signatures, options=_options(args))
    converter.convert()
    converter.save(args.output_dir, overwrite=args.overwrite)
    print(converter.summary())
    print(f"saved {args.output_dir}")
    return 0


def _profile_command(args) -> int:
    options = Options(database=args.database, profiles=args.import_files or (),
                      device=args.device, cudnn_version=args.cudnn_version)
    if args.model is None and args.batch is not None:
        raise OptionsError("--batch goes with MODEL only")
    if args.model is not None:
        return _measure(args, options)
    if options.profiles:
        records = _read_profiles(options.profiles, options.device, options.cudnn_version)
        with _open_database(options.database) as database:
            database.insert(records)
        print(f"imported {len(records)} measurement(s) from {len(options.profiles)} file(s) "
              f"into {options.database}")
        return 0
    return _export(args.export, options)


def _measure(args, options: Options) -> int:
    """Measures MODEL's convolutions on this machine's GPU into the database."""
    if args.batch is None:
        raise OptionsError(f"--batch: give the batch size to measure {args.model} at")
    if options.device is not None or options.cudnn_version is not None:
        raise OptionsError("--device and --cudnn-version go with --import and --export: "
                           f"{args.model} is measured on this machine's GPU")
    machine = current_machine()  # without a GPU, fail before tracing the model
    geometries = _geometries(args.model, _conv_layers(args)[0])
    with _open_database(options.database) as database:
        added = profile(geometries, args.batch, database, policy=args.policy)
    print(f"{args.model}, batch {args.batch}: {added} measurement(s) of {len(geometries)} "
          f"convolution geometries on {_describe([(machine.device, machine.cudnn_version)])} "
          f"added to {options.database}")
    return 0


def _export(path: str, options: Options) -> int:
    """Writes the database's measurements (of --device and --cudnn-version) to `path`."""
    _check_output_file(path, "--export")
    if not os.path.isfile(options.database):
        raise ProfileDatabaseError(options.database, "no such file: nothing to export")
    with ProfileDatabase(options.database) as database:
        machines = database.machines()
        chosen = [(device, version) for device, version in machines
                  if options.device in (None, device)
                  and options.cudnn_version in (None, version)]
        if not chosen:
            which = " ".join(part for part in (options.device, options.cudnn_version
                                               and f"cuDNN {options.cudnn_version}") if part)
            missing = f"no measurements of {which}" if which else "no measurements"
            raise ProfileDatabaseError(options.database, f"{missing} to export; it holds "
                                       f"{_describe(machines)}")
        count = database.export_jsonl(path, options.device, options.cudnn_version)
    print(f"exported {count} measurement(s) of {_describe(chosen)} to {path}")
    return 0


def _add_database_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--database", help="the profile database file (default "
                        "$TF_UCUDNN_DATABASE or ~/.cache/tf_ucudnn/profiles.sqlite)")


def _add_planning_arguments(parser: argparse.ArgumentParser) -> None:
    _add_database_argument(parser)
    parser.add_argument("--workspace-limit", default=DEFAULT_WORKSPACE_LIMIT,
                        help="each kernel's cuDNN workspace limit (default "
                             f"{format_bytes(DEFAULT_WORKSPACE_LIMIT).replace(' ', '')})")
    parser.add_argument("--workspace-budget",
                        help="all kernels' workspaces together, e.g. 512MiB (the ILP plans them)")
    parser.add_argument("--profiles", nargs="*", default=[], help="JSON-lines files to import")
    parser.add_argument("--device", help="plan with this device's measurements")
    parser.add_argument("--cudnn-version", type=int)


def _positive_int(text: str) -> int:
    if not text.isdigit() or int(text) == 0:
        raise argparse.ArgumentTypeError(f"a positive integer, not {text!r}")
    return int(text)


def _memory_command(args) -> int:
    for path, argument in ((args.png, "--png"), (args.json, "--json")):
        if path:
            _check_output_file(path, argument)
    options = Options(workspace_limit=None, memory_budget=args.memory_budget,
                      micro_batches=args.micro_batches)
    model = models.load_model(args.model, args.data_format)
    unplanned = analyze(keras_training_step(model, args.batch))
    needed = unplanned.peak_bytes + unplanned.persistent_bytes
    link = args.link_gb_s * 1e9
    _, keras_plan = plan_keras_step(model, args.batch, options.memory_budget,
                                    DeviceModel(f"{args.link_gb_s:g} GB/s link", link, link),
                                    micro_batches=options.micro_batches)
    plan = keras_plan.plan
    print(f"{args.model}, batch {args.batch}: its training step needs {format_bytes(needed)} "
          f"({format_bytes(unplanned.persistent_bytes)} of variables); the largest tensors kept "
          "for the backward pass:")
    for tensor in unplanned.kept()[:5]:
        print(f"  {tensor.name}: {format_bytes(tensor.bytes)}")
    print(plan.to_text())
    print(f"  the layers up to {keras_plan.prefix_end} run in "
          f"{keras_plan.micro_batches} micro-batches" if keras_plan.prefix_end
          else "  whole batches")
    if args.png:
        write_timeline_png(args.png, memory_timeline(plan, unplanned),
                           f"{args.model}, batch {args.batch}")
        print(f"wrote {args.png}")
    if args.json:
        _write_json(args.json, {"model": args.model, "batch": args.batch,
                                "unplanned_bytes": needed, **keras_plan.to_json()})
    return 0


def _add_model_arguments(parser: argparse.ArgumentParser, batch_required: bool) -> None:
    """How MODEL is built and traced; `plan` and `profile` take the same."""
    parser.add_argument("--batch", type=_positive_int, required=batch_required)
    parser.add_argument("--data-format", choices=["channels_last", "channels_first"],
                        default="channels_last")
    parser.add_argument("--dtype", choices=["float32", "float16", "bfloat16"], default="float32")
    parser.add_argument("--policy", choices=POLICIES, default=POWER_OF_TWO,
                        help="micro-batch sizes to measure on a GPU")


class _Parser(argparse.ArgumentParser):
    """Reports a wrong command line in one line, as the commands report their failures."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    micro_batches = list(Options().micro_batches)
    counts = " ".join(map(str, micro_batches))
    parser = _Parser(prog="tf-ucudnn", description="micro-batched cuDNN for TensorFlow")
    commands = parser.add_subparsers(dest="command", required=True)
    plan = commands.add_parser("plan", help="plan a model's convolutions and print the plan")
    plan.add_argument("model", help="'alexnet', a keras.applications name, or a .keras file")
    _add_model_arguments(plan, batch_required=True)
    plan.add_argument("--mode", choices=[PER_KERNEL, *MODES], default=PER_KERNEL,
                      help="per_kernel: each kernel within --workspace-limit (μ-cuDNN's WR); "
                           "shared_workspace / dynamic_allocator: the ILP under --workspace-budget")
    plan.add_argument("--deterministic", action="store_true",
                      help="deterministic algorithms only (implied by TF's op determinism)")
    plan.add_argument("--call-overhead-us", type=float, default=0.0,
                      help="host time of one micro-batch's call, added to cuDNN's timings")
    plan.add_argument("--compare-with-xla", action="store_true",
                      help="show which layers keep XLA's own convolution, where a plan is not "
                           "predicted clearly faster (for a model compiled with XLA)")
    _add_planning_arguments(plan)
    plan.add_argument("--json", help="also write the report here as JSON")

    convert = commands.add_parser("convert", help="convert a SavedModel's convolutions")
    convert.add_argument("input_dir")
    convert.add_argument("output_dir")
    convert.add_argument("--batch-size", type=_positive_int, required=True)
    convert.add_argument("--memory-budget",
                         help="device memory each signature must fit in at --batch-size")
    convert.add_argument("--micro-batches", nargs="+", type=int, default=micro_batches,
                         help="numbers of micro-batches to try for the ops up to a pooling "
                              f"where the memory budget needs them (default {counts})")
    convert.add_argument("--signatures", nargs="*", help="signature keys to convert (default all)")
    convert.add_argument("--overwrite", action="store_true",
                         help="replace OUTPUT_DIR if it exists")
    _add_planning_arguments(convert)

    profiling = commands.add_parser(
        "profile", help="measure a model's convolutions on this GPU into the profile database, "
                        "or import or export JSON-lines profile files")
    what = profiling.add_mutually_exclusive_group(required=True)
    what.add_argument("model", nargs="?", metavar="MODEL",
                      help="'alexnet', a keras.applications name, or a .keras file to measure")
    what.add_argument("--import", dest="import_files", nargs="+", metavar="FILE",
                      help="JSON-lines files (.gz: gzipped) to add to the database")
    what.add_argument("--export", metavar="FILE",
                      help="write the database's measurements here as JSON lines (.gz: gzipped)")
    _add_model_arguments(profiling, batch_required=False)
    _add_database_argument(profiling)
    profiling.add_argument("--device", help="--export: only this device's measurements; "
                           "--import: the device of lines that name none")
    profiling.add_argument("--cudnn-version", type=int, help="the same, for the cuDNN version")

    memory = commands.add_parser(
        "memory", help="a model's training step under a memory budget: what it keeps alive, "
                       "its plan, and the memory timeline")
    memory.add_argument("model", help="'alexnet', a keras.applications name, or a .keras file")
    memory.add_argument("--batch", type=_positive_int, required=True)
    memory.add_argument("--data-format", choices=["channels_last", "channels_first"],
                        default="channels_last")
    memory.add_argument("--memory-budget", required=True, help="e.g. 12GiB")
    memory.add_argument("--micro-batches", nargs="+", type=int, default=micro_batches,
                        help=f"micro-batch counts the first layers may run in (default {counts})")
    memory.add_argument("--link-gb-s", type=float, default=25.0,
                        help="the host link's speed each way, GB/s (default 25, PCIe 4)")
    memory.add_argument("--png", help="draw the memory timeline here")
    memory.add_argument("--json", help="also write the plan here as JSON")
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    command = {"plan": _plan_command, "convert": _convert_command,
               "profile": _profile_command, "memory": _memory_command}[args.command]
    try:
        return command(args)
    except (TfUcudnnError, ValueError, OSError) as error:
        if isinstance(error, OSError) and error.filename and error.strerror:
            error = f"{error.filename}: {error.strerror}"
        print(f"tf-ucudnn {args.command}: {' '.join(str(error).split())}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
