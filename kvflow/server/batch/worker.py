"""The online Batch API's worker: validates new batches, runs their lines through the server's routes
(run_batch.BatchRunner, at the batch priority), commits each result, writes the output and error files, and
resumes whatever a stop or a crash left.

One asyncio task on the server's event loop. Its lifecycle of a batch, as OpenAI's:

    validating ─► in_progress ─► finalizing ─► completed
        │              ├─ cancel ─► cancelling ─► cancelled       (in-flight lines finish; pending never start)
        │              └─ completion window over ─► expired        (pending lines: `batch_expired` errors)
        └─ a bad input file ─► failed (errors.data: one entry per bad line, with its line number)

Lines run in file order, the oldest batch first, at most `max_concurrency` at once over all batches (so batch work
never holds more than that many of the engine's --max-num-seqs slots), each at scheduler priority `priority`
(interactive requests run at 0: lower first). A line's result counts once it is committed (BatchStore.add_result);
a line the engine could not take (503: shutting down; 429: queue full) is not a result: it stays pending and runs
again (429: after a second; 503: on the next start). After a crash, a restart runs exactly the lines without a
committed result: at most the lines that were in flight run twice, and each custom_id appears once in the output.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from dataclasses import dataclass, field

from kvflow.server.batch.store import ACTIVE, STATUSES, BatchStore
from kvflow.server.common.errors import APIError
from kvflow.server.batch.runner import URLS, BatchLine, BatchRunner, LineRoutes, output_record, parse_line

logger = logging.getLogger("kvflow.server")

MAX_LINES = 50_000        # OpenAI's limit of requests per batch
MAX_ERRORS = 1000         # validation errors listed in a failed batch's `errors.data`
RETRY_429_S = 1.0
COMMIT_RETRY_S = 5.0
# codes of a line's validation error, by the parameter parse_line names (OpenAI's batch error codes)
CODE_BY_PARAM = {"url": "invalid_url", "method": "invalid_value", "body": "invalid_value"}


def batch_error(code: str, message: str, line: int | None = None, param: str | None = None) -> dict:
    return {"code": code, "message": message, "param": param, "line": line}


@dataclass
class Running:
    """A batch the worker is running: its next lines to start, read from the store a chunk at a time."""
    batch: dict
    next_idx: int = 0
    buffer: list = field(default_factory=list)
    exhausted: bool = False
    stop: str | None = None          # "cancelled" or "expired": start no more lines, finalize once idle
    tasks: dict = field(default_factory=dict)   # custom_id -> asyncio.Task


class BatchWorker:
    def __init__(self, store_handle, serving, routes: LineRoutes, metrics, *, max_concurrency: int, priority: int,
                 max_lines: int = MAX_LINES) -> None:
        """`serving`: the served model names and their check; `routes`: the lines' routes (the app's
        `batch_line_routes`)."""
        self.handle = store_handle
        self.serving = serving
        self.metrics = metrics
        self.max_concurrency = max(1, max_concurrency)
        self.priority = priority
        self.max_lines = max_lines
        self.runner = BatchRunner(routes, self.max_concurrency, priority=priority)
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._running: dict[str, Running] = {}
        self._paused = False            # stop starting lines (shutdown; or the engine answered 503)
        self._line_tasks: set[asyncio.Task] = set()

    # ---- lifecycle -----------------------------------------------------------------------------------------------
    def start(self) -> None:
        self._task = asyncio.ensure_future(self._loop())

    def wake(self) -> None:
        self._wake.set()

    def pause(self) -> None:
        """Start no more lines (the server is stopping); those in flight finish and commit."""
        self._paused = True

    async def stop(self, timeout: float = 10.0) -> None:
        """Pause, give the lines in flight `timeout` seconds to commit, cancel the rest (they run again on the next
        start), close the store."""
        self.pause()
        if self._line_tasks:
            await asyncio.wait(set(self._line_tasks), timeout=timeout)
        for t in list(self._line_tasks):
            t.cancel()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(BaseException):
                await self._task
        with contextlib.suppress(BaseException):
            await asyncio.gather(*self._line_tasks, return_exceptions=True)
        self.handle.close()

    @property
    def in_flight(self) -> int:
        return len(self._line_tasks)

    async def _loop(self) -> None:
        store = self.handle.existing()
        if store is not None:           # resume what the last run left; nothing to do if batches never ran here
            await self._refresh_gauges(store)
        while True:
            self._wake.clear()
            store = self.handle.existing()
            timeout = None
            if store is not None:
                try:
                    timeout = await self._tick(store)
                except asyncio.CancelledError:
                    raise
                except Exception:      # a bug of ours: log it, keep serving, look again in a while
                    logger.exception("batch worker")
                    timeout = 5.0
            try:
                await asyncio.wait_for(self._wake.wait(), timeout)
            except asyncio.TimeoutError:
                pass

    async def _tick(self, store: BatchStore) -> float | None:
        """One look at every active batch; the seconds until the next completion window ends (None: none)."""
        now = time.time()
        for b in await asyncio.to_thread(store.batches_with_status, *ACTIVE):
            st = b["status"]
            if st == "validating":
                await self._validate(store, b)
                self.wake()            # look again: it is in progress (or failed) now
            elif st == "finalizing":
                await self._finalize(store, b, "completed")
            elif st == "cancelling":
                r = self._running.setdefault(b["id"], Running(b))
                r.stop = "cancelled"
            elif st == "in_progress":
                r = self._running.setdefault(b["id"], Running(b))
                if r.stop is None and b["expires_at"] is not None and now >= b["expires_at"]:
                    r.stop = "expired"
        for batch_id, r in list(self._running.items()):
            if r.stop is not None and not r.tasks:
                await self._finalize(store, r.batch, r.stop)
        await self._fill(store)
        for batch_id, r in list(self._running.items()):      # every line done: finalize
            if r.stop is None and r.exhausted and not r.buffer and not r.tasks and not self._paused:
                b = await asyncio.to_thread(store.get_batch, batch_id)
                if b["completed"] + b["failed"] >= b["total"]:
                    await self._finalize(store, b, "completed")
                else:                # a line that was not taken (and not requeued): look again from the start
                    r.next_idx, r.exhausted = 0, False
                    self.wake()
        await self._refresh_gauges(store)
        ends = [r.batch["expires_at"] for r in self._running.values()
                if r.stop is None and r.batch["expires_at"] is not None]
        return max(0.05, min(ends) - time.time()) if ends else None

    # ---- validation ----------------------------------------------------------------------------------------------
    async def _validate(self, store: BatchStore, b: dict) -> None:
        lines, errors, model = await asyncio.to_thread(self._read_input, store, b)
        if errors:
            await asyncio.to_thread(store.update_batch, b["id"], only_if_status=("validating",), status="failed",
                                    failed_at=time.time(), errors={"object": "list", "data": errors[:MAX_ERRORS]})
            logger.info("batch %s failed validation: %d error(s)", b["id"], len(errors))
        elif await asyncio.to_thread(store.start_batch, b["id"], lines, model):
            logger.info("batch %s: %d line(s) in progress", b["id"], len(lines))

    def _read_input(self, store: BatchStore, b: dict) -> tuple[list, list[dict], str | None]:
        """(lines as (lineno, custom_id, text), validation errors, the model) from the batch's input file, checked
        as OpenAI checks it before anything runs."""
        path = store.file_path(b["input_file_id"])
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return [], [batch_error("invalid_file", f"the input file {b['input_file_id']} no longer exists",
                                    param="input_file_id")], None
        lines, errors, seen, model = [], [], {}, None
        for lineno, raw in enumerate(data.split(b"\n"), 1):
            if not raw.strip():
                continue
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError:
                errors.append(batch_error("invalid_json_line", "This line is not parseable as valid JSON "
                                          "(it is not UTF-8).", lineno))
                continue
            error = self._check_line(parse_line(lineno, text), text, b["endpoint"])
            if error is not None:
                errors.append(error)
                continue
            line = parse_line(lineno, text)
            if line.custom_id in seen:
                errors.append(batch_error(
                    "duplicate_custom_id", f"The custom_id {line.custom_id!r} of this request is a duplicate of "
                    f"line {seen[line.custom_id]}'s. The custom_id parameter must be unique for each request in a "
                    "batch.", lineno, "custom_id"))
                continue
            seen[line.custom_id] = lineno
            model = model or line.body.get("model")
            lines.append((lineno, line.custom_id, text))
        if not lines and not errors:
            errors.append(batch_error("empty_file", "The batch input file is empty."))
        if len(lines) > self.max_lines:
            errors.append(batch_error("too_many_tasks", f"The batch input file has {len(lines)} requests: a batch "
                                      f"holds at most {self.max_lines}."))
        return lines, errors, model or self.serving.names[0]

    def _check_line(self, line: BatchLine, text: str, endpoint: str) -> dict | None:
        """A line's validation error, or None."""
        n = line.lineno
        if line.custom_id is None:
            try:
                obj = json.loads(text)
            except json.JSONDecodeError:
                obj = None
            if not isinstance(obj, dict):
                return batch_error("invalid_json_line", "This line is not parseable as valid JSON.", n)
            return batch_error("missing_required_parameter", "Missing required parameter: 'custom_id' (a string).",
                               n, "custom_id")
        if line.error is not None:
            e = line.error
            if e.param == "url":
                return batch_error("invalid_url", f"The URL {line.url!r} is not served by the Batch API (kvflow runs "
                                   f"{', '.join(URLS)}).", n, "url")
            return batch_error(e.code or CODE_BY_PARAM.get(e.param, "invalid_request"), e.message, n, e.param)
        if line.url != endpoint:
            return batch_error("invalid_url", f"The URL provided for this request ({line.url}) does not prefix-match "
                               f"the batch endpoint ({endpoint}).", n, "url")
        model = line.body.get("model")
        if model is not None and not isinstance(model, str):
            return batch_error("invalid_value", "body.model must be a string.", n, "body.model")
        try:
            self.serving.preparer.check_model(model)
        except APIError as e:
            return batch_error(e.code or "model_not_found", e.message, n, "body.model")
        return None

    # ---- running lines -------------------------------------------------------------------------------------------
    async def _fill(self, store: BatchStore) -> None:
        """Start lines, oldest batch first, up to max_concurrency in flight."""
        for r in self._running.values():
            while not self._paused and r.stop is None and self.in_flight < self.max_concurrency:
                if not r.buffer and not r.exhausted:
                    rows = await asyncio.to_thread(store.pending_lines, r.batch["id"], r.next_idx,
                                                   2 * self.max_concurrency)
                    # lines already running (started from an earlier chunk) are not pending again
                    r.buffer = [row for row in rows if row["custom_id"] not in r.tasks]
                    if rows:
                        r.next_idx = rows[-1]["idx"] + 1
                    else:
                        r.exhausted = True
                if not r.buffer:
                    break
                row = r.buffer.pop(0)
                task = asyncio.ensure_future(self._run_line(store, r, row))
                r.tasks[row["custom_id"]] = task
                self._line_tasks.add(task)
            if self.in_flight >= self.max_concurrency or self._paused:
                break

    async def _run_line(self, store: BatchStore, r: Running, row) -> None:
        batch_id, cid = r.batch["id"], row["custom_id"]
        try:
            record, _ = await self.runner.run_line(parse_line(row["lineno"], row["text"]))
            status = record["response"]["status_code"]
            if status in (429, 503):       # not the line's answer: the engine could not take it now
                error = (record["response"].get("body") or {}).get("error") or {}
                if status == 503 and error.get("code") != "engine_sleeping":
                    self._paused = True    # shutting down (or dead): the next start runs it
                    return
                # queue full, or the engine put to sleep (POST /sleep): again later
                await asyncio.sleep(RETRY_429_S)
                r.buffer.insert(0, row)
                return
            if status != 200:              # OpenAI: an HTTP error's body is in `response`; `error` is for others
                record["error"] = None
            usage = (record["response"]["body"].get("usage") or {}) if status == 200 else {}
            cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
            try:
                added = await asyncio.to_thread(store.add_result, batch_id, row["idx"], cid, record,
                                                int(usage.get("prompt_tokens") or 0), int(cached),
                                                int(usage.get("completion_tokens") or 0))
            except Exception:         # e.g. the disk is full: the line stays pending and runs again, not at once
                logger.exception("batch %s: the result of line %d (custom_id %r) could not be committed", batch_id,
                                 row["lineno"], cid)
                await asyncio.sleep(COMMIT_RETRY_S)
                return
            if added and self.metrics is not None:
                self.metrics.batch_requests.labels(self.metrics.model_name,
                                                   "completed" if status == 200 else "failed").inc()
        finally:
            r.tasks.pop(cid, None)
            self._line_tasks.discard(asyncio.current_task())
            self.wake()

    # ---- the end of a batch --------------------------------------------------------------------------------------
    async def _finalize(self, store: BatchStore, b: dict, final: str) -> None:
        """Write the output and error files of what was committed and give the batch its final status."""
        batch_id = b["id"]
        self._running.pop(batch_id, None)
        now = time.time()
        if final == "completed":
            await asyncio.to_thread(store.update_batch, batch_id, only_if_status=("in_progress", "finalizing"),
                                    status="finalizing", finalizing_at=b.get("finalizing_at") or now)
        elif final == "expired":       # what never ran: an error line each, as OpenAI writes them
            for row in await asyncio.to_thread(store.pending_lines, batch_id, 0, 2**62):
                record = output_record(row["custom_id"], 0, "", {}, {
                    "code": "batch_expired",
                    "message": "This request could not be executed before the completion window expired."})
                record["response"] = None
                await asyncio.to_thread(store.add_result, batch_id, row["idx"], row["custom_id"], record)
        output_id, error_id = await asyncio.to_thread(self._write_files, store, batch_id)
        fields = {"status": final, "output_file_id": output_id, "error_file_id": error_id,
                  f"{final}_at": now}
        await asyncio.to_thread(store.update_batch, batch_id, **fields)
        b = await asyncio.to_thread(store.get_batch, batch_id)
        logger.info("batch %s %s: %d completed, %d failed of %d", batch_id, final, b["completed"], b["failed"],
                    b["total"])

    @staticmethod
    def _write_files(store: BatchStore, batch_id: str) -> tuple[str | None, str | None]:
        """The output file (status 200 lines) and the error file (the others), in input order; None where empty.
        Their ids follow from the batch's, so finalizing again after a crash replaces them."""
        ids = []
        for ok, kind in ((True, "output"), (False, "error")):
            records = list(store.results(batch_id, ok))
            file_id = f"file-{batch_id.removeprefix('batch_')}-{kind}"
            if not records:
                store.delete_file(file_id)
                ids.append(None)
                continue
            store.write_file(file_id, ((rec + "\n").encode() for rec in records), f"{batch_id}_{kind}.jsonl",
                             "batch_output", replace=True)
            ids.append(file_id)
        return ids[0], ids[1]

    async def cancel(self, store: BatchStore, batch_id: str) -> None:
        """validating: cancelled at once; in_progress: cancelling until its in-flight lines end."""
        now = time.time()
        if await asyncio.to_thread(store.update_batch, batch_id, only_if_status=("validating",),
                                   status="cancelled", cancelling_at=now, cancelled_at=now):
            return
        if await asyncio.to_thread(store.update_batch, batch_id, only_if_status=("in_progress",),
                                   status="cancelling", cancelling_at=now):
            r = self._running.get(batch_id)
            if r is not None:
                r.stop = "cancelled"
                r.batch["status"] = "cancelling"
            self.wake()

    async def _refresh_gauges(self, store: BatchStore) -> None:
        if self.metrics is None:
            return
        counts = await asyncio.to_thread(store.count_by_status)
        for status in STATUSES:
            self.metrics.batches.labels(self.metrics.model_name, status).set(counts[status])
        self.metrics.batch_queue_depth.set(await asyncio.to_thread(store.queue_depth))
