"""The tf-ucudnn command: `plan` from measured profiles, `convert` for SavedModels."""

import re

import numpy as np
import pytest
import tensorflow as tf
from test_converter import conv_model

from tf_ucudnn.cli import main
from tf_ucudnn.core.plan import KERNELS
from tf_ucudnn.graph.conv_layers import find_conv_layers, trace_model
from tf_ucudnn.profiling.records import ProfileRecord, write_jsonl

MIB = 1 << 20


def test_plan_prints_the_micro_batched_plans(profiles_dir, tmp_path, capsys):
    code = main(["plan", "alexnet", "--batch", "256", "--data-format", "channels_first",
                 "--workspace-limit", "64MiB", "--database", str(tmp_path / "db.sqlite"),
                 "--profiles", str(profiles_dir / "h100-cudnn9.14-fp32-nchw.jsonl")])
    out = capsys.readouterr().out
    assert code == 0
    assert "5 convolutions, measurements of NVIDIA H100 80GB HBM3 (cuDNN 91400)" in out
    forward_lines = [line for line in out.splitlines() if line.split()[1:2] == ["fwd"]]
    conv2_forward = forward_lines[1]  # layer names depend on the models built before
    assert "8x32@algo=1" in conv2_forward and "6.31x" in conv2_forward


def test_plan_without_measurements_says_what_is_missing(tmp_path, capsys):
    code = main(["plan", "alexnet", "--batch", "256", "--workspace-limit", "64MiB",
                 "--database", str(tmp_path / "db.sqlite")])
    assert code == 2
    assert "cannot tell which machine's measurements to use" in capsys.readouterr().err


def _synthetic_profiles(model, batch, path):
    """Algorithm 1 is 5x faster than 0 but needs 16 MiB of workspace per sample."""
    layers, _ = find_conv_layers(trace_model(model, batch))
    records = [
        ProfileRecord(device="Test GPU", cudnn_version=90000, geometry=layer.cudnn_geometry(),
                      kernel=kernel, batch_size=size, algo=algo, math="default",
                      time_ms=(1.0 if algo == 0 else 0.2) * size + 0.01,
                      workspace_bytes=0 if algo == 0 else size * 16 * MIB)
        for layer in layers for kernel in KERNELS for size in range(1, batch + 1)
        for algo in (0, 1)]
    write_jsonl(path, records)
    return len(layers)


def test_convert_command_round_trip(tmp_path, capsys):
    model = conv_model()
    model.export(str(tmp_path / "in"), verbose=0)
    _synthetic_profiles(model, 6, tmp_path / "profiles.jsonl")
    code = main(["convert", str(tmp_path / "in"), str(tmp_path / "out"), "--batch-size", "6",
                 "--workspace-limit", "64MiB", "--database", str(tmp_path / "db.sqlite"),
                 "--profiles", str(tmp_path / "profiles.jsonl")])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "3 layer(s) rewritten" in out
    # Within 64 MiB algorithm 1 runs at most 4 samples at a time: 6 = 4 + 2.
    assert '"size": 4, "algorithm": "algo=1,math=default"' in out
    loaded = tf.saved_model.load(str(tmp_path / "out"))
    x = np.random.RandomState(0).rand(6, 12, 12, 3).astype("float32")
    signature = loaded.signatures["serving_default"]
    assert signature.structured_outputs["output_0"].shape.as_list() == [None, 2]
    (name,) = signature.structured_input_signature[1]
    (output,) = signature(**{name: tf.constant(x)}).values()
    np.testing.assert_allclose(output.numpy(), model(x).numpy(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("setup, message", [
    (lambda path: None, "no SavedModel at .*no such directory"),
    (lambda path: path.mkdir(), "holds no saved_model.pb"),
])
def test_convert_command_errors_leave_no_output(tmp_path, capsys, setup, message):
    setup(tmp_path / "in")
    code = main(["convert", str(tmp_path / "in"), str(tmp_path / "out"), "--batch-size", "6"])
    assert code == 2
    err = capsys.readouterr().err
    assert err.startswith("tf-ucudnn convert: ")
    assert re.search(message, err)
    assert not (tmp_path / "out").exists()


def test_convert_command_without_profiles_says_so(tmp_path, capsys):
    conv_model().export(str(tmp_path / "in"), verbose=0)
    code = main(["convert", str(tmp_path / "in"), str(tmp_path / "out"), "--batch-size", "6",
                 "--database", str(tmp_path / "db.sqlite")])
    assert code == 2
    error = capsys.readouterr().err
    assert "could be planned" in error and "no planner: cannot tell which machine's" in error
    assert not (tmp_path / "out").exists()


def test_convert_command_passes_the_micro_batch_counts_on(monkeypatch):
    from tf_ucudnn import cli
    from tf_ucudnn.savedmodel.converter import ConversionError

    seen = []

    def recording(*args, **kwargs):
        seen.append(kwargs["options"].micro_batches)
        raise ConversionError("stopped, for a test")

    monkeypatch.setattr(cli, "Converter", recording)
    arguments = ["convert", "in", "out", "--batch-size", "6", "--memory-budget", "1GiB"]
    assert main([*arguments, "--micro-batches", "2", "3"]) == 2
    assert main(arguments) == 2
    assert seen == [(2, 3), (4, 8)]
