"""Priority scheduling through the real server (vLLM's `priority`: a lower value first; the Batch API's lines run
at 10): with a KV cache too small for everyone, the engine preempts the high-value (batch) requests and never an
interactive one, and every request still finishes with its whole output. The request log says who was preempted."""
from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import openai

from kvflow.config import EngineConfig
from kvflow.server.testing import ServerThread


def test_only_batch_requests_are_preempted_when_the_kv_cache_is_short(tmp_path):
    log = tmp_path / "requests.jsonl"
    # ~24 blocks of 16 tokens: 4 batch requests of ~100 tokens each fill it, so the interactive ones need theirs
    config = EngineConfig(dtype="float32", max_model_len=256, kv_cache_memory="18MiB", block_size=16,
                          scheduling_policy="priority", served_model_name="smol")
    with ServerThread(config, request_log=str(log)) as server:
        client = openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0, timeout=300)

        def run(kind: str, i: int):
            priority, max_tokens = (10, 90) if kind == "batch" else (0, 40)
            r = client.completions.create(model="smol", prompt=f"Write a long story, number {i}:", temperature=0,
                                          max_tokens=max_tokens, extra_body={"priority": priority, "ignore_eos": True,
                                                                             "request_id": f"{kind}{i}"})
            return kind, r.usage.completion_tokens, max_tokens

        with ThreadPoolExecutor(12) as pool:
            batch = [pool.submit(run, "batch", i) for i in range(6)]
            chat = [pool.submit(run, "chat", i) for i in range(6)]
            results = [f.result() for f in batch + chat]
        server.wait_idle()
        server.core("check")                          # every block back, nothing referenced
    assert all(tokens == want for _, tokens, want in results)          # nothing lost, preempted or not
    lines = [json.loads(x) for x in log.read_text().splitlines()]
    preempted = {x["id"]: x["num_preemptions"] for x in lines}
    assert len(preempted) == 12
    assert sum(v for k, v in preempted.items() if "batch" in k) > 0, preempted   # the cache was short
    assert all(v == 0 for k, v in preempted.items() if "chat" in k), preempted
