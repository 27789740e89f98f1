"""A hybrid (a random-weight tiny Qwen3.5: Gated DeltaNet beside attention) served whole: `kvflow serve` to the
official `openai` client — 16 concurrent streamed chats give what each gives alone, the boot's cache figures count the
state slots (vllm:cache_config_info, kv_cache_usage_perc), a repeated prompt hits the prefix cache — and
`kvflow run-batch` answering a file with each hybrid family."""
from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import openai
import pytest

from kvflow.config import EngineConfig
from kvflow.server.testing import ServerThread
from tiny_models import make_tiny_hf_model

REPO = Path(__file__).resolve().parent.parent
ENGINE = dict(dtype="float32", max_model_len=512, kv_cache_memory="64MiB", max_num_seqs=16)


@pytest.fixture(scope="module")
def qwen35_path(tmp_path_factory):
    return make_tiny_hf_model(tmp_path_factory.mktemp("qwen35-serve"), family="qwen3_5", seed=4)


@pytest.fixture(scope="module")
def server(qwen35_path):
    with ServerThread(EngineConfig(model=str(qwen35_path), served_model_name="hybrid", **ENGINE)) as s:
        yield s


def chat(n: int) -> list[dict]:
    return [{"role": "user", "content": f"Question {n}: " + "tell me about the sea " * (1 + n % 5)}]


@pytest.mark.slow
def test_concurrent_streams_give_what_each_gives_alone(server):
    aclient = openai.AsyncOpenAI(base_url=server.base_url, api_key="x", max_retries=0, timeout=300)

    async def one(n: int) -> str:
        stream = await aclient.chat.completions.create(model="hybrid", messages=chat(n), max_tokens=12,
                                                       temperature=0, stream=True)
        return "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])

    async def all_at_once():
        return await asyncio.gather(*(one(n) for n in range(16)))

    together = asyncio.run(all_at_once())
    client = openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0, timeout=300)
    for n in (0, 3, 7):
        alone = client.chat.completions.create(model="hybrid", messages=chat(n), max_tokens=12, temperature=0)
        assert alone.choices[0].message.content == together[n]


@pytest.mark.slow
def test_metrics_count_the_state_slots_and_a_repeated_prompt_hits(server):
    client = openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0, timeout=300)
    prompt = "A long shared instruction. " * 12
    for _ in range(2):
        r = client.completions.create(model="hybrid", prompt=prompt, max_tokens=4, temperature=0)
    assert r.usage.prompt_tokens_details.cached_tokens >= 16
    metrics = httpx.get(server.url + "/metrics").text
    info = next(line for line in metrics.splitlines() if line.startswith("vllm:cache_config_info{"))
    # 16 live state slots (max_num_seqs): at most 16 requests at max_model_len at once, whatever the blocks allow
    assert 'kv_cache_max_concurrency="' in info
    concurrency = float(info.split('kv_cache_max_concurrency="')[1].split('"')[0])
    assert 0 < concurrency <= 16
    assert any(line.startswith("vllm:kv_cache_usage_perc") for line in metrics.splitlines())


@pytest.mark.slow
@pytest.mark.parametrize("family", ["lfm2", "qwen3_5", "granitemoehybrid"])
def test_run_batch_answers_a_file(family, tmp_path):
    path = make_tiny_hf_model(tmp_path / family, family=family, seed=4)
    lines = [{"custom_id": f"c{i}", "method": "POST", "url": "/v1/chat/completions",
              "body": {"model": str(path), "messages": chat(i), "max_tokens": 6, "temperature": 0}} for i in range(4)]
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text("".join(json.dumps(x) + "\n" for x in lines))
    run = subprocess.run([sys.executable, "-m", "kvflow.cli", "run-batch", "-i", str(inp), "-o", str(out),
                          str(path), "--dtype", "float32", "--max-model-len", "512", "--kv-cache-memory",
                          "64MiB"], capture_output=True, text=True, timeout=600, cwd=REPO,
                         env={**os.environ, "PYTHONPATH": str(REPO)})
    assert run.returncode == 0, run.stderr[-3000:]
    records = {r["custom_id"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert set(records) == {f"c{i}" for i in range(4)}
    for r in records.values():
        assert r["error"] is None and r["response"]["status_code"] == 200
        assert r["response"]["body"]["usage"]["completion_tokens"] == 6
