import dataclasses
import multiprocessing
import sqlite3

import pytest

from tf_ucudnn.core.geometry import ConvGeometry
from tf_ucudnn.core.plan import SPACE_TO_DEPTH, SUBSAMPLED, Algorithm
from tf_ucudnn.profiling import (
    ProfileDatabase,
    ProfileDatabaseError,
    ProfileRecord,
    group_by_kernel,
    read_jsonl,
    write_jsonl,
)
from tf_ucudnn.profiling.database import APPLICATION_ID, SCHEMA_VERSION

H100 = "NVIDIA H100 80GB HBM3"
GEOMETRY = ConvGeometry(in_channels=64, out_channels=64, input_dims=(56, 56), filter_dims=(3, 3),
                        pads=(1, 1), strides=(1, 1), dilations=(1, 1), dtype="float32",
                        layout="NCHW")


def record(batch_size=32, algo=1, math="default", time_ms=1.0, device=H100, cudnn_version=91400,
           geometry=GEOMETRY, kernel="fwd", workspace_bytes=1024):
    return ProfileRecord(device, cudnn_version, geometry, kernel, batch_size, algo, math, time_ms,
                         workspace_bytes)


def test_timings_match_the_measured_file(tmp_path, profiles_dir):
    records = read_jsonl(profiles_dir / "h100-cudnn9.14-fp32-nchw.jsonl")
    with ProfileDatabase(tmp_path / "profiles.db") as db:
        assert db.insert(records) == len(records)
    # A second process (here: a second connection) sees them all.
    with ProfileDatabase(tmp_path / "profiles.db") as db:
        assert len(db) == len(records)
        for key, table in group_by_kernel(records).items():
            assert db.timings(key.device, key.cudnn_version, key.geometry, key.kernel) == table


def test_measuring_again_replaces_the_old_row(tmp_path):
    with ProfileDatabase(tmp_path / "p.db") as db:
        db.insert([record(time_ms=2.0), record(algo=0, time_ms=3.0)])
        db.insert([record(time_ms=1.5, workspace_bytes=7)])
        assert len(db) == 2
        [(size, timings)] = db.timings(H100, 91400, GEOMETRY, "fwd").items()
        assert size == 32
        assert [(t.algo, t.time_ms, t.workspace_bytes) for t in timings] == [(1, 1.5, 7),
                                                                           (0, 3.0, 1024)]


def test_every_key_field_separates_measurements(tmp_path):
    other_geometry = dataclasses.replace(GEOMETRY, strides=(2, 2))
    variants = [record(), record(device="NVIDIA A100-SXM4-80GB"), record(cudnn_version=90100),
                record(geometry=dataclasses.replace(GEOMETRY, dtype="float16")),
                record(geometry=dataclasses.replace(GEOMETRY, layout="NHWC")),
                record(geometry=other_geometry), record(kernel="bwd_data"), record(batch_size=16),
                record(algo=0), record(math="tensor_op")]
    with ProfileDatabase(tmp_path / "p.db") as db:
        db.insert(variants)
        assert len(db) == len(variants)
        table = db.timings(H100, 91400, GEOMETRY, "fwd")
        assert {size: [(t.algo, t.math) for t in timings] for size, timings in table.items()} == \
            {16: [(1, "default")], 32: [(0, "default"), (1, "default"), (1, "tensor_op")]}
        assert db.timings(H100, 91400, other_geometry, "fwd") == {32: (record().timing,)}
        assert db.timings(H100, 91500, GEOMETRY, "fwd") == {}


def test_groups_separate_measurements_and_ungrouped_keys_stay_as_they_were(tmp_path):
    grouped = dataclasses.replace(GEOMETRY, groups=4)
    # The key databases were written with before groups were: ungrouped geometries keep it.
    assert GEOMETRY.shape_key() == ('{"dilations":[1,1],"filter_dims":[3,3],"in_channels":64,'
                                    '"input_dims":[56,56],"out_channels":64,"pads":[1,1],'
                                    '"strides":[1,1]}')
    assert grouped.shape_key() != GEOMETRY.shape_key()
    with ProfileDatabase(tmp_path / "p.db") as db:
        db.insert([record(), record(geometry=grouped, algo=0)])
        assert [t.algo for t in db.timings(H100, 91400, grouped, "fwd")[32]] == [0]
        assert [t.algo for t in db.timings(H100, 91400, GEOMETRY, "fwd")[32]] == [1]
        assert {r.geometry for r in db.records()} == {GEOMETRY, grouped}


