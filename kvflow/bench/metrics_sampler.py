"""Sample the server's Prometheus /metrics during a run (vLLM's names; kvflow adds a few). A server without
/metrics (llama.cpp's without --metrics, a stub) is fine: sampling stops after the first miss and the report says so.

Gauges are read as they are (summed over label sets); counters as their increase over the run.
Engine busy fraction: the increase of kvflow:step_duration_seconds_sum over the wall time when the server has
it, else the fraction of samples with at least one running request.
Speculative decoding (vLLM's spec_decode counters, present only when it is on): the acceptance rate is accepted
draft tokens / draft tokens, the mean accepted length 1 + accepted tokens / drafts (as vLLM's log line: tokens a
request gains per verifying step, the target's own token included), and per draft position the share of drafts
whose token there was accepted.
"""
from __future__ import annotations

import asyncio
import time

import httpx
from prometheus_client.parser import text_string_to_metric_families

from kvflow.bench.summary import EngineBusy, GaugeStats, PrefixCacheStats, ServerSummary, SpecDecodeStats

# vLLM's names first (kvflow, vLLM, SGLang's vLLM-compatible set), then llama.cpp's llama-server (--metrics);
# each gauge is summed up as a field of summary.ServerSummary of the same name
GAUGES = {
    "running": ("vllm:num_requests_running", "llamacpp:requests_processing"),
    "waiting": ("vllm:num_requests_waiting", "llamacpp:requests_deferred"),
    "kv_cache_usage": ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc", "llamacpp:kv_cache_usage_ratio"),
    "resident_memory_bytes": ("process_resident_memory_bytes", "kvflow:process_resident_memory_bytes"),
}
COUNTERS = {
    "prefix_cache_queries": ("vllm:prefix_cache_queries",),
    "prefix_cache_hits": ("vllm:prefix_cache_hits",),
    "preemptions": ("vllm:num_preemptions",),
    "step_seconds": ("kvflow:step_duration_seconds",),     # a histogram: its _sum
    "generation_tokens": ("vllm:generation_tokens", "llamacpp:tokens_predicted_total"),
    "spec_drafts": ("vllm:spec_decode_num_drafts",),
    "spec_draft_tokens": ("vllm:spec_decode_num_draft_tokens",),
    "spec_accepted_tokens": ("vllm:spec_decode_num_accepted_tokens",),
}
# labelled by "position": kept per position, as spec_accepted_pos_<j>
SPEC_PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"


def parse_metrics(text: str) -> dict[str, float]:
    """The fields of GAUGES and COUNTERS found in one /metrics page (first name that is present wins)."""
    values: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            name = s.name
            if fam.type in ("counter", "unknown", "untyped") and name.endswith("_total"):
                name = name[: -len("_total")]
            elif fam.type == "histogram":
                if not name.endswith("_sum"):
                    continue
                name = name[: -len("_sum")]
            if name == SPEC_PER_POS and "position" in s.labels:
                name = f"spec_accepted_pos_{s.labels['position']}"
            values[name] = values.get(name, 0.0) + float(s.value)
    out: dict[str, float] = {}
    for field, names in {**GAUGES, **COUNTERS}.items():
        for n in names:
            if n in values:
                out[field] = values[n]
                break
    out.update((k, v) for k, v in values.items() if k.startswith("spec_accepted_pos_"))
    return out


