"""A batch file over a Ray cluster: the lines sharded with Ray Data over N actors that each hold one kvflow engine.

    driver:  read_input (duplicates refuse the file) ─ done_keys (resume) ─ ray.data.from_items(pending lines)
             ─ map_batches(BatchReplica, concurrency=N) ─ each result appended and flushed as it arrives
             ─ at the end, the output rewritten in input order
    actor:   BatchReplica: one AsyncEngine (`kvflow run-batch`'s engine), the lines of every batch it is given
             through `BatchRunner.run_line` (the server's routes: chat, completions, embeddings), up to
             `max_concurrency` lines at once across its batches, so they share the engine's continuous batch

Only the driver touches the files: the lines travel in Ray's object store, so the nodes need kvflow and the model
but not the batch file, and a result is written by one process, which keeps a set of the keys it wrote: a line
whose actor died after answering it (its task retried by Ray) is never written twice. An actor killed mid-run is
restarted by Ray (`max_restarts`), and its unfinished batches run again (`max_task_retries`); an actor whose engine
died exits, so Ray restarts it the same way. Ctrl-C or a crash of the driver keeps what was written; a rerun with
the same output file skips those custom_ids, as `kvflow run-batch` does."""
from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import sys
import time
from pathlib import Path

from kvflow.config import EngineConfig
from kvflow.ray.extra import require_ray
from kvflow.server.batch.runner import BatchCounts, done_keys, parse_line, read_input

logger = logging.getLogger("kvflow.ray")

# lines per Ray Data batch: a batch is what a killed actor runs again, and what the progress bar advances by
DEFAULT_BATCH_SIZE = 16


class BatchReplica:
    """One engine in one Ray actor; Ray Data calls it with batches of `{"lineno", "text"}` rows (the input file's
    own lines, parsed here by `kvflow run-batch`'s parser) and gets back one result row per line."""

    def __init__(self, config: EngineConfig, max_concurrency: int, threads: int | None = None) -> None:
        from kvflow.async_engine import AsyncEngine

        if threads is not None:       # the engine process reads it at start (platform.setup_threads)
            os.environ["OMP_NUM_THREADS"] = str(threads)
        self.engine = AsyncEngine.from_config(config)
        self.max_concurrency = max_concurrency
        self.runner = None        # built on Ray Data's event loop, at the first batch
        self.slots: asyncio.Semaphore | None = None

    def _start(self) -> None:
        from kvflow.server.app import batch_line_routes
        from kvflow.server.batch.runner import BatchRunner
        from kvflow.server.embeddings.routes import EmbeddingsServing
        from kvflow.server.serving.serving import OpenAIServing

        self.engine.start()
        serving = OpenAIServing(self.engine)
        self.runner = BatchRunner(batch_line_routes(serving, EmbeddingsServing(serving)), self.max_concurrency)
        self.slots = asyncio.Semaphore(self.max_concurrency)

    async def _run(self, lineno: int, text: str) -> tuple[str, str, int]:
        line = parse_line(lineno, text)
        async with self.slots:
            record, tokens = await self.runner.run_line(line)
        return line.key, json.dumps(record, ensure_ascii=False), tokens

    async def __call__(self, batch: dict) -> dict:
        if self.runner is None:
            self._start()
        results = await asyncio.gather(*(self._run(int(n), str(t)) for n, t in zip(batch["lineno"], batch["text"])))
        if not self.engine.is_alive:
            # its lines failed with the engine, not on their own: the actor goes, Ray restarts it and runs the
            # batch again
            logger.error("the engine died (%s): exiting so that Ray restarts this replica", self.engine.death_reason)
            os._exit(1)
        return {"key": [k for k, _, _ in results], "record": [r for _, r, _ in results],
                "tokens": [t for _, _, t in results]}

    def __del__(self) -> None:
        # Ray Data drops the replica when the dataset is done (a killed one never gets here: its engine dies
        # with it, PR_SET_PDEATHSIG)
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.stop()


@dataclasses.dataclass
class RayBatchSettings:
    """How a batch file is spread over the cluster."""
    address: str | None = None        # a running cluster (host:port, "auto", ray://...); None: Ray's default
    replicas: int = 1                 # actors, one engine each
    num_cpus_per_replica: float = 1.0
    threads_per_replica: int | None = None     # the engine's CPU threads (default: Ray's, = num_cpus)
    batch_size: int = DEFAULT_BATCH_SIZE

    def validate(self) -> None:
        if self.replicas < 1:
            raise ValueError(f"--replicas must be at least 1, got {self.replicas}")
        if self.num_cpus_per_replica <= 0:
            raise ValueError(f"--num-cpus-per-replica must be > 0, got {self.num_cpus_per_replica}")
        if self.threads_per_replica is not None and self.threads_per_replica < 1:
            raise ValueError(f"--threads-per-replica must be at least 1, got {self.threads_per_replica}")
        if self.batch_size < 1:
            raise ValueError(f"--ray-batch-size must be at least 1, got {self.batch_size}")


