"""The figures that sum up one run, as results.json holds them: the client's statistics of its requests
(`RunSummary`, made by stats.summarize) and the server's state read from /metrics (`ServerSummary`, made by
metrics_sampler.summarize_series).

Each class's to_json() writes the keys, in the order and with the values, that results.json has always had, and
from_json() reads them back. Where the file leaves a key out rather than writing null (the SLO and cost figures
without --slo / --cost-per-hour, a metric the server does not export), the class has an optional part that is None
when the key is absent, so that a result read back writes the same keys.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass
class Distribution:
    """One latency over a run's requests (over its tokens, for ITL), in milliseconds; None where there is no value."""
    count: int
    mean: float | None
    p50: float | None
    p90: float | None
    p95: float | None
    p99: float | None
    min: float | None
    max: float | None

    def to_json(self) -> dict:
        return asdict(self)          # the JSON keys are the fields, in their order

    @classmethod
    def from_json(cls, d: dict) -> Distribution:
        return cls(**d)


@dataclass
class SloOutcome:
    """How many requests met every SLO given (--slo); written into the summary as slo, goodput, good_requests,
    good_fraction."""
    limits: dict[str, float]         # seconds, by stats.SLO_KEYS name
    goodput: float | None            # requests meeting the SLO per second; None for a run of no duration
    good_requests: int
    good_fraction: float | None      # of all requests, failed ones included


@dataclass
class Cost:
    """What the run cost at the machine's price (--cost-per-hour)."""
    per_hour: float
    run_dollars: float
    per_million_output_tokens: float | None
    per_successful_request: float | None

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, d: dict) -> Cost:
        return cls(**d)


@dataclass
class RunSummary:
    """The client's view of one run: counts, throughput, latency distributions, goodput and cost."""
    num_requests: int
    completed: int
    failed: int
    errors_by_kind: dict[str, int]   # by client error kind ("timeout", "http_500", ...), sorted by kind
    duration_s: float
    total_input_tokens: int
    total_output_tokens: int
    request_throughput: float | None  # per second; None for a run of no duration
    input_throughput: float | None
    output_throughput: float | None
    total_token_throughput: float | None
    ttft_ms: Distribution
    tpot_ms: Distribution
    itl_ms: Distribution
    e2e_ms: Distribution
    mean_output_tokens: float | None  # per successful request; None when none succeeded
    mean_input_tokens: float | None
    slo: SloOutcome | None = None     # None: no SLO given
    cost: Cost | None = None          # None: no price given, or a run of no duration

    def to_json(self) -> dict:
        d = {
            "num_requests": self.num_requests,
            "completed": self.completed,
            "failed": self.failed,
            "errors_by_kind": dict(self.errors_by_kind),
            "duration_s": self.duration_s,
            "total_input_tokens": self.total_input_tokens,
            "total_output_tokens": self.total_output_tokens,
            "request_throughput": self.request_throughput,
            "input_throughput": self.input_throughput,
            "output_throughput": self.output_throughput,
            "total_token_throughput": self.total_token_throughput,
            "ttft_ms": self.ttft_ms.to_json(),
            "tpot_ms": self.tpot_ms.to_json(),
            "itl_ms": self.itl_ms.to_json(),
            "e2e_ms": self.e2e_ms.to_json(),
            "mean_output_tokens": self.mean_output_tokens,
            "mean_input_tokens": self.mean_input_tokens,
        }
        if self.slo is not None:
            d["slo"] = dict(self.slo.limits)
            d["goodput"] = self.slo.goodput
            d["good_requests"] = self.slo.good_requests
            d["good_fraction"] = self.slo.good_fraction
        if self.cost is not None:
            d["cost"] = self.cost.to_json()
        return d

    @classmethod
    def from_json(cls, d: dict) -> RunSummary:
        slo = None
        if "slo" in d:
            slo = SloOutcome(limits=dict(d["slo"]), goodput=d["goodput"], good_requests=d["good_requests"],
                             good_fraction=d["good_fraction"])
        return cls(
            num_requests=d["num_requests"], completed=d["completed"], failed=d["failed"],
            errors_by_kind=dict(d["errors_by_kind"]), duration_s=d["duration_s"],
            total_input_tokens=d["total_input_tokens"], total_output_tokens=d["total_output_tokens"],
            request_throughput=d["request_throughput"], input_throughput=d["input_throughput"],
            output_throughput=d["output_throughput"], total_token_throughput=d["total_token_throughput"],
            ttft_ms=Distribution.from_json(d["ttft_ms"]), tpot_ms=Distribution.from_json(d["tpot_ms"]),
            itl_ms=Distribution.from_json(d["itl_ms"]), e2e_ms=Distribution.from_json(d["e2e_ms"]),
            mean_output_tokens=d["mean_output_tokens"], mean_input_tokens=d["mean_input_tokens"],
            slo=slo, cost=Cost.from_json(d["cost"]) if "cost" in d else None)


# ---- the server's side -----------------------------------------------------------------------------------------

@dataclass
class GaugeStats:
    """A gauge over the run's /metrics samples (written as <name>_mean, <name>_max)."""
    mean: float
    max: float


