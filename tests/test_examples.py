"""The README's examples run and do what they say."""

import importlib.util
import os

EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")


def _load(name):
    spec = importlib.util.spec_from_file_location(name, os.path.join(EXAMPLES, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_training_beyond_memory_fits_the_budget_and_draws_the_timeline(tmp_path, capsys):
    png = tmp_path / "timeline.png"
    callback = _load("train_beyond_memory").main(str(png))
    plan = callback.memory_plan.plan
    assert plan.decisions.prediction.peak_bytes <= plan.budget_bytes
    printed = capsys.readouterr().out
    needed = float(printed.split("needs ")[1].split(" MiB")[0]) * 2**20
    assert needed > plan.budget_bytes  # the step as written would not fit
    assert "memory plan for a" in printed and f"wrote {png}" in printed
    assert png.read_bytes().startswith(b"\x89PNG")
