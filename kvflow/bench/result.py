"""results.json, typed: a benchmark against one server (`BenchResult`: its meta and one `RunResult` per load point)
or an optimization experiment (`ExperimentResult`: one `VariantResult` per launched server variant, each with
its own BenchResult). Both are format "kvflow-bench/1".

The runner and the experiment build these objects, write_reports writes `to_json()`, and the reports and plots
read the objects; a results file is read back with `result_from_json` (or the class's `from_json`). Every
to_json() writes the keys, key order and values that results.json has always had, so files written before read
back, and a result read back writes the same file again, with one exception: a request's "tpot" is written from
its measured token times, which the file keeps to the microsecond, so read back it is recomputed from the rounded
times and differs in its last digits.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

from kvflow.bench.client import RequestRecord
from kvflow.bench.summary import RunSummary, ServerSummary

FORMAT = "kvflow-bench/1"


def rate_to_json(rate: float) -> float | str:
    """A request rate as the file writes it: JSON has no infinity, so an unlimited rate is "inf"."""
    return "inf" if math.isinf(rate) else rate


def rate_from_json(value: float | str) -> float:
    return math.inf if value == "inf" else value


# ---- one run (one load point) ----------------------------------------------------------------------------------

@dataclass
class Load:
    """The load a run offered."""
    concurrency: int | None          # closed loop: at most this many in flight; None: no limit
    request_rate: float              # Poisson arrivals per second; math.inf: all at once
    num_requests: int | None         # None: as many as fit in duration_limit_s
    duration_limit_s: float | None

    def to_json(self) -> dict:
        return {"concurrency": self.concurrency, "request_rate": rate_to_json(self.request_rate),
                "num_requests": self.num_requests, "duration_limit_s": self.duration_limit_s}

    @classmethod
    def from_json(cls, d: dict) -> Load:
        return cls(concurrency=d["concurrency"], request_rate=rate_from_json(d["request_rate"]),
                   num_requests=d["num_requests"], duration_limit_s=d["duration_limit_s"])


@dataclass
class ClientStats:
    """The load generator's own cost during a run: near a whole core, it may have limited the load."""
    cpu_seconds: float
    wall_seconds: float
    cpu_fraction: float | None       # of one core; None for a run of no duration
    max_rss_bytes: int

    def to_json(self) -> dict:
        return asdict(self)          # the JSON keys are the fields, in their order

    @classmethod
    def from_json(cls, d: dict) -> ClientStats:
        return cls(**d)


@dataclass
class Warmup:
    """The requests sent before a run, not counted in it."""
    requests: int
    failed: int

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, d: dict) -> Warmup:
        return cls(**d)


@dataclass
class RunResult:
    """One load point: what was offered, when, the client's and the server's summaries, and every request."""
    label: str                       # "concurrency=4", "rate=inf", ...: the run's name in the reports
    load: Load
    started_at: str                  # ISO 8601, UTC, to the second
    finished_at: str
    summary: RunSummary
    server: ServerSummary
    # The /metrics samples, each {"t": seconds into the run, <metric>: value, ...} with metrics_sampler's names
    # (GAUGES, COUNTERS and the per-position spec_accepted_pos_<j>): which metrics a sample has depends on the
    # server, so a sample stays a dict.
    server_series: list[dict[str, float]]
    client: ClientStats
    warmup: Warmup
    records: list[RequestRecord]
    keep_text: bool = False          # the records are written with their answer's text (--save-output-text)

    def to_json(self) -> dict:
        return {
            "label": self.label,
            "load": self.load.to_json(),
            "started_at": self.started_at,
            "finished_at": self.finished_at,
            "summary": self.summary.to_json(),
            "server": self.server.to_json(),
            "server_series": [dict(p) for p in self.server_series],
            "client": self.client.to_json(),
            "warmup": self.warmup.to_json(),
            "records": [r.to_json(self.keep_text) for r in self.records],
        }

    @classmethod
    def from_json(cls, d: dict) -> RunResult:
        return cls(label=d["label"], load=Load.from_json(d["load"]), started_at=d["started_at"],
                   finished_at=d["finished_at"], summary=RunSummary.from_json(d["summary"]),
                   server=ServerSummary.from_json(d["server"]), server_series=[dict(p) for p in d["server_series"]],
                   client=ClientStats.from_json(d["client"]), warmup=Warmup.from_json(d["warmup"]),
                   records=[RequestRecord.from_json(r) for r in d["records"]],
                   keep_text=any("output_text" in r for r in d["records"]))


