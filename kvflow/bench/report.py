"""Reports from a result dict: the metric table, plain-language findings, Markdown, self-contained HTML, JSON."""
from __future__ import annotations

import base64
import html
import json
import math
from pathlib import Path

from kvflow.bench import plots

# (row name, path into a run, format, better): better is "higher", "lower" or None (no ratio meaning)
DIST_ROWS = [(f"{name} {stat} (ms)", (key, stat), "{:.1f}", "lower")
             for name, key in [("TTFT", "ttft_ms"), ("TPOT", "tpot_ms"), ("ITL", "itl_ms"), ("E2E", "e2e_ms")]
             for stat in ("mean", "p50", "p90", "p95", "p99")]
METRIC_ROWS = [
    ("Completed requests", ("summary", "completed"), "{:d}", "higher"),
    ("Failed requests", ("summary", "failed"), "{:d}", "lower"),
    ("Duration (s)", ("summary", "duration_s"), "{:.2f}", None),
    ("Request throughput (req/s)", ("summary", "request_throughput"), "{:.2f}", "higher"),
    ("Input token throughput (tok/s)", ("summary", "input_throughput"), "{:.1f}", "higher"),
    ("Output token throughput (tok/s)", ("summary", "output_throughput"), "{:.1f}", "higher"),
    ("Total token throughput (tok/s)", ("summary", "total_token_throughput"), "{:.1f}", "higher"),
    ("Goodput (req/s)", ("summary", "goodput"), "{:.2f}", "higher"),
    ("Requests meeting the SLO (%)", ("summary", "good_fraction"), "pct", "higher"),
    ("Mean input tokens", ("summary", "mean_input_tokens"), "{:.1f}", None),
    ("Mean output tokens", ("summary", "mean_output_tokens"), "{:.1f}", None),
    *[(n, ("summary",) + p, f, b) for n, p, f, b in DIST_ROWS],
    ("Running requests, mean", ("server", "running_mean"), "{:.1f}", None),
    ("Running requests, max", ("server", "running_max"), "{:.0f}", None),
    ("Waiting requests, mean", ("server", "waiting_mean"), "{:.1f}", "lower"),
    ("Waiting requests, max", ("server", "waiting_max"), "{:.0f}", "lower"),
    ("KV-cache usage, mean (%)", ("server", "kv_cache_usage_mean"), "pct", None),
    ("KV-cache usage, max (%)", ("server", "kv_cache_usage_max"), "pct", None),
    ("Prefix-cache hit rate (%)", ("server", "prefix_cache_hit_rate"), "pct", "higher"),
    ("Preemptions", ("server", "preemptions"), "{:.0f}", "lower"),
    ("Spec decode acceptance rate (%)", ("server", "spec_decode_acceptance_rate"), "pct", "higher"),
    ("Spec decode mean accepted length", ("server", "spec_decode_mean_accepted_length"), "{:.2f}", "higher"),
    ("Spec decode drafts", ("server", "spec_decode_num_drafts"), "{:.0f}", None),
    ("Spec decode draft tokens", ("server", "spec_decode_num_draft_tokens"), "{:.0f}", None),
    ("Spec decode accepted tokens", ("server", "spec_decode_num_accepted_tokens"), "{:.0f}", "higher"),
    ("Server resident memory, max (MiB)", ("server", "resident_memory_bytes_max"), "mib", "lower"),
    ("Engine busy (%)", ("server", "engine_busy_fraction"), "pct", None),
    ("Client CPU (% of one core)", ("client", "cpu_fraction"), "pct", None),
    ("Cost per million output tokens ($)", ("summary", "cost", "per_million_output_tokens"), "{:.4f}", "lower"),
    ("Cost per successful request ($)", ("summary", "cost", "per_successful_request"), "{:.6f}", "lower"),
]


def get_path(run: dict, path: tuple) -> float | None:
    cur = run
    for p in path:
        if not isinstance(cur, dict) or p not in cur:
            return None
        cur = cur[p]
    return cur if isinstance(cur, (int, float)) and not isinstance(cur, bool) else None


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


