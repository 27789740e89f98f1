"""Reports from a typed result (result.BenchResult or ExperimentResult): the metric table, plain-language findings,
Markdown, self-contained HTML, JSON."""
from __future__ import annotations

import base64
import html
import json
import math
from pathlib import Path
from typing import Callable

from kvflow.bench import plots
from kvflow.bench.result import (BenchMeta, CommandSettings, ExperimentResult, Result, RunResult, VariantResult,
                                 result_from_json)
from kvflow.bench.summary import Distribution

Getter = Callable[[RunResult], float | None]


def _part(part: Callable, value: Callable) -> Getter:
    """value(part(run)), or None where the run lacks that part (no SLO or price given, a metric the server does not
    export)."""
    def get(run: RunResult):
        p = part(run)
        return None if p is None else value(p)
    return get


_DISTRIBUTIONS: list[tuple[str, Callable[[RunResult], Distribution]]] = [
    ("TTFT", lambda r: r.summary.ttft_ms), ("TPOT", lambda r: r.summary.tpot_ms),
    ("ITL", lambda r: r.summary.itl_ms), ("E2E", lambda r: r.summary.e2e_ms)]
_STATS: list[tuple[str, Callable[[Distribution], float | None]]] = [
    ("mean", lambda d: d.mean), ("p50", lambda d: d.p50), ("p90", lambda d: d.p90), ("p95", lambda d: d.p95),
    ("p99", lambda d: d.p99)]

# (row name, the value of a run, format, better): better is "higher", "lower" or None (no ratio meaning)
DIST_ROWS = [(f"{name} {stat} (ms)", _part(dist, value), "{:.1f}", "lower")
             for name, dist in _DISTRIBUTIONS for stat, value in _STATS]
METRIC_ROWS: list[tuple[str, Getter, str, str | None]] = [
    ("Completed requests", lambda r: r.summary.completed, "{:d}", "higher"),
    ("Failed requests", lambda r: r.summary.failed, "{:d}", "lower"),
    ("Duration (s)", lambda r: r.summary.duration_s, "{:.2f}", None),
    ("Request throughput (req/s)", lambda r: r.summary.request_throughput, "{:.2f}", "higher"),
    ("Input token throughput (tok/s)", lambda r: r.summary.input_throughput, "{:.1f}", "higher"),
    ("Output token throughput (tok/s)", lambda r: r.summary.output_throughput, "{:.1f}", "higher"),
    ("Total token throughput (tok/s)", lambda r: r.summary.total_token_throughput, "{:.1f}", "higher"),
    ("Goodput (req/s)", _part(lambda r: r.summary.slo, lambda o: o.goodput), "{:.2f}", "higher"),
    ("Requests meeting the SLO (%)", _part(lambda r: r.summary.slo, lambda o: o.good_fraction), "pct", "higher"),
    ("Mean input tokens", lambda r: r.summary.mean_input_tokens, "{:.1f}", None),
    ("Mean output tokens", lambda r: r.summary.mean_output_tokens, "{:.1f}", None),
    *DIST_ROWS,
    ("Running requests, mean", _part(lambda r: r.server.running, lambda g: g.mean), "{:.1f}", None),
    ("Running requests, max", _part(lambda r: r.server.running, lambda g: g.max), "{:.0f}", None),
    ("Waiting requests, mean", _part(lambda r: r.server.waiting, lambda g: g.mean), "{:.1f}", "lower"),
    ("Waiting requests, max", _part(lambda r: r.server.waiting, lambda g: g.max), "{:.0f}", "lower"),
    ("KV-cache usage, mean (%)", _part(lambda r: r.server.kv_cache_usage, lambda g: g.mean), "pct", None),
    ("KV-cache usage, max (%)", _part(lambda r: r.server.kv_cache_usage, lambda g: g.max), "pct", None),
    ("Prefix-cache hit rate (%)", _part(lambda r: r.server.prefix_cache, lambda c: c.hit_rate), "pct", "higher"),
    ("Preemptions", lambda r: r.server.preemptions, "{:.0f}", "lower"),
    ("Spec decode acceptance rate (%)", _part(lambda r: r.server.spec_decode, lambda s: s.acceptance_rate), "pct",
     "higher"),
    ("Spec decode mean accepted length", _part(lambda r: r.server.spec_decode, lambda s: s.mean_accepted_length),
     "{:.2f}", "higher"),
    ("Spec decode drafts", _part(lambda r: r.server.spec_decode, lambda s: s.num_drafts), "{:.0f}", None),
    ("Spec decode draft tokens", _part(lambda r: r.server.spec_decode, lambda s: s.num_draft_tokens), "{:.0f}",
     None),
    ("Spec decode accepted tokens", _part(lambda r: r.server.spec_decode, lambda s: s.num_accepted_tokens),
     "{:.0f}", "higher"),
    ("Server resident memory, max (MiB)", _part(lambda r: r.server.resident_memory_bytes, lambda g: g.max), "mib",
     "lower"),
    ("Engine busy (%)", _part(lambda r: r.server.engine_busy, lambda b: b.fraction), "pct", None),
    ("Client CPU (% of one core)", lambda r: r.client.cpu_fraction, "pct", None),
    ("Cost per million output tokens ($)", _part(lambda r: r.summary.cost, lambda c: c.per_million_output_tokens),
     "{:.4f}", "lower"),
    ("Cost per successful request ($)", _part(lambda r: r.summary.cost, lambda c: c.per_successful_request),
     "{:.6f}", "lower"),
]