def run_batch(input_file: str | Path, output_file: str | Path, config: EngineConfig | None = None, *,
              settings: RayBatchSettings | None = None, max_concurrency: int | None = None, progress: bool = False,
              counts: BatchCounts | None = None, **settings_kwargs) -> BatchCounts:
    """Run a batch file (vLLM's run-batch format) on a Ray cluster; returns the counts of this run.

        from kvflow.ray import run_batch
        run_batch("requests.jsonl", "results.jsonl", EngineConfig(model="..."), address="auto", replicas=4)

    `settings_kwargs` are `RayBatchSettings`' fields. `max_concurrency`: lines running at once in each replica
    (default: the engine's `max_num_seqs`). A rerun with the same output file skips the custom_ids already there;
    when every line is answered, the output is in input order."""
    ray = require_ray()
    config = config or EngineConfig()
    settings = settings or RayBatchSettings(**settings_kwargs)
    settings.validate()
    max_concurrency = max_concurrency or config.max_num_seqs
    if max_concurrency < 1:
        raise ValueError(f"--max-concurrency must be at least 1, got {max_concurrency}")
    lines = read_input(input_file)            # duplicates refuse the file before anything starts
    skip = done_keys(output_file)
    pending = {line.lineno for line in lines if line.key not in skip}
    counts = counts if counts is not None else BatchCounts()
    if not pending:
        return counts
    with open(input_file, encoding="utf-8") as f:
        items = [{"lineno": n, "text": text} for n, text in enumerate(f, 1) if n in pending]
    if not ray.is_initialized():
        ray.init(address=settings.address, logging_level=logging.WARNING, log_to_driver=True)
    expected = {line.key for line in lines if line.lineno in pending}
    written = _run_on_cluster(ray, items, output_file, config, settings, max_concurrency, progress, counts)
    missing = expected - written
    if missing:       # Ray gave up on a batch (max_restarts spent): say so, the rerun resumes
        raise RuntimeError(f"{len(missing)} line(s) got no result (e.g. {sorted(missing)[:3]}): rerun the same "
                           f"command to run them")
    _rewrite_in_input_order(output_file, [line.key for line in lines])
    return counts


def _run_on_cluster(ray, items: list[dict], output_file, config: EngineConfig, settings: RayBatchSettings,
                    max_concurrency: int, progress: bool, counts: BatchCounts) -> set[str]:
    """Run the items; append each result to the output as it arrives (once per key); the keys written."""
    import ray.data

    ctx = ray.data.DataContext.get_current()
    ctx.enable_progress_bars = False              # ours counts lines and tokens instead
    ctx.print_on_execution_start = False
    blocks = max(1, -(-len(items) // settings.batch_size))
    ds = ray.data.from_items(items, override_num_blocks=blocks)
    # Ray Data's actors are restarted without limit and their tasks retried (its defaults: max_restarts=-1,
    # max_task_retries=-1), which is what a killed replica needs
    results = ds.map_batches(BatchReplica, batch_size=settings.batch_size, batch_format="numpy",
                             fn_constructor_args=(config, max_concurrency, settings.threads_per_replica),
                             compute=ray.data.ActorPoolStrategy(size=settings.replicas),
                             num_cpus=settings.num_cpus_per_replica)
    written: set[str] = set()
    bar = _ProgressBar(len(items), counts) if progress else None
    try:
        with open(output_file, "a", encoding="utf-8") as out:
            for batch in results.iter_batches(batch_size=None, batch_format="numpy"):
                for key, record, tokens in zip(batch["key"], batch["record"], batch["tokens"]):
                    key = str(key)
                    if key in written:       # a batch Ray ran again after its actor died having answered it
                        continue
                    out.write(str(record) + "\n")
                    written.add(key)
                    counts.done += 1
                    counts.failed += json.loads(record)["response"]["status_code"] != 200
                    counts.output_tokens += int(tokens)
                out.flush()
                if bar is not None:
                    bar.update()
    finally:
        if bar is not None:
            bar.close()
    return written


def _rewrite_in_input_order(output_file, keys: list[str]) -> None:
    """The whole output in the input's order (written as the replicas answered, out of order); atomically."""
    path = Path(output_file)
    by_key: dict[str, str] = {}
    others: list[str] = []      # lines of no input line (another file's): kept, after
    order = {k: i for i, k in enumerate(keys)}
    from kvflow.server.batch.runner import LINE_KEY

    for raw in path.read_text(encoding="utf-8").splitlines():
        if not raw.strip():
            continue
        out = json.loads(raw)
        key = out.get("custom_id")
        if key is None:
            m = LINE_KEY.match(((out.get("error") or {}).get("error") or {}).get("message", ""))
            key = f"line {m.group(1)}" if m else None
        if key in order and key not in by_key:
            by_key[key] = raw
        else:
            others.append(raw)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        for k in keys:
            if k in by_key:
                f.write(by_key[k] + "\n")
        for raw in others:
            f.write(raw + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


class _ProgressBar:
    """Lines answered across the cluster, with the output token rate (rich, on stderr)."""

    def __init__(self, total: int, counts: BatchCounts) -> None:
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        self.counts = counts
        self.t0 = time.perf_counter()
        self.progress = Progress(TextColumn("run-batch (ray)"), BarColumn(), MofNCompleteColumn(),
                                 TextColumn("{task.fields[stats]}"), TimeElapsedColumn(),
                                 console=Console(file=sys.stderr))
        self.progress.start()
        self.task = self.progress.add_task("run-batch", total=total, stats="")
        self.start_done = counts.done

    def update(self) -> None:
        c = self.counts
        rate = c.output_tokens / max(time.perf_counter() - self.t0, 1e-9)
        self.progress.update(self.task, completed=c.done - self.start_done,
                             stats=f"{c.failed} failed · {rate:.1f} output tok/s")

    def close(self) -> None:
        self.progress.stop()
