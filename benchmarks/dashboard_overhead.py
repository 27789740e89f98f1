"""What /dashboard costs the server: the same streamed load from `kvflow bench` against `kvflow serve` three ways,
alternating for `--reps` rounds; medians and the ratios to the first.

    off       --disable-dashboard: no hub at all
    idle      the dashboard on (its ring buffers filled every step), no page open
    attached  the dashboard on and a page open for the whole run

    .venv/bin/python benchmarks/dashboard_overhead.py --concurrency 32 --num-requests 96 --reps 3
    .venv/bin/python benchmarks/dashboard_overhead.py --client chromium      # a real page in headless chromium

Throughput alone cannot show a 1% cost on a 2-core machine (its repetitions spread by several percent), so each run
also measures the cost itself, around the load only:
- `cost`: what the server says the view spent (every message carries the hub's counters, server/dashboard.py): the
  CPU seconds of the dashboard's code on the frontend's event loop plus the engine's time building the KV map, as a
  share of the run's wall time. Were every such second taken from the engine, which keeps both cores busy, throughput
  would fall by at most this share: it bounds the cost from above.
- CPU seconds of the frontend process and of the engine process (/proc), to see the same from outside.

The attached page is by default a Python SSE client in its own process that reads and JSON-parses every message,
as the page's script does (what the *server* pays for an open page: building and sending the messages, the KV
block map from the engine). `--client chromium` opens the real page in Debian's headless chromium instead; on a
small machine the browser's own rendering then competes with the server for the same cores, which is the
browser's cost, not the stream's: run the browser elsewhere (`--url` of a server started by hand) to tell them
apart. Issue 29's bar: attached costs < 1% of output throughput at concurrency 32. Extra serve flags go after
`--serve-args`.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ab_commits import wait_ready  # noqa: E402

from kvflow.bench.result import BenchResult  # noqa: E402
from kvflow.server.testing import free_port  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
PYTHON = sys.executable
MODES = ("off", "idle", "attached")

# reads and parses every message; keeps the latest message's cost counters in argv[2] (for `cost`)
SSE_CLIENT = r"""
import json, os, sys, httpx
with httpx.Client(timeout=None) as http, http.stream("GET", sys.argv[1] + "/dashboard/events") as r:
    for line in r.iter_lines():
        if line.startswith("data: "):
            cost = json.loads(line[6:])["cost"]
            with open(sys.argv[2] + ".tmp", "w") as f:
                json.dump(cost, f)
            os.replace(sys.argv[2] + ".tmp", sys.argv[2])
"""

CHROMIUM_CLIENT = r"""
import sys, time
from playwright.sync_api import sync_playwright
with sync_playwright() as p:
    b = p.chromium.launch(executable_path=sys.argv[2], headless=True, args=["--no-sandbox"])
    page = b.new_page(viewport={"width": 1400, "height": 900})
    page.goto(sys.argv[1] + "/dashboard")
    while True:
        time.sleep(1)
