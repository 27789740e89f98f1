"""The report's figures as PNG bytes (matplotlib, Agg): latency CDFs, sweep curves, server time series, variant bars."""
from __future__ import annotations

import io
import math

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from kvflow.bench.result import RunResult  # noqa: E402


def _png(fig) -> bytes:
    buf = io.BytesIO()
    fig.tight_layout()
    fig.savefig(buf, format="png", dpi=90)
    plt.close(fig)
    return buf.getvalue()


def _cdf(ax, values_ms: list[float], label: str) -> None:
    if not values_ms:
        return
    xs = sorted(values_ms)
    ys = [(i + 1) / len(xs) for i in range(len(xs))]
    ax.step(xs, ys, where="post", label=label)


def latency_cdfs(columns: list[tuple[str, RunResult]]) -> bytes | None:
    """TTFT, TPOT, ITL and E2E CDFs, one line per run."""
    panels = [("TTFT", lambda r: [r.ttft] if r.ttft is not None else []),
              ("TPOT", lambda r: [r.tpot] if r.tpot is not None else []),
              ("ITL", lambda r: r.itls),
              ("E2E latency", lambda r: [r.e2e] if r.e2e is not None else [])]
    if not any(rec.success for _, run in columns for rec in run.records):
        return None
    fig, axes = plt.subplots(2, 2, figsize=(10, 7))
    for ax, (title, get) in zip(axes.flat, panels):
        for label, run in columns:
            # as results.json keeps them, so that a run's report and one drawn from its file are the same
            recs = [r.as_saved() for r in run.records if r.success]
            _cdf(ax, [v * 1000 for r in recs for v in get(r)], label)
        ax.set_title(f"{title} CDF")
        ax.set_xlabel("ms")
        ax.set_ylabel("fraction of requests" if title != "ITL" else "fraction of tokens")
        ax.grid(alpha=0.3)
        if len(columns) > 1 and ax.lines:
            ax.legend(fontsize=7)
    return _png(fig)


def sweep_curves(groups: list[tuple[str, list[RunResult]]], over: str) -> bytes | None:
    """Output throughput and p95 TTFT / E2E against the swept load, one line per group (variant)."""
    if not any(len(runs) > 1 for _, runs in groups):
        return None

    def x_of(run: RunResult) -> float:
        if over == "concurrency":
            return float(run.load.concurrency)
        rate = run.load.request_rate
        return math.nan if math.isinf(rate) else float(rate)       # "all at once" has no place on the axis

    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    for name, runs in groups:
        xs = [x_of(r) for r in runs]
        for ax, get in zip(axes, [lambda s: s.output_throughput, lambda s: s.ttft_ms.p95, lambda s: s.e2e_ms.p95]):
            ax.plot(xs, [get(r.summary) for r in runs], marker="o", label=name)
    for ax, title in zip(axes, ["output tokens/s", "p95 TTFT (ms)", "p95 E2E latency (ms)"]):
        ax.set_title(title)
        ax.set_xlabel(over)
        ax.grid(alpha=0.3)
        if len(groups) > 1:
            ax.legend(fontsize=7)
    return _png(fig)


def server_timeline(columns: list[tuple[str, RunResult]]) -> bytes | None:
    """KV-cache usage, running and waiting requests over the run, from /metrics samples."""
    if not any(run.server_series for _, run in columns):
        return None
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    for ax, key, title, scale in [(axes[0], "kv_cache_usage", "KV-cache usage (%)", 100.0),
                                  (axes[1], "running", "running requests", 1.0),
                                  (axes[2], "waiting", "waiting requests", 1.0)]:
        for label, run in columns:
            pts = [p for p in run.server_series if key in p]
            if pts:
                ax.plot([p["t"] for p in pts], [p[key] * scale for p in pts], label=label)
        ax.set_title(title)
        ax.set_xlabel("seconds into the run")
        ax.grid(alpha=0.3)
        if len(columns) > 1 and ax.lines:
            ax.legend(fontsize=7)
    return _png(fig)


def variant_bars(columns: list[tuple[str, RunResult]]) -> bytes | None:
    """Output throughput and p95 TTFT per variant, side by side."""
    if len(columns) < 2:
        return None
    names = [c for c, _ in columns]
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8))
    for ax, get, title in [(axes[0], lambda s: s.output_throughput or 0.0, "output tokens/s (higher is better)"),
                           (axes[1], lambda s: s.ttft_ms.p95 or 0.0, "p95 TTFT, ms (lower is better)")]:
        ax.bar(range(len(names)), [get(run.summary) for _, run in columns], color="tab:blue")
        ax.set_xticks(range(len(names)), names, rotation=20, ha="right", fontsize=8)
        ax.set_title(title)
        ax.grid(alpha=0.3, axis="y")
    return _png(fig)
