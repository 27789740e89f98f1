"""llama-server's return_progress over real HTTP with the official `openai` client: a stream whose prompt takes
several steps (max_num_batched_tokens 16) sends a prompt_progress chunk (no choices) after each step that computed some
of it, before its first token: `processed` climbs by at most a step's budget to `total`, the prompt's size, and a
repeated prompt's `cache` counts its prefix-cache hits."""
from __future__ import annotations

import openai
import pytest

from kvflow.config import EngineConfig
from kvflow.server.testing import ServerThread
from tiny_models import make_tiny_hf_model

BUDGET = 16


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = make_tiny_hf_model(tmp_path_factory.mktemp("tiny-progress"), family="llama", seed=4)
    config = EngineConfig(model=str(path), dtype="float32", max_model_len=512, kv_cache_memory="8MiB",
                          max_num_batched_tokens=BUDGET, served_model_name="tiny", enforce_eager=True)
    with ServerThread(config) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0, timeout=60)


def progress_of(chunks) -> list[dict]:
    return [c.model_extra["prompt_progress"] for c in chunks if c.model_extra.get("prompt_progress")]


def check(progress: list[dict], total: int) -> None:
    assert len(progress) >= total // BUDGET - 1, progress       # one per step of the prompt (a cached part skipped)
    assert {p["total"] for p in progress} == {total}
    processed = [p["processed"] for p in progress]
    assert processed == sorted(set(processed)) and processed[-1] == total
    assert all(b - a <= BUDGET for a, b in zip(processed, processed[1:]))
    times = [p["time_ms"] for p in progress]
    assert times == sorted(times) and times[0] >= 0


def test_a_chat_stream_reports_its_prompts_progress_before_its_first_token(client):
    messages = [{"role": "user", "content": "tell me " * 60}]
    chunks = list(client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=3, stream=True, stream_options={"include_usage": True},
        extra_body={"return_progress": True, "ignore_eos": True}))
    total = chunks[-1].usage.prompt_tokens
    assert total > 4 * BUDGET
    progress = progress_of(chunks)
    check(progress, total)
    assert progress[0]["cache"] == 0
    first_token = next(i for i, c in enumerate(chunks) if c.choices and c.choices[0].delta.content)
    last_progress = max(i for i, c in enumerate(chunks) if c.model_extra.get("prompt_progress"))
    assert last_progress < first_token and all(not c.choices for c in chunks if c.model_extra.get("prompt_progress"))
    # the same prompt again: its full blocks come from the prefix cache, and the progress says so
    again = progress_of(client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=1, stream=True, extra_body={"return_progress": True}))
    assert again[-1]["processed"] == total and 0 < again[-1]["cache"] < total
    assert all(p["cache"] == again[-1]["cache"] <= p["processed"] for p in again)


def test_a_completion_stream_reports_it_too_and_only_when_asked(client):
    prompt = "once upon a time " * 30
    chunks = list(client.completions.create(model="tiny", prompt=prompt, max_tokens=2, stream=True,
                                            stream_options={"include_usage": True},
                                            extra_body={"return_progress": True}))
    check(progress_of(chunks), chunks[-1].usage.prompt_tokens)
    plain = list(client.completions.create(model="tiny", prompt=prompt + "x", max_tokens=2, stream=True))
    assert not progress_of(plain)


def test_return_progress_needs_a_stream(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=1,
                                       extra_body={"return_progress": True})
    assert e.value.body["param"] == "return_progress"
