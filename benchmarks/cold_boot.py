"""A first boot on a cold compile cache: how soon `kvflow serve` answers, how long its decode steps take to compile,
and how fast a single stream is served meanwhile and afterwards.

    python benchmarks/cold_boot.py [--port 8123] [--output-len 64] [--requests 3] [--serve-args "..."]

Starts `kvflow serve` with empty Inductor and kvflow caches (temporary folders), times /health, then runs
`kvflow bench` rounds (concurrency 1, --requests streamed requests of exactly --output-len tokens each) while
/metrics says buckets are still compiling, and two rounds after they all are. Prints each round's TPOT p50 and
the buckets ready, then the ratio of TPOT during compilation (median of the rounds that ended before the last
bucket was ready) to TPOT after, and TPOT while no bucket was ready yet (every step eager beside the compiler).
"""
from __future__ import annotations

import argparse
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

BIN = Path(sys.executable).parent


def buckets(base: str) -> tuple[int, int] | None:
    """(ready, total) compiled decode buckets from /metrics."""
    text = httpx.get(f"{base}/metrics", timeout=10).text
    ready = re.search(r"^kvflow:compiled_decode_buckets_ready(?:\{[^}]*\})? (\S+)", text, re.M)
    total = re.search(r"^kvflow:compiled_decode_buckets_total(?:\{[^}]*\})? (\S+)", text, re.M)
    return (int(float(ready[1])), int(float(total[1]))) if ready and total else None


def bench_round(base: str, output_len: int, requests: int) -> float:
    out = subprocess.run([str(BIN / "kvflow"), "bench", "--base-url", f"{base}/v1", "--workload", "random",
                          "--input-len", "32", "--output-len", str(output_len), "--ignore-eos", "--concurrency", "1",
                          "--num-requests", str(requests), "--warmup", "0", "--no-progress",
                          "--output-dir", tempfile.mkdtemp()], capture_output=True, text=True, check=True).stdout
    return float(re.search(r"TPOT p50 (\S+) ms", out)[1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--port", type=int, default=8123)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--requests", type=int, default=3)
    ap.add_argument("--serve-args", default="")
    args = ap.parse_args()
    base = f"http://127.0.0.1:{args.port}"
    with tempfile.TemporaryDirectory() as inductor, tempfile.TemporaryDirectory() as kvflow_cache:
        env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=inductor, KVFLOW_CACHE_DIR=kvflow_cache)
        t0 = time.perf_counter()
        server = subprocess.Popen([str(BIN / "kvflow"), "serve", "--port", str(args.port),
                                   *shlex.split(args.serve_args)], env=env, stdout=subprocess.DEVNULL,
                                  stderr=open(Path(kvflow_cache) / "serve.log", "w"))
        try:
            while True:
                try:
                    if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if server.poll() is not None:
                    raise SystemExit(f"server exited: {(Path(kvflow_cache) / 'serve.log').read_text()[-2000:]}")
                time.sleep(0.2)
            health = time.perf_counter() - t0
            print(f"/health 200 after {health:.1f} s")
            during, after, eager, compiled_at = [], [], [], None
            while len(after) < 2:
                state = buckets(base)
                tpot = bench_round(base, args.output_len, args.requests)
                now = buckets(base)
                if state is None or now is None:
                    raise SystemExit("/metrics has no kvflow:compiled_decode_buckets_ready/_total")
                if compiled_at is None and now[0] == now[1]:
                    compiled_at = time.perf_counter() - t0
                (after if state[0] == state[1] else during if now[0] < now[1] else []).append(tpot)
                if now[0] == 0:
                    eager.append(tpot)
                print(f"+{time.perf_counter() - t0:6.1f} s  buckets ready {state[0]}->{now[0]} of {now[1]}  "
                      f"TPOT p50 {tpot:.1f} ms")
            print(f"every bucket compiled by +{compiled_at:.1f} s (polled between rounds)")
            if during:
                d, a = statistics.median(during), statistics.median(after)
                print(f"TPOT p50 during compilation {d:.1f} ms (median of {len(during)} rounds), after {a:.1f} ms: "
                      f"{d / a:.2f}x")
            if eager:
                print(f"TPOT p50 before the first bucket was ready (every step eager, beside the compiler) "
                      f"{statistics.median(eager):.1f} ms (median of {len(eager)} rounds)")
        finally:
            server.terminate()
            server.wait(60)


if __name__ == "__main__":
    main()
