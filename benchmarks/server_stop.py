"""How long a server takes to stop, two commits side by side: `ServerThread` on the embedded model (uvicorn, the
engine process) started and stopped from each commit's worktree (the same venv), alternating for `--reps` rounds;
the median start and stop of each and the B/A ratio of the stops.

    .venv/bin/python benchmarks/server_stop.py --a 8ebc8de --b HEAD --reps 5
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from ab_commits import ROOT, worktree

ONE_ROUND = """
import json, time
from kvflow.config import EngineConfig
from kvflow.server.testing import ServerThread
t0 = time.perf_counter()
server = ServerThread(EngineConfig()).start()
t1 = time.perf_counter()
time.sleep(1.0)                       # idle, as a test's server is when its module ends
t2 = time.perf_counter()
server.stop()
print(json.dumps({"start": t1 - t0, "stop": time.perf_counter() - t2}))
"""


def one_round(tree: Path) -> dict:
    done = subprocess.run([sys.executable, "-c", ONE_ROUND], cwd=tree, capture_output=True, text=True, check=True,
                          env={"PYTHONPATH": str(tree), "PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1"})
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--a", required=True, help="the baseline commit")
    ap.add_argument("--b", default="HEAD")
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as where:
        trees = {side: worktree(rev, Path(where)) for side, rev in (("a", args.a), ("b", args.b))}
        try:
            rounds = {"a": [], "b": []}
            for _ in range(args.reps):
                for side in ("a", "b"):
                    rounds[side].append(one_round(trees[side]))
        finally:
            for tree in trees.values():
                subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)],
                               capture_output=True)
    medians = {side: {k: statistics.median(r[k] for r in rs) for k in ("start", "stop")} for side, rs in rounds.items()}
    for side, rev in (("a", args.a), ("b", args.b)):
        stops = ", ".join(f"{r['stop']:.3f}" for r in rounds[side])
        print(f"{side} {rev}: start {medians[side]['start']:.2f} s, stop {medians[side]['stop']:.3f} s (stops {stops})")
    print(f"stop B/A: {medians['b']['stop'] / medians['a']['stop']:.2f}x")


if __name__ == "__main__":
    main()
