"""benchmarks/xla_conv_layers.py --predict-only runs on the CPU from the H100's NHWC profiles:
each AlexNet layer's prediction as XLA's convolution and as its plan within 64 MiB, and the
network's totals, nothing timed."""

import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PROFILES = os.path.join(REPO, "benchmarks", "results",
                        "h100-cudnn9.14-fp32-nhwc-alexnet-resnet50-b256-engines.jsonl.gz")


def test_predictions_only_cover_every_layer_and_add_up(tmp_path):
    out = tmp_path / "layers.json"
    subprocess.run([sys.executable, os.path.join(REPO, "benchmarks", "xla_conv_layers.py"),
                    "--predict-only", "--models", "alexnet", "--batch", "256",
                    "--database", str(tmp_path / "profiles.sqlite"), "--profiles", PROFILES,
                    "--out", str(out)], check=True, capture_output=True, timeout=600,
                   env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    results = json.loads(out.read_text())
    assert results["profiles_of"] == {"device": "NVIDIA H100 80GB HBM3", "cudnn_version": 91400}
    rows = results["models"]["alexnet"]
    assert len(rows) == 5
    for row in rows:
        assert row["predicted_xla_ms"] > 0 and row["predicted_plan_ms"] > 0
        assert isinstance(row["plan"], dict)  # a plan within the limit, as data
        assert "xla_ms" not in row and "plan_ms" not in row  # nothing timed
    totals = results["predicted_totals"]["alexnet"]
    assert totals["layers"] == 5 and totals["not_predicted"] == []
    assert totals["xla_ms"] == sum(row["count"] * row["predicted_xla_ms"] for row in rows)
    assert totals["plan_ms"] == sum(row["count"] * row["predicted_plan_ms"] for row in rows)
    assert totals["layers_gaining_the_margin"] == sum(
        row["predicted_plan_ms"] <= 0.9 * row["predicted_xla_ms"] for row in rows)