def columns_of(result: dict) -> list[tuple[str, dict]]:
    """(label, run) for every run of a bench result, or of every variant of an experiment."""
    if result.get("kind") == "experiment":
        cols = []
        for v in result["variants"]:
            runs = v["result"]["runs"] if v.get("result") else []
            for run in runs:
                cols.append((v["name"] if len(runs) == 1 else f"{v['name']} {run['label']}", run))
        return cols
    return [(run["label"], run) for run in result["runs"]]


def table_rows(columns: list[tuple[str, dict]]) -> list[list[str]]:
    """Header row then one row per metric that at least one column has."""
    rows = [["Metric"] + [c for c, _ in columns]]
    for name, path, spec, _ in METRIC_ROWS:
        vals = [get_path(run, path) for _, run in columns]
        if all(v is None for v in vals):
            continue
        rows.append([name] + [fmt(v, spec) for v in vals])
    errors = [", ".join(f"{k}: {n}" for k, n in run["summary"].get("errors_by_kind", {}).items()) or "none"
              for _, run in columns]
    rows.append(["Errors by kind"] + errors)
    return rows


def _ratio(a, b) -> str:
    if a is None or b is None or a == 0:
        return "–"
    return f"{b / a:.2f}×"


def compare_rows(columns: list[tuple[str, dict]]) -> list[list[str]]:
    """Like table_rows, with a ratio column (to the first column) after every other column."""
    base_label = columns[0][0]
    header = ["Metric", base_label]
    for label, _ in columns[1:]:
        header += [label, f"÷ {base_label}"]
    rows = [header]
    for name, path, spec, _ in METRIC_ROWS:
        vals = [get_path(run, path) for _, run in columns]
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

def _g(run, *path):
    return get_path(run, path)


def findings(result: dict) -> list[str]:
    """Plain-language conclusions, each backed by the numbers."""
    cols = columns_of(result)
    out: list[str] = []
    if not cols:
        return ["No run completed."]
    for label, run in cols:
        cpu = _g(run, "client", "cpu_fraction")
        if cpu is not None and cpu > 0.8:
            out.append(f"Warning: the client used {cpu:.0%} of a CPU core in `{label}`: it may have limited the "
                       "load it could offer; the numbers there are a lower bound on the server's capacity.")
    failed = [(label, run["summary"]) for label, run in cols if run["summary"]["failed"]]
    for label, s in failed:
        kinds = ", ".join(f"{k} ×{n}" for k, n in s["errors_by_kind"].items())
        out.append(f"`{label}`: {s['failed']} of {s['num_requests']} requests failed ({kinds}).")
    ok = [(label, run) for label, run in cols if _g(run, "summary", "output_throughput")]
    if not ok:
        out.append("No run produced output tokens.")
        return out
    if len(ok) == 1:
        label, run = ok[0]
        s = run["summary"]
        out.append(f"`{label}`: {s['output_throughput']:.1f} output tokens/s, {s['request_throughput']:.2f} "
                   f"requests/s, p95 TTFT {fmt(s['ttft_ms']['p95'], '{:.0f}')} ms, p95 E2E "
                   f"{fmt(s['e2e_ms']['p95'], '{:.0f}')} ms.")
        return out + _spec_findings(cols)

    by_tput = sorted(ok, key=lambda c: -_g(c[1], "summary", "output_throughput"))
    (bl, br), (wl, wr) = by_tput[0], by_tput[-1]
    bt, wt = _g(br, "summary", "output_throughput"), _g(wr, "summary", "output_throughput")
    out.append(f"Highest throughput: `{bl}` with {bt:.1f} output tokens/s, {bt / wt:.2f}× the lowest, "
               f"`{wl}` ({wt:.1f} tokens/s).")
    with_ttft = [c for c in ok if _g(c[1], "summary", "ttft_ms", "p95") is not None]
    best_ttft = None
    if len(with_ttft) >= 2:
        by_ttft = sorted(with_ttft, key=lambda c: _g(c[1], "summary", "ttft_ms", "p95"))
        (tl, tr), (sl, sr) = by_ttft[0], by_ttft[-1]
        a, b = _g(tr, "summary", "ttft_ms", "p95"), _g(sr, "summary", "ttft_ms", "p95")
        best_ttft = tl
        ratio = f", {b / a:.2f}× lower than" if a > 0 else ", versus"
        out.append(f"Lowest p95 time to first token: `{tl}` at {a:.0f} ms{ratio} `{sl}` ({b:.0f} ms).")
    with_e2e = [c for c in ok if _g(c[1], "summary", "e2e_ms", "p95") is not None]
    if len(with_e2e) >= 2:
        el, er = min(with_e2e, key=lambda c: _g(c[1], "summary", "e2e_ms", "p95"))
        out.append(f"Lowest p95 end-to-end latency: `{el}` at {_g(er, 'summary', 'e2e_ms', 'p95'):.0f} ms.")
    if best_ttft is not None:
        if best_ttft == bl:
            out.append(f"`{bl}` is best on both throughput and p95 TTFT.")
        else:
            out.append(f"No variant wins both: `{bl}` gives the most throughput, `{best_ttft}` the fastest first "
                       "token; pick by which one your users feel.")
    good = [c for c in ok if _g(c[1], "summary", "goodput") is not None]
    if good:
        gl, gr = max(good, key=lambda c: _g(c[1], "summary", "goodput"))
        out.append(f"Most goodput under the SLO: `{gl}` with {_g(gr, 'summary', 'goodput'):.2f} requests/s "
                   f"({_g(gr, 'summary', 'good_fraction'):.0%} of its requests met it).")
    costed = [c for c in ok if _g(c[1], "summary", "cost", "per_million_output_tokens") is not None]
    if costed:
        price = costed[0][1]["summary"]["cost"]["per_hour"]
        parts = ", ".join(f"`{lab}` ${_g(r, 'summary', 'cost', 'per_million_output_tokens'):.3f}"
                          for lab, r in sorted(costed, key=lambda c: _g(c[1], "summary", "cost",
                                                                        "per_million_output_tokens")))
        out.append(f"Cost at ${price:g}/hour, per million output tokens: {parts}.")
    out += _spec_findings(cols)
    pre = [(lab, _g(r, "server", "preemptions")) for lab, r in cols if _g(r, "server", "preemptions")]
    if pre:
        out.append("Preemptions (KV cache full, requests recomputed): "
                   + ", ".join(f"`{lab}` {n:.0f}" for lab, n in pre) + ".")
    if not failed:
        out.append("No request failed in any run.")
    return out


