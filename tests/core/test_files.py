"""Output files that appear whole or not at all."""

import pytest

from tf_ucudnn.core.files import written_whole


def test_the_file_appears_when_the_writing_ends(tmp_path):
    path = tmp_path / "out.json"
    with written_whole(str(path)) as partial:
        open(partial, "w").write("whole")
        assert not path.exists()
    assert path.read_text() == "whole" and [p.name for p in tmp_path.iterdir()] == ["out.json"]


def test_a_failed_write_leaves_nothing_and_keeps_an_older_file(tmp_path):
    path = tmp_path / "out.json"
    path.write_text("older")
    with pytest.raises(RuntimeError, match="failed half way"):
        with written_whole(str(path)) as partial:
            open(partial, "w").write("half")
            raise RuntimeError("failed half way")
    assert path.read_text() == "older" and [p.name for p in tmp_path.iterdir()] == ["out.json"]