def test_jsonl_import_export_round_trip(tmp_path, profiles_dir):
    source = profiles_dir / "h100-cudnn9.14-fp16-nhwc.jsonl"
    with ProfileDatabase(tmp_path / "p.db") as db:
        assert db.import_jsonl(source) == 810
        assert db.export_jsonl(tmp_path / "out.jsonl") == 810
    exported = read_jsonl(tmp_path / "out.jsonl")
    # Layer labels are not stored; everything else is.
    unlabeled = [dataclasses.replace(r, layer=None) for r in read_jsonl(source)]
    assert sorted(exported, key=repr) == sorted(unlabeled, key=repr)
    with ProfileDatabase(tmp_path / "again.db") as db:
        db.import_jsonl(tmp_path / "out.jsonl")
        assert sorted(db.records(), key=repr) == sorted(exported, key=repr)


def test_database_is_in_wal_mode_and_marked_as_ours(tmp_path):
    ProfileDatabase(tmp_path / "p.db").close()
    connection = sqlite3.connect(tmp_path / "p.db")
    assert connection.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    assert connection.execute("PRAGMA application_id").fetchone()[0] == APPLICATION_ID
    connection.close()


def _write_batches(path, worker, batches, per_batch, start):
    start.wait()  # all workers open and write at the same moment
    with ProfileDatabase(path) as db:
        for batch in range(batches):
            db.insert([record(batch_size=1 + worker, algo=batch % 8, time_ms=float(i),
                              kernel="fwd", workspace_bytes=batch * per_batch + i,
                              geometry=dataclasses.replace(GEOMETRY, in_channels=1 + i,
                                                           out_channels=1 + batch))
                       for i in range(per_batch)])


def test_concurrent_writers_lose_nothing(tmp_path):
    path = tmp_path / "shared.db"  # not created yet: the writers also race to create it
    workers, batches, per_batch = 4, 25, 8
    context = multiprocessing.get_context("fork")
    start = context.Barrier(workers)
    processes = [context.Process(target=_write_batches,
                                 args=(path, worker, batches, per_batch, start))
                 for worker in range(workers)]
    for process in processes:
        process.start()
    for process in processes:
        process.join(timeout=120)
    assert [p.exitcode for p in processes] == [0] * workers
    with ProfileDatabase(path) as db:
        assert len(db) == workers * batches * per_batch
        rows = {(r.batch_size, r.workspace_bytes) for r in db.records()}
    assert rows == {(1 + worker, n) for worker in range(workers)
                    for n in range(batches * per_batch)}


def test_file_that_is_not_sqlite_gives_a_clear_error(tmp_path):
    path = tmp_path / "notes.db"
    path.write_text("these are my notes, not a database\n" * 50)
    with pytest.raises(ProfileDatabaseError, match=r"notes\.db: .*not a SQLite database") as error:
        ProfileDatabase(path)
    assert error.value.path == str(path)
    assert path.read_text().startswith("these are my notes")


def test_damaged_database_gives_a_clear_error(tmp_path, profiles_dir):
    path = tmp_path / "damaged.db"
    with ProfileDatabase(path) as db:
        db.import_jsonl(profiles_dir / "h100-cudnn9.14-fp32-nchw.jsonl")
    data = bytearray(path.read_bytes())
    data[4096 + 50: 3 * 4096] = b"\xab" * (3 * 4096 - 4096 - 50)  # scribble over pages 2 and 3
    path.write_bytes(bytes(data))
    # The damage shows when the pages are read: at open or at the first query, never as a crash.
    with pytest.raises(ProfileDatabaseError, match=r"damaged\.db: .*damaged"):
        with ProfileDatabase(path) as db:
            list(db.records())
    path.write_bytes(bytes(data[:50]))  # truncated inside the header
    with pytest.raises(ProfileDatabaseError, match=r"damaged\.db: .*damaged"):
        ProfileDatabase(path)


def test_foreign_sqlite_file_is_refused_and_left_alone(tmp_path):
    path = tmp_path / "other.db"
    connection = sqlite3.connect(path)
    connection.execute("CREATE TABLE measurements (x INTEGER)")
    connection.execute("INSERT INTO measurements VALUES (1)")
    connection.commit()
    connection.close()
    before = path.read_bytes()
    with pytest.raises(ProfileDatabaseError, match=r"other\.db: .*something else"):
        ProfileDatabase(path)
    assert path.read_bytes() == before


def test_other_schema_version_is_refused(tmp_path):
    path = tmp_path / "future.db"
    ProfileDatabase(path).close()
    connection = sqlite3.connect(path)
    connection.execute("PRAGMA user_version = 99")
    connection.close()
    with pytest.raises(ProfileDatabaseError, match=r"future\.db: schema version 99"):
        ProfileDatabase(path)


def test_empty_file_becomes_a_database(tmp_path):
    path = tmp_path / "empty.db"
    path.touch()
    with ProfileDatabase(path) as db:
        db.insert([record()])
        assert len(db) == 1