def _spec_findings(cols) -> list[str]:
    """One line per run whose server reports speculative decoding (vLLM's spec_decode counters)."""
    out = []
    for label, run in cols:
        srv = run.get("server") or {}
        if "spec_decode_num_drafts" not in srv:
            continue
        if not srv["spec_decode_num_drafts"]:
            out.append(f"Speculative decoding in `{label}`: no drafts (nothing to propose, or every step above "
                       "disable_by_batch_size).")
            continue
        per_pos = srv.get("spec_decode_acceptance_per_position") or []
        pos = (" (accepted at draft position " + ", ".join(f"{j + 1}: {fmt(a, 'pct')}%" for j, a in enumerate(per_pos))
               + ")") if per_pos else ""
        out.append(f"Speculative decoding in `{label}`: acceptance rate "
                   f"{fmt(srv['spec_decode_acceptance_rate'], 'pct')}%, mean accepted length "
                   f"{fmt(srv['spec_decode_mean_accepted_length'], '{:.2f}')} tokens per verifying step, "
                   f"{srv['spec_decode_num_drafts']:.0f} drafts of {srv['spec_decode_num_draft_tokens']:.0f} tokens"
                   f"{pos}.")
    return out


# ---- documents -------------------------------------------------------------------------------------------------

def _meta_lines(result: dict) -> list[tuple[str, str]]:
    m = result["meta"]
    wl = m.get("workload") or {}
    lines = [("Command", f"`{m.get('command')}`"),
             ("Model", str(m.get("model"))),
             ("Server", f"{m.get('base_url') or m.get('launch')} (version {json.dumps(m.get('server_version'))})"),
             ("API", str(m.get("api"))),
             ("Workload", ", ".join(f"{k}={v}" for k, v in wl.items())),
             ("Seed", str(m.get("seed"))),
             ("ignore_eos", str(m.get("ignore_eos"))),
             ("kvflow", str(m.get("kvflow_version"))),
             ("Started / finished", f"{m.get('started_at')} / {m.get('finished_at')}")]
    if m.get("slo"):
        lines.append(("SLO", ", ".join(f"{k} ≤ {v * 1000:g} ms" for k, v in m["slo"].items())))
    if m.get("cost_per_hour") is not None:
        lines.append(("Machine price", f"${m['cost_per_hour']:g}/hour"))
    return lines


