"""DatabasePlanner.open imports the profiles packaged with tf_ucudnn of the machine it plans for,
and of no other, reading each file once."""

import pytest

from tf_ucudnn.conv_planning import database_planner
from tf_ucudnn.conv_planning.database_planner import DatabasePlanner
from tf_ucudnn.core.geometry import ConvGeometry
from tf_ucudnn.core.plan import LayerPlan
from tf_ucudnn.profiling import ProfileDatabase, ProfileRecord, database, packaged_profiles
from tf_ucudnn.profiling.profiler import Machine

from .fake_gpu import conv_layer

H100 = Machine("NVIDIA H100 80GB HBM3", 91400)
H100_PACKAGED_RECORDS = 5778  # of the fp32 NCHW and NHWC files


@pytest.fixture
def reads(monkeypatch):
    """The profile files read to import them."""
    paths = []
    read = database.read_jsonl
    monkeypatch.setattr(database, "read_jsonl", lambda path: paths.append(path) or read(path))
    return paths


def test_a_planner_for_a_named_machine_plans_from_its_packaged_profiles(tmp_path, reads):
    path = str(tmp_path / "db.sqlite")
    with DatabasePlanner.open("64MiB", path, device=H100.device,
                              cudnn_version=H100.cudnn_version) as planner:
        assert (planner.machine, planner.measure) == (H100, False)
        assert planner.database.machines() == [(H100.device, H100.cudnn_version)]
        assert len(planner.database) == H100_PACKAGED_RECORDS
        record = next(planner.database.records())
        assert isinstance(planner(conv_layer(record.geometry, 128 if record.geometry.layout
                                             == "NHWC" else 256, "layer")), LayerPlan)
    assert sorted(reads) == list(packaged_profiles())
    with DatabasePlanner.open("64MiB", path, device=H100.device,
                              cudnn_version=H100.cudnn_version) as planner:
        assert len(planner.database) == H100_PACKAGED_RECORDS
    assert len(reads) == len(packaged_profiles())  # none read again


def test_a_planner_on_a_gpu_imports_its_packaged_profiles(tmp_path, monkeypatch):
    monkeypatch.setattr(database_planner, "resolve_machine", lambda *args: (H100, True))
    with DatabasePlanner.open("64MiB", str(tmp_path / "db.sqlite")) as planner:
        assert planner.measure and len(planner.database) == H100_PACKAGED_RECORDS
    with DatabasePlanner.open("64MiB", str(tmp_path / "other.sqlite"),
                              import_packaged=False) as planner:
        assert len(planner.database) == 0


def test_a_machine_without_packaged_profiles_gets_none(tmp_path, reads):
    path = tmp_path / "db.sqlite"
    geometry = ConvGeometry(in_channels=8, out_channels=16, input_dims=(12, 12),
                            filter_dims=(3, 3), pads=(1, 1), strides=(1, 1), dilations=(1, 1),
                            dtype="float32", layout="NHWC")
    with ProfileDatabase(path) as db:
        db.insert([ProfileRecord("Test GPU", 90000, geometry, "fwd", 8, 1, "default", 1.0, 0)])
    for _ in range(2):
        with DatabasePlanner.open("64MiB", str(path)) as planner:
            assert planner.machine == Machine("Test GPU", 90000)
            assert planner.database.machines() == [("Test GPU", 90000)]
            assert len(planner.database) == 1
    assert len(reads) == len(packaged_profiles())  # each read once, to learn it holds none
