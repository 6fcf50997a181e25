"""profiler.profile measures what the database lacks at the sizes asked (`missing_measurements`),
so that a planner can measure the whole batch first and the micro-batches later."""

import dataclasses

import pytest

from tf_ucudnn.core.geometry import ConvGeometry
from tf_ucudnn.core.plan import DIRECT, KERNELS, SUBSAMPLED, Algorithm
from tf_ucudnn.profiling import ProfileDatabase, ProfileRecord, profiler

MACHINE = profiler.Machine("Test GPU", 90000)
STRIDED_1X1 = ConvGeometry(in_channels=8, out_channels=16, input_dims=(12, 12), filter_dims=(1, 1),
                           pads=(0, 0), strides=(2, 2), dilations=(1, 1), dtype="float32",
                           layout="NHWC")


@pytest.fixture
def measured(monkeypatch):
    """The profiler's measure calls, as (kernel, sizes, candidates, form); each size gets one
    record of that kind and form. Asking the GPU which machine it is fails."""
    calls = []

    def measure(geometry, kernel, sizes, machine, workspace_limit, device, layer, candidates,
                form):
        calls.append((kernel, tuple(sizes), candidates, form))
        text = ("engine=3" if candidates == profiler.ENGINES else "algo=1,math=default") + (
            "" if form == DIRECT else f",{form}=1")
        algorithm = Algorithm.parse(text)
        return [ProfileRecord(*dataclasses.astuple(machine), geometry, kernel, size,
                              algorithm.algo, algorithm.math, 1.0, 0, engine=algorithm.engine,
                              form=algorithm.form, deterministic=True if algorithm.engine else None)
                for size in sizes]

    def no_gpu(device="/GPU:0"):
        raise profiler.ProfilerUnavailable("no GPU in this test")

    monkeypatch.setattr(profiler, "measure", measure)
    monkeypatch.setattr(profiler, "current_machine", no_gpu)
    return calls


def test_the_whole_batch_first_and_the_micro_batches_after(tmp_path, measured):
    geometries = [(STRIDED_1X1, "test.conv")]
    with ProfileDatabase(tmp_path / "profiles.sqlite") as database:
        assert profiler.profile(geometries, 8, database, progress=False, engines=False,
                                sizes=[8], machine=MACHINE) == 6
        assert measured == [(kernel, (8,), profiler.LEGACY, form)
                            for kernel in KERNELS for form in (DIRECT, SUBSAMPLED)]
        del measured[:]
        assert profiler.profile(geometries, 8, database, progress=False, engines=False,
                                machine=MACHINE) == 18
        assert {sizes for _, sizes, _, _ in measured} == {(1, 2, 4)}
        assert profiler.missing_measurements(geometries, [1, 2, 4, 8], database, MACHINE,
                                             engines=False) == []


def test_missing_measurements_name_each_kind_form_and_kernel(tmp_path, measured):
    geometries = [(STRIDED_1X1, "test.conv")]
    with ProfileDatabase(tmp_path / "profiles.sqlite") as database:
        profiler.profile(geometries, 8, database, progress=False, engines=False, sizes=[8],
                         kernels=["fwd"], machine=MACHINE)
        missing = profiler.missing_measurements(geometries, [4, 8], database, MACHINE,
                                                kernels=["fwd"], engines=True)
    assert missing == [profiler.MissingMeasurement(STRIDED_1X1, "test.conv", "fwd", sizes,
                                                   candidates, form)
                       for candidates, sizes in ((profiler.LEGACY, (4,)),
                                                 (profiler.ENGINES, (4, 8)))
                       for form in (DIRECT, SUBSAMPLED)]
