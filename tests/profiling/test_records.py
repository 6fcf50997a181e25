import dataclasses
import gzip
import json
import re
from pathlib import Path

import pytest

from tf_ucudnn.core.errors import TfUcudnnError
from tf_ucudnn.core.geometry import ConvGeometry
from tf_ucudnn.core.plan import SPACE_TO_DEPTH, SUBSAMPLED, Algorithm
from tf_ucudnn.profiling import (
    ProfileFileError,
    ProfileRecord,
    group_by_kernel,
    micro_batch_sizes,
    packaged_profiles,
    read_jsonl,
    write_jsonl,
)

H100 = "NVIDIA H100 80GB HBM3"

ALEXNET_CONV2 = ConvGeometry(in_channels=96, out_channels=256, input_dims=(27, 27),
                             filter_dims=(5, 5), pads=(2, 2), strides=(1, 1), dilations=(1, 1),
                             dtype="float32", layout="NCHW")

VOLUME = ConvGeometry(in_channels=4, out_channels=8, input_dims=(16, 32, 32), filter_dims=(3, 3, 3),
                      pads=(1, 0, 1), strides=(1, 2, 2), dilations=(1, 1, 2), dtype="float16",
                      layout="NDHWC")


def test_reads_the_shared_layout(profiles_dir):
    records = read_jsonl(profiles_dir / "h100-cudnn9.14-fp32-nchw.jsonl")
    assert len(records) == 1800
    assert {(r.device, r.cudnn_version) for r in records} == {(H100, 91400)}
    conv2 = [r for r in records if r.layer == "alexnet.conv2"]
    assert {r.geometry for r in conv2} == {ALEXNET_CONV2}
    # The first alexnet.conv1 line: algo 1 with math 2, i.e. TF32 tensor ops.
    first = records[0]
    assert (first.layer, first.kernel, first.batch_size, first.algo, first.math) == \
        ("alexnet.conv1", "fwd", 256, 1, "tensor_op_allow_conversion")
    assert first.timing.algorithm == Algorithm(1, "tensor_op_allow_conversion")
    assert first.time_ms == 2.02672 and first.workspace_bytes == 455806096


def test_fp16_file_reads_as_nhwc(profiles_dir):
    records = read_jsonl(profiles_dir / "h100-cudnn9.14-fp16-nhwc.jsonl")
    assert len(records) == 810
    assert {(r.geometry.dtype, r.geometry.layout) for r in records} == {("float16", "NHWC")}


def test_a_line_written_before_groups_reads_as_ungrouped_and_groups_round_trip(tmp_path):
    old = {"device": H100, "cudnn": 91400, "dtype": "float32", "format": "NHWC",
           "in_channels": 8, "out_channels": 8, "input_dims": [6, 6], "filter_dims": [3, 3],
           "pads": [1, 1], "strides": [1, 1], "dilations": [1, 1], "kernel": "fwd", "batch": 4,
           "algo": 1, "math": "default", "time_ms": 0.25, "workspace_bytes": 0}
    record = ProfileRecord.from_json(old)
    assert record.geometry.groups == 1
    assert record.to_json() == old  # written back as it was read
    depthwise = dataclasses.replace(record, geometry=dataclasses.replace(record.geometry,
                                                                         groups=8))
    assert depthwise.to_json()["groups"] == 8
    path = tmp_path / "grouped.jsonl"
    write_jsonl(path, [record, depthwise])
    assert read_jsonl(path) == [record, depthwise]
    with pytest.raises(ValueError, match="groups must be positive and divide"):
        dataclasses.replace(record.geometry, groups=3)


def test_lines_without_device_take_the_given_one(tmp_path):
    line = {"layer": "x", "in_channels": 3, "height": 8, "width": 8, "out_channels": 4,
            "kernel_h": 3, "kernel_w": 3, "pad": 1, "stride": 1, "dtype": "float32",
            "format": "NCHW", "kernel": "fwd", "batch": 2, "algo": 0, "math": 0,
            "time_ms": 0.5, "workspace_bytes": 0}
    path = tmp_path / "old.jsonl"
    path.write_text(json.dumps(line) + "\n")
    with pytest.raises(ValueError, match=r"old\.jsonl:1: .*no device"):
        read_jsonl(path)
    [record] = read_jsonl(path, device=H100, cudnn_version=91400)
    assert (record.device, record.cudnn_version, record.math) == (H100, 91400, "default")