def fmt(value, spec: str) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "–"
    if spec == "pct":
        return f"{value * 100:.1f}"
    if spec == "mib":
        return f"{value / 2**20:.0f}"
    if spec == "{:d}":
        return f"{int(value):d}"
    return spec.format(value)


def columns_of(result: Result) -> list[tuple[str, RunResult]]:
    """(label, run) for every run of a bench result, or of every variant of an experiment."""
    if isinstance(result, ExperimentResult):
        cols = []
        for v in result.variants:
            runs = v.result.runs if v.result is not None else []
            for run in runs:
                cols.append((v.name if len(runs) == 1 else f"{v.name} {run.label}", run))
        return cols
    return [(run.label, run) for run in result.runs]


def table_rows(columns: list[tuple[str, RunResult]]) -> list[list[str]]:
    """Header row then one row per metric that at least one column has."""
    rows = [["Metric"] + [c for c, _ in columns]]
    for name, value, spec, _ in METRIC_ROWS:
        vals = [value(run) for _, run in columns]
        if all(v is None for v in vals):
            continue
        rows.append([name] + [fmt(v, spec) for v in vals])
    errors = [", ".join(f"{k}: {n}" for k, n in run.summary.errors_by_kind.items()) or "none" for _, run in columns]
    rows.append(["Errors by kind"] + errors)
    return rows


def _ratio(a, b) -> str:
    if a is None or b is None or a == 0:
        return "–"
    return f"{b / a:.2f}×"


def compare_rows(columns: list[tuple[str, RunResult]]) -> list[list[str]]:
    """Like table_rows, with a ratio column (to the first column) after every other column."""
    base_label = columns[0][0]
    header = ["Metric", base_label]
    for label, _ in columns[1:]:
        header += [label, f"÷ {base_label}"]
    rows = [header]
    for name, value, spec, _ in METRIC_ROWS:
        vals = [value(run) for _, run in columns]
        if all(v is None for v in vals):
            continue
        row = [name, fmt(vals[0], spec)]
        for v in vals[1:]:
            row += [fmt(v, spec), _ratio(vals[0], v)]
        rows.append(row)
    return rows


def markdown_table(rows: list[list[str]]) -> str:
    out = ["| " + " | ".join(rows[0]) + " |", "|" + "---|" * len(rows[0])]
    out += ["| " + " | ".join(c.replace("|", "\\|") for c in r) + " |" for r in rows[1:]]
    return "\n".join(out)


def html_table(rows: list[list[str]]) -> str:
    head = "".join(f"<th>{html.escape(c)}</th>" for c in rows[0])
    body = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in r) + "</tr>" for r in rows[1:])
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


# ---- findings --------------------------------------------------------------------------------------------------

def _ttft_p95(run: RunResult) -> float | None:
    return run.summary.ttft_ms.p95


def _e2e_p95(run: RunResult) -> float | None:
    return run.summary.e2e_ms.p95


_goodput = _part(lambda r: r.summary.slo, lambda o: o.goodput)
_cost_per_million = _part(lambda r: r.summary.cost, lambda c: c.per_million_output_tokens)


