"""The request log (--request-log): one JSON line per request, from the real server through the official openai
client and raw HTTP: 50 requests with errors, tool calls, structured outputs, streams and a client that goes
away; the counts equal each response's `usage`. Rotation by size through the real writer."""
from __future__ import annotations

import hashlib
import json
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from kvflow.config import EngineConfig
from kvflow.request_log import RequestLog, model_version
from kvflow.server.testing import ServerThread
from tiny_models import make_tiny_hf_model

UNIT_TOOL = {"type": "function", "function": {
    "name": "set_unit", "description": "Set the unit",
    "parameters": {"type": "object", "properties": {"unit": {"enum": ["c", "f"]}}, "required": ["unit"],
                   "additionalProperties": False}}}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = make_tiny_hf_model(tmp_path_factory.mktemp("tiny-reqlog"), family="llama", seed=3)
    cfg = EngineConfig(model=str(path), dtype="float32", max_model_len=512, kv_cache_memory="32MiB",
                       max_num_seqs=16, served_model_name="tiny")
    log = tmp_path_factory.mktemp("reqlog") / "requests.jsonl"
    with ServerThread(cfg, request_log=str(log), request_log_prompts=True) as s:
        s.request_log_path, s.model_path = log, path
        yield s


def read_lines(path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()]