# ---- a benchmark against one server ----------------------------------------------------------------------------

@dataclass
class WorkloadInfo:
    """Which workload was sent: its name and its own parameters (they differ by workload), written side by side."""
    name: str
    params: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        return {"name": self.name, **self.params}

    @classmethod
    def from_json(cls, d: dict) -> WorkloadInfo:
        return cls(name=d["name"], params={k: v for k, v in d.items() if k != "name"})


@dataclass
class Sweep:
    """One run per value of the swept load setting (--sweep)."""
    over: str                        # "concurrency" or "request_rate"
    values: list[float]              # math.inf: an unlimited rate

    def to_json(self) -> dict:
        return {"over": self.over, "values": [rate_to_json(v) for v in self.values]}

    @classmethod
    def from_json(cls, d: dict) -> Sweep:
        return cls(over=d["over"], values=[rate_from_json(v) for v in d["values"]])


@dataclass
class ClientHost:
    """The machine the load generator ran on."""
    python: str
    platform: str
    machine: str

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, d: dict) -> ClientHost:
        return cls(**d)


@dataclass
class BenchMeta:
    """What a benchmark ran against and with which settings: enough to run it again."""
    command: str                     # the kvflow bench command line that reproduces the run
    kvflow_version: str
    started_at: str
    finished_at: str
    base_url: str | None             # None in an experiment's meta: every variant had its own
    api: str                         # "chat" or "completions"
    model: str
    server_models: list[str] | None  # what /v1/models listed
    server_version: dict | None      # the server's /version answer, as it sent it; None without one
    seed: int
    workload: WorkloadInfo
    ignore_eos: bool
    temperature: float | None
    warmup: int                      # requests sent before each run
    timeout_s: float
    slo: dict[str, float]            # seconds, by stats.SLO_KEYS name; {} without --slo
    cost_per_hour: float | None
    sweep: Sweep | None
    client_host: ClientHost

    def to_json(self) -> dict:
        return {
            "command": self.command,
            "kvflow_version": self.kvflow_version,
            "started_at": self.started_at,
            "finished_at": self.finished_at,
            "base_url": self.base_url,
            "api": self.api,
            "model": self.model,
            "server_models": None if self.server_models is None else list(self.server_models),
            "server_version": self.server_version,
            "seed": self.seed,
            "workload": self.workload.to_json(),
            "ignore_eos": self.ignore_eos,
            "temperature": self.temperature,
            "warmup": self.warmup,
            "timeout_s": self.timeout_s,
            "slo": dict(self.slo),
            "cost_per_hour": self.cost_per_hour,
            "sweep": None if self.sweep is None else self.sweep.to_json(),
            "client_host": self.client_host.to_json(),
        }

    @classmethod
    def from_json(cls, d: dict) -> BenchMeta:
        return cls(command=d["command"], kvflow_version=d["kvflow_version"], started_at=d["started_at"],
                   finished_at=d["finished_at"], base_url=d["base_url"], api=d["api"], model=d["model"],
                   server_models=d["server_models"], server_version=d["server_version"], seed=d["seed"],
                   workload=WorkloadInfo.from_json(d["workload"]), ignore_eos=d["ignore_eos"],
                   temperature=d["temperature"], warmup=d["warmup"], timeout_s=d["timeout_s"], slo=dict(d["slo"]),
                   cost_per_hour=d["cost_per_hour"],
                   sweep=None if d["sweep"] is None else Sweep.from_json(d["sweep"]),
                   client_host=ClientHost.from_json(d["client_host"]))


@dataclass
class BenchResult:
    """A benchmark against one server: one run per load point of the sweep (one without --sweep)."""
    meta: BenchMeta
    runs: list[RunResult]

    KIND = "bench"

    def to_json(self) -> dict:
        return {"format": FORMAT, "kind": self.KIND, "meta": self.meta.to_json(),
                "runs": [r.to_json() for r in self.runs]}

    @classmethod
    def from_json(cls, d: dict) -> BenchResult:
        return cls(meta=BenchMeta.from_json(d["meta"]), runs=[RunResult.from_json(r) for r in d["runs"]])


