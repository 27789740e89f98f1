"""Statistics of one run: throughput, latency percentiles, goodput, errors.

Definitions (as vLLM's benchmark_serving defines them):
- duration: from the first request's send to the last request's end;
- TTFT: send to first content token; E2E: send to end of stream;
- TPOT, per request with >= 2 output tokens: (last token time - TTFT) / (output tokens - 1);
- ITL: every gap between consecutive output tokens of a request, all requests pooled (see client.py for how
  multi-token chunks are spread);
- goodput: successful requests per second that meet every SLO given (a request with one output token has no
  TPOT and meets any TPOT SLO).
Percentiles interpolate linearly between order statistics (numpy's default).
"""
from __future__ import annotations

import math
import re
from collections import Counter

from kvflow.bench.client import RequestRecord
from kvflow.bench.summary import Cost, Distribution, RunSummary, SloOutcome

SLO_KEYS = ("ttft", "tpot", "itl", "e2e")


def percentile(values: list[float], p: float) -> float | None:
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * p / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def distribution(values_s: list[float]) -> Distribution:
    """mean / p50 / p90 / p95 / p99 / min / max in milliseconds (None when there are no values)."""
    ms = [v * 1000.0 for v in values_s]
    return Distribution(count=len(values_s), mean=sum(ms) / len(ms) if ms else None,
                        p50=percentile(ms, 50), p90=percentile(ms, 90), p95=percentile(ms, 95), p99=percentile(ms, 99),
                        min=min(ms) if ms else None, max=max(ms) if ms else None)


def parse_slo(text: str | None) -> dict[str, float]:
    """'ttft=500ms,tpot=0.05' -> {'ttft': 0.5, 'tpot': 0.05} (seconds; 'ms' and 's' suffixes allowed)."""
    if not text:
        return {}
    slo = {}
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        m = re.fullmatch(r"(\w+)\s*[=:]\s*([0-9.]+(?:e-?\d+)?)\s*(ms|s)?", part)
        if not m or m.group(1).lower() not in SLO_KEYS:
            raise ValueError(f"bad --slo item {part!r}: expected e.g. ttft=500ms,tpot=50ms "
                             f"(keys: {', '.join(SLO_KEYS)})")
        value = float(m.group(2)) / (1000.0 if m.group(3) == "ms" else 1.0)
        slo[m.group(1).lower()] = value
    return slo


def meets_slo(rec: RequestRecord, slo: dict[str, float]) -> bool:
    if not rec.success:
        return False
    if "ttft" in slo and (rec.ttft is None or rec.ttft > slo["ttft"]):
        return False
    if "tpot" in slo and (rec.tpot or 0.0) > slo["tpot"]:
        return False
    if "itl" in slo and rec.itls and max(rec.itls) > slo["itl"]:
        return False
    if "e2e" in slo and (rec.e2e is None or rec.e2e > slo["e2e"]):
        return False
    return True


def run_duration(records: list[RequestRecord]) -> float:
    if not records:
        return 0.0
    start = min(r.send_time for r in records)
    end = max(r.send_time + (r.e2e or 0.0) for r in records)
    return max(end - start, 0.0)


def summarize(records: list[RequestRecord], slo: dict[str, float] | None = None,
              cost_per_hour: float | None = None, duration: float | None = None) -> RunSummary:
    slo = slo or {}
    ok = [r for r in records if r.success]
    failed = [r for r in records if not r.success]
    dur = run_duration(records) if duration is None else duration
    rate = (lambda x: x / dur) if dur > 0 else (lambda x: None)
    in_tok = sum(r.prompt_tokens or 0 for r in ok)
    out_tok = sum(r.output_tokens for r in ok)
    outcome = None
    if slo:
        good = sum(meets_slo(r, slo) for r in records)
        outcome = SloOutcome(limits=dict(slo), goodput=rate(good), good_requests=good,
                             good_fraction=good / len(records) if records else None)
    cost = None
    if cost_per_hour is not None and dur > 0:
        dollars = cost_per_hour * dur / 3600.0
        cost = Cost(per_hour=cost_per_hour, run_dollars=dollars,
                    per_million_output_tokens=dollars / out_tok * 1e6 if out_tok else None,
                    per_successful_request=dollars / len(ok) if ok else None)
    return RunSummary(
        num_requests=len(records),
        completed=len(ok),
        failed=len(failed),
        errors_by_kind=dict(sorted(Counter(r.error_kind for r in failed).items())),
        duration_s=dur,
        total_input_tokens=in_tok,
        total_output_tokens=out_tok,
        request_throughput=rate(len(ok)),
        input_throughput=rate(in_tok),
        output_throughput=rate(out_tok),
        total_token_throughput=rate(in_tok + out_tok),
        ttft_ms=distribution([r.ttft for r in ok if r.ttft is not None]),
        tpot_ms=distribution([r.tpot for r in ok if r.tpot is not None]),
        itl_ms=distribution([x for r in ok for x in r.itls]),
        e2e_ms=distribution([r.e2e for r in ok if r.e2e is not None]),
        mean_output_tokens=out_tok / len(ok) if ok else None,
        mean_input_tokens=in_tok / len(ok) if ok else None,
        slo=outcome,
        cost=cost,
    )
