"""vLLM's per-request timings (`--enable-per-request-metrics`): a response's `metrics` object, from the timestamps
the output processor already keeps for /metrics' histograms (kvflow.metrics.RequestTimings), as vLLM builds it from
its RequestStateStats (build_per_request_timing_metrics): the same intervals, in milliseconds."""
from __future__ import annotations

from kvflow.metrics import RequestTimings
from kvflow.server.serving.generation import Generation
from kvflow.server.serving.protocol import PerRequestTimingMetrics


def timing_metrics(t: RequestTimings, num_generated: int) -> PerRequestTimingMetrics:
    """One choice's timings; a field is None when a timestamp it needs was never taken."""
    ms = 1000.0
    out = PerRequestTimingMetrics()
    if t.scheduled is not None and t.first_token is not None:
        out.time_to_first_token_ms = (t.first_token - t.scheduled) * ms
    if t.first_token is not None and t.last_token is not None:
        out.generation_time_ms = (t.last_token - t.first_token) * ms
        if num_generated > 1:
            out.mean_itl_ms = (t.last_token - t.first_token) / (num_generated - 1) * ms
    out.queue_time_ms = None if t.queue_time is None else t.queue_time * ms
    if t.scheduled is not None and t.last_token is not None and t.last_token > t.scheduled:
        out.tokens_per_second = num_generated / (t.last_token - t.scheduled)
    return out


def request_metrics(gen: Generation) -> dict:
    """The `metrics` field of a response or of a stream's usage chunk: {} unless the server reports them for this
    request. As vLLM: one choice only (with n > 1 the timings are one choice's, not the request's)."""
    if not gen.per_request_metrics or gen.num_choices != 1:
        return {}
    s = gen.streams[0]
    return {"metrics": timing_metrics(s.choices[0].timings, s.num_completion_tokens)}
