"""The request log (`--request-log PATH`): one JSON line per request, written by a thread of its own.

The event loop only builds a dict and puts it on a bounded queue (`put_nowait`: never blocks; when the writer
cannot keep up, lines are dropped and counted, and the next line written says how many). The writer thread
serializes, writes through a `logging.handlers.RotatingFileHandler` (rotated at `--request-log-max-bytes`,
`--request-log-backup-count` old files kept; '-' writes to stdout, never rotated) and adds the served model's
version to every line: a `--model-version` label, else the SHA-256 of the model's weight files, computed by the
writer thread before its first line (so a multi-GB file costs the event loop nothing; lines wait in the queue
meanwhile).

Who writes which lines: the server writes one per HTTP request of the generate routes, when its response has
ended (`server/request_record.py`: status, error, client ids, tool calls, ...); requests with no HTTP request of
their own (the Batch API's lines) are written by the engine when they finish (`metrics.request_line`).
"""
from __future__ import annotations

import hashlib
import json
import logging
import logging.handlers
import os
import queue
import sys
import threading
import time
from pathlib import Path

logger = logging.getLogger("kvflow.request_log")

DEFAULT_MAX_BYTES = 100 * 2**20
DEFAULT_BACKUP_COUNT = 5
QUEUE_SIZE = 10_000          # lines waiting for the writer; beyond that they are dropped (and counted)
WEIGHT_SUFFIXES = (".gguf", ".safetensors", ".bin", ".pt", ".pth")


def model_version(path: str | os.PathLike) -> str:
    """'sha256:<hex>' of the model's weights: the file itself, or a folder's weight files (and config.json) in
    name order, each name hashed with its bytes."""
    path = Path(path)
    h = hashlib.sha256()
    if path.is_file():
        files = [path]
    else:
        files = sorted(p for p in path.iterdir() if p.is_file()
                       and (p.suffix in WEIGHT_SUFFIXES or p.name == "config.json"))
    for f in files:
        if len(files) > 1:
            h.update(f.name.encode() + b"\0")
        with open(f, "rb") as fh:
            while chunk := fh.read(1 << 20):
                h.update(chunk)
    return "sha256:" + h.hexdigest()


class RequestLog:
    """A non-blocking JSON-lines writer. `write(line)` from any thread; `flush()` waits until what was written
    is on disk; `close()` drains and stops the thread."""

    def __init__(self, path: str, *, max_bytes: int = DEFAULT_MAX_BYTES, backup_count: int = DEFAULT_BACKUP_COUNT,
                 model_version: str | None = None, model_path: str | os.PathLike | None = None) -> None:
        self.path = path
        if path == "-":
            self._handler: logging.Handler = logging.StreamHandler(sys.stdout)
        else:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            # delay: the file is opened by the writer thread at its first line, so even an open that blocks (a
            # FIFO nobody reads, a hung network mount) never holds the event loop
            self._handler = logging.handlers.RotatingFileHandler(path, maxBytes=max_bytes, backupCount=backup_count,
                                                                 encoding="utf-8", delay=True)
        self._handler.setFormatter(logging.Formatter("%(message)s"))
        self._version = model_version
        self._model_path = model_path
        self._queue: queue.Queue = queue.Queue(QUEUE_SIZE)
        self.dropped = 0           # lines the writer had no room for (reported on the next line written)
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="kvflow-request-log", daemon=True)
        self._thread.start()

    # ---- any thread ----------------------------------------------------------------------------------------
    @property
    def model_version(self) -> str | None:
        """The label, or the weights' hash once the writer thread has computed it (None until then)."""
        return self._version

    def write(self, line: dict) -> None:
        if self._closed:
            return
        try:
            self._queue.put_nowait(line)
        except queue.Full:
            self.dropped += 1

    def flush(self, timeout: float = 10.0) -> None:
        """Wait until every line written so far is on disk (tests, shutdown)."""
        deadline = time.monotonic() + timeout
        while self._queue.unfinished_tasks and time.monotonic() < deadline and self._thread.is_alive():
            time.sleep(0.005)

    def close(self, timeout: float = 10.0) -> None:
        """Write what is queued (within `timeout`: a writer stuck on its file is left behind, a daemon thread)."""
        if self._closed:
            return
        self._closed = True
        try:
            self._queue.put(None, timeout=timeout)
        except queue.Full:
            pass
        self._thread.join(timeout)
        if self.path != "-" and not self._thread.is_alive():
            self._handler.close()

    # ---- the writer thread ---------------------------------------------------------------------------------
    def _run(self) -> None:
        if self._version is None and self._model_path is not None:
            try:
                self._version = model_version(self._model_path)
            except OSError as e:
                logger.warning("request log: cannot hash the model at %s (%s); model_version will be null",
                               self._model_path, e)
        reported = 0
        while True:
            line = self._queue.get()
            try:
                if line is None:
                    return
                line["model_version"] = self._version
                if self.dropped != reported:
                    line["dropped_before"] = self.dropped - reported   # lines lost since the last one written
                    reported = self.dropped
                record = logging.LogRecord("kvflow.request_log", logging.INFO, __file__, 0,
                                           json.dumps(line, default=str), None, None)
                self._handler.handle(record)
                self._handler.flush()
            except Exception:  # noqa: BLE001 - a bad line never stops the log
                logger.exception("request log: writing a line failed")
            finally:
                self._queue.task_done()
