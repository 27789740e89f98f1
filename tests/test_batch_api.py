"""The online Batch API: /v1/files and /v1/batches through the official openai client against the real
server (uvicorn + AsyncEngine, a tiny random-weight model), the SQLite store on disk under a tmp --batch-dir.

- 200 lines (two files: a chat batch and a completions batch, as OpenAI's one-endpoint-per-batch rule has it, with
  bodies the routes refuse among them) run to `completed`: every custom_id once in the output or the error file,
  good lines equal to what the same request returns online, counts, usage and metrics add up.
- `kvflow serve` killed with SIGKILL mid-batch and started again on the same --batch-dir: the batch completes, no
  custom_id is missing or twice, and the lines committed before the kill were not run again (the new process's
  engine ran exactly the rest: vllm:request_success_total).
- Cancel mid-run; a completion window that ends; files and batches that do not exist; bad input files (OpenAI's
  validation errors, per line); limits (file size, disk space); pagination; the API key; `kvflow batch report`.
"""
from __future__ import annotations

import json
import os
import re
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

from kvflow.config import EngineConfig
from kvflow.server.testing import ServerThread, free_port
from tiny_models import make_tiny_hf_model

REPO = Path(__file__).resolve().parents[1]
ENGINE = dict(dtype="float32", max_model_len=256, kv_cache_memory="16MiB", enforce_eager=True,
              served_model_name="tiny")
FINAL = ("completed", "failed", "cancelled", "expired")
WORDS = ["alpha", "kernel", "paged cache", "the river", "seven apples", "a quiet", "blue", "numbers: 3 5"]


def line(custom_id, url, body, method="POST") -> str:
    return json.dumps({"custom_id": custom_id, "method": method, "url": url, "body": body})


def chat_body(i: int, **kw) -> dict:
    return {"model": "tiny", "messages": [{"role": "user", "content": f"Say {WORDS[i % 8]} {i}"}],
            "max_tokens": 3 + i % 4, "temperature": 0, **kw}


def completion_body(i: int, **kw) -> dict:
    return {"model": "tiny", "prompt": f"Once upon {WORDS[i % 8]} {i}", "max_tokens": 3 + i % 3, "temperature": 0,
            **kw}


def slow_body(i: int) -> dict:
    return {"model": "tiny", "prompt": f"count {i}", "max_tokens": 40, "ignore_eos": True, "temperature": 0}


def jsonl(lines: list[str]) -> bytes:
    return ("\n".join(lines) + "\n").encode()


def upload(client, lines: list[str], name="requests.jsonl"):
    return client.files.create(file=(name, jsonl(lines)), purpose="batch")


def wait_for(client, batch_id: str, statuses=FINAL, timeout: float = 300, until=None):
    deadline = time.monotonic() + timeout
    while True:
        b = client.batches.retrieve(batch_id)
        if b.status in statuses or (until is not None and until(b)):
            return b
        assert time.monotonic() < deadline, b
        time.sleep(0.1)


def records(client, file_id: str | None) -> list[dict]:
    if file_id is None:
        return []
    return [json.loads(x) for x in client.files.content(file_id).text.splitlines()]


def engine_requests(base_url: str) -> float:
    """Requests the engine finished (every reason), from /metrics."""
    text = httpx.get(base_url + "/metrics").text
    return sum(float(m.group(1)) for m in re.finditer(r'^vllm:request_success_total\{[^}]*\} (\S+)$', text, re.M))


def metric(base_url: str, name: str, **labels) -> float:
    text = httpx.get(base_url + "/metrics").text
    for m in re.finditer(rf'^{re.escape(name)}\{{([^}}]*)\}} (\S+)$', text, re.M):
        got = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1)))
        if all(got.get(k) == v for k, v in labels.items()):
            return float(m.group(2))
    raise KeyError(name)


def error_of(exc_info, status: int) -> dict:
    e = exc_info.value
    assert e.status_code == status, e
    body = e.response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    return body["error"]


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return make_tiny_hf_model(tmp_path_factory.mktemp("tiny-batch-api"), family="llama", seed=7)