# ---- an optimization experiment --------------------------------------------------------------------------------

@dataclass
class CommandSettings:
    """The settings of an experiment none of whose variants ran: only what its command line said."""
    command: str
    seed: int
    model: str | None                # --model; None: each server's first model would have been used
    api: str
    workload: WorkloadInfo
    started_at: str
    finished_at: str

    def to_json(self) -> dict:
        return {"command": self.command, "seed": self.seed, "model": self.model, "api": self.api,
                "workload": self.workload.to_json(), "started_at": self.started_at, "finished_at": self.finished_at}

    @classmethod
    def from_json(cls, d: dict) -> CommandSettings:
        return cls(command=d["command"], seed=d["seed"], model=d["model"], api=d["api"],
                   workload=WorkloadInfo.from_json(d["workload"]), started_at=d["started_at"],
                   finished_at=d["finished_at"])


@dataclass
class ExperimentMeta:
    """The experiment's settings, the launch command and the flags it varied.

    Every variant ran the same load, so the settings are the meta of the first variant that ran, with the
    experiment's own start and end and no base_url (each variant had its own); when none ran, only what the command
    line said. The file writes the settings' keys, then launch, base_url (null) and varied."""
    common: BenchMeta | CommandSettings
    launch: str
    varied: list[str]                # "FLAG=V1,V2" per --vary

    def to_json(self) -> dict:
        d = self.common.to_json()
        d["launch"] = self.launch
        d["base_url"] = None
        d["varied"] = list(self.varied)
        return d

    @classmethod
    def from_json(cls, d: dict) -> ExperimentMeta:
        # only a variant's bench meta has kvflow_version
        common = BenchMeta.from_json(d) if "kvflow_version" in d else CommandSettings.from_json(d)
        return cls(common=common, launch=d["launch"], varied=list(d["varied"]))


@dataclass
class VariantResult:
    """One server variant of an experiment: how it was started, its benchmark, or why it has none."""
    name: str                        # "FLAG=V,...", or "default" when nothing was varied
    settings: dict[str, str]         # the varied flags' values
    command: str                     # the server command line it ran
    log: str                         # the path of the server's output
    result: BenchResult | None = None
    error: str | None = None         # why the variant has no result
    startup_seconds: float | None = None
    exit_code: int | None = None

    def to_json(self) -> dict:
        return {"name": self.name, "settings": dict(self.settings), "command": self.command, "log": self.log,
                "result": None if self.result is None else self.result.to_json(), "error": self.error,
                "startup_seconds": self.startup_seconds, "exit_code": self.exit_code}

    @classmethod
    def from_json(cls, d: dict) -> VariantResult:
        return cls(name=d["name"], settings=dict(d["settings"]), command=d["command"], log=d["log"],
                   result=None if d["result"] is None else BenchResult.from_json(d["result"]), error=d["error"],
                   startup_seconds=d["startup_seconds"], exit_code=d["exit_code"])


@dataclass
class ExperimentResult:
    """The same workload against each variant of a launched server."""
    meta: ExperimentMeta
    variants: list[VariantResult]

    KIND = "experiment"

    def to_json(self) -> dict:
        return {"format": FORMAT, "kind": self.KIND, "meta": self.meta.to_json(),
                "variants": [v.to_json() for v in self.variants]}

    @classmethod
    def from_json(cls, d: dict) -> ExperimentResult:
        return cls(meta=ExperimentMeta.from_json(d["meta"]),
                   variants=[VariantResult.from_json(v) for v in d["variants"]])


Result = BenchResult | ExperimentResult          # what a results.json holds


def result_from_json(d: dict) -> Result:
    """A results.json document of either kind."""
    if not isinstance(d, dict) or "kind" not in d:
        raise ValueError("not a kvflow bench results document (no \"kind\")")
    if d["kind"] == ExperimentResult.KIND:
        return ExperimentResult.from_json(d)
    if d["kind"] == BenchResult.KIND:
        return BenchResult.from_json(d)
    raise ValueError(f"unknown kind of kvflow bench results: {d['kind']!r}")
