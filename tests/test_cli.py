"""The tf-ucudnn command: `plan` from measured profiles, `convert` for SavedModels, `profile` to
measure and to import and export profiles; and that every failure is one line, before any work."""

import dataclasses
import gzip
import json
import os
import re
import shutil
import subprocess

import numpy as np
import pytest
import tensorflow as tf
from conftest import gpu_unavailable_reason
from savedmodel.test_converter import conv_model

from tf_ucudnn.cli import main
from tf_ucudnn.core.plan import KERNELS
from tf_ucudnn.core.units import MIB
from tf_ucudnn.graph.conv_layers import find_conv_layers, trace_model
from tf_ucudnn.profiling import ProfileDatabase, packaged_profiles, read_jsonl
from tf_ucudnn.profiling.records import ProfileRecord, write_jsonl


H100 = "NVIDIA H100 80GB HBM3"


def one_line_error(capsys, command):
    """The failure's message: one line on stderr, in the command's name; nothing on stdout."""
    captured = capsys.readouterr()
    assert captured.err.startswith(f"tf-ucudnn {command}: "), captured.err
    assert captured.err.count("\n") == 1 and "Traceback" not in captured.err, captured.err
    assert captured.out == ""
    return captured.err


@pytest.fixture
def read_only():
    """Makes a directory (created if missing) read-only, for root too (chattr +i), until the
    test ends."""
    as_root = os.geteuid() == 0
    changed = []

    def make(path):
        path.mkdir(exist_ok=True)
        if not as_root:
            path.chmod(0o555)
        elif not shutil.which("chattr") or subprocess.run(
                ["chattr", "+i", str(path)], capture_output=True).returncode:
            pytest.skip("running as root, where only chattr +i (unavailable here) makes a "
                        "directory read-only")
        changed.append(path)
        return path

    yield make
    for path in changed:
        if as_root:
            subprocess.run(["chattr", "-i", str(path)], check=True)
        else:
            path.chmod(0o755)


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
    # The packaged profiles are imported (a note says so), but hold no AlexNet in NHWC.
    code = main(["plan", "alexnet", "--batch", "256", "--workspace-limit", "64MiB",
                 "--database", str(tmp_path / "db.sqlite")])
    assert code == 2
    note, error = capsys.readouterr().err.splitlines()
    assert "imported the 5778 packaged ones" in note
    assert re.match(f"tf-ucudnn plan: no measurements of 5 of the 5 convolution.* at batch 256 "
                    f"on {H100}", error)


def test_plan_with_several_machines_asks_which(tmp_path, capsys):
    model = conv_model()
    _synthetic_profiles(model, 6, tmp_path / "a.jsonl")
    _synthetic_profiles(model, 6, tmp_path / "b.jsonl", device="Other GPU")
    code = main(["plan", "alexnet", "--batch", "6", "--database", str(tmp_path / "db.sqlite"),
                 "--profiles", str(tmp_path / "a.jsonl"), str(tmp_path / "b.jsonl")])
    assert code == 2
    error = one_line_error(capsys, "plan")
    assert "cannot tell which machine's measurements to use" in error
    assert "'Other GPU' cuDNN 90000, 'Test GPU' cuDNN 90000" in error


def test_plan_without_a_gpu_or_profiles_uses_the_packaged_ones(tmp_path, capsys):
    database = tmp_path / "db.sqlite"
    assert main(["plan", "resnet50", "--batch", "128", "--database", str(database)]) == 0
    captured = capsys.readouterr()
    [note] = captured.err.splitlines()
    assert re.match(f"tf-ucudnn plan: {database} held no measurements and no --profiles were "
                    f"given: imported the 5778 packaged ones of {H100} .cuDNN 91400. from ",
                    note)
    assert note.endswith("(also packaged: NVIDIA H200 (cuDNN 91400); --device names another)")
    assert f"resnet50, batch 128, 53 convolutions, measurements of {H100}" in captured.out
    assert re.search(r"^total .* 3\.17x$", captured.out, re.MULTILINE)
    with ProfileDatabase(database) as db:  # one machine's: the database then names one
        assert len(db) == sum(record.device == H100 for path in packaged_profiles()
                              for record in read_jsonl(path))