@pytest.fixture(scope="module")
def server(model_path, tmp_path_factory):
    with ServerThread(EngineConfig(model=str(model_path), max_num_seqs=32, **ENGINE),
                      batch_dir=str(tmp_path_factory.mktemp("batches"))) as s:
        yield s


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server.base_url, api_key="none", max_retries=0, timeout=60)


# ---- 200 lines to completed -------------------------------------------------------------------------------------
REFUSED = {   # bodies the routes refuse when the line runs: OpenAI puts them in the error file with their status
    "chat-refused-type": (chat_body(0, max_tokens="lots"), 400, "max_tokens"),
    "chat-refused-best-of": (chat_body(1, best_of=2), 400, "best_of"),
    "chat-streamed": (chat_body(2, stream=True), 400, "stream"),
    "chat-bad-temperature": (chat_body(3, temperature=-1), 400, "temperature"),
    "cmpl-refused-type": (completion_body(0, max_tokens="lots"), 400, "max_tokens"),
    "cmpl-no-prompt": ({"model": "tiny", "max_tokens": 3}, 400, "prompt"),
}


@pytest.fixture(scope="module")
def two_hundred(server):
    client = openai.OpenAI(base_url=server.base_url, api_key="none", max_retries=0, timeout=60)
    before = engine_requests(server.url)
    chat = [line(f"chat-{i}", "/v1/chat/completions", chat_body(i)) for i in range(96)]
    cmpl = [line(f"cmpl-{i}", "/v1/completions", completion_body(i)) for i in range(98)]
    for cid, (body, _, _) in REFUSED.items():     # spread among the good lines
        target = chat if cid.startswith("chat") else cmpl
        target.insert(7 * len(target) // 10 if "type" in cid else len(target) // 3, line(cid, (
            "/v1/chat/completions" if cid.startswith("chat") else "/v1/completions"), body))
    assert len(chat) + len(cmpl) == 200
    files = [upload(client, chat, "chat.jsonl"), upload(client, cmpl, "completions.jsonl")]
    batches = [client.batches.create(input_file_id=files[0].id, endpoint="/v1/chat/completions",
                                     completion_window="24h", metadata={"job": "nightly-eval"}),
               client.batches.create(input_file_id=files[1].id, endpoint="/v1/completions", completion_window="24h")]
    assert [b.status for b in batches] == ["validating", "validating"]
    done = [wait_for(client, b.id) for b in batches]
    return dict(lines=chat + cmpl, files=files, created=batches, batches=done, before=before,
                ran=engine_requests(server.url) - before)


@pytest.mark.slow
def test_200_lines_complete_with_every_custom_id_once(two_hundred, client):
    outputs, errors = [], []
    for b in two_hundred["batches"]:
        assert b.status == "completed", b
        assert b.errors is None and b.output_file_id and b.error_file_id
        assert b.in_progress_at and b.finalizing_at and b.completed_at and b.expires_at == b.created_at + 86400
        outputs += records(client, b.output_file_id)
        errors += records(client, b.error_file_id)
    assert len(outputs) + len(errors) == 200
    ids = [r["custom_id"] for r in outputs + errors]
    assert sorted(ids) == sorted(json.loads(x)["custom_id"] for x in two_hundred["lines"])
    assert all(r["response"]["status_code"] == 200 and r["error"] is None for r in outputs)
    assert {r["custom_id"] for r in errors} == set(REFUSED)
    for r in outputs + errors:
        assert set(r) == {"id", "custom_id", "response", "error"} and r["id"].startswith("batch_req_")
    chat, cmpl = two_hundred["batches"]
    assert chat.request_counts.model_dump() == {"total": 100, "completed": 96, "failed": 4}
    assert cmpl.request_counts.model_dump() == {"total": 100, "completed": 98, "failed": 2}
    assert chat.metadata == {"job": "nightly-eval"} and chat.model == "tiny"
    assert two_hundred["ran"] == 194          # refused lines never reach the engine
    for b, n in ((chat, 96), (cmpl, 98)):     # usage: the sum of the output lines' usage
        lines = [r for r in outputs if r["custom_id"].startswith("chat" if "chat" in b.endpoint else "cmpl")]
        assert len(lines) == n
        u = b.usage
        assert u.output_tokens == sum(r["response"]["body"]["usage"]["completion_tokens"] for r in lines) > 0
        assert u.input_tokens == sum(r["response"]["body"]["usage"]["prompt_tokens"] for r in lines) > 0
        assert u.total_tokens == u.input_tokens + u.output_tokens