class MetricsSampler:
    """Fetch /metrics every `interval` seconds in the background; `series` holds {t, field: value} samples."""

    def __init__(self, root_url: str, interval: float = 0.5, t_zero: float | None = None):
        self.url = root_url.rstrip("/") + "/metrics"
        self.interval = interval
        self.t_zero = t_zero if t_zero is not None else time.perf_counter()
        self.series: list[dict] = []
        self.available: bool | None = None
        self.error: str | None = None
        self._task: asyncio.Task | None = None
        self._client: httpx.AsyncClient | None = None

    async def sample(self) -> dict | None:
        assert self._client is not None
        try:
            resp = await self._client.get(self.url)
            if resp.status_code != 200:
                raise ValueError(f"HTTP {resp.status_code}")
            values = parse_metrics(resp.text)
        except Exception as e:   # noqa: BLE001 - any failure means "no metrics", never a failed run
            if self.available is None:
                self.available, self.error = False, f"{type(e).__name__}: {e}"[:300]
            return None
        self.available = True
        point = {"t": time.perf_counter() - self.t_zero, **values}
        self.series.append(point)
        return point

    async def _loop(self) -> None:
        while True:
            await self.sample()
            if self.available is False:
                return
            await asyncio.sleep(self.interval)

    async def start(self) -> None:
        self._client = httpx.AsyncClient(timeout=5.0, trust_env=False)
        await self.sample()                  # the baseline for counters
        if self.available:
            self._task = asyncio.create_task(self._loop())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        if self.available:
            await self.sample()              # the final counters
        if self._client is not None:
            await self._client.aclose()

    def summary(self) -> ServerSummary:
        return summarize_series(self.series, self.available, self.error)


def _delta(series: list[dict], key: str) -> float | None:
    vals = [p[key] for p in series if key in p]
    return vals[-1] - vals[0] if len(vals) >= 2 else None


def _gauge(series: list[dict], key: str) -> GaugeStats | None:
    vals = [p[key] for p in series if key in p]
    return GaugeStats(mean=sum(vals) / len(vals), max=max(vals)) if vals else None


def summarize_series(series: list[dict], available: bool | None = True, error: str | None = None) -> ServerSummary:
    if not available or not series:
        return ServerSummary(available=False, error=error)
    prefix = None
    q, h = _delta(series, "prefix_cache_queries"), _delta(series, "prefix_cache_hits")
    if q is not None and h is not None:
        prefix = PrefixCacheStats(queries=q, hits=h, hit_rate=h / q if q > 0 else None)
    busy = None
    wall = series[-1]["t"] - series[0]["t"]
    step_seconds = _delta(series, "step_seconds")
    if step_seconds is not None and wall > 0:
        busy = EngineBusy(fraction=min(step_seconds / wall, 1.0), source="kvflow:step_duration_seconds")
    else:
        running = [p["running"] for p in series if "running" in p]
        if running:
            busy = EngineBusy(fraction=sum(1 for r in running if r > 0) / len(running),
                              source="samples with running > 0")
    return ServerSummary(available=True, samples=len(series), running=_gauge(series, "running"),
                         waiting=_gauge(series, "waiting"), kv_cache_usage=_gauge(series, "kv_cache_usage"),
                         resident_memory_bytes=_gauge(series, "resident_memory_bytes"), prefix_cache=prefix,
                         preemptions=_delta(series, "preemptions"), spec_decode=_spec_decode(series),
                         engine_busy=busy)


def _spec_decode(series: list[dict]) -> SpecDecodeStats | None:
    """The run's speculative decoding figures from vLLM's spec_decode counters; None when the server has none."""
    drafts, tokens = _delta(series, "spec_drafts"), _delta(series, "spec_draft_tokens")
    accepted = _delta(series, "spec_accepted_tokens")
    if drafts is None or tokens is None or accepted is None:
        return None
    per_position = None
    positions = sorted({int(k.rsplit("_", 1)[1]) for p in series for k in p
                        if k.startswith("spec_accepted_pos_") and k.rsplit("_", 1)[1].isdigit()})
    if positions and drafts > 0:
        per_pos = [_delta(series, f"spec_accepted_pos_{j}") for j in positions]
        per_position = [None if a is None else a / drafts for a in per_pos]
    return SpecDecodeStats(num_drafts=drafts, num_draft_tokens=tokens, num_accepted_tokens=accepted,
                           acceptance_rate=accepted / tokens if tokens > 0 else None,
                           mean_accepted_length=1.0 + accepted / drafts if drafts > 0 else None,
                           acceptance_per_position=per_position)
