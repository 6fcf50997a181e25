"""A SQLite database of cuDNN measurements, so each layer is measured once per machine.

Measurements are keyed by device name, cuDNN version, dtype, layout, geometry, kernel, micro-batch
size and algorithm (a legacy algorithm with its math type, or an engine configuration, as its
plan text: `tf_ucudnn.core.plan.Algorithm`); measuring again replaces the old row. Several
processes (for instance one per GPU, profiling different layers) may write to one file at once:
the database runs in WAL mode, waits for locks instead of failing at once, and writes each batch
of records in one transaction.

A file that is not SQLite, is damaged, or is SQLite but not ours (no tf_ucudnn application id, or
another schema version) raises `ProfileDatabaseError` naming the file and the reason; a foreign file
is never written to. A file of an earlier schema version is migrated in place to the current one
when opened: version 1 kept legacy algorithms only, in `algo` and `math` columns; version 2 did not
record whether an engine configuration is deterministic.

`import_missing` remembers, in a table of its own (`imported_files`, made when first needed),
which profile files it has taken a machine's records from. That table changes nothing about the
measurements, so it leaves the schema version as it is: a tf_ucudnn that does not know it reads
and writes the file as before.
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
import time
from typing import Iterable, Iterator, Optional

from tf_ucudnn.core.errors import TfUcudnnError
from tf_ucudnn.core.geometry import ConvGeometry
from tf_ucudnn.core.plan import Algorithm
from tf_ucudnn.profiling.records import (
    AlgorithmTiming,
    PathLike,
    ProfileRecord,
    fastest_first,
    read_jsonl,
    write_jsonl,
)

# Stored in the SQLite header (PRAGMA application_id / user_version) to recognize our files.
APPLICATION_ID = 0x7563444E  # "ucDN"
# Version 3 records whether an engine configuration is deterministic (`deterministic`: 1, 0, or
# NULL where not recorded); version 2 keeps the algorithm as its plan text, so that engine
# configurations fit beside legacy algorithms; version 1 had `algo` and `math` columns instead.
SCHEMA_VERSION = 3
_NO_DETERMINISM_VERSION = 2
_LEGACY_ALGO_MATH_VERSION = 1

_KEY_COLUMNS = ("device", "cudnn_version", "dtype", "layout", "geometry", "kernel", "batch_size",
                "algorithm")
_MEASURED_COLUMNS = ("time_ms", "workspace_bytes")
_COLUMNS = _KEY_COLUMNS + _MEASURED_COLUMNS + ("deterministic",)


# Which files `import_missing` has taken a machine's records from, each known by its name and size.
_IMPORTED_FILES_SCHEMA = """
CREATE TABLE IF NOT EXISTS imported_files (
    name TEXT NOT NULL,
    size INTEGER NOT NULL,
    device TEXT NOT NULL,
    cudnn_version INTEGER NOT NULL,
    PRIMARY KEY (name, size, device, cudnn_version)
) WITHOUT ROWID
"""


def _schema(table: str) -> str:
    return f"""
CREATE TABLE {table} (
    device TEXT NOT NULL,
    cudnn_version INTEGER NOT NULL,
    dtype TEXT NOT NULL,
    layout TEXT NOT NULL,
    geometry TEXT NOT NULL,
    kernel TEXT NOT NULL,
    batch_size INTEGER NOT NULL,
    algorithm TEXT NOT NULL,
    time_ms REAL NOT NULL,
    workspace_bytes INTEGER NOT NULL,
    deterministic INTEGER,
    PRIMARY KEY ({", ".join(_KEY_COLUMNS)})
) WITHOUT ROWID
"""


# Version 1 rows as current rows: the algorithm text as Algorithm.to_attr writes it, determinism
# not recorded (they are legacy algorithms).
_MIGRATE_FROM_LEGACY_ALGO_MATH = f"""
INSERT INTO measurements_migrated ({", ".join(_KEY_COLUMNS + _MEASURED_COLUMNS)})
SELECT device, cudnn_version, dtype, layout, geometry, kernel, batch_size,
       'algo=' || algo || ',math=' || math, time_ms, workspace_bytes