@pytest.mark.slow
def test_fifty_requests_fifty_lines(server):
    client = openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0)
    expected: dict[str, dict] = {}       # X-Request-Id -> what its line must say

    def completion(i):
        r = client.completions.create(model="tiny", prompt=f"request {i}: " + "word " * (i % 7), max_tokens=4 + i % 5,
                                      temperature=0, user=f"user-{i}", extra_headers={"X-Request-Id": f"c{i}"},
                                      extra_body={"ignore_eos": True})
        return {"id": r.id, "usage": r.usage, "finish_reason": "length", "status": 200, "user": f"user-{i}"}

    def chat(i, stream):
        messages = [{"role": "user", "content": f"hello {i}"}]
        if stream:
            chunks = list(client.chat.completions.create(
                model="tiny", messages=messages, max_tokens=6, stream=True, stream_options={"include_usage": True},
                extra_headers={"X-Request-Id": f"s{i}"}, extra_body={"ignore_eos": True}))
            return {"id": chunks[0].id, "usage": chunks[-1].usage, "finish_reason": "length", "status": 200,
                    "prompt": messages}
        r = client.chat.completions.create(model="tiny", messages=messages, max_tokens=6,
                                           extra_headers={"X-Request-Id": f"h{i}"}, extra_body={"ignore_eos": True})
        return {"id": r.id, "usage": r.usage, "finish_reason": "length", "status": 200, "prompt": messages}

    def tool_call(i, stream):
        kw = dict(model="tiny", messages=[{"role": "user", "content": f"unit {i}?"}], max_tokens=40,
                  tools=[UNIT_TOOL], tool_choice={"type": "function", "function": {"name": "set_unit"}},
                  extra_headers={"X-Request-Id": f"t{i}"})
        if stream:
            chunks = list(client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
            names = [tc.function.name for c in chunks for ch in c.choices for tc in (ch.delta.tool_calls or [])
                     if tc.function and tc.function.name]
            finish = next(ch.finish_reason for c in chunks for ch in c.choices if ch.finish_reason)
            return {"id": chunks[0].id, "usage": chunks[-1].usage, "finish_reason": finish, "status": 200,
                    "tool_calls": names, "structured_output": "tool_choice"}
        r = client.chat.completions.create(**kw)
        return {"id": r.id, "usage": r.usage, "finish_reason": r.choices[0].finish_reason, "status": 200,
                "tool_calls": [c.function.name for c in r.choices[0].message.tool_calls or []],
                "structured_output": "tool_choice"}

    def json_object(i):
        r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "json"}],
                                           max_tokens=8, response_format={"type": "json_object"},
                                           extra_headers={"X-Request-Id": f"j{i}"})
        return {"id": r.id, "usage": r.usage, "finish_reason": r.choices[0].finish_reason, "status": 200,
                "structured_output": "json_object"}

    def bad(i, kind):
        try:
            if kind == "temperature":
                client.completions.create(model="tiny", prompt="x", max_tokens=2, temperature=-1,
                                          extra_headers={"X-Request-Id": f"e{i}"})
            else:
                client.completions.create(model="nope", prompt="x", max_tokens=2,
                                          extra_headers={"X-Request-Id": f"e{i}"})
        except openai.APIStatusError as e:
            return {"status": e.status_code, "error_type": e.body["type"] if "type" in e.body else e.body["error"]["type"]}
        raise AssertionError("no error")

    def disconnect(i):
        with httpx.Client(timeout=30) as http:
            with http.stream("POST", server.base_url + "/completions", headers={"X-Request-Id": f"d{i}"},
                             json={"model": "tiny", "prompt": "go on", "max_tokens": 400, "stream": True,
                                   "ignore_eos": True}) as resp:
                for line in resp.iter_lines():
                    if line.startswith("data: {"):
                        break               # one chunk, then hang up
        return {"status": 499, "error_type": "client_closed_request", "finish_reason": "abort"}

    jobs = ([(f"c{i}", completion, (i,)) for i in range(20)] + [(f"h{i}", chat, (i, False)) for i in range(6)]
            + [(f"s{i}", chat, (i, True)) for i in range(6)] + [(f"t{i}", tool_call, (i, i % 2 == 1)) for i in range(6)]
            + [(f"j{i}", json_object, (i,)) for i in range(3)]
            + [(f"e{i}", bad, (i, "temperature" if i < 4 else "model")) for i in range(6)]
            + [(f"d{i}", disconnect, (i,)) for i in range(3)])
    assert len(jobs) == 50
    with ThreadPoolExecutor(8) as pool:
        futures = {key: pool.submit(fn, *args) for key, fn, args in jobs}
        expected = {key: f.result() for key, f in futures.items()}
    server.wait_idle()
    server.core("check")        # the disconnected requests gave their blocks back

    lines = read_lines(server.request_log_path)
    assert len(lines) == 50, [x["client_request_id"] for x in lines]
    by_key = {x["client_request_id"]: x for x in lines}
    assert set(by_key) == set(expected)
    version = model_version(server.model_path)
    for key, want in expected.items():
        line = by_key[key]
        assert line["model_version"] == version
        assert line["status"] == want["status"], (key, line)
        assert line["time"] <= time.time()
        if "usage" in want:       # a success: the counts are the response's usage
            u = want["usage"]
            assert line["id"] == want["id"]
            assert line["model"] == "tiny" and line["error_type"] is None and line["error"] is None
            assert (line["prompt_tokens"], line["completion_tokens"]) == (u.prompt_tokens, u.completion_tokens), key
            assert line["cached_tokens"] == (u.prompt_tokens_details.cached_tokens if u.prompt_tokens_details else 0)
            assert line["finish_reason"] == want["finish_reason"], (key, line)
            assert 0 <= line["queue_time"] <= line["ttft"] <= line["e2e"]
            assert line["tpot"] is None if u.completion_tokens < 2 else line["tpot"] > 0
            assert line["tool_calls"] == want.get("tool_calls", [])
            assert line["structured_output"] == want.get("structured_output")
            assert line["num_preemptions"] == 0 and line["priority"] == 0
            if "user" in want:
                assert line["user"] == want["user"]
            if "prompt" in want:
                assert line["prompt"] == want["prompt"]
        else:                     # an error, or a client that went away
            assert line["error_type"] == want["error_type"], (key, line)
            if want["status"] == 499:
                assert line["finish_reason"] == "abort" and line["e2e"] > 0 and line["prompt_tokens"] > 0
            else:
                assert line["completion_tokens"] == 0 and line["error"]
    assert sum(1 for x in lines if x["tool_calls"] == ["set_unit"]) == 6
    assert all(x["finish_reason"] == "tool_calls" for x in lines if x["tool_calls"])


def test_model_version_label_and_hash(tmp_path):
    f = tmp_path / "m.gguf"
    f.write_bytes(b"weights" * 1000)
    assert model_version(f) == "sha256:" + hashlib.sha256(f.read_bytes()).hexdigest()
    log = RequestLog(str(tmp_path / "a.jsonl"), model_version="v7")
    log.write({"id": "x"})
    log.close()
    assert read_lines(tmp_path / "a.jsonl") == [{"id": "x", "model_version": "v7"}]