"""


def start_client(kind: str, url: str, cost_file: Path) -> subprocess.Popen:
    if kind == "chromium":
        chromium = shutil.which("chromium") or shutil.which("chromium-browser")
        if chromium is None:
            raise SystemExit("no chromium on PATH (apt-get install chromium)")
        return subprocess.Popen([PYTHON, "-c", CHROMIUM_CLIENT, url, chromium])
    return subprocess.Popen([PYTHON, "-c", SSE_CLIENT, url, str(cost_file)])


def cpu_seconds(pid: int) -> dict[int, float]:
    """User + system CPU seconds of process `pid` and of each of its descendants, from /proc."""
    tick = os.sysconf("SC_CLK_TCK")
    parent, spent = {}, {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        p = int(stat.parent.name)
        parent[p], spent[p] = int(fields[1]), (int(fields[11]) + int(fields[12])) / tick
    tree, todo = {pid: spent.get(pid, 0.0)}, [c for c, pp in parent.items() if pp == pid]
    while todo:
        c = todo.pop()
        tree[c] = spent.get(c, 0.0)
        todo += [g for g, pp in parent.items() if pp == c]
    return tree


def cpu_delta(pid: int, before: dict[int, float], after: dict[int, float]) -> tuple[float, float]:
    """(CPU seconds of `pid`, of its descendants) between two `cpu_seconds`: of the processes alive at the end (one
    that ended meanwhile, e.g. the decode-step compiler, is left out rather than subtracted)."""
    spent = {p: s - before.get(p, 0.0) for p, s in after.items()}
    return spent.get(pid, 0.0), sum(s for p, s in spent.items() if p != pid)


def read_cost(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def run_mode(mode: str, args, bench: list[str], out: Path) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    serve = [*args.serve_args, "--host", "127.0.0.1", "--port", str(port)]
    if mode == "off":
        serve.append("--disable-dashboard")
    log = open(out / "server.log", "w")
    proc = subprocess.Popen([PYTHON, "-m", "kvflow.cli", "serve", *serve], stdout=log, stderr=subprocess.STDOUT,
                            cwd=ROOT)
    client = None
    cost_file = out / "cost.json"
    try:
        wait_ready(url, proc, args.ready_timeout)
        if mode == "attached":
            client = start_client(args.client, url, cost_file)
            time.sleep(3)          # the page is open and streaming before the load starts
            if client.poll() is not None:
                raise RuntimeError(f"the dashboard client exited with {client.returncode}")
        cost0, cpu0, t0 = read_cost(cost_file), cpu_seconds(proc.pid), time.monotonic()
        subprocess.run([PYTHON, "-m", "kvflow.cli", "bench", "--base-url", url + "/v1", "--no-progress",
                        "--output-dir", str(out), *bench], check=True, cwd=ROOT, capture_output=True)
        cost1, cpu1, wall = read_cost(cost_file), cpu_seconds(proc.pid), time.monotonic() - t0
        if client is not None and client.poll() is not None:
            raise RuntimeError("the dashboard client died during the run")
        result = BenchResult.from_json(json.loads((out / "results.json").read_text()))
        summary = result.runs[-1].summary.to_json()     # summary.json: the run's summary, then this mode's costs
        summary["wall_s"] = wall
        summary["frontend_cpu_s"], summary["engine_cpu_s"] = cpu_delta(proc.pid, cpu0, cpu1)
        if cost0 and cost1:
            spent = cost1["frontend_s"] + cost1["engine_s"] - cost0["frontend_s"] - cost0["engine_s"]
            summary["dashboard_share"] = spent / (cost1["uptime_s"] - cost0["uptime_s"])
            summary["dashboard_cost"] = {"start": cost0, "end": cost1}
        (out / "summary.json").write_text(json.dumps(summary, indent=1))
        return summary
    finally:
        if client is not None:
            client.terminate()
            client.wait(30)
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--num-requests", type=int, default=96)
    ap.add_argument("--workload", default="haiku")
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--client", choices=("sse", "chromium"), default="sse")
    ap.add_argument("--ready-timeout", type=float, default=1800)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--serve-args", nargs=argparse.REMAINDER, default=[])
    args = ap.parse_args()

    out = args.out or Path(tempfile.mkdtemp(prefix="kvflow-dashboard-"))
    bench = ["--workload", args.workload, "--output-len", str(args.output_len), "--ignore-eos", "--temperature", "0",
             "--num-requests", str(args.num_requests), "--concurrency", str(args.concurrency), "--warmup", "4"]
    figures: dict[str, list[dict]] = {m: [] for m in MODES}
    for rep in range(args.reps):
        order = MODES if rep % 2 == 0 else tuple(reversed(MODES))      # alternating: drift hits every mode
        for mode in order:
            s = run_mode(mode, args, bench, out / f"{mode}{rep}")
            figures[mode].append(s)
            share = f", view {100 * s['dashboard_share']:.2f}% of the time" if "dashboard_share" in s else ""
            print(f"rep {rep} {mode:8}: {s['output_throughput']:.1f} out tok/s, TPOT p50 {s['tpot_ms']['p50']:.1f} ms, "
                  f"TTFT p50 {s['ttft_ms']['p50']:.0f} ms, {s['failed']} failed; CPU s frontend "
                  f"{s['frontend_cpu_s']:.1f}, engine {s['engine_cpu_s']:.1f} in {s['wall_s']:.1f} s{share}", flush=True)

    def median(mode: str, key, sub=None) -> float:
        return statistics.median(f[key][sub] if sub else f[key] for f in figures[mode])

    def per_token(mode: str, key: str) -> float:           # CPU ms per output token
        return statistics.median(1000 * f[key] / (f["output_throughput"] * f["duration_s"]) for f in figures[mode])

    base = median("off", "output_throughput")
    print(f"\n| dashboard | output tok/s (median of {args.reps}) | vs off | TPOT p50 ms | frontend CPU ms/token | "
          f"engine CPU ms/token | the view's own time (server's figure) |\n|---|---|---|---|---|---|---|")
    for mode in MODES:
        tput = median(mode, "output_throughput")
        shares = [f["dashboard_share"] for f in figures[mode] if "dashboard_share" in f]
        own = (f"{100 * statistics.median(shares):.2f}% (max {100 * max(shares):.2f}%)" if shares else "–")
        print(f"| {mode} | {tput:.1f} | {tput / base:.3f}x | {median(mode, 'tpot_ms', 'p50'):.1f} | "
              f"{per_token(mode, 'frontend_cpu_s'):.3f} | {per_token(mode, 'engine_cpu_s'):.3f} | {own} |")
    print(f"\n(concurrency {args.concurrency}, {args.num_requests} requests x {args.output_len} tokens, "
          f"client {args.client}, serve {' '.join(args.serve_args) or '(defaults)'}; results under {out})")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