def test_unopenable_path_gives_a_clear_error(tmp_path):
    with pytest.raises(ProfileDatabaseError, match="cannot open"):
        ProfileDatabase(tmp_path / "no such directory" / "p.db")


def test_jsonl_written_by_hand_imports(tmp_path):
    path = tmp_path / "hand.jsonl"
    write_jsonl(path, [record(batch_size=8), record(batch_size=8, algo=2, time_ms=0.5)])
    with ProfileDatabase(tmp_path / "p.db") as db:
        db.import_jsonl(path)
        assert [t.algo for t in db.timings(H100, 91400, GEOMETRY, "fwd")[8]] == [2, 1]


def test_records_and_export_of_one_machine(tmp_path):
    a100 = "NVIDIA A100-SXM4-80GB"
    measured = [record(), record(cudnn_version=90100), record(device=a100),
                record(device=a100, batch_size=16)]
    with ProfileDatabase(tmp_path / "p.db") as db:
        db.insert(measured)
        assert db.machines() == [(a100, 91400), (H100, 90100), (H100, 91400)]
        assert list(db.records(device=a100)) == [record(device=a100, batch_size=16),
                                                 record(device=a100)]
        assert list(db.records(device=H100, cudnn_version=90100)) == [record(cudnn_version=90100)]
        assert len(list(db.records(cudnn_version=91400))) == 3
        assert len(list(db.records())) == 4
        assert db.export_jsonl(tmp_path / "h100.jsonl.gz", device=H100) == 2
    assert sorted(read_jsonl(tmp_path / "h100.jsonl.gz"), key=repr) == \
        sorted([record(), record(cudnn_version=90100)], key=repr)


def engine_record(engine=12, knobs=(("SPLIT_K_SLC", 2),), batch_size=32, time_ms=0.5,
                  workspace_bytes=2048, deterministic=None):
    return ProfileRecord(H100, 91400, GEOMETRY, "fwd", batch_size, None, None, time_ms,
                         workspace_bytes, engine=engine, knobs=knobs, deterministic=deterministic)


def test_engine_configurations_are_stored_beside_legacy_algorithms(tmp_path):
    measured = [record(algo=1, time_ms=1.0), engine_record(), engine_record(knobs=()),
                engine_record(engine=9, time_ms=2.0), record(algo=0, time_ms=0.25)]
    with ProfileDatabase(tmp_path / "p.db") as db:
        db.insert(measured)
        db.insert([engine_record(time_ms=0.75)])  # measured again: replaces only its own row
        assert len(db) == 5
        assert [str(t.algorithm) for t in db.timings(H100, 91400, GEOMETRY, "fwd")[32]] == [
            "algo=0,math=default", "engine=12", "engine=12,knobs=SPLIT_K_SLC:2",
            "algo=1,math=default", "engine=9,knobs=SPLIT_K_SLC:2"]
        # Key order, algorithms in Algorithm.order_key's order (engine 9 before engine 12).
        assert list(db.records()) == [record(algo=0, time_ms=0.25), record(algo=1, time_ms=1.0),
                                      engine_record(engine=9, time_ms=2.0),
                                      engine_record(knobs=()), engine_record(time_ms=0.75)]
        db.export_jsonl(tmp_path / "all.jsonl")
        assert read_jsonl(tmp_path / "all.jsonl") == list(db.records())


def test_engine_determinism_is_stored_and_read_back(tmp_path):
    measured = [engine_record(deterministic=True), engine_record(engine=9, deterministic=False),
                engine_record(engine=3), record()]
    with ProfileDatabase(tmp_path / "p.db") as db:
        db.insert(measured)
        assert sorted(db.records(), key=repr) == sorted(measured, key=repr)
        by_engine = {t.engine: t.deterministic
                     for t in db.timings(H100, 91400, GEOMETRY, "fwd")[32]}
        assert by_engine == {12: True, 9: False, 3: None, None: None}


def _write_database(path, schema, version, rows):
    """A tf_ucudnn database of an earlier schema version, as that version wrote it."""
    connection = sqlite3.connect(path)
    connection.execute(schema)
    connection.executemany(
        f"INSERT INTO measurements VALUES ({', '.join('?' * len(rows[0]))})", rows)
    connection.execute(f"PRAGMA application_id = {APPLICATION_ID}")
    connection.execute(f"PRAGMA user_version = {version}")
    connection.commit()
    connection.close()


# Schema version 2, as tf_ucudnn wrote it before engine determinism was recorded.
_VERSION_2_SCHEMA = """
CREATE TABLE measurements (
    device TEXT NOT NULL, cudnn_version INTEGER NOT NULL, dtype TEXT NOT NULL,
    layout TEXT NOT NULL, geometry TEXT NOT NULL, kernel TEXT NOT NULL,
    batch_size INTEGER NOT NULL, algorithm TEXT NOT NULL, time_ms REAL NOT NULL,
    workspace_bytes INTEGER NOT NULL,
    PRIMARY KEY (device, cudnn_version, dtype, layout, geometry, kernel, batch_size, algorithm)
) WITHOUT ROWID
"""