def findings(result: Result) -> list[str]:
    """Plain-language conclusions, each backed by the numbers."""
    cols = columns_of(result)
    out: list[str] = []
    if not cols:
        return ["No run completed."]
    for label, run in cols:
        cpu = run.client.cpu_fraction
        if cpu is not None and cpu > 0.8:
            out.append(f"Warning: the client used {cpu:.0%} of a CPU core in `{label}`: it may have limited the "
                       "load it could offer; the numbers there are a lower bound on the server's capacity.")
    failed = [(label, run.summary) for label, run in cols if run.summary.failed]
    for label, s in failed:
        kinds = ", ".join(f"{k} ×{n}" for k, n in s.errors_by_kind.items())
        out.append(f"`{label}`: {s.failed} of {s.num_requests} requests failed ({kinds}).")
    ok = [(label, run) for label, run in cols if run.summary.output_throughput]
    if not ok:
        out.append("No run produced output tokens.")
        return out
    if len(ok) == 1:
        label, run = ok[0]
        s = run.summary
        out.append(f"`{label}`: {s.output_throughput:.1f} output tokens/s, {s.request_throughput:.2f} "
                   f"requests/s, p95 TTFT {fmt(s.ttft_ms.p95, '{:.0f}')} ms, p95 E2E "
                   f"{fmt(s.e2e_ms.p95, '{:.0f}')} ms.")
        return out + _spec_findings(cols)

    by_tput = sorted(ok, key=lambda c: -c[1].summary.output_throughput)
    (bl, br), (wl, wr) = by_tput[0], by_tput[-1]
    bt, wt = br.summary.output_throughput, wr.summary.output_throughput
    out.append(f"Highest throughput: `{bl}` with {bt:.1f} output tokens/s, {bt / wt:.2f}× the lowest, "
               f"`{wl}` ({wt:.1f} tokens/s).")
    with_ttft = [c for c in ok if _ttft_p95(c[1]) is not None]
    best_ttft = None
    if len(with_ttft) >= 2:
        by_ttft = sorted(with_ttft, key=lambda c: _ttft_p95(c[1]))
        (tl, tr), (sl, sr) = by_ttft[0], by_ttft[-1]
        a, b = _ttft_p95(tr), _ttft_p95(sr)
        best_ttft = tl
        ratio = f", {b / a:.2f}× lower than" if a > 0 else ", versus"
        out.append(f"Lowest p95 time to first token: `{tl}` at {a:.0f} ms{ratio} `{sl}` ({b:.0f} ms).")
    with_e2e = [c for c in ok if _e2e_p95(c[1]) is not None]
    if len(with_e2e) >= 2:
        el, er = min(with_e2e, key=lambda c: _e2e_p95(c[1]))
        out.append(f"Lowest p95 end-to-end latency: `{el}` at {_e2e_p95(er):.0f} ms.")
    if best_ttft is not None:
        if best_ttft == bl:
            out.append(f"`{bl}` is best on both throughput and p95 TTFT.")
        else:
            out.append(f"No variant wins both: `{bl}` gives the most throughput, `{best_ttft}` the fastest first "
                       "token; pick by which one your users feel.")
    good = [c for c in ok if _goodput(c[1]) is not None]
    if good:
        gl, gr = max(good, key=lambda c: _goodput(c[1]))
        out.append(f"Most goodput under the SLO: `{gl}` with {gr.summary.slo.goodput:.2f} requests/s "
                   f"({gr.summary.slo.good_fraction:.0%} of its requests met it).")
    costed = [c for c in ok if _cost_per_million(c[1]) is not None]
    if costed:
        price = costed[0][1].summary.cost.per_hour
        parts = ", ".join(f"`{lab}` ${_cost_per_million(r):.3f}"
                          for lab, r in sorted(costed, key=lambda c: _cost_per_million(c[1])))
        out.append(f"Cost at ${price:g}/hour, per million output tokens: {parts}.")
    out += _spec_findings(cols)
    pre = [(lab, r.server.preemptions) for lab, r in cols if r.server.preemptions]
    if pre:
        out.append("Preemptions (KV cache full, requests recomputed): "
                   + ", ".join(f"`{lab}` {n:.0f}" for lab, n in pre) + ".")
    if not failed:
        out.append("No request failed in any run.")
    return out


