"""profiler: cuDNN measurements through the UcudnnProfileConvolution op."""

import dataclasses

import pytest
import tensorflow as tf

from tf_ucudnn.core.geometry import ConvGeometry
from tf_ucudnn.core.plan import (
    ALGORITHM_COUNTS,
    CHANNELS_FIRST,
    DIRECT,
    KERNELS,
    SPACE_TO_DEPTH,
    SUBSAMPLED,
    Algorithm,
)
from tf_ucudnn.kernels.library import engines_available, gpu_kernels_available
from tf_ucudnn.profiling import ProfileDatabase, ProfileRecord, profiler

GEOMETRY = ConvGeometry(in_channels=8, out_channels=16, input_dims=(12, 12), filter_dims=(3, 3),
                        pads=(1, 1), strides=(1, 1), dilations=(1, 1), dtype="float32",
                        layout="NCHW")


def _gpu_reason():
    if not gpu_kernels_available():
        return "tf_ucudnn was built without its cuDNN kernels"
    if not tf.config.list_physical_devices("GPU"):
        return "no GPU visible to TensorFlow"
    return None


def test_without_cudnn_kernels_profiling_says_why():
    if gpu_kernels_available():
        pytest.skip("this build has the cuDNN kernels")
    with pytest.raises(profiler.ProfilerUnavailable, match="without its cuDNN kernels"):
        profiler.current_machine()
    assert not engines_available()


def test_measure_refuses_an_unknown_kind_of_candidate():
    with pytest.raises(ValueError, match="candidates must be one of"):
        profiler.measure(GEOMETRY, "fwd", [2], profiler.Machine("GPU", 91400), candidates="all")


def _record(batch_size, algorithm):
    algorithm = Algorithm.parse(algorithm)
    return ProfileRecord("GPU", 91400, GEOMETRY, "fwd", batch_size, algorithm.algo,
                         algorithm.math, 0.5, 0, engine=algorithm.engine, knobs=algorithm.knobs,
                         form=algorithm.form)


def test_legacy_algorithms_and_engine_configurations_are_measured_apart(tmp_path):
    machine = profiler.Machine("GPU", 91400)
    with ProfileDatabase(tmp_path / "profiles.sqlite") as database:
        database.insert([_record(size, "algo=1,math=default") for size in (1, 2, 4)]
                        + [_record(4, "engine=7,knobs=TILE_SIZE:2")])
        table = database.timings(machine.device, machine.cudnn_version, GEOMETRY, "fwd")
        unmeasured = {kind: profiler.unmeasured_sizes(table, [1, 2, 4, 8], kind)
                      for kind in profiler.CANDIDATES}
    assert unmeasured == {profiler.LEGACY: [8], profiler.ENGINES: [1, 2, 8]}


def test_runs_in_each_form_are_measured_apart(tmp_path):
    machine = profiler.Machine("GPU", 91400)
    with ProfileDatabase(tmp_path / "profiles.sqlite") as database:
        database.insert([_record(size, "algo=1,math=default") for size in (1, 2)]
                        + [_record(2, "algo=1,math=default,subsampled=1"),
                           _record(1, "engine=7,subsampled=1"),
                           _record(1, "engine=7,space_to_depth=1")])
        table = database.timings(machine.device, machine.cudnn_version, GEOMETRY, "fwd")
    forms = (DIRECT, SUBSAMPLED, SPACE_TO_DEPTH)
    unmeasured = {(kind, form): profiler.unmeasured_sizes(table, [1, 2], kind, form)
                  for kind in profiler.CANDIDATES for form in forms}
    assert unmeasured == {(profiler.LEGACY, DIRECT): [], (profiler.LEGACY, SUBSAMPLED): [1],
                          (profiler.LEGACY, SPACE_TO_DEPTH): [1, 2],
                          (profiler.ENGINES, DIRECT): [1, 2], (profiler.ENGINES, SUBSAMPLED): [2],
                          (profiler.ENGINES, SPACE_TO_DEPTH): [2]}


def test_each_geometry_is_measured_in_the_forms_it_can_take():
    strided_1x1 = dataclasses.replace(GEOMETRY, filter_dims=(1, 1), pads=(0, 0), strides=(2, 2))
    stem = dataclasses.replace(GEOMETRY, in_channels=3, filter_dims=(7, 7), strides=(2, 2))
    assert profiler.forms_to_measure(GEOMETRY) == (DIRECT,)
    assert profiler.forms_to_measure(strided_1x1) == (DIRECT, SUBSAMPLED)
    assert profiler.forms_to_measure(stem) == (DIRECT, SPACE_TO_DEPTH)
    depthwise = dataclasses.replace(GEOMETRY, out_channels=8, groups=8)
    assert profiler.forms_to_measure(depthwise) == (DIRECT,)  # channels-first already
    assert profiler.forms_to_measure(dataclasses.replace(depthwise, layout="NHWC")) == (
        DIRECT, CHANNELS_FIRST)
    assert profiler.forms_to_measure(dataclasses.replace(GEOMETRY, layout="NHWC")) == (DIRECT,)


