"""`--data-parallel-size 2`: two engine processes behind one frontend, through the real server and the official
client: the same greedy answers as one engine, requests spread over both, a shared prefix kept on one, and
one engine's death is the server's."""
from __future__ import annotations

import concurrent.futures
import os
import signal
import time

import httpx
import openai
import pytest

from kvflow.config import EngineConfig
from kvflow.server.testing import ServerThread
from tiny_models import make_tiny_hf_model


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return make_tiny_hf_model(tmp_path_factory.mktemp("tiny-dp"), family="llama", seed=3)


def config(model_path, **kw):
    return EngineConfig(**{**dict(model=str(model_path), dtype="float32", max_model_len=512, kv_cache_memory="32MiB",
                                  served_model_name="tiny", enforce_eager=True), **kw})


PROMPTS = [f"request number {i} asks about " + "something else " * i for i in range(8)]


def answers(server) -> list[str]:
    client = openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0, timeout=60)
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        return list(pool.map(lambda p: client.completions.create(
            model="tiny", prompt=p, max_tokens=12, temperature=0, extra_body={"ignore_eos": True}).choices[0].text,
            PROMPTS))


@pytest.mark.slow
def test_two_engines_answer_as_one_and_share_the_work(model_path):
    with ServerThread(config(model_path)) as one:
        expected = answers(one)
    with ServerThread(config(model_path, data_parallel_size=2)) as two:
        assert len({p.pid for p in two.engine.processes}) == 2
        assert answers(two) == expected
        two.wait_idle()
        computed = [two.engine.call_core("counters", rank=r)["num_prompt_tokens_computed"] for r in (0, 1)]
        assert all(c > 0 for c in computed), computed          # both engines prefilled some of the prompts
        for r in (0, 1):
            two.engine.call_core("check", rank=r)

        # one long shared prefix: every request after the first lands where its blocks are cached
        client = openai.OpenAI(base_url=two.base_url, api_key="x", max_retries=0, timeout=60)
        system = "You are a careful assistant who answers in one line. " * 8
        before = [two.engine.call_core("counters", rank=r)["num_prompt_tokens_computed"] for r in (0, 1)]
        for i in range(4):
            client.completions.create(model="tiny", prompt=system + f"Question {i}?", max_tokens=2)
        two.wait_idle()
        after = [two.engine.call_core("counters", rank=r)["num_prompt_tokens_computed"] for r in (0, 1)]
        grew = [a - b for a, b in zip(after, before)]
        assert min(grew) == 0, grew                            # all four on one engine
        metrics = httpx.get(two.url + "/metrics").text
        hits = next(float(line.split()[-1]) for line in metrics.splitlines()
                    if line.startswith("vllm:prefix_cache_hits_total"))
        assert hits >= 3 * 64                                  # three requests found the prefix's blocks


@pytest.mark.slow
def test_one_engine_dying_is_the_servers_death(model_path):
    with ServerThread(config(model_path, data_parallel_size=2)) as server:
        assert answers(server)
        os.kill(server.engine.processes[1].pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while httpx.get(server.url + "/health").status_code != 503:
            assert time.monotonic() < deadline, "the frontend did not notice a dead engine"
            time.sleep(0.1)
        assert "SIGKILL" in httpx.get(server.url + "/health").json()["error"]["message"]