def test_refused_lines_carry_the_routes_status_and_error_body(two_hundred, client, server):
    errors = {r["custom_id"]: r for b in two_hundred["batches"] for r in records(client, b.error_file_id)}
    with httpx.Client(base_url=server.url, timeout=60) as http:
        for cid, (body, status, param) in REFUSED.items():
            r = errors[cid]
            assert r["response"]["status_code"] == status and r["error"] is None, r
            assert r["response"]["body"]["error"]["param"] == param, r
            if cid != "chat-streamed":     # online, stream: true streams; a batch line cannot
                url = "/v1/chat/completions" if cid.startswith("chat") else "/v1/completions"
                online = http.post(url, json=body)
                assert online.status_code == status and online.json() == r["response"]["body"], cid


@pytest.mark.slow
def test_good_lines_equal_the_online_answer(two_hundred, client, server):
    outputs = {r["custom_id"]: r for b in two_hundred["batches"] for r in records(client, b.output_file_id)}
    bodies = {json.loads(x)["custom_id"]: json.loads(x) for x in two_hundred["lines"]}
    with httpx.Client(base_url=server.url, timeout=60) as http:
        for cid, r in outputs.items():
            req = bodies[cid]
            online = http.post(req["url"], json=req["body"]).json()
            body = r["response"]["body"]
            assert body["object"] == online["object"] and r["response"]["request_id"] == body["id"]
            for usage in (body["usage"], online["usage"]):   # prefix-cache hits depend on what ran before
                usage.pop("prompt_tokens_details", None)
            assert body["usage"] == online["usage"], cid
            assert body["choices"] == online["choices"], cid


def test_files_and_metrics_after_the_batches(two_hundred, client, server):
    chat, cmpl = two_hundred["batches"]
    out = client.files.retrieve(chat.output_file_id)
    assert out.purpose == "batch_output" and out.filename == f"{chat.id}_output.jsonl"
    assert out.bytes == len(client.files.content(chat.output_file_id).content)
    inp = client.files.retrieve(two_hundred["files"][0].id)
    assert inp.purpose == "batch" and inp.filename == "chat.jsonl" and inp.status == "processed"
    assert client.files.content(inp.id).content == jsonl([x for x in two_hundred["lines"] if '"chat-' in x])
    listed = [f.id for f in client.files.list(purpose="batch_output")]
    assert {chat.output_file_id, chat.error_file_id, cmpl.output_file_id, cmpl.error_file_id} <= set(listed)
    assert metric(server.url, "kvflow:batch_requests_total", status="completed") >= 194
    assert metric(server.url, "kvflow:batch_requests_total", status="failed") >= 6
    assert metric(server.url, "kvflow:batches", status="completed") >= 2
    assert metric(server.url, "kvflow:batch_queue_depth") == 0