@pytest.mark.parametrize("form", [SUBSAMPLED, SPACE_TO_DEPTH, CHANNELS_FIRST])
def test_measure_refuses_a_form_the_geometry_cannot_take(form):
    with pytest.raises(ValueError, match=f"not measured in the {form} form"):
        profiler.measure(GEOMETRY, "fwd", [2], profiler.Machine("GPU", 91400), form=form)


@pytest.fixture
def machine():
    reason = _gpu_reason()
    if reason:
        pytest.skip(reason)
    return profiler.current_machine()


@pytest.mark.gpu
def test_machine_names_the_gpu_and_cudnn(machine):
    assert machine.device and machine.device != "GPU"
    assert machine.cudnn_version >= 8000


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", KERNELS)
def test_measures_algorithms_at_each_size(machine, kernel):
    records = profiler.measure(GEOMETRY, kernel, [8, 3, 1], machine)
    assert {r.batch_size for r in records} == {8, 3, 1}
    for record in records:
        assert record.kernel == kernel and record.geometry == GEOMETRY
        assert 0 <= record.algo < ALGORITHM_COUNTS[kernel]
        assert record.time_ms > 0 and record.workspace_bytes >= 0
    # cuDNN's Find runs several algorithms for a plain 3x3 convolution.
    assert len({r.algo for r in records if r.batch_size == 8}) >= 2


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", KERNELS)
def test_measures_legacy_algorithms_only_unless_asked(machine, kernel):
    records = profiler.measure(GEOMETRY, kernel, [4], machine)
    assert records and all(r.engine is None for r in records)


@pytest.fixture
def engines(machine):
    if not engines_available():
        pytest.skip("tf_ucudnn was built without cudnn-frontend")
    return machine


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", KERNELS)
def test_measures_engine_configurations_at_each_size(engines, kernel):
    records = profiler.measure(GEOMETRY, kernel, [8, 3, 1], engines,
                               candidates=profiler.ENGINES, workspace_limit=64 << 20)
    assert {r.batch_size for r in records} == {8, 3, 1}
    for record in records:
        assert record.engine is not None and record.algo is None and record.math is None
        assert record.time_ms > 0 and 0 <= record.workspace_bytes <= 64 << 20
        # The text a plan carries names the same configuration back.
        assert Algorithm.parse(record.algorithm.to_attr()) == record.algorithm
    at_eight = [r.algorithm for r in records if r.batch_size == 8]
    assert len(at_eight) == len(set(at_eight)), "a configuration is listed twice"


@pytest.mark.gpu
def test_engine_configurations_keep_to_the_workspace_limit(engines):
    records = profiler.measure(GEOMETRY, "bwd_filter", [8], engines,
                               candidates=profiler.ENGINES, workspace_limit=0)
    assert all(r.workspace_bytes == 0 for r in records)


@pytest.mark.gpu
def test_profile_adds_engine_timings_to_a_database_of_legacy_ones(engines, tmp_path):
    with ProfileDatabase(tmp_path / "profiles.sqlite") as database:
        assert profiler.profile([(GEOMETRY, "test.conv")], 4, database, progress=False,
                                engines=False) > 0
        legacy = len(database)
        assert profiler.profile([(GEOMETRY, "test.conv")], 4, database, progress=False) > 0
        for kernel in KERNELS:
            table = database.timings(engines.device, engines.cudnn_version, GEOMETRY, kernel)
            for size in (1, 2, 4):
                kinds = {t.algorithm.is_engine for t in table[size]}
                assert kinds == {False, True}, f"{kernel} at {size}: {kinds}"
        assert len(database) > legacy
        assert profiler.profile([(GEOMETRY, "test.conv")], 4, database, progress=False) == 0


@pytest.mark.gpu
def test_asymmetric_and_nhwc_geometries_run(machine):
    geometry = ConvGeometry(in_channels=3, out_channels=4, input_dims=(10, 11), filter_dims=(3, 3),
                            pads=(0, 1), strides=(2, 1), dilations=(1, 2), dtype="float16",
                            layout="NHWC")
    records = profiler.measure(geometry, "fwd", [4], machine)
    assert records and all(r.geometry.layout == "NHWC" for r in records)


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", KERNELS)
def test_grouped_and_depthwise_geometries_run(machine, kernel):
    for groups in (2, 16):  # 16: depthwise, one input channel per group
        geometry = ConvGeometry(in_channels=16, out_channels=32, input_dims=(12, 12),
                                filter_dims=(3, 3), pads=(1, 1), strides=(1, 1), dilations=(1, 1),
                                dtype="float32", layout="NHWC", groups=groups)
        records = profiler.measure(geometry, kernel, [4, 2], machine)
        assert {r.batch_size for r in records} == {4, 2}
        assert all(r.geometry.groups == groups and r.time_ms > 0 for r in records)


@pytest.mark.gpu
def test_profile_measures_once_per_machine(machine, tmp_path):
    with ProfileDatabase(tmp_path / "profiles.sqlite") as database:
        added = profiler.profile([(GEOMETRY, "test.conv")], 4, database, progress=False)
        assert added > 0
        for kernel in KERNELS:
            table = database.timings(machine.device, machine.cudnn_version, GEOMETRY, kernel)
            assert set(table) == {1, 2, 4}
        assert profiler.profile([(GEOMETRY, "test.conv")], 4, database, progress=False) == 0
