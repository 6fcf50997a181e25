"""Converter: SavedModels converted to tf_ucudnn ops serve the same signatures and outputs."""

import os
import subprocess
import sys
import textwrap

import keras
import numpy as np
import pytest
import tensorflow as tf
from tensorflow.core.protobuf import saved_model_pb2

from tf_ucudnn.core.plan import KernelPlan, LayerPlan
from tf_ucudnn.options import Options, OptionsError
from tf_ucudnn.savedmodel.converter import ConversionError, Converter

BATCH = 6
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Compared with the original at float32 precision: on a GPU, TF32 would round TensorFlow's and
# tf_ucudnn's algorithms differently.
pytestmark = pytest.mark.usefixtures("no_tf32")


def split_in_two(layer):
    batch = layer.batch_size
    halves = KernelPlan.of((batch // 2, 0), (batch - batch // 2, 1))
    return LayerPlan(halves, halves, halves)


def conv_model():
    keras.utils.set_random_seed(0)
    inputs = keras.Input((12, 12, 3))
    x = keras.layers.Conv2D(8, 3, padding="same", activation="relu")(inputs)
    shortcut = x
    x = keras.layers.Conv2D(8, 3, padding="same")(x)
    x = keras.layers.Add()([x, shortcut])
    x = keras.layers.Conv2D(4, 3, strides=2)(x)
    return keras.Model(inputs, keras.layers.Dense(2)(keras.layers.GlobalAveragePooling2D()(x)))


@pytest.fixture(scope="module")
def saved_model(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("models") / "conv")
    model = conv_model()
    model.export(path, verbose=0)
    return path, model


@pytest.fixture(scope="module")
def converted(saved_model, tmp_path_factory):
    path, model = saved_model
    converter = Converter(path, batch_size=BATCH, planner=split_in_two)
    converter.convert()
    out = str(tmp_path_factory.mktemp("converted") / "conv_ucudnn")
    converter.save(out)
    return converter, out, model


def _saved_op_types(path):
    meta = saved_model_pb2.SavedModel()
    with open(os.path.join(path, "saved_model.pb"), "rb") as file:
        meta.ParseFromString(file.read())
    graph = meta.meta_graphs[0].graph_def
    return {node.op for node in graph.node} | {
        node.op for function in graph.library.function for node in function.node_def}


def test_converted_model_serves_the_same_signatures_and_outputs(converted):
    converter, out, model = converted
    loaded = tf.saved_model.load(out)
    assert set(loaded.signatures) == {"serve", "serving_default"}
    rng = np.random.RandomState(1)
    for batch in (BATCH, 3):  # the planned batch, and another that runs the original graph
        x = rng.rand(batch, 12, 12, 3).astype("float32")
        for key, signature in loaded.signatures.items():
            assert signature.structured_outputs["output_0"].shape.as_list() == [None, 2]
            (name,) = signature.structured_input_signature[1]
            (output,) = signature(**{name: tf.constant(x)}).values()
            np.testing.assert_allclose(output.numpy(), model(x).numpy(), rtol=1e-5, atol=1e-6)


def test_converted_model_holds_tf_ucudnn_ops_with_the_plans(converted):
    converter, out, _ = converted
    types = _saved_op_types(out)
    assert "UcudnnConv2D" in types and "Conv2D" in types  # Conv2D: the other batch sizes
    for report in converter.reports.values():
        assert len(report.layers) == 3 and not report.left_alone
        assert all(item.plan.forward.sizes == (3, 3) for item in report.layers)
    assert "3 layer(s) rewritten" in converter.summary()


def test_variables_are_shared_not_copied(saved_model, converted):
    path, _ = saved_model
    _, out, _ = converted

    def variable_bytes(root):
        folder = os.path.join(root, "variables")
        return sum(os.path.getsize(os.path.join(folder, name)) for name in os.listdir(folder))

    assert variable_bytes(out) < 1.5 * variable_bytes(path)


def test_missing_input_is_named_and_nothing_is_written(tmp_path):
    out = tmp_path / "out"
    with pytest.raises(ConversionError, match="no SavedModel at .*no such directory"):
        Converter(str(tmp_path / "absent"), batch_size=BATCH, planner=split_in_two).convert()
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ConversionError, match="holds no saved_model.pb"):
        Converter(str(empty), batch_size=BATCH, planner=split_in_two).convert()
    assert not out.exists()


def test_corrupt_saved_model_gets_a_clear_error(tmp_path):
    corrupt = tmp_path / "corrupt"
    corrupt.mkdir()
    (corrupt / "saved_model.pb").write_bytes(b"\x08\x01garbage, not a protocol buffer\xff\xfe")
    with pytest.raises(ConversionError, match="cannot load the SavedModel at"):
        Converter(str(corrupt), batch_size=BATCH, planner=split_in_two).convert()


def test_model_without_convolutions_is_refused(tmp_path):
    model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(3)])
    model.export(str(tmp_path / "dense"), verbose=0)
    converter = Converter(str(tmp_path / "dense"), batch_size=BATCH, planner=split_in_two)
    with pytest.raises(ConversionError, match="has no Conv2D or Conv3D"):
        converter.convert()
    with pytest.raises(ConversionError, match="nothing to save"):
        converter.save(str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()


def test_no_plannable_convolution_is_refused_with_the_reasons(saved_model):
    path, _ = saved_model
    converter = Converter(path, batch_size=BATCH, planner=lambda layer: "no profile, for a test")
    with pytest.raises(ConversionError, match="could be planned, e.g. .*no profile, for a test"):
        converter.convert()


def test_unknown_signature_is_named(saved_model):
    path, _ = saved_model
    with pytest.raises(ConversionError, match="no signature named \\['predict'\\]"):
        Converter(path, batch_size=BATCH, planner=split_in_two,
                  signature_keys=["predict"]).convert()


def test_an_existing_output_is_kept_unless_overwrite(converted, tmp_path):
    converter, _, _ = converted
    out = tmp_path / "taken"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(ConversionError, match="exists and is not empty"):
        converter.save(str(out))
    assert (out / "keep.txt").read_text() == "mine"
    converter.save(str(out), overwrite=True)
    assert (out / "saved_model.pb").exists() and not (out / "keep.txt").exists()
    assert not [name for name in os.listdir(tmp_path) if name.startswith(".ucudnn-")]


def test_a_failed_save_leaves_no_partial_output(converted, tmp_path, monkeypatch):
    converter, _, _ = converted

    def broken_save(*args, **kwargs):
        os.makedirs(os.path.join(args[1], "variables"))
        raise OSError("disk full, for a test")

    monkeypatch.setattr(tf.saved_model, "save", broken_save)
    with pytest.raises(ConversionError, match="cannot write .*out: disk full, for a test"):
        converter.save(str(tmp_path / "out"))
    assert os.listdir(tmp_path) == []


def test_a_memory_budget_is_checked_per_signature(saved_model, tmp_path):
    from training_steps import SLOW_LINK

    from tf_ucudnn.memory import BudgetError

    path, model = saved_model
    roomy = Converter(path, batch_size=BATCH, planner=split_in_two, memory_budget="1GiB",
                      device_model=SLOW_LINK)
    roomy.convert()
    for report in roomy.reports.values():
        assert report.memory.decisions.prediction.peak_bytes <= 1 << 30
        assert "memory plan for a 1 GiB budget" in report.to_text()
    roomy.save(str(tmp_path / "out"))
    loaded = tf.saved_model.load(str(tmp_path / "out"))
    signature = loaded.signatures["serving_default"]
    (name,) = signature.structured_input_signature[1]
    x = np.random.RandomState(2).rand(BATCH, 12, 12, 3).astype("float32")
    (output,) = signature(**{name: tf.constant(x)}).values()
    np.testing.assert_allclose(output.numpy(), model(x).numpy(), rtol=1e-5, atol=1e-6)
    tight = Converter(path, batch_size=BATCH, planner=split_in_two, memory_budget="1KiB",
                      device_model=SLOW_LINK)
    with pytest.raises(BudgetError, match="cannot be met"):
        tight.convert()


def test_a_memory_budget_only_micro_batches_meet_runs_the_first_layers_in_them(tmp_path):
    from training_steps import SLOW_LINK

    keras.utils.set_random_seed(0)
    inputs = keras.Input((16, 16, 3))
    x = keras.layers.Conv2D(16, 3, padding="same", activation="relu")(inputs)
    x = keras.layers.Conv2D(16, 3, padding="same", activation="relu")(x)
    x = keras.layers.Conv2D(4, 3, padding="same")(keras.layers.MaxPooling2D(4)(x))
    model = keras.Model(inputs, keras.layers.Dense(2)(keras.layers.GlobalAveragePooling2D()(x)))
    path = str(tmp_path / "pooled")
    model.export(path, verbose=0)
    roomy = Converter(path, batch_size=BATCH, planner=split_in_two, memory_budget="1GiB",
                      device_model=SLOW_LINK)
    roomy.convert()
    # Serving keeps nothing for a backward pass: no swap or recomputation goes below this.
    peak = min(report.memory.decisions.prediction.peak_bytes for report in roomy.reports.values())
    tight = Converter(path, batch_size=BATCH, planner=split_in_two, memory_budget=peak - 1,
                      device_model=SLOW_LINK, micro_batches=(2, 3))
    tight.convert()
    for report in tight.reports.values():
        assert report.memory_prefix.cut.endswith("MaxPool2d:0")
        assert report.memory_prefix.micro_batches in (2, 3)
        assert report.memory.decisions.prediction.peak_bytes < peak
    assert "micro-batches" in tight.summary()
    tight.save(str(tmp_path / "out"))
    signature = tf.saved_model.load(str(tmp_path / "out")).signatures["serving_default"]
    (name,) = signature.structured_input_signature[1]
    x = np.random.RandomState(2).rand(BATCH, 16, 16, 3).astype("float32")
    (output,) = signature(**{name: tf.constant(x)}).values()
    np.testing.assert_allclose(output.numpy(), model(x).numpy(), rtol=1e-5, atol=1e-6)


def test_converted_model_compiles_with_xla(converted):
    """Its signatures run inside tf.function(jit_compile=True), at the planned batch size and
    another, with the same outputs."""
    _, out, model = converted
    loaded = tf.saved_model.load(out)
    signature = loaded.signatures["serving_default"]
    (name,) = signature.structured_input_signature[1]
    compiled = tf.function(lambda x: signature(**{name: x}), jit_compile=True)
    rng = np.random.RandomState(2)
    for batch in (BATCH, 3):
        x = rng.rand(batch, 12, 12, 3).astype("float32")
        (output,) = compiled(tf.constant(x)).values()
        np.testing.assert_allclose(output.numpy(), model(x).numpy(), rtol=1e-5, atol=1e-6)
    hlo = compiled.experimental_get_compiler_ir(tf.constant(x[:BATCH]))(stage="hlo")
    assert "UcudnnConv2D" in hlo  # the plans' ops went into XLA's computation


def test_an_output_directory_that_cannot_be_written_is_a_conversion_error(converted, tmp_path):
    converter, _, _ = converted
    a_file = tmp_path / "a_file"
    a_file.write_text("not a directory")
    with pytest.raises(ConversionError, match="cannot write .*a_file/out"):
        converter.save(str(a_file / "out"))
    assert sorted(os.listdir(tmp_path)) == ["a_file"]


def test_options_and_keyword_settings_fold_into_one_options(tmp_path):
    path = str(tmp_path / "unread")  # nothing is read before convert()
    assert Converter(path, batch_size=BATCH).options == Options()
    converter = Converter(path, batch_size=BATCH, memory_budget="1GiB",
                          options=Options(workspace_limit="32MiB", memory_budget="2GiB"))
    assert converter.options == Options(workspace_limit="32MiB", memory_budget="1GiB")
    assert "32 MiB of workspace per kernel" in converter.summary()
    with pytest.raises(OptionsError, match="profiles and planner=: those settings"):
        Converter(path, batch_size=BATCH, planner=split_in_two, profiles=["mine.jsonl"])
    with pytest.raises(OptionsError, match="trial_steps: not a setting of Options"):
        Converter(path, batch_size=BATCH, trial_steps=0)


def test_converted_model_loads_after_importing_tf_ucudnn_alone(converted, tmp_path):
    """In a fresh process, with no load_ops() call: the import registers the ops the model holds."""
    _, out, model = converted
    assert "UcudnnConv2D" in _saved_op_types(out)
    x = np.random.RandomState(3).rand(BATCH, 12, 12, 3).astype("float32")  # the planned batch
    np.save(tmp_path / "x.npy", x)
    script = textwrap.dedent("""
        import sys
        import numpy as np
        import tensorflow as tf
        import tf_ucudnn
        tf.config.experimental.enable_tensor_float_32_execution(False)
        signature = tf.saved_model.load(sys.argv[1]).signatures["serving_default"]
        (name,) = signature.structured_input_signature[1]
        (output,) = signature(**{name: tf.constant(np.load(sys.argv[2]))}).values()
        np.save(sys.argv[3], output.numpy())
        print(tf_ucudnn.__file__)
    """)
    # This checkout's tf_ucudnn, not the one an editable install may point at.
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")]))
    result = subprocess.run([sys.executable, "-c", script, out, str(tmp_path / "x.npy"),
                             str(tmp_path / "y.npy")], env=env, cwd=tmp_path,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == os.path.join(REPO, "tf_ucudnn", "__init__.py")
    np.testing.assert_allclose(np.load(tmp_path / "y.npy"), model(x).numpy(), rtol=1e-5,
                               atol=1e-6)