def test_batch_report_on_a_finished_batch(two_hundred, server):
    chat = two_hundred["batches"][0]
    run = subprocess.run([sys.executable, "-m", "kvflow.cli", "batch", "report", chat.id, "--batch-dir",
                          server.config.batch_dir, "--cost-per-hour", "3.6"], capture_output=True, text=True,
                         cwd=REPO, timeout=120, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert run.returncode == 0, run.stderr
    out = run.stdout
    assert out.startswith(f"# Batch {chat.id}")
    assert "| status | completed |" in out and "| requests | 100 total: 96 completed, 4 failed, 0 not run |" in out
    assert f"{chat.usage.output_tokens:,} output" in out
    wall = float(re.search(r"\| wall time \| ([\d.,]+) s \|", out).group(1).replace(",", ""))
    assert wall > 0
    cost = float(re.search(r"\| cost \| ([\d.e+-]+) at 3.6/hour", out).group(1))
    assert cost == pytest.approx(3.6 * wall / 3600, rel=0.01, abs=1e-8)
    per = float(re.search(r"\| cost per successful request \| ([\d.e+-]+) \|", out).group(1))
    assert per == pytest.approx(cost / 96, rel=0.02)
    # failed requests by kind: max_tokens, best_of and stream have no code; temperature's is invalid_value
    assert "| 3 | 400 | - | " in out and "| 1 | 400 | invalid_value | temperature" in out
    bad = subprocess.run([sys.executable, "-m", "kvflow.cli", "batch", "report", "batch_nope", "--batch-dir",
                          server.config.batch_dir], capture_output=True, text=True, cwd=REPO, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(REPO)})
    assert bad.returncode == 2 and "no batch 'batch_nope'" in bad.stderr


# ---- bad input --------------------------------------------------------------------------------------------------
def test_a_bad_input_file_fails_the_batch_with_openais_line_errors(client, server):
    before = engine_requests(server.url)
    good = chat_body(0)
    lines = [
        line("ok-1", "/v1/chat/completions", good),
        '{"custom_id": "broken", "method": "POST", "url": "/v1/chat/completions", "body": {',     # 2: malformed
        line("unknown-url", "/v1/images/generations", {"prompt": "a cat"}),                        # 3
        line("mismatched", "/v1/completions", completion_body(0)),                                 # 4
        line("no-such-model", "/v1/chat/completions", {**good, "model": "gpt-9"}),                 # 5
        line("ok-1", "/v1/chat/completions", good),                                                # 6: duplicate
        json.dumps({"method": "POST", "url": "/v1/chat/completions", "body": good}),               # 7: no custom_id
        line("ok-2", "/v1/chat/completions", good),
    ]
    f = upload(client, lines)
    b = wait_for(client, client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                                               completion_window="24h").id)
    assert b.status == "failed" and b.failed_at and b.output_file_id is None and b.error_file_id is None
    assert b.request_counts.total == 0 and b.in_progress_at is None
    errs = {e.line: e for e in b.errors.data}
    assert b.errors.object == "list" and sorted(errs) == [2, 3, 4, 5, 6, 7]
    assert (errs[2].code, errs[2].param) == ("invalid_json_line", None)
    assert (errs[3].code, errs[3].param) == ("invalid_url", "url") and "/v1/images/generations" in errs[3].message
    assert (errs[4].code, errs[4].param) == ("invalid_url", "url") and "prefix-match" in errs[4].message
    assert (errs[5].code, errs[5].param) == ("model_not_found", "body.model") and "gpt-9" in errs[5].message
    assert (errs[6].code, errs[6].param) == ("duplicate_custom_id", "custom_id") and "line 1" in errs[6].message
    assert (errs[7].code, errs[7].param) == ("missing_required_parameter", "custom_id")
    assert engine_requests(server.url) == before                   # nothing ran
    empty = client.files.create(file=("empty.jsonl", b"\n\n"), purpose="batch")
    b = wait_for(client, client.batches.create(input_file_id=empty.id, endpoint="/v1/chat/completions",
                                               completion_window="24h").id)
    assert b.status == "failed" and [e.code for e in b.errors.data] == ["empty_file"]
    # nothing else affected: the server answers, a good batch runs
    assert client.completions.create(model="tiny", prompt="still here", max_tokens=2).choices[0].text is not None
    f = upload(client, [lines[0], lines[-1]])
    assert wait_for(client, client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                                                  completion_window="24h").id).status == "completed"


