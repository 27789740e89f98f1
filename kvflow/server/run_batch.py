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

import argparse
import asyncio
import dataclasses
import json
import logging
import re
import sys
import time
import uuid
from pathlib import Path

from kvflow.config import EngineConfig
from kvflow.server.protocol import APIError, validation_error

logger = logging.getLogger("kvflow.server")

URLS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings")
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

    def __init__(self, serving, embeddings, max_concurrency: int, counts: BatchCounts | None = None, *,
                 priority: int = 0) -> None:
        """`priority`: the scheduler priority every line runs at, added to the line's own `priority` (the online
        Batch API runs its lines behind interactive traffic; offline, nothing else runs)."""
        from kvflow.server.embeddings_api import EmbeddingRequest
        from kvflow.server.protocol import ChatCompletionRequest, CompletionRequest

        self.routes = {"/v1/chat/completions": (ChatCompletionRequest, serving.chat),
                       "/v1/completions": (CompletionRequest, serving.completions),
                       "/v1/embeddings": (EmbeddingRequest, embeddings.create)}
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


# ---- the command ------------------------------------------------------------------------------------------------
def add_run_batch_parser(sub) -> argparse.ArgumentParser:
    from kvflow.server.cli import add_config_flags

    p = sub.add_parser("run-batch", help="run a file of OpenAI batch requests (JSONL) offline",
                       description="Run a JSONL file of OpenAI batch requests (vLLM's run-batch format: "
                                   "chat completions, completions, embeddings) through the server's routes, "
                                   "offline; rerun with the same output file to resume.")
    p.add_argument("-i", "--input-file", required=True, help="the batch requests, one JSON object per line")
    p.add_argument("-o", "--output-file", required=True,
                   help="the results, one line per request (appended: the custom_ids already there are skipped)")
    help_model = dataclasses.fields(EngineConfig)[0].metadata["help"]
    p.add_argument("model_tag", nargs="?", default=None, metavar="MODEL", help=help_model)
    p.add_argument("--model", dest="model_opt", default=None, help="same as MODEL")
    p.add_argument("--max-concurrency", type=int, default=None,
                   help="most lines running at once (default: the engine's --max-num-seqs)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar (none either when not a TTY)")
    p.add_argument("--log-level", default="warning", help="logging level (default: %(default)s)")
    add_config_flags(p.add_argument_group("engine"), EngineConfig, skip=("model",))
    p.set_defaults(func=run_batch_command)
    return p


def config_from_args(args) -> EngineConfig:
    model = args.model_tag or args.model_opt
    if args.model_tag and args.model_opt and args.model_tag != args.model_opt:
        raise ValueError(f"two different models given: {args.model_tag!r} and --model {args.model_opt!r}")
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(EngineConfig) if f.name != "model"}
    return EngineConfig(**values, model=model)


def run_batch_command(args) -> int:
    from kvflow.server.cli import setup_logging

    setup_logging(args.log_level)
    config = config_from_args(args)            # ValueError -> a clean error exit in kvflow.cli
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise ValueError(f"--max-concurrency must be at least 1, got {args.max_concurrency}")
    lines = read_input(args.input_file)        # duplicates refuse the file before the model loads
    skip = done_keys(args.output_file)
    pending = [line for line in lines if line.key not in skip]
    progress = not args.no_progress and sys.stderr.isatty()
    t0 = time.perf_counter()
    counts = BatchCounts()
    if pending:
        try:
            asyncio.run(_run(config, pending, args.output_file, args.max_concurrency or config.max_num_seqs,
                             progress, counts))
        except KeyboardInterrupt:
            print(f"run-batch: interrupted after {counts.done} line(s); what finished is in {args.output_file}: "
                  "rerun the same command to resume", file=sys.stderr)
            return 130
    done, failed = counts.done, counts.failed
    print(f"run-batch: {done} line(s) processed ({failed} failed), {len(lines) - len(pending)} skipped "
          f"(already in {args.output_file}), in {time.perf_counter() - t0:.1f}s", file=sys.stderr)
    return 0


async def _run(config: EngineConfig, lines: list[BatchLine], output_file: str, max_concurrency: int,
               progress: bool, counts: BatchCounts) -> None:
    from kvflow.async_engine import AsyncEngine
    from kvflow.server.embeddings_api import EmbeddingsServing
    from kvflow.server.serving import OpenAIServing

    engine = await asyncio.to_thread(AsyncEngine.from_config, config)
    engine.start()
    serving = OpenAIServing(engine)
    runner = BatchRunner(serving, EmbeddingsServing(serving), max_concurrency, counts)
    try:
        with open(output_file, "a", encoding="utf-8") as out:
            if not progress:
                await runner.run(lines, out)
            else:
                await _run_with_progress(runner, lines, out)
    finally:
        await serving.shutdown_engine()


async def _run_with_progress(runner: BatchRunner, lines: list[BatchLine], out) -> None:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    t0 = time.perf_counter()
    with Progress(TextColumn("run-batch"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[stats]}"),
                  TimeElapsedColumn(), console=Console(file=sys.stderr)) as bar:
        task = bar.add_task("run-batch", total=len(lines), stats="")

        def on_result():
            c = runner.counts
            rate = c.output_tokens / max(time.perf_counter() - t0, 1e-9)
            bar.update(task, completed=c.done, stats=f"{c.failed} failed · {rate:.1f} output tok/s")

        await runner.run(lines, out, on_result)
