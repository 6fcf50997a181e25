"""Options: every entry point's settings, parsed once with one set of defaults."""

import pytest

from tf_ucudnn.core.errors import TfUcudnnError
from tf_ucudnn.options import DEFAULT_WORKSPACE_LIMIT, Options, OptionsError


def test_sizes_are_read_once_as_bytes():
    options = Options(workspace_limit="64MiB", workspace_budget="1.5GiB", memory_budget=1000)
    assert options.workspace_limit == 64 << 20
    assert options.workspace_budget == 3 << 29
    assert options.memory_budget == 1000
    assert Options(workspace_limit=options.workspace_limit) == Options(workspace_limit="64MiB")


def test_one_set_of_defaults():
    options = Options()
    assert options.workspace_limit == DEFAULT_WORKSPACE_LIMIT == 64 << 20
    assert options.plans_convolutions and options.workspace_budget is None
    assert options.micro_batches == (4, 8) and options.profiles == ()
    assert not Options(workspace_limit=None).plans_convolutions
    assert Options(workspace_limit=None, workspace_budget="1GiB").plans_convolutions


def test_the_database_defaults_to_the_environments_then_the_users_cache(monkeypatch):
    monkeypatch.setenv("TF_UCUDNN_DATABASE", "/somewhere/profiles.sqlite")
    assert Options().database == "/somewhere/profiles.sqlite"
    monkeypatch.delenv("TF_UCUDNN_DATABASE")
    assert Options().database.endswith("/.cache/tf_ucudnn/profiles.sqlite")
    assert Options(database="mine.sqlite").database == "mine.sqlite"


@pytest.mark.parametrize("settings, message", [
    ({"workspace_limit": "64 parsecs"}, "workspace_limit: cannot read '64 parsecs' as a size"),
    ({"memory_budget": -1}, "memory_budget: a size must not be negative"),
    ({"micro_batches": (4, 1)}, r"micro_batches: counts of 2 or more, got \[4, 1\]"),
    ({"profiles": "one.jsonl"}, "profiles: a list of files"),
])
def test_a_bad_option_is_named_with_the_reason(settings, message):
    with pytest.raises(OptionsError, match=message) as error:
        Options(**settings)
    assert isinstance(error.value, TfUcudnnError) and isinstance(error.value, ValueError)


def test_the_workspace_in_words():
    assert Options().describe_workspace() == "64 MiB of workspace per kernel"
    assert Options(workspace_budget="512MiB").describe_workspace() == (
        "64 MiB of workspace per kernel, 512 MiB for all kernels together")
    assert Options(workspace_limit=None).describe_workspace() == (
        "convolutions left to TensorFlow")
