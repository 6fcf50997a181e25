"""SavedModel conversion, in the manner of TF-TRT's `TrtGraphConverterV2`:

    converter = tf_ucudnn.Converter("model_dir", batch_size=128, workspace_limit="32MiB")
    converter.convert()
    converter.save("model_ucudnn")
    print(converter.summary())

Each signature is traced at the planned batch size, its function calls inlined (a restored
signature is a call of the saved function), and its convolutions rewritten with their plans. The
converted signature keeps the original's inputs and outputs: a batch of the planned size runs the
rewritten graph, any other size runs the original one. The variables are the original's, not
copies. The output directory appears whole or not at all.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from typing import Optional, Sequence

import tensorflow as tf

from tf_ucudnn.core.errors import TfUcudnnError
from tf_ucudnn.core.plan import LayerPlanner
from tf_ucudnn.options import Options, OptionsError
from tf_ucudnn.pipeline import conv_planner, entry_options, plan_graph
from tf_ucudnn.profiling.database import ProfileDatabaseError
from tf_ucudnn.report import RewriteReport

# Why a converted signature keeps each layer's convolution, bias and activation apart.
UNFUSED_IN_SAVED_MODELS = ("a converted SavedModel may be served compiled by XLA, which has no "
                           "kernel for the fused op")


class ConversionError(TfUcudnnError, RuntimeError):
    """Why a SavedModel cannot be converted; nothing is written when it is raised."""


class Converter:
    """Converts a SavedModel's convolutions to tf_ucudnn's micro-batched ops.

    Args:
      input_saved_model_dir: the SavedModel to convert.
      batch_size: the batch size to plan for.
      options: a `tf_ucudnn.Options` (its defaults if None): `workspace_limit` (each kernel's
        cuDNN workspace), `workspace_budget` (optionally, all kernels' workspaces together,
        planned by the network-wide ILP), `memory_budget`, `micro_batches`, and what the
        default planner plans from (`database`, `profiles`, `device`, `cudnn_version`).
      planner: gives each layer its plan or a reason to leave it alone; by default a
        `DatabasePlanner` over the options' database (measuring on a GPU, else planning from
        the profiles imported into it). The settings only that planner reads, given beside a
        planner, are an OptionsError naming them.
      device_model: the `tf_ucudnn.memory.DeviceModel` for the memory budget (measured on a GPU
        if not given).
      signature_keys: the signatures to convert (default: all); the others are not saved.
      **overrides: any setting of `options` by name, over it (sizes in bytes or such as
        "16GiB"); a name that is no setting is an OptionsError naming it.

    With a `memory_budget`, each signature's graph must fit in it at the planned batch size
    (checked by the memory planner, which also swaps and recomputes where a signature keeps
    tensors for a backward pass, and where that is not enough runs its ops up to a pooling in
    whichever of `micro_batches` micro-batches fits); a BudgetError says by how much.
    """

    def __init__(self, input_saved_model_dir: str, *, batch_size: int,
                 options: Optional[Options] = None, planner: Optional[LayerPlanner] = None,
                 device_model=None, signature_keys: Optional[Sequence[str]] = None,
                 **overrides):
        if batch_size <= 0:
            raise OptionsError(f"batch_size must be positive, got {batch_size}")
        self.input_saved_model_dir = input_saved_model_dir
        self.batch_size = batch_size
        self.options = entry_options(options, planner, **overrides)
        self._planner = planner
        self._device_model = device_model
        self._signature_keys = signature_keys
        self._loaded = None
        self._signatures: dict = {}
        self.reports: dict[str, RewriteReport] = {}

    def convert(self) -> dict[str, RewriteReport]:
        """Plans and rewrites every signature; returns their reports."""
        self.reports, self._signatures = {}, {}
        loaded = _load(self.input_saved_model_dir)
        available = dict(loaded.signatures)
        keys = list(self._signature_keys or available)
        unknown = [key for key in keys if key not in available]
        if not available or unknown:
            raise ConversionError(
                f"{self.input_saved_model_dir}: no signature named {unknown}, it has "
                f"{sorted(available)}" if unknown else
                f"{self.input_saved_model_dir} has no signatures to convert")
        signatures, reports = {}, {}
        try:
            with conv_planner(self.options, self._planner) as planner:
                for key in keys:
                    signatures[key], reports[key] = self._convert_signature(key, available[key],
                                                                            planner)
        except ProfileDatabaseError as error:
            raise ConversionError(f"no plans can be made: {error}") from error
        if not any(report.layers or report.left_alone for report in reports.values()):
            raise ConversionError(f"{self.input_saved_model_dir} has no Conv2D or Conv3D in "
                                  f"signatures {keys}: nothing to convert")
        if not any(report.layers for report in reports.values()):
            reasons = "; ".join(f"{item.node}: {item.reason}" for report in reports.values()
                                for item in report.left_alone[:3])
            raise ConversionError(f"no convolution of {self.input_saved_model_dir} could be "
                                  f"planned, e.g. {reasons}")
        self._loaded, self._signatures, self.reports = loaded, signatures, reports
        return reports

    def _convert_signature(self, key, signature, planner):
        args, kwargs = signature.structured_input_signature
        if args:
            raise ConversionError(f"signature {key!r} takes positional inputs; only keyword "
                                  "inputs (as tf.saved_model.save writes them) are supported")
        fixed = {}
        for name, spec in kwargs.items():
            if spec.shape.rank is None or spec.shape.rank == 0 or \
                    spec.shape[0] not in (None, self.batch_size):
                raise ConversionError(
                    f"signature {key!r}: input {name!r} of shape {spec.shape} has no batch "
                    f"dimension to set to {self.batch_size}")
            fixed[name] = tf.TensorSpec([self.batch_size, *spec.shape[1:]], spec.dtype, name)
        traced = tf.function(lambda **inputs: signature(**inputs)).get_concrete_function(**fixed)
        planned, report = plan_graph(traced, self.options, planner, inline_functions=True,
                                     device_model=self._device_model,
                                     unfused_because=UNFUSED_IN_SAVED_MODELS)
        names = sorted(kwargs)  # the order tf.nest flattens keyword inputs in
        planned_shape = tf.constant([self.batch_size], tf.int64)

        def serve(**inputs):
            def run_planned():
                # Outputs keep the original's static shapes (batch unknown), as serving expects.
                return tf.nest.map_structure(
                    lambda output, spec: tf.compat.v1.placeholder_with_default(output, spec.shape),
                    planned(*[inputs[name] for name in names]), signature.structured_outputs)

            batch = tf.shape(inputs[names[0]], out_type=tf.int64)[:1]
            return tf.cond(tf.reduce_all(tf.equal(batch, planned_shape)), run_planned,
                           lambda: signature(**inputs))

        return tf.function(serve, autograph=False).get_concrete_function(**kwargs), report

    def save(self, output_saved_model_dir: str, overwrite: bool = False) -> None:
        """Writes the converted SavedModel, whole or not at all; load it with
        tf.saved_model.load after `tf_ucudnn.load_ops()`."""
        if not self.reports:
            raise ConversionError("convert() has not run, or failed: nothing to save")
        output_saved_model_dir = os.path.abspath(output_saved_model_dir)
        if os.path.exists(output_saved_model_dir) and os.listdir(output_saved_model_dir) and \
                not overwrite:
            raise ConversionError(f"{output_saved_model_dir} exists and is not empty")
        parent = os.path.dirname(output_saved_model_dir)
        try:
            os.makedirs(parent, exist_ok=True)
            staging = tempfile.mkdtemp(prefix=".ucudnn-", dir=parent)
        except OSError as error:
            raise ConversionError(f"cannot write {output_saved_model_dir}: "
                                  f"{error.strerror or error}") from error
        try:
            root = tf.Module()
            root.original = self._loaded  # tracks the variables the signatures capture
            tf.saved_model.save(root, staging, signatures=self._signatures)
            if os.path.exists(output_saved_model_dir):
                shutil.rmtree(output_saved_model_dir)
            os.replace(staging, output_saved_model_dir)
        except BaseException as error:
            shutil.rmtree(staging, ignore_errors=True)
            if isinstance(error, OSError):
                raise ConversionError(f"cannot write {output_saved_model_dir}: "
                                      f"{error.strerror or error}") from error
            raise

    def summary(self) -> str:
        lines = [f"tf_ucudnn conversion of {self.input_saved_model_dir} at batch "
                 f"{self.batch_size}, {self.options.describe_workspace()} "
                 "(other batch sizes run the original graph)"]
        for key, report in self.reports.items():
            lines.append(f"signature {key!r}: " + report.to_text())
        return "\n".join(lines)


def _load(path: str):
    if not os.path.isdir(path):
        raise ConversionError(f"no SavedModel at {path}: no such directory")
    if not tf.saved_model.contains_saved_model(path):
        raise ConversionError(f"no SavedModel at {path}: it holds no saved_model.pb")
    try:
        return tf.saved_model.load(path)
    except Exception as error:  # TensorFlow raises many kinds for a damaged model
        raise ConversionError(f"cannot load the SavedModel at {path} "
                              f"({type(error).__name__}): {error}") from error
