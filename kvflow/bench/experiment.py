"""The optimization experiment: the same workload against each variant of a launched server, one report."""
from __future__ import annotations

import dataclasses
import shlex
import sys
from pathlib import Path

from kvflow.bench.launcher import LaunchedServer, variant_name, variants
from kvflow.bench.result import CommandSettings, ExperimentMeta, ExperimentResult, VariantResult, WorkloadInfo
from kvflow.bench.runner import BenchConfig, now_iso, run_benchmark
from kvflow.bench.workloads import Workload


def run_experiment(cfg: BenchConfig, workload: Workload, launch: str, vary: list[tuple[str, list[str]]],
                   output_dir: Path, sweep=None, launch_timeout: float = 300.0, command: str | None = None,
                   log=print) -> ExperimentResult:
    """Start each variant on a free loopback port, wait for /health, bench it, stop it (SIGTERM, then kill)."""
    cfg.validate()
    command = command if command is not None else " ".join(sys.argv)
    started = now_iso()
    out: list[VariantResult] = []
    for i, settings in enumerate(variants(vary)):
        name = variant_name(settings)
        server = LaunchedServer(launch, settings, Path(output_dir) / f"server-{i}.log")
        entry = VariantResult(name=name, settings=settings, command=shlex.join(server.argv), log=str(server.log_path))
        log(f"[{i + 1}/{len(variants(vary))}] {name}: starting {entry.command}")
        try:
            server.start(launch_timeout)
            entry.startup_seconds = server.startup_seconds
            vcfg = dataclasses.replace(cfg, base_url=server.base_url)
            entry.result = run_benchmark(vcfg, workload, sweep, command=command)
            s = entry.result.runs[-1].summary
            log(f"    {s.completed} completed, {s.failed} failed, "
                f"{(s.output_throughput or 0):.1f} output tokens/s")
        except Exception as e:   # noqa: BLE001 - one broken variant must not lose the others' results
            entry.error = f"{type(e).__name__}: {e}"
            log(f"    failed: {entry.error}")
        finally:
            entry.exit_code = server.stop()
        out.append(entry)
    finished = now_iso()
    first = next((v.result.meta for v in out if v.result is not None), None)
    if first is not None:
        common = dataclasses.replace(first, started_at=started, finished_at=finished, base_url=None)
    else:
        common = CommandSettings(command=command, seed=cfg.seed, model=cfg.model, api=cfg.api,
                                 workload=WorkloadInfo(workload.name, dict(workload.params)), started_at=started,
                                 finished_at=finished)
    meta = ExperimentMeta(common=common, launch=launch, varied=[f"{f}={','.join(v)}" for f, v in vary])
    return ExperimentResult(meta=meta, variants=out)
