"""`kvflow run-batch -i requests.jsonl -o results.jsonl [MODEL]`: OpenAI's batch file format, offline, in vLLM's
`run-batch` shape, through the server's own routes (no HTTP, no second engine path).

Each input line is `{"custom_id", "method": "POST", "url", "body"}` with url `/v1/chat/completions`,
`/v1/completions` or `/v1/embeddings`; each output line is `{"id", "custom_id", "response": {"status_code",
"request_id", "body"}, "error"}`. The body is validated by the route's pydantic model and run by the route's method
(`OpenAIServing.chat` / `.completions`, `EmbeddingsServing.create`) on the same AsyncEngine `kvflow serve` builds;
up to `--max-concurrency` lines run at once, so they share the continuous batch.

A line the server would refuse becomes an output line with the server's answer: `response.status_code` and
`response.body` are what HTTP would return (OpenAI's error shape), and `error` repeats that body (vLLM puts its
ErrorResponse there). A line that is not JSON, or has no string custom_id, gets `custom_id: null` and an error
whose message starts with `line N:`. Duplicate custom_ids refuse the whole file before anything runs.

Resumable: every result is appended and flushed when its line finishes; a rerun with the same output file skips
the custom_ids (and the `line N:` errors) it already holds, and drops a last line cut off mid-write.
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import re
import uuid
from pathlib import Path
from typing import Awaitable, Callable

from kvflow.server.common.errors import APIError, validation_error

logger = logging.getLogger("kvflow.server")

URLS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings")
# url -> (the route's pydantic request model, its method: `await method(req, priority=...)` -> the response model).
# The app builds it from the surfaces (server/app.py, batch_line_routes), so the Batch API imports none of them.
LineRoutes = dict[str, tuple[type, Callable[..., Awaitable]]]
LINE_KEY = re.compile(r"^line (\d+): ")


@dataclasses.dataclass
class BatchLine:
    lineno: int                    # 1-based, in the input file
    custom_id: str | None          # None: the line could not be read far enough to have one
    url: str | None = None
    body: dict | None = None
    error: APIError | None = None  # refused before running (unreadable line, method, url, body not an object)

    @property
    def key(self) -> str:
        """What a rerun matches in the output: the custom_id, or the line of an unreadable one."""
        return self.custom_id if self.custom_id is not None else f"line {self.lineno}"


def read_input(path: str | Path) -> list[BatchLine]:
    """Every non-blank line; ValueError naming the line for a custom_id given twice."""
    lines: list[BatchLine] = []
    seen: dict[str, int] = {}
    with open(path, encoding="utf-8") as f:
        for lineno, text in enumerate(f, 1):
            if not text.strip():
                continue
            line = parse_line(lineno, text)
            if line.custom_id is not None:
                if line.custom_id in seen:
                    raise ValueError(f"{path}: line {lineno}: custom_id {line.custom_id!r} is already used by line "
                                     f"{seen[line.custom_id]}; each custom_id must be unique in a batch")
                seen[line.custom_id] = lineno
            lines.append(line)
    return lines


def parse_line(lineno: int, text: str) -> BatchLine:
    def unreadable(msg: str) -> BatchLine:
        return BatchLine(lineno, None, error=APIError(400, f"line {lineno}: {msg}", param=None))

    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        return unreadable(f"malformed JSON: {e}")
    if not isinstance(obj, dict):
        return unreadable("a batch line must be a JSON object")
    custom_id = obj.get("custom_id")
    if not isinstance(custom_id, str):
        return unreadable("custom_id (a string) is required")
    line = BatchLine(lineno, custom_id, url=obj.get("url"), body=obj.get("body"))
    if obj.get("method", "POST") != "POST":
        line.error = APIError(405, f"method {obj.get('method')!r} is not allowed: batch requests are POST",
                              param="method")
    elif line.url not in URLS:
        line.error = APIError(404, f"url {line.url!r} is not served by run-batch: use one of {', '.join(URLS)}",
                              type="not_found_error", param="url")
    elif not isinstance(line.body, dict):
        line.error = APIError(400, "the body must be a JSON object", param="body")
    return line


def done_keys(path: str | Path) -> set[str]:
    """The keys of the lines an earlier run wrote to `path`; a last line cut off mid-write is removed."""
    p = Path(path)
    if not p.exists():
        return set()
    data = p.read_bytes()
    if data and not data.endswith(b"\n"):           # interrupted mid-write: keep what is whole
        data = data[:data.rfind(b"\n") + 1]
        with open(p, "r+b") as f:
            f.truncate(len(data))
    keys = set()
    for raw in data.splitlines():
        if not raw.strip():
            continue
        out = json.loads(raw)
        if out.get("custom_id") is not None:
            keys.add(out["custom_id"])
        else:
            m = LINE_KEY.match(((out.get("error") or {}).get("error") or {}).get("message", ""))
            if m:
                keys.add(f"line {m.group(1)}")
    return keys


def output_record(custom_id: str | None, status_code: int, request_id: str, body: dict,
                  error: dict | None) -> dict:
    return {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": custom_id,
            "response": {"status_code": status_code, "request_id": request_id, "body": body}, "error": error}


@dataclasses.dataclass
class BatchCounts:
    done: int = 0             # lines written, failed ones included
    failed: int = 0           # of those, lines whose status is not 200
    output_tokens: int = 0


class BatchRunner:
    """The lines of one batch through the server's routes, `max_concurrency` at a time."""

    def __init__(self, routes: LineRoutes, max_concurrency: int, counts: BatchCounts | None = None, *,
                 priority: int = 0) -> None:
        """`routes`: each URL's request model and method (the app's `batch_line_routes`). `priority`: the scheduler
        priority every line runs at, added to the line's own `priority` (the online Batch API runs its lines behind
        interactive traffic; offline, nothing else runs)."""
        self.routes = routes
        self.max_concurrency = max_concurrency
        self.priority = priority
        self.counts = counts or BatchCounts()

    async def run_line(self, line: BatchLine) -> tuple[dict, int]:
        """(the output record, its output tokens); never raises for what the line holds."""
        from pydantic import ValidationError

        from kvflow.errors import InvalidRequestError

        try:
            if line.error is not None:
                raise line.error
            model, route = self.routes[line.url]
            try:
                req = model.model_validate(line.body)
            except ValidationError as e:
                raise validation_error(e.errors()) from None
            if getattr(req, "stream", None):
                raise APIError(400, "stream is not supported in a batch: each line's response is written whole",
                               param="stream")
            resp = await route(req, priority=self.priority)
        except APIError as e:
            return self.error_record(line, e), 0
        except InvalidRequestError as e:
            return self.error_record(line, APIError.bad_request(e)), 0
        except Exception as e:   # a bug of ours: this line fails, the others go on
            logger.exception("batch line %d (custom_id %r) failed", line.lineno, line.custom_id)
            return self.error_record(line, APIError(500, f"internal error: {type(e).__name__}: {e}",
                                                    type="internal_error")), 0
        body = resp.model_dump(mode="json")
        usage = body.get("usage") or {}
        return (output_record(line.custom_id, 200, body.get("id") or f"batch-{uuid.uuid4().hex}", body, None),
                int(usage.get("completion_tokens") or 0))

    @staticmethod
    def error_record(line: BatchLine, err: APIError) -> dict:
        return output_record(line.custom_id, err.status_code, f"batch-{uuid.uuid4().hex}", err.body(), err.body())

    async def run(self, lines: list[BatchLine], out, on_result=None) -> None:
        """Run `lines`, appending each result to the open file `out` (flushed) as it finishes."""
        queue: asyncio.Queue[BatchLine] = asyncio.Queue()
        for line in lines:
            queue.put_nowait(line)

        async def worker():
            while not queue.empty():
                line = queue.get_nowait()
                record, tokens = await self.run_line(line)
                out.write(json.dumps(record, ensure_ascii=False) + "\n")
                out.flush()
                self.counts.done += 1
                self.counts.failed += record["response"]["status_code"] != 200
                self.counts.output_tokens += tokens
                if on_result is not None:
                    on_result()

        await asyncio.gather(*(worker() for _ in range(max(1, min(self.max_concurrency, len(lines))))))