def _server_notes(cols) -> list[str]:
    notes = []
    for label, run in cols:
        srv = run.get("server") or {}
        if not srv.get("available"):
            notes.append(f"`{label}`: no server metrics ({srv.get('error') or 'no /metrics'}).")
    return notes


def title_of(result: dict) -> str:
    if result.get("kind") == "experiment":
        flags = ", ".join(result["meta"].get("varied") or [])
        return f"kvflow bench: optimization experiment ({flags})"
    return "kvflow bench report"


def markdown_report(result: dict) -> str:
    cols = columns_of(result)
    parts = [f"# {title_of(result)}", ""]
    parts += [f"- **{k}**: {v}" for k, v in _meta_lines(result)]
    if result.get("kind") == "experiment":
        parts += ["", "## Variants", ""]
        for v in result["variants"]:
            state = "ok" if v.get("result") else f"failed: {v.get('error')}"
            parts.append(f"- `{v['name']}`: `{v['command']}` (startup {fmt(v.get('startup_seconds'), '{:.1f}')} s,"
                         f" {state})")
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


def figures(result: dict) -> list[tuple[str, bytes]]:
    cols = columns_of(result)
    out = []
    if result.get("kind") == "experiment":
        groups = [(v["name"], v["result"]["runs"]) for v in result["variants"] if v.get("result")]
        png = plots.variant_bars(cols)
        if png:
            out.append(("Variants side by side", png))
    else:
        groups = [("runs", result["runs"])]
    sweep = result["meta"].get("sweep")
    if sweep:
        png = plots.sweep_curves(groups, sweep["over"])
        if png:
            out.append((f"Throughput and p95 latency against {sweep['over']}", png))
    png = plots.latency_cdfs(cols)
    if png:
        out.append(("Latency CDFs", png))
    png = plots.server_timeline(cols)
    if png:
        out.append(("Server state over time (from /metrics)", png))
    return out


def html_report(result: dict) -> str:
    cols = columns_of(result)
    title = title_of(result)
    body = [f"<h1>{html.escape(title)}</h1>", "<ul>"]
    body += [f"<li><b>{html.escape(k)}</b>: {_md_inline(v)}</li>" for k, v in _meta_lines(result)]
    body.append("</ul>")
    if result.get("kind") == "experiment":
        body.append("<h2>Variants</h2><ul>")
        for v in result["variants"]:
            state = "ok" if v.get("result") else f"failed: {v.get('error')}"
            name = html.escape(v["name"])
            body.append(f"<li><code>{name}</code>: <code>{html.escape(v['command'])}</code> "
                        f"({html.escape(state)})</li>")
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


def write_reports(result: dict, output_dir: Path) -> dict[str, Path]:
    """results.json (every record), report.md, report.html in output_dir."""
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    paths = {"json": output_dir / "results.json", "markdown": output_dir / "report.md",
             "html": output_dir / "report.html"}
    paths["json"].write_text(json.dumps(result, indent=1, allow_nan=False, default=_json_default))
    paths["markdown"].write_text(markdown_report(result))
    paths["html"].write_text(html_report(result))
    return paths


def _json_default(o):
    raise TypeError(f"not JSON serializable: {type(o).__name__}")


def load_result(path: str | Path) -> dict:
    path = Path(path)
    if path.is_dir():
        path = path / "results.json"
    if not path.is_file():
        raise FileNotFoundError(f"no such results file: {path}")
    result = json.loads(path.read_text())
    if not isinstance(result, dict) or "kind" not in result:
        raise ValueError(f"{path} is not a kvflow bench results file")
    return result


def compare_report(paths: list[str | Path]) -> str:
    """Side-by-side Markdown table of several results files, with ratios to the first."""
    if len(paths) < 2:
        raise ValueError("compare needs at least two results files")
    cols: list[tuple[str, dict]] = []
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
