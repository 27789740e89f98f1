"""--sse-ping-interval over real HTTP: a stream that waits for its first token gets an SSE comment (`: ping`) every
interval, on chat, completions, responses and messages, and the official `openai` and `anthropic` clients read such a
stream as if the pings were not there. The wait is a real one: the server runs one sequence at a time
(max_num_seqs=1) and a long request holds it until the test closes that request."""
from __future__ import annotations

import contextlib
import time

import anthropic
import httpx
import openai
import pytest

from kvflow.config import EngineConfig
from kvflow.server.testing import ServerThread
from tiny_models import make_tiny_hf_model

INTERVAL = 0.2
PING = ": ping"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = make_tiny_hf_model(tmp_path_factory.mktemp("tiny-pings"), family="llama", seed=0,
                              max_position_embeddings=8192)
    config = EngineConfig(model=str(path), dtype="float32", max_model_len=8192, kv_cache_memory="64MiB",
                          max_num_seqs=1, served_model_name="tiny", enforce_eager=True)
    with ServerThread(config, sse_ping_interval=INTERVAL) as s:
        yield s


@contextlib.contextmanager
def blocker(server):
    """A request that holds the server's one sequence slot (thousands of tokens) until the block exits."""
    with httpx.Client(timeout=60) as http:
        body = {"model": "tiny", "prompt": "hold", "max_tokens": 8000, "ignore_eos": True, "stream": True}
        with http.stream("POST", server.base_url + "/completions", json=body) as r:
            lines = r.iter_lines()
            assert next(line for line in lines if line.startswith("data:"))     # it runs
            yield


SURFACES = {
    "chat": ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}),
    "completions": ("/v1/completions", {"prompt": "hi", "max_tokens": 3}),
    "responses": ("/v1/responses", {"input": "hi", "max_output_tokens": 3}),
    "messages": ("/v1/messages", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}),
}


@pytest.mark.slow
@pytest.mark.parametrize("surface", SURFACES)
def test_a_waiting_stream_is_pinged_every_interval_then_streams_as_usual(server, surface):
    path, body = SURFACES[surface]
    pings: list[float] = []
    events_after = 0
    with httpx.Client(timeout=60) as http, contextlib.ExitStack() as held:
        held.enter_context(blocker(server))
        with http.stream("POST", server.url + path, json={"model": "tiny", "stream": True, **body}) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            for line in lines:
                if line == PING:
                    pings.append(time.monotonic())
                    if len(pings) == 4:
                        break
            gaps = [b - a for a, b in zip(pings, pings[1:])]
            assert all(INTERVAL * 0.8 <= g <= INTERVAL + 0.5 for g in gaps), gaps
            held.close()       # the blocker leaves: the stream gets its tokens and ends as it would without pings
            for line in lines:
                if line.startswith("data:"):
                    events_after += 1
                    last = line
    assert events_after >= 2, (surface, events_after)
    if surface in ("chat", "completions"):
        assert last == "data: [DONE]"
    elif surface == "messages":
        assert '"message_stop"' in last
    else:
        assert '"response.incomplete"' in last       # max_output_tokens reached


@pytest.mark.slow
def test_the_official_clients_read_a_pinged_stream(server):
    client = openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0, timeout=60)
    claude = anthropic.Anthropic(base_url=server.url, api_key="x", max_retries=0, timeout=60)
    with contextlib.ExitStack() as held:
        held.enter_context(blocker(server))
        chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                              max_tokens=3, stream=True, extra_body={"ignore_eos": True})
        message = claude.messages.create(model="tiny", max_tokens=3, stream=True,
                                         messages=[{"role": "user", "content": "hi"}])
        responses = client.responses.create(model="tiny", input="hi", max_output_tokens=3, stream=True)
        time.sleep(INTERVAL * 4)        # pings pile up in each stream before its first token
        held.close()
        chunks = list(chat)
        events = [e.type for e in message]
        kinds = [e.type for e in responses]
    assert chunks[-1].choices[0].finish_reason == "length"
    assert sum(1 for c in chunks if c.choices[0].delta.content) >= 1
    assert events[0] == "message_start" and events[-1] == "message_stop" and "content_block_delta" in events
    assert kinds[0] == "response.created" and kinds[-1] in ("response.completed", "response.incomplete")


def test_without_pings_configured_none_are_sent():
    from kvflow.server.serving.sse_pings import with_pings

    async def slow():
        import asyncio
        await asyncio.sleep(0.05)
        yield "data: 1\n\n"

    async def run(interval):
        return [e async for e in with_pings(slow(), interval)]

    import asyncio
    assert asyncio.run(run(None)) == ["data: 1\n\n"] == asyncio.run(run(-1))
    assert asyncio.run(run(0.01))[-1] == "data: 1\n\n" and asyncio.run(run(0.01))[0] == ": ping\n\n"