def test_more_than_50000_lines_fail_the_batch(client, server):
    before = engine_requests(server.url)
    body = json.dumps({"model": "tiny", "prompt": "x", "max_tokens": 1})
    text = "".join(f'{{"custom_id": "r{i}", "method": "POST", "url": "/v1/completions", "body": {body}}}\n'
                   for i in range(50_001))
    f = client.files.create(file=("many.jsonl", text.encode()), purpose="batch")
    b = wait_for(client, client.batches.create(input_file_id=f.id, endpoint="/v1/completions",
                                               completion_window="24h").id)
    assert b.status == "failed" and [e.code for e in b.errors.data] == ["too_many_tasks"]
    assert "50001" in b.errors.data[0].message and "50000" in b.errors.data[0].message
    assert engine_requests(server.url) == before


def test_the_batch_flags_reach_the_server_config(tmp_path):
    import argparse

    from kvflow.server.cli import add_serve_parser, configs_from_args

    parser = argparse.ArgumentParser()
    add_serve_parser(parser.add_subparsers())
    _, server = configs_from_args(parser.parse_args([
        "serve", "m", "--batch-dir", str(tmp_path), "--max-batch-file-size", "1MiB", "--batch-max-concurrency", "3",
        "--batch-priority", "5", "--batch-min-free-space", "0"]))
    assert (server.batch_dir, server.max_batch_file_size, server.batch_max_concurrency, server.batch_priority,
            server.batch_min_free_space) == (str(tmp_path), 2**20, 3, 5, 0)
    defaults = configs_from_args(parser.parse_args(["serve", "m"]))[1]
    assert (defaults.batch_dir, defaults.max_batch_file_size, defaults.batch_max_concurrency,
            defaults.batch_priority) == ("~/.cache/kvflow/batches", 200 * 2**20, None, 10)
    with pytest.raises(ValueError, match="batch-max-concurrency"):
        configs_from_args(parser.parse_args(["serve", "m", "--batch-max-concurrency", "0"]))


def test_what_does_not_exist_is_a_404_in_openais_shape(client):
    with pytest.raises(openai.NotFoundError) as e:
        client.batches.create(input_file_id="file-nope", endpoint="/v1/chat/completions", completion_window="24h")
    err = error_of(e, 404)
    assert err["param"] == "input_file_id" and "file-nope" in err["message"] and err["type"] == "invalid_request_error"
    for call in (lambda: client.files.retrieve("file-nope"), lambda: client.files.content("file-nope"),
                 lambda: client.files.delete("file-nope"), lambda: client.batches.retrieve("batch_nope"),
                 lambda: client.batches.cancel("batch_nope")):
        with pytest.raises(openai.NotFoundError) as e:
            call()
        assert "nope" in error_of(e, 404)["message"]
    with pytest.raises(openai.NotFoundError) as e:
        client.batches.list(after="batch_nope")
    assert error_of(e, 404)["param"] == "after"


def test_bad_create_parameters_are_400s_naming_them(client):
    f = upload(client, [line("a", "/v1/chat/completions", chat_body(0))])
    cases = [
        (dict(endpoint="/v1/moderations", completion_window="24h"), "endpoint"),
        (dict(endpoint="/v1/chat/completions", completion_window="1 week"), "completion_window"),
        (dict(endpoint="/v1/chat/completions", completion_window="24h", metadata={f"k{i}": "v" for i in range(17)}),
         "metadata"),
        (dict(endpoint="/v1/chat/completions", completion_window="24h",
              extra_body={"output_expires_after": {"anchor": "created_at", "seconds": 3600}}), "output_expires_after"),
        (dict(endpoint="/v1/chat/completions", completion_window="24h", extra_body={"priority": 1}), "priority"),
    ]
    for kw, param in cases:
        with pytest.raises(openai.BadRequestError) as e:
            client.batches.create(input_file_id=f.id, **kw)
        assert error_of(e, 400)["param"] == param, kw
    out = wait_for(client, client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                                                 completion_window="24h").id)
    with pytest.raises(openai.BadRequestError) as e:      # an output file is not a batch input
        client.batches.create(input_file_id=out.output_file_id, endpoint="/v1/chat/completions",
                              completion_window="24h")
    assert error_of(e, 400)["param"] == "input_file_id"
    with pytest.raises(openai.BadRequestError) as e:      # a finished batch cannot be cancelled
        client.batches.cancel(out.id)
    assert "completed" in error_of(e, 400)["message"]
    with pytest.raises(openai.BadRequestError) as e:
        client.files.create(file=("x.jsonl", b"{}\n"), purpose="fine-tune")
    assert error_of(e, 400)["param"] == "purpose"
    with pytest.raises(openai.BadRequestError) as e:
        client.files.create(file=("x.jsonl", b"{}\n"), purpose="batch",
                            expires_after={"anchor": "created_at", "seconds": 3600})
    assert error_of(e, 400)["param"].startswith("expires_after")