def _synthetic_profiles(model, batch, path, device="Test GPU"):
    """Algorithm 1 is 5x faster than 0 but needs 16 MiB of workspace per sample."""
    layers, _ = find_conv_layers(trace_model(model, batch))
    records = [
        ProfileRecord(device=device, cudnn_version=90000, geometry=layer.cudnn_geometry(),
                      kernel=kernel, batch_size=size, algo=algo, math="default",
                      time_ms=(1.0 if algo == 0 else 0.2) * size + 0.01,
                      workspace_bytes=0 if algo == 0 else size * 16 * MIB)
        for layer in layers for kernel in KERNELS for size in range(1, batch + 1)
        for algo in (0, 1)]
    write_jsonl(path, records)
    return records


def test_plan_shows_the_layers_xla_keeps(tmp_path, capsys):
    model = conv_model()
    model.save(tmp_path / "model.keras")
    records = _synthetic_profiles(model, 6, tmp_path / "even.jsonl")
    # The first layer runs 4x slower per sample on more than 3 samples at once: micro-batches
    # beat XLA's undivided convolution there; elsewhere they gain nothing on it.
    first = records[0].geometry
    write_jsonl(tmp_path / "profiles.jsonl", [
        dataclasses.replace(r, time_ms=r.time_ms * 4)
        if r.geometry == first and r.batch_size > 3 else r for r in records])
    arguments = ["plan", str(tmp_path / "model.keras"), "--batch", "6",
                 "--database", str(tmp_path / "db.sqlite"),
                 "--profiles", str(tmp_path / "profiles.jsonl")]
    assert main([*arguments, "--compare-with-xla", "--json", str(tmp_path / "plan.json")]) == 0
    out = capsys.readouterr().out
    assert "own: 2 layer(s) keep TensorFlow's or XLA's own convolution" in out
    # Three kernels of 1.21 ms undivided (algorithm 1), against 1.22 ms in 4 + 2 samples.
    assert out.count("XLA's own convolution is predicted as fast or faster: 3.630 ms undivided "
                     "with any workspace, against 3.660 ms planned") == 2
    rows = json.loads((tmp_path / "plan.json").read_text())["kernels"]
    assert [row["left_alone"] is None for row in rows] == [True] * 3 + [False] * 6
    assert all(len(row["micro_batches"]) == 2 for row in rows[:3])  # 3 + 3 samples
    assert all(len(row["micro_batches"]) == 1 for row in rows[3:])  # XLA's, on all 6
    assert main(arguments) == 0
    assert "own:" not in capsys.readouterr().out


def test_plan_in_the_dynamic_allocator_mode_fits_beside_the_training_step(tmp_path, capsys):
    from tf_ucudnn.conv_planning.plan_report import layer_label
    from tf_ucudnn.memory.analysis.kernel_live_bytes import training_live_bytes
    from tf_ucudnn.keras.planned_step import keras_training_step

    model = conv_model()
    model.save(tmp_path / "model.keras")
    _synthetic_profiles(model, 6, tmp_path / "profiles.jsonl")
    budget = 4 << 20
    assert main(["plan", str(tmp_path / "model.keras"), "--batch", "6", "--mode",
                 "dynamic_allocator", "--workspace-budget", str(budget), "--json",
                 str(tmp_path / "plan.json"), "--database", str(tmp_path / "db.sqlite"),
                 "--profiles", str(tmp_path / "profiles.jsonl")]) == 0
    assert "dynamic_allocator, budget 4 MiB" in capsys.readouterr().out
    # Each kernel's workspace fits beside what the training step holds as it runs.
    step = keras_training_step(tf.keras.models.load_model(tmp_path / "model.keras"), 6)
    live = {(layer_label(layer), kernel): size for (layer, kernel), size
            in training_live_bytes(step, find_conv_layers(step.graph)[0]).items()}
    rows = json.loads((tmp_path / "plan.json").read_text())["kernels"]
    assert len(rows) == 9
    for row in rows:
        assert row["workspace_limit_bytes"] == budget - live[(row["layer"], row["kernel"])]
        assert row["workspace_bytes"] <= row["workspace_limit_bytes"]


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


