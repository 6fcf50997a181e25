"""benchmarks/keras_beyond_memory.py runs on the CPU (a tiny model, no cap): Keras fit, the
tuner, the callback at 4x (twice, in fresh processes) and at the tuner's pick, each in a process
of its own, into one JSON."""

import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_the_table_keeps_keras_fit_the_callback_and_the_tuners_pick(tmp_path):
    out = tmp_path / "results.json"
    subprocess.run([sys.executable, os.path.join(REPO, "benchmarks", "keras_beyond_memory.py"),
                    "--models", "smoke", "--tries", "1", "--steps", "2", "--tune", "1",
                    "--repeats", "2",
                    "--out", str(out)], check=True, capture_output=True, timeout=600,
                   env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    entry = json.loads(out.read_text())["models"]["smoke"]
    assert entry["keras_fit"]["largest_batch_tried"] == 8 and entry["keras_fit"]["img_per_s"] > 0
    callback = entry["keras_callback"]
    assert callback["batch"] == 32 and callback["img_per_s"] > 0
    assert callback["accumulation"]["micro_batch_size"] == 32  # no cap: the whole batch fits
    # The 4x batch, which the tuner did not plan: its step predicted at Keras fit's time per
    # image, beside the step measured.
    step = callback["step_ms"]
    assert step["predicted"] == 32 / entry["keras_fit"]["img_per_s"] * 1e3
    assert step["predicted_from"] == "Keras fit's time per image"
    assert step["measured"] == 32 / callback["img_per_s"] * 1e3
    assert step["measured_over_predicted"] == step["measured"] / step["predicted"]
    assert entry["keras_callback_trained"] == 2
    assert [run["batch"] for run in entry["keras_callback_repeats"]] == [32, 32]
    tuned = entry["keras_tuned"]
    [trial] = tuned["trials"]
    assert trial["batch_size"] == 8 and trial["accumulated_micro_batch"] == 8
    # A trial's step is measured as the callback runs it, by batch and micro-batch.
    assert set(tuned["measured_step_ms"]) == {"8/8"}
    assert trial["step_ms"] == tuned["measured_step_ms"]["8/8"]
    assert tuned["best_batch"] == 8
    # The callback trains the tuner's pick too, the tuner's measurement beside its step.
    picked = entry["keras_callback_tuned"]
    assert picked["batch"] == 8 and picked["img_per_s"] > 0
    assert picked["step_ms"]["predicted"] == 8 / entry["keras_fit"]["img_per_s"] * 1e3
    assert picked["step_ms"]["tuner_measured"] == trial["step_ms"]
    assert picked["step_ms"]["measured_over_tuner_measured"] == \
        picked["step_ms"]["measured"] / trial["step_ms"]
    assert "tuner_measured" not in step  # the 4x batch was not a trial


def test_repeats_zero_tunes_without_training_the_4x_batch(tmp_path):
    out = tmp_path / "results.json"
    subprocess.run([sys.executable, os.path.join(REPO, "benchmarks", "keras_beyond_memory.py"),
                    "--models", "smoke", "--tries", "1", "--steps", "2", "--tune", "1", "4",
                    "--repeats", "0", "--out", str(out)], check=True, capture_output=True,
                   timeout=600, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    entry = json.loads(out.read_text())["models"]["smoke"]
    assert "keras_callback" not in entry and "keras_callback_repeats" not in entry
    tuned = entry["keras_tuned"]
    assert [t["batch_size"] for t in tuned["trials"]] == [8, 32]
    assert all(t["accumulated_micro_batch"] == t["batch_size"] for t in tuned["trials"])
    assert tuned["best_batch"] == max(tuned["trials"],
                                      key=lambda t: t["images_per_second"])["batch_size"]
    # The callback trains the tuner's pick, unless it is the 4x batch, not trained here.
    assert ("keras_callback_tuned" in entry) == (tuned["best_batch"] != 32)