@dataclass
class PrefixCacheStats:
    """The prefix cache's counters over the run (prefix_cache_queries, _hits, _hit_rate)."""
    queries: float
    hits: float
    hit_rate: float | None           # None when there was no query


@dataclass
class SpecDecodeStats:
    """Speculative decoding over the run, from vLLM's spec_decode counters (spec_decode_<field>)."""
    num_drafts: float
    num_draft_tokens: float
    num_accepted_tokens: float
    acceptance_rate: float | None           # accepted / draft tokens; None without draft tokens
    mean_accepted_length: float | None      # 1 + accepted tokens / drafts; None without drafts
    # accepted / drafts at each draft position; None: no per-position counter, or no draft
    acceptance_per_position: list[float | None] | None = None


@dataclass
class EngineBusy:
    """The fraction of the run the engine was busy (engine_busy_fraction) and what it was measured from
    (engine_busy_source)."""
    fraction: float
    source: str


def _gauge_from_json(d: dict, name: str) -> GaugeStats | None:
    return GaugeStats(d[f"{name}_mean"], d[f"{name}_max"]) if f"{name}_mean" in d else None


@dataclass
class ServerSummary:
    """The server's state over one run. Which parts a server has depends on the metrics it exports (vLLM's names,
    llama-server's, kvflow's own); a part it lacks is None and is left out of the JSON."""
    available: bool                  # False: no /metrics (none served, or it failed), and only `error` is set
    error: str | None = None         # why there are no metrics; None when there are, or none was ever sampled
    samples: int | None = None
    running: GaugeStats | None = None
    waiting: GaugeStats | None = None
    kv_cache_usage: GaugeStats | None = None
    resident_memory_bytes: GaugeStats | None = None
    prefix_cache: PrefixCacheStats | None = None
    preemptions: float | None = None
    spec_decode: SpecDecodeStats | None = None
    engine_busy: EngineBusy | None = None

    def _gauges(self) -> list[tuple[str, GaugeStats | None]]:
        """(JSON key prefix, gauge) in the order results.json writes them (metrics_sampler.GAUGES' order)."""
        return [("running", self.running), ("waiting", self.waiting), ("kv_cache_usage", self.kv_cache_usage),
                ("resident_memory_bytes", self.resident_memory_bytes)]

    def to_json(self) -> dict:
        if not self.available:
            return {"available": False, "error": self.error}
        d: dict = {"available": True, "samples": self.samples}
        for name, g in self._gauges():
            if g is not None:
                d[f"{name}_mean"] = g.mean
                d[f"{name}_max"] = g.max
        if self.prefix_cache is not None:
            d["prefix_cache_queries"] = self.prefix_cache.queries
            d["prefix_cache_hits"] = self.prefix_cache.hits
            d["prefix_cache_hit_rate"] = self.prefix_cache.hit_rate
        if self.preemptions is not None:
            d["preemptions"] = self.preemptions
        sd = self.spec_decode
        if sd is not None:
            d["spec_decode_num_drafts"] = sd.num_drafts
            d["spec_decode_num_draft_tokens"] = sd.num_draft_tokens
            d["spec_decode_num_accepted_tokens"] = sd.num_accepted_tokens
            d["spec_decode_acceptance_rate"] = sd.acceptance_rate
            d["spec_decode_mean_accepted_length"] = sd.mean_accepted_length
            if sd.acceptance_per_position is not None:
                d["spec_decode_acceptance_per_position"] = list(sd.acceptance_per_position)
        if self.engine_busy is not None:
            d["engine_busy_fraction"] = self.engine_busy.fraction
            d["engine_busy_source"] = self.engine_busy.source
        return d

    @classmethod
    def from_json(cls, d: dict) -> ServerSummary:
        if not d["available"]:
            return cls(available=False, error=d["error"])
        prefix = None
        if "prefix_cache_queries" in d:
            prefix = PrefixCacheStats(d["prefix_cache_queries"], d["prefix_cache_hits"], d["prefix_cache_hit_rate"])
        spec = None
        if "spec_decode_num_drafts" in d:
            per_pos = d.get("spec_decode_acceptance_per_position")
            spec = SpecDecodeStats(d["spec_decode_num_drafts"], d["spec_decode_num_draft_tokens"],
                                   d["spec_decode_num_accepted_tokens"], d["spec_decode_acceptance_rate"],
                                   d["spec_decode_mean_accepted_length"],
                                   None if per_pos is None else list(per_pos))
        busy = None
        if "engine_busy_fraction" in d:
            busy = EngineBusy(d["engine_busy_fraction"], d["engine_busy_source"])
        return cls(available=True, samples=d["samples"], running=_gauge_from_json(d, "running"),
                   waiting=_gauge_from_json(d, "waiting"), kv_cache_usage=_gauge_from_json(d, "kv_cache_usage"),
                   resident_memory_bytes=_gauge_from_json(d, "resident_memory_bytes"), prefix_cache=prefix,
                   preemptions=d.get("preemptions"), spec_decode=spec, engine_busy=busy)