@pytest.mark.slow
def test_upload_limits_file_size_and_disk_space(model_path, tmp_path):
    with ServerThread(EngineConfig(model=str(model_path), **ENGINE), batch_dir=str(tmp_path / "b"),
                      max_batch_file_size="4KiB", batch_min_free_space="4096TiB") as server:
        client = openai.OpenAI(base_url=server.base_url, api_key="none", max_retries=0)
        with pytest.raises(openai.APIStatusError) as e:       # over the limit by a little: the route's answer
            client.files.create(file=("big.jsonl", b"x" * 5000), purpose="batch")
        err = error_of(e, 413)
        assert err["code"] == "file_too_large" and "--max-batch-file-size" in err["message"]
        with pytest.raises(openai.APIStatusError) as e:       # by a lot: refused from Content-Length, unread
            client.files.create(file=("big.jsonl", b"x" * 200_000), purpose="batch")
        assert "--max-batch-file-size" in error_of(e, 413)["message"]
        with pytest.raises(openai.APIStatusError) as e:       # fits the limit, not the disk's reserve
            client.files.create(file=("ok.jsonl", b"{}\n"), purpose="batch")
        err = error_of(e, 507)
        assert err["code"] == "insufficient_storage" and "--batch-min-free-space" in err["message"]
        assert client.files.list().data == []
        # other bodies keep --max-request-body-size: a 5 kB request is fine
        assert httpx.post(server.url + "/tokenize", json={"prompt": "word " * 1000}).status_code == 200


def test_list_pages_newest_first(client):
    f = upload(client, [line("a", "/v1/completions", completion_body(0))])
    ids = [client.batches.create(input_file_id=f.id, endpoint="/v1/completions", completion_window="24h").id
           for _ in range(3)]
    page = client.batches.list(limit=2)
    assert [b.id for b in page.data] == ids[::-1][:2] and page.has_more
    rest = client.batches.list(limit=2, after=page.data[-1].id)
    assert rest.data[0].id == ids[0]
    assert [b.id for b in client.batches.list(limit=100).data][:3] == ids[::-1]
    for i in ids:
        wait_for(client, i)
    files = client.files.list(limit=1)
    assert len(files.data) == 1 and files.has_more
    assert client.files.delete(f.id).deleted
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(f.id)