def _spec_findings(cols: list[tuple[str, RunResult]]) -> list[str]:
    """One line per run whose server reports speculative decoding (vLLM's spec_decode counters)."""
    out = []
    for label, run in cols:
        sd = run.server.spec_decode
        if sd is None:
            continue
        if not sd.num_drafts:
            out.append(f"Speculative decoding in `{label}`: no drafts (nothing to propose, or every step above "
                       "disable_by_batch_size).")
            continue
        per_pos = sd.acceptance_per_position or []
        pos = (" (accepted at draft position " + ", ".join(f"{j + 1}: {fmt(a, 'pct')}%" for j, a in enumerate(per_pos))
               + ")") if per_pos else ""
        out.append(f"Speculative decoding in `{label}`: acceptance rate "
                   f"{fmt(sd.acceptance_rate, 'pct')}%, mean accepted length "
                   f"{fmt(sd.mean_accepted_length, '{:.2f}')} tokens per verifying step, "
                   f"{sd.num_drafts:.0f} drafts of {sd.num_draft_tokens:.0f} tokens"
                   f"{pos}.")
    return out


# ---- documents -------------------------------------------------------------------------------------------------

def _settings_of(result: Result) -> BenchMeta | CommandSettings:
    return result.meta.common if isinstance(result, ExperimentResult) else result.meta


def _meta_lines(result: Result) -> list[tuple[str, str]]:
    m = _settings_of(result)
    server = result.meta.launch if isinstance(result, ExperimentResult) else result.meta.base_url
    bench = m if isinstance(m, BenchMeta) else None      # None: no variant of the experiment ran
    lines = [("Command", f"`{m.command}`"),
             ("Model", str(m.model)),
             ("Server", f"{server} (version {json.dumps(bench.server_version if bench else None)})"),
             ("API", str(m.api)),
             ("Workload", ", ".join(f"{k}={v}" for k, v in [("name", m.workload.name), *m.workload.params.items()])),
             ("Seed", str(m.seed)),
             ("ignore_eos", str(bench.ignore_eos if bench else None)),
             ("kvflow", str(bench.kvflow_version if bench else None)),
             ("Started / finished", f"{m.started_at} / {m.finished_at}")]
    if bench and bench.slo:
        lines.append(("SLO", ", ".join(f"{k} ≤ {v * 1000:g} ms" for k, v in bench.slo.items())))
    if bench and bench.cost_per_hour is not None:
        lines.append(("Machine price", f"${bench.cost_per_hour:g}/hour"))
    return lines


def _server_notes(cols: list[tuple[str, RunResult]]) -> list[str]:
    notes = []
    for label, run in cols:
        if not run.server.available:
            notes.append(f"`{label}`: no server metrics ({run.server.error or 'no /metrics'}).")
    return notes


def title_of(result: Result) -> str:
    if isinstance(result, ExperimentResult):
        flags = ", ".join(result.meta.varied)
        return f"kvflow bench: optimization experiment ({flags})"
    return "kvflow bench report"


def _variant_state(v: VariantResult) -> str:
    return "ok" if v.result is not None else f"failed: {v.error}"


def markdown_report(result: Result) -> str:
    cols = columns_of(result)
    parts = [f"# {title_of(result)}", ""]
    parts += [f"- **{k}**: {v}" for k, v in _meta_lines(result)]
    if isinstance(result, ExperimentResult):
        parts += ["", "## Variants", ""]
        for v in result.variants:
            parts.append(f"- `{v.name}`: `{v.command}` (startup {fmt(v.startup_seconds, '{:.1f}')} s,"
                         f" {_variant_state(v)})")
    parts += ["", "## Results", "", markdown_table(table_rows(cols)) if cols else "_no run completed_"]
    notes = _server_notes(cols)
    if notes:
        parts += [""] + [f"- {n}" for n in notes]
    parts += ["", "## Findings", ""] + [f"- {f}" for f in findings(result)]
    return "\n".join(parts) + "\n"


CSS = """body{font-family:system-ui,sans-serif;margin:2em;max-width:1200px;color:#222}
table{border-collapse:collapse;margin:1em 0;font-size:14px}th,td{border:1px solid #ccc;padding:3px 8px;text-align:right}
th:first-child,td:first-child{text-align:left}thead{background:#f0f0f0}img{max-width:100%;margin:1em 0}
code{background:#f4f4f4;padding:1px 4px}"""


def _md_inline(text: str) -> str:
    """Escape, then turn `code` spans into <code>."""
    parts = html.escape(text).split("`")
    return "".join(f"<code>{p}</code>" if i % 2 else p for i, p in enumerate(parts))


