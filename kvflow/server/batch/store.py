"""The Batch API's storage: file and batch metadata, each batch's input lines and each line's result in
one SQLite database (stdlib `sqlite3`, WAL mode) under `--batch-dir`; file bodies as files beside it.

    <batch-dir>/batches.sqlite3        files, batches, lines (a batch's validated input), results
    <batch-dir>/files/<file id>        the bytes of an uploaded file or of a batch's output / error file

A line's result is one row keyed by (batch_id, custom_id), inserted in the same transaction that adds it to its
batch's counters (request_counts, tokens): a result is committed (synchronous=FULL: on disk when the commit
returns) before it counts as done, and inserting it twice is a no-op (`add_result` says whether it counted), so a
line counts exactly once whatever crashes or restarts. Every method is synchronous and safe from any thread (one
connection behind a lock); the asyncio side calls them through `asyncio.to_thread` where they write.
"""
from __future__ import annotations

import json
import os
import secrets
import sqlite3
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from kvflow.metrics import BATCH_STATUSES

DB_NAME = "batches.sqlite3"

SCHEMA = """
CREATE TABLE IF NOT EXISTS files (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    id TEXT NOT NULL UNIQUE,
    bytes INTEGER NOT NULL,
    created_at REAL NOT NULL,
    filename TEXT NOT NULL,
    purpose TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS batches (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    id TEXT NOT NULL UNIQUE,
    endpoint TEXT NOT NULL,
    input_file_id TEXT NOT NULL,
    completion_window TEXT NOT NULL,
    status TEXT NOT NULL,
    model TEXT,
    metadata TEXT,
    errors TEXT,
    output_file_id TEXT,
    error_file_id TEXT,
    created_at REAL NOT NULL,
    expires_at REAL,
    in_progress_at REAL,
    finalizing_at REAL,
    completed_at REAL,
    failed_at REAL,
    expired_at REAL,
    cancelling_at REAL,
    cancelled_at REAL,
    total INTEGER NOT NULL DEFAULT 0,
    completed INTEGER NOT NULL DEFAULT 0,
    failed INTEGER NOT NULL DEFAULT 0,
    input_tokens INTEGER NOT NULL DEFAULT 0,
    cached_tokens INTEGER NOT NULL DEFAULT 0,
    output_tokens INTEGER NOT NULL DEFAULT 0
);
CREATE INDEX IF NOT EXISTS batches_status ON batches (status);
CREATE TABLE IF NOT EXISTS lines (
    batch_id TEXT NOT NULL,
    idx INTEGER NOT NULL,
    lineno INTEGER NOT NULL,
    custom_id TEXT NOT NULL,
    text TEXT NOT NULL,
    PRIMARY KEY (batch_id, idx)
);
CREATE TABLE IF NOT EXISTS results (
    batch_id TEXT NOT NULL,
    custom_id TEXT NOT NULL,
    idx INTEGER NOT NULL,
    status_code INTEGER NOT NULL,
    record TEXT NOT NULL,
    input_tokens INTEGER NOT NULL,
    cached_tokens INTEGER NOT NULL,
    output_tokens INTEGER NOT NULL,
    finished_at REAL NOT NULL,
    PRIMARY KEY (batch_id, custom_id)
);
CREATE INDEX IF NOT EXISTS results_idx ON results (batch_id, idx);
"""

BATCH_TIMES = ("created_at", "expires_at", "in_progress_at", "finalizing_at", "completed_at", "failed_at",
               "expired_at", "cancelling_at", "cancelled_at")
# a batch's fields that `update_batch` may set
BATCH_FIELDS = frozenset(("status", "model", "errors", "output_file_id", "error_file_id", "total",
                          *BATCH_TIMES[1:]))
ACTIVE = ("validating", "in_progress", "finalizing", "cancelling")
STATUSES = BATCH_STATUSES


def new_file_id() -> str:
    return f"file-{secrets.token_hex(12)}"


def new_batch_id() -> str:
    return f"batch_{secrets.token_hex(16)}"