def test_command_line_mistakes_are_one_line(capsys):
    for argv, message in [
            (["plan", "alexnet", "--batch", "0"], "argument --batch: a positive integer, not '0'"),
            (["profile"], "one of the arguments MODEL --import --export is required"),
            (["profile", "alexnet", "--export", "x"], "--export: not allowed with argument MODEL")]:
        with pytest.raises(SystemExit) as exit_:
            main(argv)
        assert exit_.value.code == 2
        assert message in one_line_error(capsys, argv[0])


@pytest.mark.parametrize("setup, message", [
    (lambda out, read_only: out.write_text("a file"), "a file, not a directory"),
    (lambda out, read_only: (out.mkdir(), (out / "x").touch()),
     r"exists and is not empty \(--overwrite replaces it\)"),
    (lambda out, read_only: read_only(out), "a read-only directory"),
    (lambda out, read_only: read_only(out.parent), "its directory .* is read-only"),
], ids=["file", "not-empty", "read-only", "in-read-only"])
def test_convert_checks_the_output_directory_first(tmp_path, capsys, read_only, setup, message):
    out = tmp_path / "parent" / "out"
    out.parent.mkdir()
    setup(out, read_only)
    # No input either: were the output checked after loading it, that would be the error.
    code = main(["convert", str(tmp_path / "in"), str(out), "--batch-size", "6",
                 "--database", str(tmp_path / "db.sqlite")])
    assert code == 2
    assert re.search(f"output directory {out}: {message}", one_line_error(capsys, "convert"))
    assert not (tmp_path / "db.sqlite").exists()


@pytest.mark.parametrize("target, message", [
    ("folder", "a directory, not a file"),
    ("missing/report.json", "no directory .*missing"),
    ("read-only/report.json", "its directory .*read-only is read-only"),
])
def test_plan_checks_the_json_path_first(tmp_path, capsys, read_only, target, message):
    (tmp_path / "folder").mkdir()
    read_only(tmp_path / "read-only")
    # An unknown model: were the path checked after loading it, that would be the error.
    code = main(["plan", "none.keras", "--batch", "8", "--database", str(tmp_path / "db.sqlite"),
                 "--json", str(tmp_path / target)])
    assert code == 2
    assert re.search(f"--json {tmp_path / target}: {message}", one_line_error(capsys, "plan"))
    assert not (tmp_path / "db.sqlite").exists()


def _damaged_profiles(tmp_path, kind):
    good = ProfileRecord(H100, 91400, find_conv_layers(trace_model(conv_model(), 2))[0][0]
                         .cudnn_geometry(), "fwd", 2, 1, "default", 0.2, 0)
    if kind == "not-an-object":
        path = tmp_path / "profiles.jsonl"
        write_jsonl(path, [good])
        with open(path, "a") as out:
            out.write('"a string"\n')
        return path, r"profiles\.jsonl:2: bad profile record: not a JSON object"
    if kind == "truncated":
        path = tmp_path / "profiles.jsonl.gz"
        write_jsonl(path, [dataclasses.replace(good, batch_size=size) for size in range(1, 5000)])
        path.write_bytes(path.read_bytes()[:-100])
        return path, r"profiles\.jsonl\.gz:\d+: cannot read: .*truncated"
    return tmp_path / "missing.jsonl", r"missing\.jsonl: cannot open: No such file"


@pytest.mark.parametrize("kind", ["not-an-object", "truncated", "missing"])
def test_bad_profile_files_fail_in_one_line_importing_nothing(tmp_path, capsys, kind):
    path, message = _damaged_profiles(tmp_path, kind)
    good = tmp_path / "good.jsonl"
    _synthetic_profiles(conv_model(), 2, good)
    code = main(["plan", "alexnet", "--batch", "8", "--database", str(tmp_path / "db.sqlite"),
                 "--profiles", str(good), str(path)])
    assert code == 2
    assert re.search(message, one_line_error(capsys, "plan"))
    code = main(["profile", "--import", str(good), str(path),
                 "--database", str(tmp_path / "db.sqlite")])
    assert code == 2
    assert re.search(message, one_line_error(capsys, "profile"))
    assert not (tmp_path / "db.sqlite").exists()