def test_version_2_database_is_migrated_in_place(tmp_path):
    path = tmp_path / "v2.db"
    old = [record(algo=1, time_ms=0.5), engine_record(time_ms=0.25)]
    _write_database(path, _VERSION_2_SCHEMA, 2, [
        (r.device, r.cudnn_version, r.geometry.dtype, r.geometry.layout, r.geometry.shape_key(),
         r.kernel, r.batch_size, r.algorithm.to_attr(), r.time_ms, r.workspace_bytes)
        for r in old])

    with ProfileDatabase(path) as db:
        # Engine rows measured before: determinism not recorded.
        assert sorted(db.records(), key=repr) == sorted(old, key=repr)
        db.insert([engine_record(engine=9, deterministic=True)])
        assert [t.deterministic for t in db.timings(H100, 91400, GEOMETRY, "fwd")[32]
                if t.engine == 9] == [True]
    connection = sqlite3.connect(path)
    assert connection.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
    connection.close()
    with ProfileDatabase(path) as db:  # opens again as it is, now
        assert len(db) == 3


# Schema version 1, as tf_ucudnn wrote it before engine configurations (algo and math columns).
_VERSION_1_SCHEMA = """
CREATE TABLE measurements (
    device TEXT NOT NULL, cudnn_version INTEGER NOT NULL, dtype TEXT NOT NULL,
    layout TEXT NOT NULL, geometry TEXT NOT NULL, kernel TEXT NOT NULL,
    batch_size INTEGER NOT NULL, algo INTEGER NOT NULL, math TEXT NOT NULL,
    time_ms REAL NOT NULL, workspace_bytes INTEGER NOT NULL,
    PRIMARY KEY (device, cudnn_version, dtype, layout, geometry, kernel, batch_size, algo, math)
) WITHOUT ROWID
"""


def test_version_1_database_is_migrated_in_place(tmp_path):
    path = tmp_path / "old.db"
    old = [record(algo=1, math="tensor_op", time_ms=0.5), record(algo=2, time_ms=0.25),
           record(batch_size=8, algo=0, kernel="bwd_filter", workspace_bytes=0)]
    _write_database(path, _VERSION_1_SCHEMA, 1, [
        (r.device, r.cudnn_version, r.geometry.dtype, r.geometry.layout, r.geometry.shape_key(),
         r.kernel, r.batch_size, r.algo, r.math, r.time_ms, r.workspace_bytes) for r in old])

    with ProfileDatabase(path) as db:
        assert sorted(db.records(), key=repr) == sorted(old, key=repr)
        assert [t.algorithm for t in db.timings(H100, 91400, GEOMETRY, "fwd")[32]] == [
            Algorithm(2, "default"), Algorithm(1, "tensor_op")]
        db.insert([engine_record(time_ms=0.125)])
        assert str(db.timings(H100, 91400, GEOMETRY, "fwd")[32][0].algorithm) == \
            "engine=12,knobs=SPLIT_K_SLC:2"
    connection = sqlite3.connect(path)
    assert connection.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
    assert connection.execute("PRAGMA application_id").fetchone()[0] == APPLICATION_ID
    assert [row[0] for row in connection.execute("SELECT name FROM sqlite_master")] == \
        ["measurements"]
    connection.close()
    with ProfileDatabase(path) as db:  # opens again as it is, now
        assert len(db) == 4


@pytest.mark.parametrize("form, geometry_change", [
    (SUBSAMPLED, dict(filter_dims=(1, 1), pads=(0, 0), strides=(2, 2))),
    (SPACE_TO_DEPTH, dict(in_channels=3, strides=(2, 2))),
])
def test_measurements_in_other_forms_are_kept_beside_direct_ones(tmp_path, form,
                                                                geometry_change):
    geometry = dataclasses.replace(GEOMETRY, **geometry_change)
    direct = record(geometry=geometry, time_ms=2.0)
    other = dataclasses.replace(direct, time_ms=0.5, workspace_bytes=9 << 20, form=form)
    with ProfileDatabase(tmp_path / "profiles.sqlite") as database:
        database.insert([direct, other])
        assert len(database) == 2
        [first, second] = database.timings(H100, 91400, geometry, "fwd")[32]
        assert first.algorithm == Algorithm(1, "default", form=form)
        assert (first.time_ms, first.workspace_bytes) == (0.5, 9 << 20)
        assert second.algorithm == Algorithm(1, "default")
        assert sorted(database.records(), key=lambda r: r.time_ms) == [other, direct]