class BatchStore:
    def __init__(self, directory: str | Path) -> None:
        self.dir = Path(directory).expanduser()
        self.files_dir = self.dir / "files"
        self.files_dir.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._db = sqlite3.connect(self.dir / DB_NAME, check_same_thread=False, isolation_level=None)
        self._db.row_factory = sqlite3.Row
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=FULL")     # a commit is on disk when it returns
        self._db.executescript(SCHEMA)

    @staticmethod
    def exists(directory: str | Path) -> bool:
        return (Path(directory).expanduser() / DB_NAME).exists()

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def _rows(self, sql: str, args=()) -> list[sqlite3.Row]:
        with self._lock:
            return self._db.execute(sql, args).fetchall()

    def _one(self, sql: str, args=()) -> sqlite3.Row | None:
        with self._lock:
            return self._db.execute(sql, args).fetchone()

    # ---- files ---------------------------------------------------------------------------------------------------
    def file_path(self, file_id: str) -> Path:
        return self.files_dir / file_id

    def add_file(self, file_id: str, filename: str, purpose: str, nbytes: int, created_at: float | None = None,
                 replace: bool = False) -> dict:
        """The row of a file whose bytes are already at `file_path(file_id)` (written and fsynced)."""
        with self._lock:
            self._db.execute(f"INSERT OR {'REPLACE' if replace else 'ABORT'} INTO files "
                             "(id, bytes, created_at, filename, purpose) VALUES (?, ?, ?, ?, ?)",
                             (file_id, nbytes, created_at or time.time(), filename, purpose))
        return self.get_file(file_id)

    def get_file(self, file_id: str) -> dict | None:
        row = self._one("SELECT * FROM files WHERE id = ?", (file_id,))
        return dict(row) if row else None

    def list_files(self, *, after: str | None, limit: int, order: str, purpose: str | None) -> tuple[list[dict], bool]:
        """A page of files, newest first (order 'desc') or oldest first, after the file `after`; and whether more
        follow. ValueError when `after` names no file."""
        where, args = [], []
        if purpose is not None:
            where.append("purpose = ?")
            args.append(purpose)
        if after is not None:
            row = self._one("SELECT seq FROM files WHERE id = ?", (after,))
            if row is None:
                raise ValueError(after)
            where.append("seq < ?" if order == "desc" else "seq > ?")
            args.append(row["seq"])
        sql = (f"SELECT * FROM files {'WHERE ' + ' AND '.join(where) if where else ''} "
               f"ORDER BY seq {'DESC' if order == 'desc' else 'ASC'} LIMIT ?")
        rows = [dict(r) for r in self._rows(sql, (*args, limit + 1))]
        return rows[:limit], len(rows) > limit

    def delete_file(self, file_id: str) -> bool:
        with self._lock:
            gone = self._db.execute("DELETE FROM files WHERE id = ?", (file_id,)).rowcount > 0
        if gone:
            self.file_path(file_id).unlink(missing_ok=True)
        return gone

    def write_file(self, file_id: str, chunks, filename: str, purpose: str, replace: bool = False) -> dict:
        """Write `chunks` (bytes) to a file's path (through a temporary name, fsynced), then add its row."""
        path = self.file_path(file_id)
        tmp = path.with_name(path.name + ".part")
        n = 0
        with open(tmp, "wb") as f:
            for chunk in chunks:
                f.write(chunk)
                n += len(chunk)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        return self.add_file(file_id, filename, purpose, n, replace=replace)

    # ---- batches -------------------------------------------------------------------------------------------------
    def create_batch(self, batch_id: str, endpoint: str, input_file_id: str, completion_window: str,
                     expires_at: float | None, metadata: dict | None) -> dict:
        with self._lock:
            self._db.execute("INSERT INTO batches (id, endpoint, input_file_id, completion_window, status, metadata, "
                             "created_at, expires_at) VALUES (?, ?, ?, ?, 'validating', ?, ?, ?)",
                             (batch_id, endpoint, input_file_id, completion_window,
                              None if metadata is None else json.dumps(metadata), time.time(), expires_at))
        return self.get_batch(batch_id)

    def get_batch(self, batch_id: str) -> dict | None:
        row = self._one("SELECT * FROM batches WHERE id = ?", (batch_id,))
        return _batch(row) if row else None

    def list_batches(self, *, after: str | None, limit: int) -> tuple[list[dict], bool]:
        """A page of batches, newest first, after the batch `after`; ValueError when `after` names no batch."""
        if after is not None:
            row = self._one("SELECT seq FROM batches WHERE id = ?", (after,))
            if row is None:
                raise ValueError(after)
            rows = self._rows("SELECT * FROM batches WHERE seq < ? ORDER BY seq DESC LIMIT ?", (row["seq"], limit + 1))
        else:
            rows = self._rows("SELECT * FROM batches ORDER BY seq DESC LIMIT ?", (limit + 1,))
        return [_batch(r) for r in rows[:limit]], len(rows) > limit

    def batches_with_status(self, *statuses: str) -> list[dict]:
        """Oldest first."""
        marks = ", ".join("?" * len(statuses))
        return [_batch(r) for r in self._rows(f"SELECT * FROM batches WHERE status IN ({marks}) ORDER BY seq",
                                              statuses)]

    def update_batch(self, batch_id: str, *, only_if_status: tuple[str, ...] | None = None, **fields) -> bool:
        """Set fields (errors as a dict); with `only_if_status`, only while the batch has one of those statuses
        (False if it had not)."""
        bad = set(fields) - BATCH_FIELDS
        if bad:
            raise KeyError(f"not a batch field: {sorted(bad)}")
        if "errors" in fields and fields["errors"] is not None:
            fields["errors"] = json.dumps(fields["errors"])
        sets = ", ".join(f"{k} = ?" for k in fields)
        sql, args = f"UPDATE batches SET {sets} WHERE id = ?", [*fields.values(), batch_id]
        if only_if_status:
            sql += f" AND status IN ({', '.join('?' * len(only_if_status))})"
            args.extend(only_if_status)
        with self._lock:
            return self._db.execute(sql, args).rowcount > 0

    def start_batch(self, batch_id: str, lines: list[tuple[int, str, str]], model: str | None) -> bool:
        """validating -> in_progress with its input lines ((lineno, custom_id, text), in file order), in one
        transaction (a restart during validation validates again). False if the batch was no longer validating
        (cancelled meanwhile)."""
        with self._lock:
            db = self._db
            db.execute("BEGIN IMMEDIATE")
            try:
                db.execute("DELETE FROM lines WHERE batch_id = ?", (batch_id,))
                db.executemany("INSERT INTO lines (batch_id, idx, lineno, custom_id, text) VALUES (?, ?, ?, ?, ?)",
                               ((batch_id, i, lineno, cid, text) for i, (lineno, cid, text) in enumerate(lines)))
                ok = db.execute("UPDATE batches SET status = 'in_progress', in_progress_at = ?, total = ?, model = ? "
                                "WHERE id = ? AND status = 'validating'",
                                (time.time(), len(lines), model, batch_id)).rowcount > 0
                db.execute("COMMIT" if ok else "ROLLBACK")
            except BaseException:
                db.execute("ROLLBACK")
                raise
        return ok

    # ---- lines and results ---------------------------------------------------------------------------------------
    def pending_lines(self, batch_id: str, after_idx: int, limit: int) -> list[sqlite3.Row]:
        """Lines from index `after_idx` on (in file order) that have no committed result."""
        return self._rows("SELECT l.idx, l.lineno, l.custom_id, l.text FROM lines l LEFT JOIN results r "
                          "ON r.batch_id = l.batch_id AND r.custom_id = l.custom_id "
                          "WHERE l.batch_id = ? AND l.idx >= ? AND r.custom_id IS NULL ORDER BY l.idx LIMIT ?",
                          (batch_id, after_idx, limit))

    def add_result(self, batch_id: str, idx: int, custom_id: str, record: dict, input_tokens: int = 0,
                   cached_tokens: int = 0, output_tokens: int = 0) -> bool:
        """Commit one line's result and count it in its batch; False (nothing changed) if the line already has
        one."""
        status = (record.get("response") or {}).get("status_code") or 0
        with self._lock:
            db = self._db
            db.execute("BEGIN IMMEDIATE")
            try:
                added = db.execute(
                    "INSERT OR IGNORE INTO results (batch_id, custom_id, idx, status_code, record, input_tokens, "
                    "cached_tokens, output_tokens, finished_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                    (batch_id, custom_id, idx, status, json.dumps(record, ensure_ascii=False), input_tokens,
                     cached_tokens, output_tokens, time.time())).rowcount > 0
                if added:
                    db.execute("UPDATE batches SET completed = completed + ?, failed = failed + ?, "
                               "input_tokens = input_tokens + ?, cached_tokens = cached_tokens + ?, "
                               "output_tokens = output_tokens + ? WHERE id = ?",
                               (status == 200, status != 200, input_tokens, cached_tokens, output_tokens, batch_id))
                db.execute("COMMIT")
            except BaseException:
                db.execute("ROLLBACK")
                raise
        return added

    def results(self, batch_id: str, ok: bool) -> Iterator[str]:
        """The committed records (JSON text) of a batch's successful (status 200) or other lines, in file order."""
        rows = self._rows(f"SELECT record FROM results WHERE batch_id = ? AND status_code {'=' if ok else '!='} 200 "
                          "ORDER BY idx", (batch_id,))
        return (r["record"] for r in rows)

    def result_times(self, batch_id: str) -> list[float]:
        return [r[0] for r in self._rows("SELECT finished_at FROM results WHERE batch_id = ? ORDER BY finished_at",
                                         (batch_id,))]

    # ---- gauges --------------------------------------------------------------------------------------------------
    def count_by_status(self) -> dict[str, int]:
        counts = dict.fromkeys(STATUSES, 0)
        for r in self._rows("SELECT status, COUNT(*) FROM batches GROUP BY status"):
            counts[r[0]] = r[1]
        return counts

    def queue_depth(self) -> int:
        """Lines of in-progress batches without a result."""
        row = self._one("SELECT COALESCE(SUM(total - completed - failed), 0) FROM batches WHERE status = 'in_progress'")
        return int(row[0])


def _batch(row: sqlite3.Row) -> dict:
    b = dict(row)
    b["metadata"] = None if b["metadata"] is None else json.loads(b["metadata"])
    b["errors"] = None if b["errors"] is None else json.loads(b["errors"])
    return b


class StoreHandle:
    """The store of `--batch-dir`, opened on first use: a server whose clients never use the Batch API creates
    nothing on disk; one that finds a database there at start resumes its batches."""

    def __init__(self, directory: str | Path) -> None:
        self.dir = Path(directory).expanduser()
        self._store: BatchStore | None = None
        self._lock = threading.Lock()

    def get(self) -> BatchStore:
        with self._lock:
            if self._store is None:
                self._store = BatchStore(self.dir)
            return self._store

    def existing(self) -> BatchStore | None:
        """The store if it is open or there is one on disk (then opened), else None."""
        if self._store is None and not BatchStore.exists(self.dir):
            return None
        return self.get()

    def close(self) -> None:
        with self._lock:
            if self._store is not None:
                self._store.close()
                self._store = None
