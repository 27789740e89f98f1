"""`kvflow run-batch`: a file of OpenAI batch requests (vLLM's run-batch format) run offline through the server's
routes (`batch/runner.py`'s BatchRunner over the app's batch line routes), on the AsyncEngine `kvflow serve` builds."""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import sys
import time

from kvflow.config import EngineConfig
from kvflow.server.batch.runner import BatchCounts, BatchLine, BatchRunner, done_keys, read_input
from kvflow.server.common.flags import add_config_flags, setup_logging


# ---- the command ------------------------------------------------------------------------------------------------
def add_run_batch_parser(sub) -> argparse.ArgumentParser:

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
    from kvflow.server.app import batch_line_routes
    from kvflow.server.embeddings.routes import EmbeddingsServing
    from kvflow.server.serving.serving import OpenAIServing

    engine = await asyncio.to_thread(AsyncEngine.from_config, config)
    engine.start()
    serving = OpenAIServing(engine)
    runner = BatchRunner(batch_line_routes(serving, EmbeddingsServing(serving)), max_concurrency, counts)
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
