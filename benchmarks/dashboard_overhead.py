"""What /dashboard costs the server: the same streamed load from `kvflow bench` against `kvflow serve` three ways,
alternating for `--reps` rounds; medians and the ratios to the first.

    off       --disable-dashboard: no hub at all
    idle      the dashboard on (its ring buffers filled every step), no page open
    attached  the dashboard on and a page open for the whole run

    .venv/bin/python benchmarks/dashboard_overhead.py --concurrency 32 --num-requests 96 --reps 3
    .venv/bin/python benchmarks/dashboard_overhead.py --client chromium      # a real page in headless chromium

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

from kvflow.server.testing import free_port  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
PYTHON = sys.executable
MODES = ("off", "idle", "attached")

SSE_CLIENT = r"""
import json, sys, httpx
n = 0
with httpx.Client(timeout=None) as http, http.stream("GET", sys.argv[1] + "/dashboard/events") as r:
    for line in r.iter_lines():
        if line.startswith("data: "):
            json.loads(line[6:]); n += 1
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


def start_client(kind: str, url: str) -> subprocess.Popen:
    if kind == "chromium":
        chromium = shutil.which("chromium") or shutil.which("chromium-browser")
        if chromium is None:
            raise SystemExit("no chromium on PATH (apt-get install chromium)")
        return subprocess.Popen([PYTHON, "-c", CHROMIUM_CLIENT, url, chromium])
    return subprocess.Popen([PYTHON, "-c", SSE_CLIENT, url])


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
    try:
        wait_ready(url, proc, args.ready_timeout)
        if mode == "attached":
            client = start_client(args.client, url)
            time.sleep(3)          # the page is open and streaming before the load starts
            if client.poll() is not None:
                raise RuntimeError(f"the dashboard client exited with {client.returncode}")
        subprocess.run([PYTHON, "-m", "kvflow.cli", "bench", "--base-url", url + "/v1", "--no-progress",
                        "--output-dir", str(out), *bench], check=True, cwd=ROOT, capture_output=True)
        if client is not None and client.poll() is not None:
            raise RuntimeError("the dashboard client died during the run")
        result = json.loads((out / "results.json").read_text())
        runs = result["runs"] if "runs" in result else [result]
        return runs[-1]["summary"]
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
            print(f"rep {rep} {mode:8}: {s['output_throughput']:.1f} out tok/s, TPOT p50 {s['tpot_ms']['p50']:.1f} ms, "
                  f"TTFT p50 {s['ttft_ms']['p50']:.0f} ms, {s['failed']} failed", flush=True)

    def median(mode: str, key, sub=None) -> float:
        return statistics.median(f[key][sub] if sub else f[key] for f in figures[mode])

    base = median("off", "output_throughput")
    print(f"\n| dashboard | output tok/s (median of {args.reps}) | vs off | TPOT p50 ms |\n|---|---|---|---|")
    for mode in MODES:
        tput = median(mode, "output_throughput")
        print(f"| {mode} | {tput:.1f} | {tput / base:.3f}x | {median(mode, 'tpot_ms', 'p50'):.1f} |")
    print(f"\n(concurrency {args.concurrency}, {args.num_requests} requests x {args.output_len} tokens, "
          f"client {args.client}, serve {' '.join(args.serve_args) or '(defaults)'}; results under {out})")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