FROM measurements
"""


class ProfileDatabaseError(TfUcudnnError, Exception):
    """The profile database file cannot be used; says which file and why."""

    def __init__(self, path: str, reason: str):
        super().__init__(f"profile database {path}: {reason}")
        self.path = path
        self.reason = reason


class ProfileDatabase:
    """Measurements on disk. Use as a context manager, or call `close()`."""

    def __init__(self, path: PathLike, busy_timeout_s: float = 60.0):
        self.path = os.fspath(path)
        self._busy_timeout_s = busy_timeout_s
        with self._errors("cannot open"):
            # timeout: wait that long for other processes' locks. isolation_level=None: no
            # implicit transactions; we open them explicitly.
            self._connection = sqlite3.connect(self.path, timeout=busy_timeout_s,
                                               isolation_level=None)
        try:
            with self._errors("cannot open"):
                self._open_or_create()
        except ProfileDatabaseError:
            self._connection.close()
            raise

    def close(self) -> None:
        self._connection.close()

    def __enter__(self) -> "ProfileDatabase":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def __len__(self) -> int:
        with self._errors("cannot count measurements"):
            return self._connection.execute("SELECT COUNT(*) FROM measurements").fetchone()[0]

    def insert(self, records: Iterable[ProfileRecord]) -> int:
        """Adds records in one transaction, replacing earlier measurements of the same key."""
        with self._errors("cannot insert measurements"), self._transaction():
            return self._insert_rows(records)

    def _insert_rows(self, records: Iterable[ProfileRecord]) -> int:
        rows = [_row(record) for record in records]
        placeholders = ", ".join("?" * len(_COLUMNS))
        self._connection.executemany(
            f"INSERT OR REPLACE INTO measurements ({', '.join(_COLUMNS)}) "
            f"VALUES ({placeholders})", rows)
        return len(rows)

    def import_missing(self, paths: Iterable[PathLike], device: str, cudnn_version: int) -> int:
        """Adds one machine's records from profile files (the packaged ones, say) for the kernels
        it has no measurement of on that machine; returns how many were added.

        A kernel measured here keeps its own timings, none mixed in from another measuring run.
        Each file is read once per machine: the database remembers it by name and size (so a
        file changed by a later release is read again), and reading is what costs (seconds for
        tens of thousands of records), not looking.
        """
        with self._errors("cannot import profiles"):
            self._connection.execute(_IMPORTED_FILES_SCHEMA)
            done = set(self._connection.execute(
                "SELECT name, size FROM imported_files WHERE device = ? AND cudnn_version = ?",
                (device, cudnn_version)))
        added = 0
        for path in paths:
            mark = (os.path.basename(path), os.path.getsize(path))
            if mark in done:
                continue
            records = [r for r in read_jsonl(path)
                       if (r.device, r.cudnn_version) == (device, cudnn_version)]
            with self._errors("cannot import profiles"), self._transaction():
                measured = set(self._connection.execute(
                    "SELECT DISTINCT dtype, layout, geometry, kernel FROM measurements "
                    "WHERE device = ? AND cudnn_version = ?", (device, cudnn_version)))
                added += self._insert_rows(r for r in records if _kernel_columns(r) not in measured)
                self._connection.execute("INSERT OR IGNORE INTO imported_files VALUES (?, ?, ?, ?)",
                                         (*mark, device, cudnn_version))
        return added

    def timings(self, device: str, cudnn_version: int, geometry: ConvGeometry,
                kernel: str) -> dict[int, tuple[AlgorithmTiming, ...]]:
        """One kernel's timing table: micro-batch size -> algorithms measured, fastest first."""
        with self._errors("cannot read measurements"):
            rows = self._connection.execute(
                "SELECT batch_size, algorithm, time_ms, workspace_bytes, deterministic "
                "FROM measurements "
                "WHERE device = ? AND cudnn_version = ? AND dtype = ? AND layout = ? "
                "AND geometry = ? AND kernel = ? ORDER BY batch_size",
                (device, cudnn_version, geometry.dtype, geometry.layout, geometry.shape_key(),
                 kernel)).fetchall()
        by_size: dict[int, list[AlgorithmTiming]] = {}
        for batch_size, algorithm, time_ms, workspace_bytes, deterministic in rows:
            by_size.setdefault(batch_size, []).append(
                AlgorithmTiming.from_algorithm(Algorithm.parse(algorithm), time_ms,
                                               workspace_bytes, _determinism(deterministic)))
        return {size: fastest_first(timings) for size, timings in by_size.items()}

    def records(self, device: Optional[str] = None,
                cudnn_version: Optional[int] = None) -> Iterator[ProfileRecord]:
        """Every measurement (of `device` and `cudnn_version` where given), in key order."""
        where, values = _machine_filter(device, cudnn_version)
        with self._errors("cannot read measurements"):
            rows = self._connection.execute(
                f"SELECT {', '.join(_COLUMNS)} FROM measurements {where}", values).fetchall()
        measured = [(row[:-4], Algorithm.parse(row[-4]), row[-3:]) for row in rows]
        # Algorithms in their own order, not their texts' ("engine=10" before "engine=9").
        measured.sort(key=lambda item: (item[0], item[1].order_key))
        for (device, cudnn_version, dtype, layout, geometry, kernel, batch_size), algorithm, (
                time_ms, workspace_bytes, deterministic) in measured:
            yield ProfileRecord(device, cudnn_version,
                                ConvGeometry.from_shape_key(geometry, dtype, layout), kernel,
                                batch_size, algorithm.algo, algorithm.math, time_ms,
                                workspace_bytes, engine=algorithm.engine, knobs=algorithm.knobs,
                                form=algorithm.form, deterministic=_determinism(deterministic))

    def machines(self) -> list[tuple[str, int]]:
        """The (device, cuDNN version) pairs measured, sorted."""
        with self._errors("cannot read measurements"):
            return [tuple(row) for row in self._connection.execute(
                "SELECT DISTINCT device, cudnn_version FROM measurements ORDER BY 1, 2")]

    def import_jsonl(self, path: PathLike, device: Optional[str] = None,
                     cudnn_version: Optional[int] = None) -> int:
        """Adds the records of a JSON-lines file (either layout; see `records.read_jsonl`); a file
        that cannot be read raises ProfileFileError before anything is added."""
        return self.insert(read_jsonl(path, device, cudnn_version))

    def export_jsonl(self, path: PathLike, device: Optional[str] = None,
                     cudnn_version: Optional[int] = None) -> int:
        """Writes the measurements (of `device` and `cudnn_version` where given) as JSON lines,
        without layer labels (they are not stored); the file appears whole or not at all."""
        return write_jsonl(path, self.records(device, cudnn_version))

    def _open_or_create(self) -> None:
        # Look before writing anything, so that a foreign database is left untouched.
        if self._schema_version() != SCHEMA_VERSION:
            with self._transaction():
                # Another process may have created or migrated the schema since we looked.
                version = self._schema_version()
                if version == 0:
                    self._connection.execute(_schema("measurements"))
                    self._connection.execute(f"PRAGMA application_id = {APPLICATION_ID}")
                elif version == _LEGACY_ALGO_MATH_VERSION:
                    self._connection.execute(_schema("measurements_migrated"))
                    self._connection.execute(_MIGRATE_FROM_LEGACY_ALGO_MATH)
                    self._connection.execute("DROP TABLE measurements")
                    self._connection.execute(
                        "ALTER TABLE measurements_migrated RENAME TO measurements")
                elif version == _NO_DETERMINISM_VERSION:
                    self._connection.execute(
                        "ALTER TABLE measurements ADD COLUMN deterministic INTEGER")
                self._connection.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
        self._use_wal()

    def _use_wal(self) -> None:
        """WAL lets readers and a writer work at once; the mode persists in the file.

        Switching a new file to WAL needs an exclusive lock, and SQLite reports a busy file at
        once there instead of waiting; so wait here, while other processes create or read it.
        """
        deadline = time.monotonic() + self._busy_timeout_s
        while True:
            try:
                self._connection.execute("PRAGMA journal_mode = WAL")
                return
            except sqlite3.OperationalError as error:
                if "locked" not in str(error) or time.monotonic() > deadline:
                    raise
                time.sleep(0.01)

    def _schema_version(self) -> int:
        """Our database's schema version (one this code reads or migrates), 0 for an empty one;
        raises for anything else."""
        # One statement, so one snapshot: another process may be creating the schema right now.
        application_id, version, schema_objects = self._connection.execute(
            "SELECT (SELECT application_id FROM pragma_application_id), "
            "(SELECT user_version FROM pragma_user_version), "
            "(SELECT COUNT(*) FROM sqlite_master)").fetchone()
        if application_id == 0 and version == 0 and schema_objects == 0:
            return 0
        if application_id != APPLICATION_ID:
            raise ProfileDatabaseError(
                self.path, f"a SQLite database of something else (application id "
                           f"{application_id:#x}, not tf_ucudnn's {APPLICATION_ID:#x})")
        if version not in (_LEGACY_ALGO_MATH_VERSION, _NO_DETERMINISM_VERSION, SCHEMA_VERSION):
            raise ProfileDatabaseError(
                self.path, f"schema version {version}, but this tf_ucudnn reads versions "
                           f"{_LEGACY_ALGO_MATH_VERSION} to {SCHEMA_VERSION}")
        return version

    @contextlib.contextmanager
    def _transaction(self):
        # IMMEDIATE takes the write lock up front, so concurrent writers queue on busy_timeout
        # instead of failing when upgrading a read lock.
        self._connection.execute("BEGIN IMMEDIATE")
        try:
            yield
        except BaseException:
            if self._connection.in_transaction:  # some errors have already rolled it back
                self._connection.execute("ROLLBACK")
            raise
        self._connection.execute("COMMIT")

    @contextlib.contextmanager
    def _errors(self, action: str):
        try:
            yield
        except sqlite3.DatabaseError as error:  # also OperationalError: locked, unreadable, ...
            reason = str(error)
            if reason in ("file is not a database", "database disk image is malformed"):
                reason = f"not a SQLite database, or damaged ({reason})"
            raise ProfileDatabaseError(self.path, f"{action}: {reason}") from error


def _machine_filter(device: Optional[str], cudnn_version: Optional[int]) -> tuple[str, tuple]:
    """A WHERE clause and its values selecting one machine's rows (all rows where both are None)."""
    conditions = [(column, value) for column, value in (("device", device),
                                                         ("cudnn_version", cudnn_version))
                  if value is not None]
    if not conditions:
        return "", ()
    return ("WHERE " + " AND ".join(f"{column} = ?" for column, _ in conditions),
            tuple(value for _, value in conditions))


def _kernel_columns(record: ProfileRecord) -> tuple:
    """The columns that name a record's kernel on its machine, as stored."""
    g = record.geometry
    return g.dtype, g.layout, g.shape_key(), record.kernel


def _row(record: ProfileRecord) -> tuple:
    return (record.device, record.cudnn_version, *_kernel_columns(record), record.batch_size,
            record.algorithm.to_attr(), record.time_ms, record.workspace_bytes,
            None if record.deterministic is None else int(record.deterministic))


def _determinism(stored: Optional[int]) -> Optional[bool]:
    return None if stored is None else bool(stored)
