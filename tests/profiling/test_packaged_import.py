"""ProfileDatabase.import_missing: one machine's records from profile files, for the kernels the
database has not measured itself, each file read once per machine."""

import contextlib
import dataclasses
import sqlite3

import pytest

from tf_ucudnn.core.geometry import ConvGeometry
from tf_ucudnn.profiling import (
    ProfileDatabase,
    ProfileFileError,
    ProfileRecord,
    database,
    write_jsonl,
)

GPU, OTHER = ("Test GPU", 90000), ("Other GPU", 90000)
GEOMETRY = ConvGeometry(in_channels=8, out_channels=16, input_dims=(12, 12), filter_dims=(3, 3),
                        pads=(1, 1), strides=(1, 1), dilations=(1, 1), dtype="float32",
                        layout="NHWC")
WIDER = dataclasses.replace(GEOMETRY, out_channels=32)


def _record(machine, geometry, kernel, batch_size, time_ms):
    return ProfileRecord(*machine, geometry, kernel, batch_size, 1, "default", time_ms, 0)


@pytest.fixture
def shipped(tmp_path):
    """A file of two machines' records: both geometries' forward kernels at sizes 1 and 2."""
    path = tmp_path / "shipped.jsonl.gz"
    write_jsonl(path, [_record(machine, geometry, "fwd", size, 1.0)
                       for machine in (GPU, OTHER) for geometry in (GEOMETRY, WIDER)
                       for size in (1, 2)])
    return path


def test_a_machines_records_are_imported_where_the_kernel_is_not_measured(tmp_path, shipped):
    with ProfileDatabase(tmp_path / "db.sqlite") as db:
        db.insert([_record(GPU, GEOMETRY, "fwd", 1, 5.0)])  # measured here: kept as it is
        assert db.import_missing([shipped], *GPU) == 2
        assert db.machines() == [GPU]
        assert {size: [t.time_ms for t in timings]
                for size, timings in db.timings(*GPU, GEOMETRY, "fwd").items()} == {1: [5.0]}
        assert set(db.timings(*GPU, WIDER, "fwd")) == {1, 2}


def _spoil(path):
    """Garbage of the same size: reading the file now fails."""
    path.write_bytes(b"x" * path.stat().st_size)


def test_each_file_is_read_once_per_machine(tmp_path, shipped):
    with ProfileDatabase(tmp_path / "db.sqlite") as db:
        assert db.import_missing([shipped], *GPU) == 4
        original = shipped.read_bytes()
        _spoil(shipped)
        assert db.import_missing([shipped], *GPU) == 0  # not read again
        with pytest.raises(ProfileFileError):  # another machine's records are read
            db.import_missing([shipped], *OTHER)
        shipped.write_bytes(original)
        assert db.import_missing([shipped], *OTHER) == 4
        assert len(db) == 8
    _spoil(shipped)
    with ProfileDatabase(tmp_path / "db.sqlite") as db:  # remembered on disk
        assert db.import_missing([shipped], *GPU) == db.import_missing([shipped], *OTHER) == 0
        # A file of another size (a later release's, say) is read again.
        shipped.write_bytes(b"x" * (len(original) + 1))
        with pytest.raises(ProfileFileError):
            db.import_missing([shipped], *GPU)


def test_remembering_imports_leaves_the_schema_version_as_it_was(tmp_path, shipped):
    with ProfileDatabase(tmp_path / "db.sqlite") as db:
        db.import_missing([shipped], *GPU)
    with contextlib.closing(sqlite3.connect(tmp_path / "db.sqlite")) as connection:
        version, = connection.execute("PRAGMA user_version").fetchone()
    assert version == database.SCHEMA_VERSION == 3
