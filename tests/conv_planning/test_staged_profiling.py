"""The planner measures in stages and within a budget (issue 43): compared with XLA, a layer's
micro-batches are measured only where the whole batch leaves a plan room to gain; a spent budget
leaves layers pending; what was measured is not measured again. Measuring is faked from real
profiles (`fake_gpu`)."""

from pathlib import Path

import pytest

from tf_ucudnn.conv_planning.database_planner import DatabasePlanner, kernels_run
from tf_ucudnn.core.plan import DIRECT, LayerPlan
from tf_ucudnn.profiling import ProfileDatabase, read_jsonl
from tf_ucudnn.profiling.profiler import Machine, forms_to_measure

from .fake_gpu import FakeGpu, conv_layer

MIB = 1 << 20
RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results"


@pytest.fixture(scope="module")
def tables(profiles_dir):
    """name -> (records, layers, whether engine configurations were measured): the measured
    tables, each geometry a layer named as its records are (or by its position)."""
    def load(path, engines, positions=None):
        records = read_jsonl(path)
        batch = max(r.batch_size for r in records)
        names = {}
        for record in records:
            names.setdefault(record.geometry, record.layer or f"conv{len(names)}")
        layers = [conv_layer(geometry, batch, name) for geometry, name in names.items()]
        if positions is not None:
            layers = [layers[i] for i in positions]
            records = [r for r in records if r.geometry in {l.cudnn_geometry() for l in layers}]
        return records, layers, engines

    return {
        "h100 fp32": load(profiles_dir / "h100-cudnn9.14-fp32-nchw.jsonl", False),
        "h100 fp16": load(profiles_dir / "h100-cudnn9.14-fp16-nhwc.jsonl", False),
        "h100 nhwc": load(RESULTS / "h100-cudnn9.14-fp32-nhwc-vgg16-resnet50-b128.jsonl.gz",
                          False),
        # ResNet-50's stem (planned: in space-to-depth blocks), strided 1x1 convolutions (also
        # measured subsampled) and 3x3 ones; with engine configurations.
        "h200": load(RESULTS / "h200-cudnn9.14-fp32-nhwc-resnet50-b128.jsonl.gz", True,
                     positions=[19, 0, 7, 15, 18]),
    }


def _planners(records, engines, monkeypatch, tmp_path, **settings):
    """A planner over every measurement, and one that measures on a fake GPU what it needs."""
    machine = Machine(records[0].device, records[0].cudnn_version)
    everything = ProfileDatabase(tmp_path / "everything.sqlite")
    everything.insert(records)
    gpu = FakeGpu(records).install(monkeypatch, engines)
    staged = DatabasePlanner(ProfileDatabase(tmp_path / "staged.sqlite"), machine=machine,
                             measure=True, deterministic_only=False, compare_with_xla=True,
                             **settings)
    return DatabasePlanner(everything, machine=machine, measure=False, deterministic_only=False,
                           compare_with_xla=True, **settings), staged, gpu


def _plans(planner, layers):
    """Each layer's plan, None where it is left alone."""
    return {layer.name: (lambda plan: plan if isinstance(plan, LayerPlan) else None)(
        planner(layer)) for layer in layers}


def _left_from_the_bound(planner, layers):
    return sum("judged from the whole batch alone" in str(planner(layer)) for layer in layers)


@pytest.mark.parametrize("name, limit_mib, margin, planned, left_from_bound", [
    ("h100 fp32", 4096, 0.1, 0, 10),
    ("h100 fp32", 4096, 0.0, 10, 0),  # no margin: the bound never decides alone
    ("h100 nhwc", 64, 0.1, 0, 29),
    ("h100 nhwc", 64, 0.0, 27, 0),
    ("h200", 4096, 0.1, 1, 4),
])
def test_staged_measuring_plans_as_measuring_everything(tables, monkeypatch, tmp_path, name,
                                                        limit_mib, margin, planned,
                                                        left_from_bound):
    records, layers, engines = tables[name]
    everything, staged, gpu = _planners(records, engines, monkeypatch, tmp_path,
                                        workspace_limit_bytes=limit_mib * MIB,
                                        xla_margin=margin)
    plans = _plans(everything, layers)
    assert _plans(staged, layers) == plans
    assert sum(plan is not None for plan in plans.values()) == planned
    assert _left_from_the_bound(staged, layers) == left_from_bound
    if left_from_bound == len(layers):  # the whole batch alone was measured
        assert {size for call in gpu.calls for size in call.sizes} == {layers[0].batch_size}
        assert len(staged.database) == sum(r.batch_size == layers[0].batch_size for r in records)


def test_on_the_h200_only_the_stem_is_measured_in_micro_batches(tables, monkeypatch, tmp_path):
    records, layers, _ = tables["h200"]
    _, staged, gpu = _planners(records, True, monkeypatch, tmp_path,
                               workspace_limit_bytes=4096 * MIB)
    assert isinstance(staged(layers[0]), LayerPlan)  # the stem, in space-to-depth blocks
    for layer in layers[1:]:
        staged(layer)
    stem = layers[0].cudnn_geometry()
    assert {call.geometry for call in gpu.calls if call.sizes != (128,)} == {stem}
    # The stem's every record, the others' whole batch: 2214 of the 7127.
    assert len(staged.database) == sum(r.geometry == stem or r.batch_size == 128
                                       for r in records) == 2214
    assert len(records) == 7127