@pytest.mark.slow
def test_the_api_key_guards_files_and_batches(model_path, tmp_path):
    with ServerThread(EngineConfig(model=str(model_path), **ENGINE), batch_dir=str(tmp_path / "b"),
                      api_key="sekret") as server:
        bad = openai.OpenAI(base_url=server.base_url, api_key="wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            bad.files.create(file=("x.jsonl", b"{}\n"), purpose="batch")
        with pytest.raises(openai.AuthenticationError):
            bad.batches.list()
        good = openai.OpenAI(base_url=server.base_url, api_key="sekret", max_retries=0)
        assert good.files.create(file=("x.jsonl", b"{}\n"), purpose="batch").id.startswith("file-")


# ---- cancel, expiry ---------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_cancel_mid_run_finishes_running_lines_and_starts_no_more(model_path, tmp_path):
    with ServerThread(EngineConfig(model=str(model_path), **ENGINE), batch_dir=str(tmp_path / "b"),
                      batch_max_concurrency=2) as server:
        client = openai.OpenAI(base_url=server.base_url, api_key="none", max_retries=0)
        f = upload(client, [line(f"c{i}", "/v1/completions", slow_body(i)) for i in range(30)])
        b = client.batches.create(input_file_id=f.id, endpoint="/v1/completions", completion_window="24h")
        b = wait_for(client, b.id, until=lambda b: b.request_counts.completed >= 2)
        assert metric(server.url, "kvflow:batches", status="in_progress") == 1
        assert 0 < metric(server.url, "kvflow:batch_queue_depth") <= 28
        cancelled = client.batches.cancel(b.id)
        assert cancelled.status in ("cancelling", "cancelled") and cancelled.cancelling_at
        b = wait_for(client, b.id)
        assert b.status == "cancelled" and b.cancelled_at and b.completed_at is None
        out = records(client, b.output_file_id)            # the partial output, readable
        assert len(out) == b.request_counts.completed and b.request_counts.failed == 0
        # those done when the cancel was taken, and at most the two running then (batch_max_concurrency)
        assert 2 <= cancelled.request_counts.completed <= len(out) <= cancelled.request_counts.completed + 2
        assert len({r["custom_id"] for r in out}) == len(out)
        assert all(r["response"]["body"]["usage"]["completion_tokens"] == 40 for r in out)   # ran to their end
        server.wait_idle()
        assert engine_requests(server.url) == len(out)     # no pending line was started
        time.sleep(0.5)
        assert client.batches.retrieve(b.id).request_counts.completed == len(out)


@pytest.mark.slow
def test_a_batch_past_its_completion_window_expires(model_path, tmp_path):
    with ServerThread(EngineConfig(model=str(model_path), **ENGINE), batch_dir=str(tmp_path / "b"),
                      batch_max_concurrency=1) as server:
        client = openai.OpenAI(base_url=server.base_url, api_key="none", max_retries=0)
        f = upload(client, [line(f"c{i}", "/v1/completions", slow_body(i)) for i in range(40)])
        b = client.batches.create(input_file_id=f.id, endpoint="/v1/completions", completion_window="2s")
        assert b.expires_at - b.created_at == 2
        b = wait_for(client, b.id, timeout=60)
        assert b.status == "expired" and b.expired_at
        out, err = records(client, b.output_file_id), records(client, b.error_file_id)
        assert len(out) + len(err) == 40 and 0 < len(out) < 40
        assert b.request_counts.model_dump() == {"total": 40, "completed": len(out), "failed": len(err)}
        assert all(r["response"] is None and r["error"]["code"] == "batch_expired" for r in err)


def test_an_embeddings_batch_equals_the_online_vectors(client, server):
    inputs = ["a cat", "vector of blue", ["two", "inputs"]]
    f = upload(client, [line(f"e{i}", "/v1/embeddings", {"model": "tiny", "input": x}) for i, x in enumerate(inputs)])
    b = wait_for(client, client.batches.create(input_file_id=f.id, endpoint="/v1/embeddings",
                                               completion_window="24h").id)
    assert b.status == "completed" and b.request_counts.completed == 3 and b.usage.output_tokens == 0
    out = {r["custom_id"]: r["response"]["body"] for r in records(client, b.output_file_id)}
    for i, x in enumerate(inputs):
        online = client.embeddings.create(model="tiny", input=x)
        assert len(out[f"e{i}"]["data"]) == len(online.data)
        for got, want in zip(out[f"e{i}"]["data"], online.data):
            assert got["embedding"] == pytest.approx(want.embedding, rel=1e-4, abs=1e-5)
    assert b.usage.input_tokens == sum(body["usage"]["prompt_tokens"] for body in out.values())


# ---- stop, SIGKILL and restart ----------------------------------------------------------------------------------
def committed(batch_dir: Path, batch_id: str) -> tuple[dict, str]:
    """The results committed for a batch (custom_id -> record text) and its status, read from the store."""
    with sqlite3.connect(batch_dir / "batches.sqlite3") as db:
        results = dict(db.execute("SELECT custom_id, record FROM results WHERE batch_id = ?", (batch_id,)).fetchall())
        status, = db.execute("SELECT status FROM batches WHERE id = ?", (batch_id,)).fetchone()
    return results, status


@pytest.mark.slow
def test_a_graceful_stop_commits_the_lines_in_flight_and_a_restart_resumes(model_path, tmp_path):
    batch_dir = tmp_path / "batches"
    n = 16
    config = EngineConfig(model=str(model_path), **ENGINE)
    with ServerThread(config, batch_dir=str(batch_dir), batch_max_concurrency=2) as server:
        client = openai.OpenAI(base_url=server.base_url, api_key="none", max_retries=0)
        f = upload(client, [line(f"c{i}", "/v1/completions", slow_body(i)) for i in range(n)])
        b = client.batches.create(input_file_id=f.id, endpoint="/v1/completions", completion_window="24h")
        at_stop = wait_for(client, b.id, until=lambda b: b.request_counts.completed >= 2).request_counts.completed
    results, status = committed(batch_dir, b.id)
    # the two lines in flight finished within the grace period and were committed; none was refused and kept
    assert status == "in_progress" and at_stop <= len(results) < n
    assert all(json.loads(r)["response"]["status_code"] == 200 for r in results.values())
    with ServerThread(config, batch_dir=str(batch_dir), batch_max_concurrency=2) as server:
        client = openai.OpenAI(base_url=server.base_url, api_key="none", max_retries=0)
        done = wait_for(client, b.id)
        assert done.status == "completed" and done.request_counts.completed == n
        out = records(client, done.output_file_id)
        assert sorted(r["custom_id"] for r in out) == sorted(f"c{i}" for i in range(n))
        assert engine_requests(server.url) == n - len(results)


def serve(model_path, batch_dir, *flags) -> tuple[subprocess.Popen, str]:
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvflow.cli", "serve", str(model_path), "--port", str(port), "--host", "127.0.0.1",
         "--dtype", "float32", "--max-model-len", "256", "--kv-cache-memory", "16MiB", "--enforce-eager",
         "--served-model-name", "tiny", "--batch-dir", str(batch_dir), "--log-level", "warning", *flags],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        assert proc.poll() is None, proc.stdout.read()
        try:
            if httpx.get(base + "/health", timeout=1).status_code == 200:
                return proc, base
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, "server did not start"
        time.sleep(0.2)


