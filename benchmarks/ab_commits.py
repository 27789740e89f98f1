"""Two commits of kvflow side by side: `kvflow serve` from each (a git worktree, the same venv), the same streamed
load from `kvflow bench` against each, the servers alternating for `--reps` rounds; medians and the B/A ratio.

    .venv/bin/python benchmarks/ab_commits.py --a a9e7e25 --b HEAD --concurrency 32 --num-requests 96 --reps 3

Each server runs alone (the other is stopped), after its background compile of the decode steps has ended (or it
said it gave up), so both are timed in their steady state. Extra serve flags go after `--serve-args`.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from kvflow.bench.result import BenchResult
from kvflow.bench.summary import RunSummary
from kvflow.server.testing import free_port

ROOT = Path(__file__).resolve().parent.parent
PYTHON = sys.executable


def worktree(rev: str, where: Path) -> Path:
    path = where / rev.replace("/", "_")
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "-f", str(path), rev], check=True,
                   capture_output=True)
    return path


def wait_ready(url: str, proc: subprocess.Popen, timeout: float) -> None:
    """/health answers, then the compiled decode buckets are all loaded (or compiling is off or gave up)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                text = httpx.get(url + "/metrics", timeout=5).text
                ready = re.search(r"^kvflow:compiled_decode_buckets_ready\{[^}]*\} (\S+)", text, re.M)
                total = re.search(r"^kvflow:compiled_decode_buckets_total\{[^}]*\} (\S+)", text, re.M)
                if not total or float(total.group(1)) == 0 or (ready and ready.group(1) == total.group(1)):
                    return
        except httpx.HTTPError:
            pass
        time.sleep(2)
    raise TimeoutError("the server was not ready in time")


def run_side(tree: Path, serve_args: list[str], bench_args: list[str], out: Path, timeout: float) -> RunSummary:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = dict(os.environ, PYTHONPATH=str(tree))
    out.mkdir(parents=True, exist_ok=True)
    log = open(out / "server.log", "w")
    proc = subprocess.Popen([PYTHON, "-m", "kvflow.cli", "serve", *serve_args, "--host", "127.0.0.1", "--port",
                             str(port)], env=env, stdout=log, stderr=subprocess.STDOUT, cwd=tree)
    try:
        wait_ready(url, proc, timeout)
        subprocess.run([PYTHON, "-m", "kvflow.cli", "bench", "--base-url", url + "/v1", "--no-progress",
                        "--output-dir", str(out), *bench_args], check=True, cwd=ROOT, capture_output=True)
        return BenchResult.from_json(json.loads((out / "results.json").read_text())).runs[-1].summary
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--a", required=True, help="baseline revision")
    ap.add_argument("--b", default="HEAD", help="revision compared with it")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--num-requests", type=int, default=96)
    ap.add_argument("--workload", default="haiku")
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--ready-timeout", type=float, default=1800)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--serve-args", nargs=argparse.REMAINDER, default=[])
    args = ap.parse_args()

    work = Path(tempfile.mkdtemp(prefix="kvflow-ab-"))
    out = args.out or work / "results"
    trees = {"A": worktree(args.a, work), "B": worktree(args.b, work)}
    bench = ["--workload", args.workload, "--output-len", str(args.output_len), "--ignore-eos", "--temperature", "0",
             "--num-requests", str(args.num_requests), "--concurrency", str(args.concurrency), "--warmup", "4"]
    figures: dict[str, list[RunSummary]] = {"A": [], "B": []}
    try:
        for rep in range(args.reps):
            for side in ("A", "B") if rep % 2 == 0 else ("B", "A"):      # alternating: drift hits both
                s = run_side(trees[side], args.serve_args, bench, out / f"{side}{rep}", args.ready_timeout)
                figures[side].append(s)
                print(f"rep {rep} {side} ({getattr(args, side.lower())}): {s.output_throughput:.1f} out tok/s, "
                      f"TPOT p50 {s.tpot_ms.p50:.1f} ms, TTFT p50 {s.ttft_ms.p50:.0f} ms, "
                      f"{s.failed} failed", flush=True)
    finally:
        for tree in trees.values():
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)], capture_output=True)

    def median(side: str, figure) -> float:
        return statistics.median(figure(s) for s in figures[side])

    a, b = median("A", lambda s: s.output_throughput), median("B", lambda s: s.output_throughput)
    ta, tb = median("A", lambda s: s.tpot_ms.p50), median("B", lambda s: s.tpot_ms.p50)
    print(f"\n| revision | output tok/s (median of {args.reps}) | TPOT p50 ms |\n|---|---|---|")
    print(f"| A {args.a} | {a:.1f} | {ta:.1f} |\n| B {args.b} | {b:.1f} | {tb:.1f} |")
    print(f"\nB/A output throughput: {b / a:.3f}x; TPOT p50 {tb / ta:.3f}x "
          f"(concurrency {args.concurrency}, {args.num_requests} requests, serve {shlex.join(args.serve_args)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
