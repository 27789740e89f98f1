"""Replicas behind an existing router: examples/router/two_replicas.sh starts two `kvflow serve` replicas and
vllm-router (its cache-aware policy) on loopback; chat requests sharing a system prompt, sent through the router,
land on the replica whose prefix cache holds it: each replica's request log shows which requests it served, and its
`vllm:prefix_cache_hits` counts their cached prefix."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvflow.server.testing import free_port
from tiny_models import make_tiny_hf_model

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "examples" / "router" / "two_replicas.sh"
BIN = Path(sys.executable).parent
SYSTEM = {"pirate": "You are a pirate who answers every question about the sea. " * 12,
          "auditor": "You are a careful accountant who audits ledgers line by line. " * 12}


def prefix_cache_hits(url: str) -> float:
    for family in text_string_to_metric_families(httpx.get(url + "/metrics").text):
        for s in family.samples:
            if s.name == "vllm:prefix_cache_hits_total":
                return s.value
    raise AssertionError("no vllm:prefix_cache_hits_total")


def served_by_replica(log_dir: Path, ids: set[str], timeout: float = 30.0) -> dict[str, tuple[int, int]]:
    """Response id -> (replica index, cached tokens), from the replicas' request logs, once `ids` are all there."""
    deadline = time.monotonic() + timeout
    while True:
        served = {}
        for k in range(2):
            path = log_dir / f"replica-{k + 1}.jsonl"
            for line in path.read_text().splitlines() if path.exists() else []:
                try:
                    x = json.loads(line)
                except json.JSONDecodeError:         # a line being written
                    continue
                served[x["id"]] = (k, x["cached_tokens"])
        if ids <= set(served) or time.monotonic() > deadline:
            return served
        time.sleep(0.1)


@pytest.mark.slow
@pytest.mark.skipif(not (BIN / "vllm-router").exists(), reason="vllm-router is not installed (pip install "
                                                                "vllm-router; the test extra has it)")
def test_shared_prefixes_land_on_the_replica_that_holds_them(tmp_path):
    model = make_tiny_hf_model(tmp_path / "model", family="llama", seed=8)
    ports = [free_port(), free_port()]
    router_port = free_port()
    env = dict(os.environ, MODEL=str(model), BIN=str(BIN), ROUTER_PORT=str(router_port),
               REPLICA_PORTS=" ".join(map(str, ports)), LOG_DIR=str(tmp_path), ROUTER_METRICS_PORT=str(free_port()),
               SERVE_ARGS="--dtype float32 --max-model-len 512 --kv-cache-memory 16MiB --max-num-seqs 8 "
                          "--enforce-eager --served-model-name tiny --log-level warning")
    log = open(tmp_path / "router.log", "w")
    proc = subprocess.Popen(["bash", str(SCRIPT)], env=env, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    router = f"http://127.0.0.1:{router_port}"
    replicas = [f"http://127.0.0.1:{p}" for p in ports]
    try:
        deadline = time.monotonic() + 180
        while True:
            assert proc.poll() is None, (tmp_path / "router.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "the router did not come up"
            try:
                if httpx.get(router + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        hits_before = [prefix_cache_hits(url) for url in replicas]
        client = openai.OpenAI(base_url=router + "/v1", api_key="x", max_retries=0, timeout=60)

        def ask(role: str, i: int):
            r = client.chat.completions.create(model="tiny", max_tokens=3, messages=[
                {"role": "system", "content": SYSTEM[role]}, {"role": "user", "content": f"question {i}"}])
            return role, r.id, r

        # a prefix the router has not seen goes to the replica with the fewest requests in flight: the auditor's first
        # request is sent while the pirate's first is still streaming, so the two land on different replicas (sent
        # together, the pirate's could finish before the auditor's was routed on a loaded machine)
        stream = iter(client.chat.completions.create(
            model="tiny", max_tokens=300, stream=True, extra_body={"ignore_eos": True}, messages=[
                {"role": "system", "content": SYSTEM["pirate"]}, {"role": "user", "content": "question 0"}]))
        pirate_id = next(stream).id
        answers = [ask("auditor", 0)]
        assert sum(1 for _ in stream) > 0            # the pirate's stream went on past the auditor's answer
        answers.insert(0, ("pirate", pirate_id, None))
        for i in range(1, 4):
            answers += [ask(role, i) for role in SYSTEM]
        # each replica's log writer is a thread behind a queue: wait until every answer's line is on disk (a fixed
        # sleep lost the last lines on a loaded machine)
        served = served_by_replica(tmp_path, {rid for _, rid, _ in answers})
        where = {role: {served[rid][0] for rr, rid, _ in answers if rr == role} for role in SYSTEM}
        assert all(len(w) == 1 for w in where.values()), where       # each prefix stayed on one replica
        assert where["pirate"] != where["auditor"], where               # and the two went to different ones
        for role in SYSTEM:
            (first, _), *rest = [(rid, r) for rr, rid, r in answers if rr == role]
            assert served[first][1] == 0
            for rid, r in rest:   # every later request hit its replica's cache for the whole system prompt
                assert r.usage.prompt_tokens_details.cached_tokens == served[rid][1] >= 0.8 * r.usage.prompt_tokens
        for k, url in enumerate(replicas):
            mine = sum(cached for rep, cached in served.values() if rep == k)
            assert prefix_cache_hits(url) - hits_before[k] == mine > 0
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
        log.close()
