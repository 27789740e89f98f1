"""`kvflow run-batch --ray --replicas N` on a local Ray cluster against `kvflow run-batch` on one engine: the
same batch file, output tokens per second both ways, and the check that both answered every line exactly once
with equal bodies (greedy).

    python benchmarks/ray_batch.py [MODEL] [--lines 600] [--max-tokens 32] [--reps 3] [--nodes 2]
                                   [--cpus-per-node 1] [--check-only] [--kill-one]

The cluster is the tests' (tests/ray_cluster.py): `--nodes` nodes of `--cpus-per-node` CPUs on this machine,
loopback only; `--replicas` is the node count, one replica (one 1-thread engine, by default) per node. The
single engine runs with its defaults (every core). Each command is timed whole, from the process start to its
exit, so model loading and (for Ray) actor start-up count: that is what a user waits for. The figure reported
beside it is the command's own "in N s" (from reading the file to the last line written). Lines are chat
completions with `ignore_eos`, so each produces exactly --max-tokens tokens. Medians of --reps, the two
commands alternating, nothing else running. `--kill-one`: in every Ray run one replica is SIGKILLed once results
have begun to arrive (tests/ray_cluster.py's KILLER); Ray restarts it, and the check still holds.
"""
from __future__ import annotations

import argparse
import json
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
from ray_cluster import KILLER, RayCluster, env  # noqa: E402  (the tests' cluster: ports, temp dir, clean stop)

TOPICS = ["the ocean", "a city at night", "machine learning", "coffee", "mountains", "a lost key", "trains",
          "the moon", "friendship", "a library", "winter", "robots", "music", "gardening", "rivers", "chess"]


def write_batch(path: Path, n: int, max_tokens: int) -> None:
    with path.open("w") as f:
        for i in range(n):
            body = {"model": "default", "temperature": 0, "max_tokens": max_tokens, "ignore_eos": True,
                    "messages": [{"role": "user",
                                  "content": f"Q{i}: write a short story about {TOPICS[i % len(TOPICS)]}."}]}
            f.write(json.dumps({"custom_id": f"req-{i}", "method": "POST", "url": "/v1/chat/completions",
                                "body": body}) + "\n")


def run_batch(model: list[str], inp: Path, out: Path, extra: list[str]) -> tuple[float, float]:
    cmd = [sys.executable, "-m", "kvflow.cli", "run-batch", *model, "-i", str(inp), "-o", str(out),
           "--served-model-name", "default", "--no-progress", *extra]
    t0 = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, env=env(), cwd=REPO)
    wall = time.perf_counter() - t0
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{done.stderr[-3000:]}")
    m = re.search(r"processed \((\d+) failed\).*in ([\d.]+)s", done.stderr)
    if not m or m.group(1) != "0":
        raise SystemExit(f"unexpected summary:\n{done.stderr[-3000:]}")
    return wall, float(m.group(2))


def results(path: Path) -> dict[str, dict]:
    records = [json.loads(x) for x in path.read_text().splitlines()]
    by_id: dict[str, dict] = {}
    for r in records:
        if r["custom_id"] in by_id:
            raise SystemExit(f"{path}: {r['custom_id']} written twice")
        by_id[r["custom_id"]] = r
    return by_id


def comparable(record: dict) -> dict:
    body = dict(record["response"]["body"])
    for k in ("id", "created"):
        body.pop(k, None)
    body["usage"] = {k: v for k, v in body["usage"].items() if k != "prompt_tokens_details"}
    return {"status": record["response"]["status_code"], "body": body}


def check(single: Path, ray: Path, n: int) -> int:
    a, b = results(single), results(ray)
    want = {f"req-{i}" for i in range(n)}
    for name, got in (("single", a), ("ray", b)):
        if set(got) != want:
            raise SystemExit(f"{name}: {len(want - set(got))} line(s) missing, {len(set(got) - want)} unexpected")
    differ = [k for k in sorted(want) if comparable(a[k]) != comparable(b[k])]
    if differ:
        raise SystemExit(f"{len(differ)} bodies differ between one engine and Ray, e.g. {differ[:3]}")
    return sum(r["response"]["body"]["usage"]["completion_tokens"] for r in a.values())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model", nargs="?", default=None, help="default: the embedded model")
    ap.add_argument("--lines", type=int, default=600)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--nodes", type=int, default=2)
    ap.add_argument("--cpus-per-node", type=int, default=1)
    ap.add_argument("--engine-args", default="", help="extra engine flags for both commands")
    ap.add_argument("--check-only", action="store_true", help="one run of each and the equality check")
    ap.add_argument("--kill-one", action="store_true", help="SIGKILL one replica mid-run in each Ray run")
    args = ap.parse_args()

    model = [args.model] if args.model else []
    engine = args.engine_args.split()
    work = Path(tempfile.mkdtemp(prefix="raybench"))
    inp = work / "batch.jsonl"
    write_batch(inp, args.lines, args.max_tokens)
    reps = 1 if args.check_only else args.reps
    print(f"machine: {platform.processor() or platform.machine()}; {args.lines} lines x {args.max_tokens} tokens; "
          f"Ray: {args.nodes} nodes x {args.cpus_per_node} CPU, {args.nodes} replicas", flush=True)

    cluster = RayCluster.start(nodes=args.nodes, cpus_per_node=args.cpus_per_node)
    walls: dict[str, list[float]] = {"one engine": [], "ray": []}
    inner: dict[str, list[float]] = {"one engine": [], "ray": []}
    tokens = 0
    try:
        for rep in range(reps):
            for name, extra in (("one engine", []),
                                ("ray", ["--ray", cluster.address, "--replicas", str(args.nodes),
                                         "--num-cpus-per-replica", str(args.cpus_per_node)])):
                out = work / f"{name.replace(' ', '_')}.jsonl"
                out.unlink(missing_ok=True)
                killer = None
                if extra and args.kill_one:
                    killer = subprocess.Popen([sys.executable, "-c", KILLER, cluster.address, str(out)],
                                              stdout=subprocess.PIPE, text=True, env=env(), cwd=REPO)
                    killer.stdout.readline()                  # "ready": it watches the actor table from now on
                wall, own = run_batch(model, inp, out, engine + extra)
                if killer is not None:
                    events = killer.communicate(timeout=300)[0]
                    print("  " + " ".join(events.split()), flush=True)
                walls[name].append(wall)
                inner[name].append(own)
                print(f"  rep {rep + 1} {name:10s}: {wall:7.1f} s whole, {own:7.1f} s its own", flush=True)
            tokens = check(work / "one_engine.jsonl", work / "ray.jsonl", args.lines)
    finally:
        cluster.stop()
    print(f"every line answered once by each, bodies equal; {tokens} output tokens per run")
    print("| command | whole run, s (median) | output tok/s, whole | its own time, s | output tok/s, own |")
    print("| --- | --- | --- | --- | --- |")
    for name in walls:
        w, o = statistics.median(walls[name]), statistics.median(inner[name])
        print(f"| {name} | {w:.1f} | {tokens / w:.0f} | {o:.1f} | {tokens / o:.0f} |")
    w1, w2 = statistics.median(walls["one engine"]), statistics.median(walls["ray"])
    print(f"ray / one engine, output tok/s (whole runs): {w1 / w2:.2f}x")


if __name__ == "__main__":
    main()