def test_damaged_database_fails_in_one_line(tmp_path, capsys):
    database = tmp_path / "damaged.sqlite"
    with ProfileDatabase(database) as db:
        db.import_jsonl(packaged_profiles()[0])
    data = bytearray(database.read_bytes())
    data[4096 + 50: 3 * 4096] = b"\xab" * (3 * 4096 - 4096 - 50)  # scribble over pages 2 and 3
    database.write_bytes(bytes(data))
    conv_model().export(str(tmp_path / "in"), verbose=0)
    message = f"profile database {database}: .*damaged"
    for argv in (["plan", "alexnet", "--batch", "8"],
                 ["convert", str(tmp_path / "in"), str(tmp_path / "out"), "--batch-size", "6"],
                 ["profile", "--import", str(packaged_profiles()[0])],
                 ["profile", "--export", str(tmp_path / "out.jsonl")]):
        assert main([*argv, "--database", str(database)]) == 2
        assert re.search(message, one_line_error(capsys, argv[0]))
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.jsonl").exists()


def test_profile_import_and_export_round_trip(tmp_path, capsys):
    model = conv_model()
    test_gpu = _synthetic_profiles(model, 4, tmp_path / "test.jsonl")
    other_gpu = _synthetic_profiles(model, 4, tmp_path / "other.jsonl.gz", device="Other GPU")
    # Lines that name no machine take --device and --cudnn-version.
    with gzip.open(tmp_path / "anonymous.jsonl.gz", "wt") as out:
        for record in test_gpu[:5]:
            line = record.to_json()
            del line["device"], line["cudnn"]
            out.write(f"{line}\n".replace("'", '"'))
    database = ["--database", str(tmp_path / "db.sqlite")]
    assert main(["profile", "--import", str(tmp_path / "test.jsonl"),
                 str(tmp_path / "other.jsonl.gz"), *database]) == 0
    assert capsys.readouterr().out == (f"imported {len(test_gpu) + len(other_gpu)} "
                                       f"measurement(s) from 2 file(s) into {database[1]}\n")
    assert main(["profile", "--import", str(tmp_path / "anonymous.jsonl.gz"), "--device", "New",
                 "--cudnn-version", "7", *database]) == 0
    capsys.readouterr()

    def unlabelled(records):
        return sorted((dataclasses.replace(r, layer=None) for r in records), key=repr)

    assert main(["profile", "--export", str(tmp_path / "all.jsonl.gz"), *database]) == 0
    assert "of New (cuDNN 7); Other GPU (cuDNN 90000); Test GPU (cuDNN 90000)" in \
        capsys.readouterr().out
    new = [dataclasses.replace(r, device="New", cudnn_version=7) for r in test_gpu[:5]]
    assert unlabelled(read_jsonl(tmp_path / "all.jsonl.gz")) == \
        unlabelled(test_gpu + other_gpu + new)
    assert main(["profile", "--export", str(tmp_path / "other.jsonl"), "--device", "Other GPU",
                 *database]) == 0
    assert capsys.readouterr().out == (f"exported {len(other_gpu)} measurement(s) of Other GPU "
                                       f"(cuDNN 90000) to {tmp_path / 'other.jsonl'}\n")
    assert unlabelled(read_jsonl(tmp_path / "other.jsonl")) == unlabelled(other_gpu)

    assert main(["profile", "--export", str(tmp_path / "none.jsonl"), "--device", "Test GPU",
                 "--cudnn-version", "7", *database]) == 2
    error = one_line_error(capsys, "profile")
    assert "no measurements of Test GPU cuDNN 7 to export; it holds New (cuDNN 7); " in error
    assert not (tmp_path / "none.jsonl").exists()
    assert main(["profile", "--export", str(tmp_path / "x.jsonl"),
                 "--database", str(tmp_path / "missing.sqlite")]) == 2
    assert "missing.sqlite: no such file: nothing to export" in one_line_error(capsys, "profile")
    assert not (tmp_path / "missing.sqlite").exists()


