"""Drive the load: warm-up, then requests at a closed-loop concurrency and/or Poisson arrival rate, for a number
of requests or a duration; /metrics sampled alongside; one RunResult per load point of a sweep."""
from __future__ import annotations

import asyncio
import math
import platform
import random
import resource
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone

import httpx

from kvflow.bench.client import CONNECT_ERROR, RequestRecord, build_body, send_request
from kvflow.bench.metrics_sampler import MetricsSampler
from kvflow.bench.result import (BenchMeta, BenchResult, ClientHost, ClientStats, Load, RunResult, Sweep, Warmup,
                                 WorkloadInfo, rate_to_json)
from kvflow.bench.stats import summarize
from kvflow.bench.workloads import Workload


@dataclass
class BenchConfig:
    base_url: str
    model: str | None = None
    api: str = "completions"
    num_requests: int | None = None        # None: the workload's own size (or unlimited with duration)
    duration: float | None = None          # seconds of sending; in-flight requests then finish
    concurrency: int | None = None         # closed loop: at most this many in flight
    request_rate: float = math.inf         # Poisson arrivals per second; inf: all at once
    seed: int = 0
    warmup: int = 1
    ignore_eos: bool = False
    temperature: float | None = 0.0
    timeout: float = 600.0
    slo: dict = field(default_factory=dict)
    cost_per_hour: float | None = None
    metrics_interval: float = 0.5
    progress: bool = True
    extra_body: dict | None = None
    keep_text: bool = False
    api_key: str | None = None

    def validate(self) -> None:
        if self.api not in ("chat", "completions"):
            raise ValueError(f"--api must be chat or completions, got {self.api!r}")
        if self.concurrency is not None and self.concurrency < 1:
            raise ValueError(f"--concurrency must be >= 1, got {self.concurrency}")
        if not self.request_rate > 0:
            raise ValueError(f"--request-rate must be > 0 (or inf), got {self.request_rate}")
        if self.num_requests is not None and self.num_requests < 1:
            raise ValueError(f"--num-requests must be >= 1, got {self.num_requests}")
        if self.duration is not None and self.duration <= 0:
            raise ValueError(f"--duration must be > 0, got {self.duration}")
        if self.duration is not None and self.num_requests is None and self.concurrency is None \
                and math.isinf(self.request_rate):
            raise ValueError("--duration without --num-requests needs --concurrency or a finite --request-rate")
        if self.warmup < 0:
            raise ValueError(f"--warmup must be >= 0, got {self.warmup}")
        if self.timeout <= 0:
            raise ValueError(f"--timeout must be > 0, got {self.timeout}")


def load_label(concurrency: int | None, rate: float) -> str:
    parts = []
    if concurrency is not None:
        parts.append(f"concurrency={concurrency}")
    if not math.isinf(rate) or concurrency is None:
        parts.append(f"rate={rate_to_json(rate)}")
    return ",".join(parts)


def root_url(base_url: str) -> str:
    """http://host:port/v1 -> http://host:port (where /health, /metrics, /version live)."""
    u = httpx.URL(base_url)
    path = u.path.rstrip("/")
    if path.endswith("/v1"):
        path = path[:-3]
    return str(u.copy_with(path=path or "/", query=None)).rstrip("/")


def now_iso() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def _headers(cfg: BenchConfig) -> dict:
    return {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}


@dataclass
class ServerInfo:
    """What the server says about itself before the load, and the model to request."""
    models: list[str]                # what /v1/models lists
    server_version: dict | None      # its /version answer; None without one
    model: str


async def probe_server(cfg: BenchConfig) -> ServerInfo:
    """The server's /version and model list; the model to use. Raises ConnectionError when unreachable."""
    async with httpx.AsyncClient(timeout=10.0, trust_env=False, headers=_headers(cfg)) as c:
        try:
            r = await c.get(cfg.base_url.rstrip("/") + "/models")
        except httpx.TransportError as e:
            raise ConnectionError(f"cannot reach the server at {cfg.base_url}: {type(e).__name__}: {e}") from None
        models = []
        if r.status_code == 200:
            try:
                models = [m.get("id") for m in r.json().get("data", [])]
            except (ValueError, AttributeError):
                models = []
        try:
            v = await c.get(root_url(cfg.base_url) + "/version")
            server_version = v.json() if v.status_code == 200 else None
        except (httpx.HTTPError, ValueError):
            server_version = None
    if cfg.model is None and not models:
        raise ValueError(f"--model not given and {cfg.base_url}/models lists no model")
    return ServerInfo(models=models, server_version=server_version,
                      model=models[0] if cfg.model is None else cfg.model)