def test_rotation_by_size(tmp_path):
    path = tmp_path / "r.jsonl"
    log = RequestLog(str(path), max_bytes=2000, backup_count=2, model_version="v")
    for i in range(100):
        log.write({"id": f"req-{i}", "pad": "x" * 50})
    log.close()
    files = sorted(tmp_path.glob("r.jsonl*"))
    assert [p.name for p in files] == ["r.jsonl", "r.jsonl.1", "r.jsonl.2"]
    assert all(p.stat().st_size <= 2000 for p in files)
    kept = [x["id"] for p in reversed(files) for x in read_lines(p)]
    assert kept == [f"req-{i}" for i in range(100 - len(kept), 100)]     # the newest lines, in order


@pytest.mark.slow
def test_a_stuck_log_never_blocks_serving(tmp_path):
    """The log is a FIFO nobody reads: the writer thread blocks on it, the server does not (requests, /health);
    once a reader comes, the lines arrive."""
    import os
    import threading

    fifo = tmp_path / "stuck.jsonl"
    os.mkfifo(fifo)
    path = make_tiny_hf_model(tmp_path / "m", family="llama", seed=7)
    cfg = EngineConfig(model=str(path), dtype="float32", max_model_len=256, kv_cache_memory="16MiB", max_num_seqs=4,
                       served_model_name="tiny")
    got = []
    with ServerThread(cfg, request_log=str(fifo), model_version="v") as server:
        client = openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0, timeout=20)
        t0 = time.monotonic()
        ids = [client.completions.create(model="tiny", prompt=f"p{i}", max_tokens=3).id for i in range(5)]
        assert httpx.get(server.url + "/health").status_code == 200
        assert time.monotonic() - t0 < 15            # nothing waited on the log
        assert server.engine.request_log._thread.is_alive()

        def read():
            with open(fifo) as f:
                got.extend(f.readline() for _ in range(5))

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        reader.join(20)
    assert [json.loads(x)["id"] for x in got] == ids


def test_adapter_routes_and_embeddings(server):
    """The Responses and Messages APIs (adapters over the chat route) and embeddings: a line each, under the id
    the client sees, with the counts their usage reports."""
    client = openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0)
    r = client.responses.create(model="tiny", input="hello there", max_output_tokens=5,
                                extra_headers={"X-Request-Id": "a-resp"})
    with httpx.Client(base_url=server.url, timeout=30, headers={"X-Request-Id": "a-msg"}) as http:
        m = http.post("/v1/messages", json={"model": "tiny", "max_tokens": 5,
                                            "messages": [{"role": "user", "content": "hi " * 20}]}).json()
    e = client.embeddings.create(model="tiny", input=["a cat", "a dog"], extra_headers={"X-Request-Id": "a-emb"})
    server.wait_idle()
    lines = {x["client_request_id"]: x for x in read_lines(server.request_log_path)
             if x["client_request_id"] in ("a-resp", "a-msg", "a-emb")}
    assert lines["a-resp"]["id"] == r.id and lines["a-resp"]["route"] == "/v1/responses"
    assert (lines["a-resp"]["prompt_tokens"], lines["a-resp"]["completion_tokens"]) == \
        (r.usage.input_tokens, r.usage.output_tokens)
    u = m["usage"]
    assert lines["a-msg"]["id"] == m["id"] and lines["a-msg"]["route"] == "/v1/messages"
    assert lines["a-msg"]["prompt_tokens"] == u["input_tokens"] + u["cache_read_input_tokens"]
    assert (lines["a-msg"]["completion_tokens"], lines["a-msg"]["cached_tokens"]) == \
        (u["output_tokens"], u["cache_read_input_tokens"])
    assert lines["a-emb"]["route"] == "/v1/embeddings" and lines["a-emb"]["prompt_tokens"] == e.usage.prompt_tokens
    assert lines["a-emb"]["completion_tokens"] == 0 and lines["a-emb"]["status"] == 200