def test_profile_arguments_that_do_not_go_together(tmp_path, capsys):
    for argv, message in [(["alexnet"], "--batch: give the batch size to measure alexnet at"),
                          (["--import", "x.jsonl", "--batch", "8"], "--batch goes with MODEL"),
                          (["alexnet", "--batch", "8", "--device", "H100"],
                           "--device and --cudnn-version go with --import and --export")]:
        assert main(["profile", *argv, "--database", str(tmp_path / "db.sqlite")]) == 2
        assert message in one_line_error(capsys, "profile")
    assert not (tmp_path / "db.sqlite").exists()


def test_profile_without_a_gpu_fails_before_loading_the_model(tmp_path, capsys):
    if gpu_unavailable_reason() is None:
        pytest.skip("this machine can measure")
    # An unknown model: were the GPU looked for after loading it, that would be the error.
    code = main(["profile", "none.keras", "--batch", "8",
                 "--database", str(tmp_path / "db.sqlite")])
    assert code == 2
    assert re.search("without its cuDNN kernels|no GPU", one_line_error(capsys, "profile"))
    assert not (tmp_path / "db.sqlite").exists()


@pytest.mark.gpu
def test_profile_measures_what_plan_then_uses(tmp_path, capsys, gpu_device):
    conv_model().save(tmp_path / "model.keras")
    database = ["--database", str(tmp_path / "db.sqlite")]
    assert main(["profile", str(tmp_path / "model.keras"), "--batch", "4", *database]) == 0
    # 3 distinct geometries x 3 kernels x sizes 1, 2, 4, each with some algorithms.
    assert re.search(r"batch 4: \d+ measurement\(s\) of 3 convolution geometries on ",
                     capsys.readouterr().out)
    with ProfileDatabase(tmp_path / "db.sqlite") as db:
        assert {r.batch_size for r in db.records()} == {1, 2, 4}
    assert main(["plan", str(tmp_path / "model.keras"), "--batch", "4", *database]) == 0
    assert "model.keras, batch 4, 3 convolutions" in capsys.readouterr().out


def _tiny_cnn_file(tmp_path):
    import keras

    layers = keras.layers
    inputs = keras.Input((32, 32, 3))
    x = layers.Conv2D(16, 3, padding="same", activation="relu")(inputs)
    x = layers.MaxPooling2D(name="pool")(x)
    x = layers.Conv2D(16, 3, padding="same", activation="relu")(x)
    model = keras.Model(inputs, layers.Dense(10)(layers.GlobalAveragePooling2D()(x)))
    path = str(tmp_path / "tiny.keras")
    model.save(path)
    return path


def test_memory_command_plans_under_a_budget_and_draws_the_timeline(tmp_path, capsys):
    model = _tiny_cnn_file(tmp_path)
    png, plan_json = tmp_path / "timeline.png", tmp_path / "plan.json"
    assert main(["memory", model, "--batch", "64", "--memory-budget", "8MiB",
                 "--png", str(png), "--json", str(plan_json)]) == 0
    out = capsys.readouterr().out
    needed = float(out.split("needs ")[1].split(" MiB")[0])
    assert needed > 8 and "memory plan for a 8 MiB budget" in out
    assert "the layers up to pool run in" in out
    assert png.read_bytes().startswith(b"\x89PNG")
    written = json.loads(plan_json.read_text())
    assert written["prefix_end"] == "pool"
    assert written["plan"]["decisions"]["prediction"]["peak_bytes"] <= 8 << 20


def test_memory_command_fails_in_one_line(tmp_path, capsys):
    model = _tiny_cnn_file(tmp_path)
    assert main(["memory", model, "--batch", "64", "--memory-budget", "1KiB"]) == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert error.startswith("tf-ucudnn memory: the memory budget of 1 KiB cannot be met")
    assert main(["memory", model, "--batch", "64", "--memory-budget", "8MiB",
                 "--png", str(tmp_path)]) == 2
    assert f"--png {tmp_path}: a directory, not a file" in capsys.readouterr().err


def test_memory_command_gives_an_application_a_loss_on_its_probabilities(capsys, recwarn):
    # keras.applications' classifiers end in a softmax: a loss on logits would warn.
    assert main(["memory", "mobilenetv3small", "--batch", "2", "--memory-budget", "1GiB"]) == 0
    assert "memory plan for a 1 GiB budget" in capsys.readouterr().out
    assert [str(w.message) for w in recwarn if "from_logits" in str(w.message)] == []