def test_jsonl_round_trip_keeps_every_field(tmp_path):
    records = [
        ProfileRecord(H100, 91400, ALEXNET_CONV2, "fwd", 32, 1, "default", 0.19747, 43168403,
                      layer="alexnet.conv2"),
        ProfileRecord("other GPU", 90100, VOLUME, "bwd_filter", 7, 6, "tensor_op", 1.5, 12),
    ]
    path = tmp_path / "profile.jsonl"
    assert write_jsonl(path, records) == 2
    assert read_jsonl(path) == records


def test_shared_file_survives_our_writer(tmp_path, profiles_dir):
    records = read_jsonl(profiles_dir / "h100-cudnn9.14-fp16-nhwc.jsonl")
    write_jsonl(tmp_path / "copy.jsonl", records)
    assert read_jsonl(tmp_path / "copy.jsonl") == records


def test_bad_line_names_file_and_line(tmp_path):
    good = ProfileRecord(H100, 91400, ALEXNET_CONV2, "fwd", 32, 1, "default", 0.2, 0)
    path = tmp_path / "bad.jsonl"
    write_jsonl(path, [good])
    with open(path, "a") as out:
        out.write("\n" + json.dumps({**good.to_json(), "algo": 9}) + "\n")
    with pytest.raises(ValueError, match=r"bad\.jsonl:3: .*fwd algorithm"):
        read_jsonl(path)
    path.write_text('{"device": "x", "cudnn": 1}\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl:1: .*missing field"):
        read_jsonl(path)
    path.write_text("not json\n")
    with pytest.raises(ValueError, match=r"bad\.jsonl:1"):
        read_jsonl(path)


@pytest.mark.parametrize("change, message", [
    (dict(layout="NHWC", input_dims=(4, 4, 4), filter_dims=(1, 1, 1), pads=(0, 0, 0),
          strides=(1, 1, 1), dilations=(1, 1, 1)), "layout of a 3-D"),
    (dict(pads=(1,)), "pads"),
    (dict(strides=(0, 1)), "positive"),
    (dict(input_dims=(8,), filter_dims=(1,), pads=(0,), strides=(1,), dilations=(1,)), "2 or 3"),
])
def test_geometry_rejects_inconsistent_fields(change, message):
    with pytest.raises(ValueError, match=message):
        dataclasses.replace(ALEXNET_CONV2, **change)


def test_record_rejects_bad_values():
    fields = dict(device=H100, cudnn_version=91400, geometry=ALEXNET_CONV2, kernel="fwd",
                  batch_size=32, algo=1, math="default", time_ms=0.2, workspace_bytes=0)
    for change, message in [({"kernel": "forward"}, "kernel"), ({"batch_size": 0}, "batch size"),
                            ({"batch_size": True}, "batch size"),
                            ({"kernel": "bwd_data", "algo": 6}, "bwd_data algorithm"),
                            ({"math": "tf32"}, "math"), ({"time_ms": float("nan")}, "time_ms"),
                            ({"workspace_bytes": -1}, "workspace")]:
        with pytest.raises(ValueError, match=message):
            ProfileRecord(**{**fields, **change})


def test_geometry_shape_key_round_trips_and_is_canonical():
    key = VOLUME.shape_key()
    assert ConvGeometry.from_shape_key(key, "float16", "NDHWC") == VOLUME
    assert VOLUME.conv_kind == "conv3d" and ALEXNET_CONV2.conv_kind == "conv2d"
    # Lists or tuples, the same geometry gives the same key.
    as_lists = dataclasses.replace(VOLUME, input_dims=[16, 32, 32])
    assert as_lists.shape_key() == key


def test_micro_batch_size_policies():
    assert micro_batch_sizes(256, "undivided") == (256,)
    assert micro_batch_sizes(256, "power_of_two") == (1, 2, 4, 8, 16, 32, 64, 128, 256)
    assert micro_batch_sizes(100, "power_of_two") == (1, 2, 4, 8, 16, 32, 64, 100)
    assert micro_batch_sizes(1, "power_of_two") == (1,)
    assert micro_batch_sizes(5, "all") == (1, 2, 3, 4, 5)
    with pytest.raises(ValueError, match="policy"):
        micro_batch_sizes(8, "halves")
    with pytest.raises(ValueError, match="positive"):
        micro_batch_sizes(0, "all")


def test_group_by_kernel_builds_fastest_first_tables(profiles_dir):
    records = read_jsonl(profiles_dir / "h100-cudnn9.14-fp32-nchw.jsonl")
    tables = group_by_kernel(records)
    assert len(tables) == 30  # 10 layers x 3 kernels
    assert sum(len(t) for table in tables.values() for t in table.values()) == len(records)
    for table in tables.values():
        assert list(table) == [1, 2, 4, 8, 16, 32, 64, 128, 256]
        for timings in table.values():
            times = [t.time_ms for t in timings]
            assert times == sorted(times)


def test_reads_gzipped_files(tmp_path):
    import gzip
    import os

    from tf_ucudnn.profiling.records import read_jsonl
    shared = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "results",
                          "h100-cudnn9.14-fp32-nchw-alexnet-resnet50-b256.jsonl.gz")
    records = read_jsonl(shared)
    assert len(records) > 1000
    assert {r.device for r in records} == {"NVIDIA H100 80GB HBM3"}
    assert {r.kernel for r in records} == {"fwd", "bwd_data", "bwd_filter"}
    plain = tmp_path / "profiles.jsonl"
    with gzip.open(shared, "rt") as source:
        plain.write_text(source.read())
    assert read_jsonl(plain) == records