async def _run_load(cfg: BenchConfig, workload: Workload, model: str, concurrency: int | None, rate: float,
                    label: str) -> RunResult:
    url = cfg.base_url.rstrip("/") + ("/chat/completions" if cfg.api == "chat" else "/completions")
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    timeout = httpx.Timeout(cfg.timeout, connect=min(cfg.timeout, 30.0))
    n = cfg.num_requests
    if n is None and cfg.duration is None:
        n = workload.default_num_requests()

    def body_of(spec, warm=False):
        b = build_body(cfg.api, model, spec, ignore_eos=cfg.ignore_eos, temperature=cfg.temperature,
                       extra_body=cfg.extra_body)
        if warm:
            b["max_tokens"] = min(b.get("max_tokens") or 16, 16)
        return b

    async with httpx.AsyncClient(limits=limits, timeout=timeout, trust_env=False, headers=_headers(cfg)) as client:
        warm_records = []
        if cfg.warmup:
            t0 = time.perf_counter()
            warm_records = await asyncio.gather(*[
                send_request(client, url, cfg.api, body_of(s, warm=True), s, t0, cfg.timeout)
                for s in workload.take(cfg.warmup)])
            if all(r.error_kind == CONNECT_ERROR for r in warm_records):
                raise ConnectionError(f"cannot reach the server at {url}: {warm_records[0].error}")

        t_zero = time.perf_counter()
        sampler = MetricsSampler(root_url(cfg.base_url), cfg.metrics_interval, t_zero=t_zero)
        await sampler.start()
        started_at = now_iso()
        cpu0 = time.process_time()
        records: list[RequestRecord] = []
        progress = _Progress(cfg.progress, n, cfg.duration, label)
        sem = asyncio.Semaphore(concurrency) if concurrency else None
        rng = random.Random(cfg.seed)
        tasks: set[asyncio.Task] = set()

        async def one(spec):
            try:
                rec = await send_request(client, url, cfg.api, body_of(spec), spec, t_zero, cfg.timeout,
                                         keep_text=cfg.keep_text)
                records.append(rec)
                progress.advance(rec.success)
            finally:
                if sem is not None:
                    sem.release()

        with progress:
            arrival = 0.0
            for spec in workload.take(n):
                if not math.isinf(rate):
                    arrival += rng.expovariate(rate)
                    delay = t_zero + arrival - time.perf_counter()
                    if cfg.duration is not None and arrival >= cfg.duration:
                        break
                    if delay > 0:
                        await asyncio.sleep(delay)
                if sem is not None:
                    await sem.acquire()
                if cfg.duration is not None and time.perf_counter() - t_zero >= cfg.duration:
                    if sem is not None:
                        sem.release()
                    break
                task = asyncio.create_task(one(spec))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
            while tasks:
                await asyncio.gather(*list(tasks))
        wall = time.perf_counter() - t_zero
        cpu = time.process_time() - cpu0
        finished_at = now_iso()
        await sampler.stop()

    records.sort(key=lambda r: r.index)
    return RunResult(
        label=label,
        load=Load(concurrency=concurrency, request_rate=rate, num_requests=n, duration_limit_s=cfg.duration),
        started_at=started_at,
        finished_at=finished_at,
        summary=summarize(records, cfg.slo, cfg.cost_per_hour),
        server=sampler.summary(),
        server_series=sampler.series,
        client=ClientStats(cpu_seconds=cpu, wall_seconds=wall, cpu_fraction=cpu / wall if wall > 0 else None,
                           max_rss_bytes=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024),
        warmup=Warmup(requests=len(warm_records), failed=sum(not r.success for r in warm_records)),
        records=records,
        keep_text=cfg.keep_text,
    )


class _Progress:
    """A rich progress bar on a terminal; silent otherwise."""

    def __init__(self, enabled: bool, total: int | None, duration: float | None, label: str):
        self.enabled = enabled and sys.stderr.isatty()
        self.bar = None
        if self.enabled:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
            self.bar = Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                                TextColumn("failed {task.fields[failed]}"), TimeElapsedColumn(), transient=False)
            self.task = self.bar.add_task(label, total=total, failed=0)
        self.failed = 0

    def advance(self, success: bool) -> None:
        self.failed += not success
        if self.bar is not None:
            self.bar.update(self.task, advance=1, failed=self.failed)

    def __enter__(self):
        if self.bar is not None:
            self.bar.start()
        return self

    def __exit__(self, *exc):
        if self.bar is not None:
            self.bar.stop()


def sweep_points(cfg: BenchConfig, sweep: tuple[str, list[float]] | None) -> list[tuple[int | None, float]]:
    if sweep is None:
        return [(cfg.concurrency, cfg.request_rate)]
    what, values = sweep
    if what == "concurrency":
        return [(int(v), cfg.request_rate) for v in values]
    return [(cfg.concurrency, float(v)) for v in values]


def run_benchmark(cfg: BenchConfig, workload: Workload, sweep: tuple[str, list[float]] | None = None,
                  command: str | None = None) -> BenchResult:
    """The whole benchmark against one server: its meta and one run per load point."""
    cfg.validate()
    import kvflow

    started = now_iso()

    async def main():
        info = await probe_server(cfg)
        runs = []
        for conc, rate in sweep_points(cfg, sweep):
            runs.append(await _run_load(cfg, workload, info.model, conc, rate, load_label(conc, rate)))
        return info, runs

    info, runs = asyncio.run(main())
    meta = BenchMeta(
        command=command if command is not None else " ".join(sys.argv),
        kvflow_version=kvflow.__version__,
        started_at=started,
        finished_at=now_iso(),
        base_url=cfg.base_url,
        api=cfg.api,
        model=info.model,
        server_models=info.models,
        server_version=info.server_version,
        seed=cfg.seed,
        workload=WorkloadInfo(workload.name, dict(workload.params)),
        ignore_eos=cfg.ignore_eos,
        temperature=cfg.temperature,
        warmup=cfg.warmup,
        timeout_s=cfg.timeout,
        slo=cfg.slo,
        cost_per_hour=cfg.cost_per_hour,
        sweep=Sweep(over=sweep[0], values=[float(v) for v in sweep[1]]) if sweep else None,
        client_host=ClientHost(python=platform.python_version(), platform=platform.platform(),
                               machine=platform.machine()),
    )
    return BenchResult(meta=meta, runs=runs)