def test_where_the_assumption_fails_the_bound_leaves_a_gain_to_xla(tables, monkeypatch,
                                                                  tmp_path):
    """In half precision on the H100, AlexNet's conv3 computes its filter gradient twice as fast
    per sample at half the batch: a plan of two halves beats XLA by 27%, but the whole batch
    alone does not show it (xla_comparison's docstring counts such cases)."""
    records, layers, _ = tables["h100 fp16"]
    everything, staged, _ = _planners(records, False, monkeypatch, tmp_path,
                                      workspace_limit_bytes=64 * MIB)
    full, measured_in_stages = _plans(everything, layers), _plans(staged, layers)
    assert [name for name in full if full[name] != measured_in_stages[name]] == ["alexnet.conv3"]
    conv3 = next(layer for layer in layers if layer.name == "alexnet.conv3")
    prediction = everything.predict(conv3, full["alexnet.conv3"])
    assert prediction.plan_ms / prediction.xla_ms == pytest.approx(0.734, abs=0.001)


def test_a_layer_left_to_xla_from_the_bound_says_so(tables, monkeypatch, tmp_path):
    records, layers, _ = tables["h100 fp32"]
    _, staged, gpu = _planners(records, False, monkeypatch, tmp_path,
                               workspace_limit_bytes=64 * MIB)
    conv2 = next(layer for layer in layers if layer.name == "alexnet.conv2")
    whole_batch = [r for r in records
                   if r.geometry == conv2.cudnn_geometry() and r.batch_size == 256]
    xla = sum(min(r.time_ms for r in whole_batch if r.kernel == kernel and r.form == DIRECT)
              for kernel in kernels_run(conv2))
    bound = sum(min(r.time_ms for r in whole_batch if r.kernel == kernel)
                for kernel in kernels_run(conv2))
    assert (round(bound, 3), round(xla, 3)) == (2.891, 2.891)  # all its runs are direct
    assert staged(conv2) == (
        "XLA's own convolution, judged from the whole batch alone: no plan is assumed faster "
        "than the fastest whole-batch run in any form with any workspace, 2.891 ms, against "
        "2.891 ms undivided as XLA runs it (a plan must gain 10%); micro-batches of 1, 2, 4, 8, "
        "16, 32, 64, 128 not measured")
    assert {call.sizes for call in gpu.calls} == {(256,)}
    assert staged.predict(conv2) == staged.predict(conv2, None)


def test_a_spent_budget_leaves_layers_pending_for_later(tables, monkeypatch, tmp_path):
    """Each measuring call takes 1 s on the fake GPU. Without a margin, the bound never leaves a
    layer to XLA: each is measured in two stages (the whole batch, then the micro-batches) of 3
    calls, one a kernel (legacy algorithms, direct form only)."""
    records, layers, _ = tables["h100 fp32"]
    layers = [layer for layer in layers if forms_to_measure(layer.cudnn_geometry()) == (DIRECT,)]
    everything, _, gpu = _planners(records, False, monkeypatch, tmp_path,
                                   workspace_limit_bytes=4096 * MIB, xla_margin=0.0)
    gpu.seconds_per_call = 1.0
    planner = DatabasePlanner(ProfileDatabase(tmp_path / "budget.sqlite"), 4096 * MIB,
                              machine=everything.machine, measure=True, deterministic_only=False,
                              compare_with_xla=True, xla_margin=0.0, profiling_seconds=10,
                              clock=gpu.clock)
    first_pass = [planner(layer) for layer in layers]
    # The second layer's micro-batches begin at 9 s and end at 12 s; nothing begins after.
    assert [isinstance(plan, LayerPlan) for plan in first_pass[:2]] == [True, True]
    assert first_pass[2:] == ["not measured yet: the profiling budget of 10 s is spent"] * 6
    assert planner.pending == tuple(layers[2:])
    assert planner.measure_pending(5) == 1  # its second stage begins at 3 s, the next at 6 s
    assert planner.pending == tuple(layers[3:])
    assert planner.measure_pending(1000) == 5 and planner.pending == ()
    assert _plans(planner, layers) == _plans(everything, layers)
    assert gpu.now == 6 * len(layers)


def test_a_second_planner_over_the_same_database_measures_nothing(tables, monkeypatch,
                                                                  tmp_path):
    records, layers, _ = tables["h200"]
    _, first, gpu = _planners(records, True, monkeypatch, tmp_path,
                              workspace_limit_bytes=4096 * MIB)
    plans = [first(layer) for layer in layers]
    calls = len(gpu.calls)
    assert calls == 60  # 48 for the whole batches, 12 for the stem's micro-batches
    first.close()
    with DatabasePlanner(ProfileDatabase(tmp_path / "staged.sqlite"), 4096 * MIB,
                         machine=first.machine, measure=True, deterministic_only=False,
                         compare_with_xla=True) as second:
        assert [second(layer) for layer in layers] == plans
    assert len(gpu.calls) == calls
