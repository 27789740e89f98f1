"""Priority scheduling through the real server (vLLM's `priority`: a lower value first; the Batch API's lines run
at 10): with a KV cache too small for everyone, the engine preempts the high-value (batch) requests and never an
interactive one, and every request still finishes with its whole output. The request log says who was preempted."""
from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from kvflow.config import EngineConfig
from kvflow.server.testing import ServerThread


@pytest.mark.slow
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


@pytest.mark.slow
def test_interactive_streams_run_beside_a_batch_and_only_batch_lines_are_preempted(tmp_path):
    """The Batch API's lines run at --batch-priority 10 behind interactive requests: with a KV cache too small for
    everyone, the interactive streams are never preempted (batch lines are), they finish while the batch is still
    running (they did not queue behind it), and the batch still completes every line."""
    import time

    from tiny_models import make_tiny_hf_model

    model = make_tiny_hf_model(tmp_path / "tiny", family="llama", seed=3)
    log = tmp_path / "requests.jsonl"
    # 2 layers x 2 KV heads x 16 dims x fp32 x K,V = 512 B per token: 24 blocks of 16 tokens; 8 batch lines of
    # ~70 tokens want 40 of them; 64 lines: the batch outlasts the streams even on a loaded machine
    config = EngineConfig(model=str(model), dtype="float32", max_model_len=128, kv_cache_memory=24 * 16 * 512,
                          block_size=16, enforce_eager=True, served_model_name="tiny")
    lines = [json.dumps({"custom_id": f"b{i}", "method": "POST", "url": "/v1/completions",
                         "body": {"model": "tiny", "prompt": f"batch line {i}", "max_tokens": 64, "ignore_eos": True,
                                  "temperature": 0}}) for i in range(64)]
    with ServerThread(config, request_log=str(log), batch_dir=str(tmp_path / "batches"),
                      batch_max_concurrency=8) as server:
        client = openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0, timeout=300)
        f = client.files.create(file=("b.jsonl", ("\n".join(lines) + "\n").encode()), purpose="batch")
        batch = client.batches.create(input_file_id=f.id, endpoint="/v1/completions", completion_window="24h")
        deadline = time.monotonic() + 120
        while client.batches.retrieve(batch.id).request_counts.completed < 2:     # the batch runs at full width
            assert time.monotonic() < deadline
            time.sleep(0.05)

        def stream(i: int) -> int:
            chunks = client.completions.create(model="tiny", prompt=f"interactive {i}", max_tokens=40, temperature=0,
                                               stream=True, extra_body={"ignore_eos": True})
            return sum(1 for c in chunks if c.choices and c.choices[0].text is not None)

        with ThreadPoolExecutor(4) as pool:
            assert all(n > 0 for n in pool.map(stream, range(4)))
        assert client.batches.retrieve(batch.id).status == "in_progress"        # the streams did not wait for it
        deadline = time.monotonic() + 300
        while (b := client.batches.retrieve(batch.id)).status != "completed":   # finalizing: its files being written
            assert time.monotonic() < deadline and b.status in ("in_progress", "finalizing"), b
            time.sleep(0.1)
        assert b.request_counts.completed == 64 and b.request_counts.failed == 0
        server.wait_idle()
        server.core("check")
    records = [json.loads(x) for x in log.read_text().splitlines()]
    interactive = [r for r in records if r.get("priority") == 0]
    batch_lines = [r for r in records if r.get("priority") == 10]
    assert len(interactive) == 4 and len(batch_lines) == 64
    assert all(r["num_preemptions"] == 0 for r in interactive), interactive
    assert sum(r["num_preemptions"] for r in batch_lines) > 0           # the cache was short