@pytest.mark.slow
def test_sigkill_mid_batch_then_restart_completes_each_line_once(model_path, tmp_path):
    batch_dir = tmp_path / "batches"
    n = 24
    proc, base = serve(model_path, batch_dir, "--batch-max-concurrency", "2")
    try:
        client = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0)
        f = upload(client, [line(f"c{i}", "/v1/completions", slow_body(i)) for i in range(n)])
        b = client.batches.create(input_file_id=f.id, endpoint="/v1/completions", completion_window="24h")
        wait_for(client, b.id, until=lambda b: b.request_counts.completed >= 5)
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    before, status = committed(batch_dir, b.id)           # what was committed before the kill
    assert status == "in_progress" and 5 <= len(before) < n
    proc, base = serve(model_path, batch_dir, "--batch-max-concurrency", "2")
    try:
        client = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0)
        done = wait_for(client, b.id)
        assert done.status == "completed", done
        assert done.request_counts.model_dump() == {"total": n, "completed": n, "failed": 0}
        out = records(client, done.output_file_id)
        assert sorted(r["custom_id"] for r in out) == sorted(f"c{i}" for i in range(n))   # none missing, none twice
        assert done.error_file_id is None
        # the lines committed before the kill are in the output as they were, and were not run again
        by_id = {r["custom_id"]: r for r in out}
        for cid, rec in before.items():
            assert by_id[cid] == json.loads(rec)
        assert engine_requests(base) == n - len(before)
        assert done.usage.output_tokens == 40 * n
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