def test_writes_gzipped_files_when_the_name_says_so(tmp_path):
    import gzip

    from tf_ucudnn.profiling.records import read_jsonl, write_jsonl
    records = read_jsonl(Path(__file__).parents[2] / "benchmarks" / "results"
                         / "h100-cudnn9.14-fp32-nhwc-vgg16-resnet50-b128.jsonl.gz")
    assert {r.geometry.layout for r in records} == {"NHWC"}
    assert write_jsonl(tmp_path / "copy.jsonl.gz", records) == len(records)
    with gzip.open(tmp_path / "copy.jsonl.gz", "rt") as compressed:
        assert compressed.readline().startswith("{")
    assert read_jsonl(tmp_path / "copy.jsonl.gz") == records


def _write_lines(path, lines):
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "wt") as out:
        out.write("".join(line + "\n" for line in lines))


def test_unreadable_files_raise_a_plugin_error_naming_file_and_line(tmp_path):
    good = json.dumps(ProfileRecord(H100, 91400, ALEXNET_CONV2, "fwd", 32, 1, "default", 0.2,
                                    0).to_json())
    _write_lines(tmp_path / "array.jsonl", [good, "[1, 2]"])
    _write_lines(tmp_path / "broken.jsonl", [good, good, '{"device": '])
    # Enough lines for many compressed blocks, cut in the middle.
    _write_lines(tmp_path / "whole.jsonl.gz", [good] * 20000)
    whole = (tmp_path / "whole.jsonl.gz").read_bytes()
    (tmp_path / "truncated.jsonl.gz").write_bytes(whole[:len(whole) // 2])
    (tmp_path / "plain.jsonl.gz").write_text(good + "\n")
    (tmp_path / "folder.jsonl").mkdir()
    cases = [("array.jsonl", r"array\.jsonl:2: bad profile record: not a JSON object: \[1, 2\]"),
             ("broken.jsonl", r"broken\.jsonl:3: bad profile record: not JSON"),
             ("truncated.jsonl.gz", r"truncated\.jsonl\.gz:\d+: cannot read: .*truncated"),
             ("plain.jsonl.gz", r"plain\.jsonl\.gz:1: cannot read: not valid gzip data"),
             ("missing.jsonl", r"missing\.jsonl: cannot open: No such file"),
             ("folder.jsonl", r"folder\.jsonl: cannot open: Is a directory")]
    for name, message in cases:
        with pytest.raises(ProfileFileError, match=message) as error:
            read_jsonl(tmp_path / name)
        assert isinstance(error.value, TfUcudnnError) and isinstance(error.value, ValueError)
    # The line named is where the data ends, not the first or the last.
    with pytest.raises(ProfileFileError) as error:
        read_jsonl(tmp_path / "truncated.jsonl.gz")
    assert 1 < int(re.search(r":(\d+):", str(error.value)).group(1)) < 20000


def test_write_jsonl_writes_whole_files_or_none(tmp_path):
    record = ProfileRecord(H100, 91400, ALEXNET_CONV2, "fwd", 32, 1, "default", 0.2, 0)
    path = tmp_path / "profile.jsonl.gz"
    write_jsonl(path, [record])

    def failing():
        yield record
        raise RuntimeError("the source failed")

    with pytest.raises(RuntimeError, match="source failed"):
        write_jsonl(path, failing())
    assert read_jsonl(path) == [record]  # the old file, untouched
    assert sorted(p.name for p in tmp_path.iterdir()) == ["profile.jsonl.gz"]
    with pytest.raises(ProfileFileError, match=r"nowhere.*profile\.jsonl: cannot write: No such"):
        write_jsonl(tmp_path / "nowhere" / "profile.jsonl", [record])
    with pytest.raises(ProfileFileError, match=r"cannot write: Is a directory"):
        write_jsonl(tmp_path, [record])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["profile.jsonl.gz"]


def test_packaged_profiles_are_the_measured_files():
    paths = packaged_profiles()
    assert [p.name for p in paths] == ["h100-cudnn9.14-fp32-nchw-alexnet-resnet50-b256.jsonl.gz",
                                       "h100-cudnn9.14-fp32-nhwc-vgg16-resnet50-b128.jsonl.gz",
                                       "h200-cudnn9.14-fp32-nhwc-resnet50-b128.jsonl.gz"]
    benchmarks = Path(__file__).parents[2] / "benchmarks" / "results"
    for path in paths:
        records = read_jsonl(path)
        device = H100 if path.name.startswith("h100") else "NVIDIA H200"
        assert {(r.device, r.cudnn_version, r.geometry.dtype) for r in records} == \
            {(device, 91400, "float32")}
        layout = "NHWC" if "nhwc" in path.name else "NCHW"
        assert {r.geometry.layout for r in records} == {layout}
        assert max(r.batch_size for r in records) == (128 if layout == "NHWC" else 256)
        if (benchmarks / path.name).exists():  # the source checkout's copy
            assert path.read_bytes() == (benchmarks / path.name).read_bytes()


def engine_record(engine=12, knobs=(("TILE_SIZE", 5), ("SPLIT_K_SLC", 2)), **change):
    fields = dict(device=H100, cudnn_version=91400, geometry=ALEXNET_CONV2, kernel="fwd",
                  batch_size=32, algo=None, math=None, time_ms=0.15, workspace_bytes=4096,
                  engine=engine, knobs=knobs)
    return ProfileRecord(**{**fields, **change})


def test_engine_configuration_records_round_trip_as_json_lines(tmp_path):
    record = engine_record()
    assert record.knobs == (("SPLIT_K_SLC", 2), ("TILE_SIZE", 5))  # sorted, as Algorithm keeps them
    assert record.algorithm == Algorithm.parse("engine=12,knobs=SPLIT_K_SLC:2/TILE_SIZE:5")
    assert record.timing.algorithm == record.algorithm
    line = record.to_json()
    assert line["engine"] == 12 and line["knobs"] == {"SPLIT_K_SLC": 2, "TILE_SIZE": 5}
    assert "algo" not in line and "math" not in line
    no_knobs = engine_record(engine=3, knobs=())
    assert "knobs" not in no_knobs.to_json()
    legacy = ProfileRecord(H100, 91400, ALEXNET_CONV2, "fwd", 32, 1, "default", 0.2, 0)
    assert "engine" not in legacy.to_json() and "knobs" not in legacy.to_json()
    write_jsonl(tmp_path / "mixed.jsonl", [legacy, record, no_knobs])
    assert read_jsonl(tmp_path / "mixed.jsonl") == [legacy, record, no_knobs]


def test_an_engine_records_determinism_round_trips_and_a_legacy_algorithm_has_none(tmp_path):
    recorded = [engine_record(deterministic=True), engine_record(engine=3, deterministic=False),
                engine_record(engine=4)]
    lines = [r.to_json() for r in recorded]
    assert [line.get("deterministic") for line in lines] == [True, False, None]
    assert "deterministic" not in lines[2]  # not recorded: as lines written before it was
    assert [r.timing.deterministic for r in recorded] == [True, False, None]
    write_jsonl(tmp_path / "d.jsonl", recorded)
    assert read_jsonl(tmp_path / "d.jsonl") == recorded
    for bad in (dict(deterministic=1), dict(deterministic="yes")):
        with pytest.raises(ValueError, match="deterministic"):
            engine_record(**bad)
    with pytest.raises(ValueError, match="not given for a legacy algorithm"):
        ProfileRecord(H100, 91400, ALEXNET_CONV2, "fwd", 32, 1, "default", 0.2, 0,
                      deterministic=True)


def test_lines_written_before_engines_load_as_before(profiles_dir):
    """A line of the measured files, and one of this module's layout as written before engines."""
    shared = json.loads((profiles_dir / "h100-cudnn9.14-fp32-nchw.jsonl").open().readline())
    own = {"device": H100, "cudnn": 91400, "dtype": "float32", "format": "NCHW",
           "in_channels": 96, "out_channels": 256, "input_dims": [27, 27], "filter_dims": [5, 5],
           "pads": [2, 2], "strides": [1, 1], "dilations": [1, 1], "kernel": "fwd", "batch": 32,
           "algo": 1, "math": "default", "time_ms": 0.2, "workspace_bytes": 0}
    for line, (algo, math) in [(shared, (1, "tensor_op_allow_conversion")), (own, (1, "default"))]:
        record = ProfileRecord.from_json(line)
        assert (record.algo, record.math, record.engine, record.knobs) == (algo, math, None, ())
        assert record.algorithm == Algorithm(algo, math)
    assert ProfileRecord.from_json(own).to_json() == own


def test_engine_records_reject_bad_values(tmp_path):
    for change, message in [({"algo": 1, "math": "default"}, "not both"),
                            ({"math": "default"}, "not both"), ({"engine": -1}, "engine"),
                            ({"knobs": (("split_k", 2),)}, "knob name"),
                            ({"knobs": (("SPLIT_K_SLC", "2"),)}, "int value")]:
        with pytest.raises(ValueError, match=message):
            engine_record(**change)
    line = engine_record().to_json()
    bad_lines = [{**line, "algo": 1}, {**line, "knobs": [["SPLIT_K_SLC", 2]]},
                 {**line, "knobs": {"SPLIT_K_SLC": 2.5}}]
    _write_lines(tmp_path / "bad.jsonl", [json.dumps(bad) for bad in bad_lines])
    with pytest.raises(ProfileFileError, match=r"bad\.jsonl:1: bad profile record: .*not both"):
        read_jsonl(tmp_path / "bad.jsonl")
    for bad in bad_lines[1:]:
        _write_lines(tmp_path / "bad.jsonl", [json.dumps(bad)])
        with pytest.raises(ProfileFileError, match=r"bad\.jsonl:1: bad profile record: .*knob"):
            read_jsonl(tmp_path / "bad.jsonl")


def test_timings_of_engines_and_legacy_algorithms_sort_by_time_then_algorithm_order():
    tied = [engine_record(engine=2, knobs=(), time_ms=0.2, workspace_bytes=0),
            ProfileRecord(H100, 91400, ALEXNET_CONV2, "fwd", 32, 7, "default", 0.2, 0),
            engine_record(engine=10, knobs=(), time_ms=0.2, workspace_bytes=0),
            engine_record(time_ms=0.1)]
    (table,) = group_by_kernel(tied).values()
    assert [str(t.algorithm) for t in table[32]] == [
        "engine=12,knobs=SPLIT_K_SLC:2/TILE_SIZE:5", "algo=7,math=default", "engine=2",
        "engine=10"]


STRIDED_1X1 = ConvGeometry(in_channels=256, out_channels=512, input_dims=(56, 56),
                           filter_dims=(1, 1), pads=(0, 0), strides=(2, 2), dilations=(1, 1),
                           dtype="float32", layout="NCHW")


RESNET_STEM = ConvGeometry(in_channels=3, out_channels=64, input_dims=(230, 230),
                           filter_dims=(7, 7), pads=(0, 0), strides=(2, 2), dilations=(1, 1),
                           dtype="float32", layout="NCHW")


def test_records_in_other_forms_round_trip_as_json_lines(tmp_path):
    subsampled = ProfileRecord(H100, 91400, STRIDED_1X1, "bwd_filter", 64, None, None, 0.3,
                               55 << 20, engine=62, knobs=(("WORKSPACE", 0),), form=SUBSAMPLED)
    legacy = ProfileRecord(H100, 91400, STRIDED_1X1, "fwd", 64, 1, "default", 0.2, 0,
                           form=SUBSAMPLED)
    direct = ProfileRecord(H100, 91400, STRIDED_1X1, "fwd", 64, 1, "default", 0.4, 0)
    blocks = ProfileRecord(H100, 91400, RESNET_STEM, "fwd", 32, 1, "default", 0.2, 7 << 20,
                           form=SPACE_TO_DEPTH)
    assert subsampled.to_json()["form"] == "subsampled" and "form" not in direct.to_json()
    assert blocks.to_json()["form"] == "space_to_depth"
    assert str(subsampled.algorithm) == "engine=62,knobs=WORKSPACE:0,subsampled=1"
    assert str(blocks.algorithm) == "algo=1,math=default,space_to_depth=1"
    assert subsampled.timing.algorithm == subsampled.algorithm
    assert legacy.timing.algorithm == Algorithm(1, "default", form=SUBSAMPLED)
    write_jsonl(tmp_path / "forms.jsonl", [subsampled, legacy, direct, blocks])
    assert read_jsonl(tmp_path / "forms.jsonl") == [subsampled, legacy, direct, blocks]


def test_geometries_that_can_run_in_space_to_depth_blocks():
    assert RESNET_STEM.can_space_to_depth and not RESNET_STEM.can_subsample
    alexnet_conv1 = dataclasses.replace(RESNET_STEM, out_channels=96, input_dims=(227, 227),
                                        filter_dims=(11, 11), strides=(4, 4))
    assert alexnet_conv1.can_space_to_depth  # 48 channels in blocks of 4
    assert not dataclasses.replace(RESNET_STEM, strides=(1, 1)).can_space_to_depth
    assert not dataclasses.replace(RESNET_STEM, strides=(2, 1)).can_space_to_depth
    assert not dataclasses.replace(RESNET_STEM, filter_dims=(1, 1)).can_space_to_depth
    assert not dataclasses.replace(RESNET_STEM, dilations=(2, 2)).can_space_to_depth
    assert not dataclasses.replace(RESNET_STEM, in_channels=6, out_channels=66,
                                   groups=3).can_space_to_depth
    assert not dataclasses.replace(RESNET_STEM, in_channels=32).can_space_to_depth  # 128
    assert dataclasses.replace(RESNET_STEM, in_channels=16).can_space_to_depth  # 64
    three_d = ConvGeometry(in_channels=3, out_channels=8, input_dims=(16, 16, 16),
                           filter_dims=(3, 3, 3), pads=(0, 0, 0), strides=(2, 2, 2),
                           dilations=(1, 1, 1), dtype="float32", layout="NCDHW")
    assert not three_d.can_space_to_depth
    assert not STRIDED_1X1.can_space_to_depth and not ALEXNET_CONV2.can_space_to_depth


def test_geometries_measured_on_channels_first_copies():
    """Channels-last grouped convolutions: cuDNN's channels-last grouped kernels are its slow
    ones; its channels-last ungrouped ones are its fast ones."""
    depthwise = dataclasses.replace(ALEXNET_CONV2, out_channels=96, groups=96, layout="NHWC")
    assert depthwise.can_run_channels_first
    assert dataclasses.replace(depthwise, groups=2).can_run_channels_first
    assert not dataclasses.replace(depthwise, groups=1).can_run_channels_first
    assert not dataclasses.replace(depthwise, layout="NCHW").can_run_channels_first
    three_d = ConvGeometry(in_channels=4, out_channels=4, input_dims=(4, 8, 8),
                           filter_dims=(3, 3, 3), pads=(1, 1, 1), strides=(1, 1, 1),
                           dilations=(1, 1, 1), dtype="float32", layout="NDHWC", groups=4)
    assert three_d.can_run_channels_first
    assert not dataclasses.replace(three_d, layout="NCDHW").can_run_channels_first


def test_geometries_that_can_subsample():
    assert STRIDED_1X1.can_subsample
    assert not dataclasses.replace(STRIDED_1X1, strides=(1, 1)).can_subsample
    assert not dataclasses.replace(STRIDED_1X1, pads=(1, 1)).can_subsample
    assert not dataclasses.replace(STRIDED_1X1, filter_dims=(3, 3)).can_subsample
    assert dataclasses.replace(STRIDED_1X1, strides=(1, 2)).can_subsample
    assert not ALEXNET_CONV2.can_subsample