def figures(result: Result) -> list[tuple[str, bytes]]:
    cols = columns_of(result)
    out = []
    if isinstance(result, ExperimentResult):
        groups = [(v.name, v.result.runs) for v in result.variants if v.result is not None]
        png = plots.variant_bars(cols)
        if png:
            out.append(("Variants side by side", png))
    else:
        groups = [("runs", result.runs)]
    settings = _settings_of(result)
    sweep = settings.sweep if isinstance(settings, BenchMeta) else None
    if sweep:
        png = plots.sweep_curves(groups, sweep.over)
        if png:
            out.append((f"Throughput and p95 latency against {sweep.over}", png))
    png = plots.latency_cdfs(cols)
    if png:
        out.append(("Latency CDFs", png))
    png = plots.server_timeline(cols)
    if png:
        out.append(("Server state over time (from /metrics)", png))
    return out


def html_report(result: Result) -> str:
    cols = columns_of(result)
    title = title_of(result)
    body = [f"<h1>{html.escape(title)}</h1>", "<ul>"]
    body += [f"<li><b>{html.escape(k)}</b>: {_md_inline(v)}</li>" for k, v in _meta_lines(result)]
    body.append("</ul>")
    if isinstance(result, ExperimentResult):
        body.append("<h2>Variants</h2><ul>")
        for v in result.variants:
            body.append(f"<li><code>{html.escape(v.name)}</code>: <code>{html.escape(v.command)}</code> "
                        f"({html.escape(_variant_state(v))})</li>")
        body.append("</ul>")
    body.append("<h2>Findings</h2><ul>")
    body += [f"<li>{_md_inline(f)}</li>" for f in findings(result)]
    body.append("</ul><h2>Results</h2>")
    body.append(html_table(table_rows(cols)) if cols else "<p>No run completed.</p>")
    notes = _server_notes(cols)
    if notes:
        body.append("<ul>" + "".join(f"<li>{_md_inline(n)}</li>" for n in notes) + "</ul>")
    for caption, png in figures(result):
        b64 = base64.b64encode(png).decode("ascii")
        body.append(f"<h2>{html.escape(caption)}</h2><img alt=\"{html.escape(caption)}\" "
                    f"src=\"data:image/png;base64,{b64}\">")
    return (f"<!DOCTYPE html>\n<html><head><meta charset=\"utf-8\"><title>{html.escape(title)}</title>"
            f"<style>{CSS}</style></head><body>\n" + "\n".join(body) + "\n</body></html>\n")


def write_reports(result: Result, output_dir: Path) -> dict[str, Path]:
    """results.json (every record), report.md, report.html in output_dir."""
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    paths = {"json": output_dir / "results.json", "markdown": output_dir / "report.md",
             "html": output_dir / "report.html"}
    paths["json"].write_text(json.dumps(result.to_json(), indent=1, allow_nan=False, default=_json_default))
    paths["markdown"].write_text(markdown_report(result))
    paths["html"].write_text(html_report(result))
    return paths


def _json_default(o):
    raise TypeError(f"not JSON serializable: {type(o).__name__}")


def load_result(path: str | Path) -> Result:
    """A results.json file (or the folder that holds one), read into its typed result."""
    path = Path(path)
    if path.is_dir():
        path = path / "results.json"
    if not path.is_file():
        raise FileNotFoundError(f"no such results file: {path}")
    document = json.loads(path.read_text())
    if not isinstance(document, dict) or "kind" not in document:
        raise ValueError(f"{path} is not a kvflow bench results file")
    return result_from_json(document)


def compare_report(paths: list[str | Path]) -> str:
    """Side-by-side Markdown table of several results files, with ratios to the first."""
    if len(paths) < 2:
        raise ValueError("compare needs at least two results files")
    cols: list[tuple[str, RunResult]] = []
    for p in paths:
        result = load_result(p)
        stem = Path(p).parent.name if Path(p).name == "results.json" else Path(p).stem
        file_cols = columns_of(result)
        for label, run in file_cols:
            cols.append((stem if len(file_cols) == 1 else f"{stem}: {label}", run))
    lines = ["# kvflow bench compare", ""]
    lines += [f"- `{p}`" for p in paths]
    lines += ["", "Ratios are each column divided by the first.", "", markdown_table(compare_rows(cols))]
    return "\n".join(lines) + "\n"
