"""Options: every entry point's settings, parsed once with one set of defaults."""

import pytest

from tf_ucudnn.core.errors import TfUcudnnError
import tf_ucudnn
from tf_ucudnn.options import DEFAULT_WORKSPACE_LIMIT, KerasOptions, Options, OptionsError


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
    ({"profiling_seconds": 0}, "profiling_seconds: a positive number of seconds"),
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


def test_options_are_exported_with_the_keras_subclass():
    assert tf_ucudnn.Options is Options and tf_ucudnn.KerasOptions is KerasOptions
    assert issubclass(KerasOptions, Options)
    keras_options = KerasOptions(memory_budget="1GiB", trial_steps=0)
    assert keras_options.memory_budget == 1 << 30 and keras_options.trial_steps == 0
    with pytest.raises(Exception):  # frozen: one options object, changed only by `resolve`
        keras_options.trial_steps = 3


def test_resolve_folds_keyword_overrides_into_the_options_given():
    base = Options(workspace_limit="32MiB", memory_budget="2GiB")
    resolved = Options.resolve(base, memory_budget="1GiB")
    assert resolved.workspace_limit == 32 << 20 and resolved.memory_budget == 1 << 30
    assert base.memory_budget == 2 << 30  # the given options are left as they were
    assert Options.resolve() == Options()
    assert KerasOptions.resolve(None, trial_steps=4).trial_steps == 4


def test_resolve_names_a_setting_it_does_not_have():
    with pytest.raises(OptionsError, match=r"trial_steps: not a setting of Options"):
        Options.resolve(None, trial_steps=4)
    with pytest.raises(OptionsError, match="options: a KerasOptions is needed, got a Options"):
        KerasOptions.resolve(Options())


def test_settings_only_our_planner_reads_conflict_with_a_given_planner():
    def planner(layer):
        return "left alone"
    Options(workspace_limit="32MiB").check_planner(planner)  # the limit is every planner's
    Options(workspace_budget="1GiB").check_planner(None)
    with pytest.raises(OptionsError, match=r"workspace_budget, profiles and planner="):
        Options(workspace_budget="1GiB", profiles=["a.jsonl"]).check_planner(planner)


@pytest.mark.parametrize("settings, message", [
    ({"batch_norm_statistics": "ghost"}, "batch_norm_statistics must be one of"),
    ({"fuse_batch_norm": "fastest"}, "fuse_batch_norm='fastest': the kernels are cudnn, xla"),
    ({"trial_steps": -1}, "trial_steps must be 0 or more"),
    ({"prefetch_batches": -2}, "prefetch_batches must be 0 or more"),
    ({"stream_conv_batch_norm": 4}, "stream_conv_batch_norm=4 and workspace_limit=67108864"),
    ({"profiling_share": 1.5}, "profiling_share: a share in"),
])
def test_a_bad_keras_option_is_named_with_the_reason(settings, message):
    with pytest.raises(OptionsError, match=message):
        KerasOptions(**settings)


def test_the_batch_norm_kernel_asked_for():
    assert KerasOptions().batch_norm_kernel is None
    assert KerasOptions(fuse_batch_norm=False).batch_norm_kernel is None
    assert KerasOptions(fuse_batch_norm=True).batch_norm_kernel == "cudnn"
    assert KerasOptions(fuse_batch_norm="xla").batch_norm_kernel == "xla"
