"""The memory timeline picture."""

import pytest
from training_steps import conv_training_step

from tf_ucudnn.memory.analysis.liveness import analyze
from tf_ucudnn.memory.analysis.timeline import write_timeline_png


def test_a_timeline_is_a_png_with_the_budget_and_the_plan(tmp_path):
    liveness = analyze(conv_training_step())
    path = write_timeline_png(str(tmp_path / "timeline.png"), liveness,
                              budget_bytes=liveness.peak_bytes // 2,
                              planned_peak_bytes=liveness.peak_bytes // 3, title="a step",
                              unplanned=liveness)
    data = open(path, "rb").read()
    assert data.startswith(b"\x89PNG\r\n\x1a\n") and len(data) > 5000
    assert [p.name for p in tmp_path.iterdir()] == ["timeline.png"]


def test_a_failed_write_leaves_nothing(tmp_path):
    with pytest.raises(OSError):
        write_timeline_png(str(tmp_path / "missing" / "timeline.png"),
                           analyze(conv_training_step()))
    assert list(tmp_path.iterdir()) == []
