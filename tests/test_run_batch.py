"""`kvflow run-batch` (offline): vLLM's batch file format through the server's own routes.

The real command (a subprocess) on a tiny random model: a file mixing chat, completions and embeddings with bad lines
(malformed JSON, an unknown url, a refused field, a streaming body, a body the model refuses, a model not served);
every custom_id once in the output, good lines equal to what `kvflow serve` answers for the same greedy request,
bad lines carry the server's status and OpenAI's error body. Resumed: the first half is run alone, then the whole
file into the same output, which keeps the first half's lines as they were and computes only the rest.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import httpx
import numpy as np
import pytest

from kvflow.config import EngineConfig
from kvflow.server.batch.runner import done_keys
from kvflow.server.testing import ServerThread
from tiny_models import make_tiny_hf_model

REPO = Path(__file__).resolve().parents[1]
ENGINE = dict(dtype="float32", max_model_len=256, kv_cache_memory="16MiB", enforce_eager=True,
              served_model_name="tiny")
FLAGS = ["--dtype", "float32", "--max-model-len", "256", "--kv-cache-memory", "16MiB", "--enforce-eager",
         "--served-model-name", "tiny", "--no-progress"]
WORDS = ["alpha", "kernel", "paged cache", "the river", "seven apples", "a quiet", "blue", "numbers: 3 5"]


def line(custom_id, url, body, method="POST") -> str:
    return json.dumps({"custom_id": custom_id, "method": method, "url": url, "body": body})


def batch_lines() -> list[str]:
    lines = []
    for i in range(6):
        lines.append(line(f"chat-{i}", "/v1/chat/completions",
                          {"model": "tiny", "messages": [{"role": "user", "content": f"Say {WORDS[i]}"}],
                           "max_tokens": 6 + i % 3, "temperature": 0}))
        lines.append(line(f"cmpl-{i}", "/v1/completions",
                          {"model": "tiny", "prompt": f"Once upon {WORDS[i + 1]}", "max_tokens": 8,
                           "temperature": 0}))
        if i < 3:
            lines.append(line(f"embd-{i}", "/v1/embeddings", {"model": "tiny", "input": f"vector of {WORDS[i]}"}))
    bad = [
        '{"custom_id": "broken", "method": "POST", "url": "/v1/completions", "body": {',   # malformed JSON
        line("unknown-url", "/v1/images/generations", {"prompt": "a cat"}),
        line("refused-best-of", "/v1/chat/completions",
             {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "best_of": 2}),
        line("refused-dimensions", "/v1/embeddings", {"model": "tiny", "input": "x", "dimensions": 8}),
        line("streamed", "/v1/chat/completions",
             {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "stream": True}),
        line("bad-type", "/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": "lots"}),
        line("no-such-model", "/v1/completions", {"model": "gpt-9", "prompt": "x", "max_tokens": 2}),
    ]
    # the bad lines spread among the good ones
    for k, b in enumerate(bad):
        lines.insert(2 + 3 * k, b)
    return lines


def run_batch(model_path, inp, out, *extra) -> subprocess.CompletedProcess:
    run = subprocess.run([sys.executable, "-m", "kvflow.cli", "run-batch", "-i", str(inp), "-o", str(out),
                          str(model_path), *FLAGS, *extra], capture_output=True, text=True, timeout=600, cwd=REPO,
                         env={**os.environ, "PYTHONPATH": str(REPO)})
    assert run.returncode == 0, run.stderr[-3000:]
    return run


def processed(run) -> tuple[int, int, int]:
    m = re.search(r"run-batch: (\d+) line\(s\) processed \((\d+) failed\), (\d+) skipped", run.stderr)
    assert m, run.stderr[-2000:]
    return tuple(int(x) for x in m.groups())


def read_output(path) -> list[dict]:
    return [json.loads(x) for x in Path(path).read_text().splitlines()]


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return make_tiny_hf_model(tmp_path_factory.mktemp("tiny-batch"), family="llama", seed=7)


@pytest.fixture(scope="module")
def batch(model_path, tmp_path_factory):
    """The first half run alone, then the whole file resumed into the same output."""
    d = tmp_path_factory.mktemp("batch")
    lines = batch_lines()
    half = len(lines) // 2
    (d / "half.jsonl").write_text("\n".join(lines[:half]) + "\n")
    (d / "all.jsonl").write_text("\n".join(lines) + "\n")
    out = d / "results.jsonl"
    first = run_batch(model_path, d / "half.jsonl", out)
    first_text = out.read_text()
    second = run_batch(model_path, d / "all.jsonl", out, "--max-concurrency", "4")
    return dict(lines=lines, half=half, out=out, first=first, first_text=first_text, second=second)


def by_id(records) -> dict:
    return {r["custom_id"]: r for r in records}


@pytest.mark.slow
def test_every_line_answered_once_and_good_lines_equal_the_servers_answer(batch, model_path):
    records = read_output(batch["out"])
    assert len(records) == len(batch["lines"])
    ids = [r["custom_id"] for r in records]
    named = [i for i in ids if i is not None]
    assert len(named) == len(set(named)) and ids.count(None) == 1     # the malformed line: no custom_id to give
    expected = {json.loads(x)["custom_id"] for x in batch["lines"] if not x.endswith("{")}
    assert set(named) == expected
    got = by_id(records)
    good = [json.loads(x) for x in batch["lines"] if not x.endswith("{")
            and json.loads(x)["custom_id"].startswith(("chat-", "cmpl-", "embd-"))]
    assert len(good) == 15
    for r in records:
        assert set(r) == {"id", "custom_id", "response", "error"}
        assert set(r["response"]) == {"status_code", "request_id", "body"}
    with ServerThread(EngineConfig(model=str(model_path), **ENGINE)) as server, \
            httpx.Client(base_url=server.url, timeout=120) as client:
        for g in good:
            r = got[g["custom_id"]]
            assert r["response"]["status_code"] == 200 and r["error"] is None, r
            online = client.post(g["url"], json=g["body"])
            assert online.status_code == 200, online.text
            online, body = online.json(), r["response"]["body"]
            assert body["object"] == online["object"]
            for usage in (body["usage"], online["usage"]):    # prefix-cache hits depend on what ran before
                usage.pop("prompt_tokens_details", None)
            assert body["usage"] == online["usage"]
            if g["url"] == "/v1/embeddings":
                np.testing.assert_allclose(body["data"][0]["embedding"], online["data"][0]["embedding"],
                                           rtol=1e-4, atol=1e-5)
            else:
                assert body["choices"] == online["choices"], g["custom_id"]
                assert body["choices"][0]["text" if g["url"] == "/v1/completions" else "message"]


@pytest.mark.slow
def test_bad_lines_carry_the_servers_status_and_openais_error_body(batch, model_path):
    records = read_output(batch["out"])
    got = by_id(records)
    expect = {"unknown-url": (404, "url"), "refused-best-of": (400, "best_of"),
              "refused-dimensions": (400, "dimensions"), "streamed": (400, "stream"),
              "bad-type": (400, "max_tokens"), "no-such-model": (404, "model"), None: (400, None)}
    for cid, (status, param) in expect.items():
        r = got[cid]
        assert r["response"]["status_code"] == status, r
        err = r["response"]["body"]["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["param"] == param, r
        assert r["error"] == r["response"]["body"]
    assert got[None]["response"]["body"]["error"]["message"].startswith("line 3: malformed JSON")
    assert got["no-such-model"]["response"]["body"]["error"]["code"] == "model_not_found"
    # the same bodies sent to the server are refused the same way
    bodies = {json.loads(x)["custom_id"]: json.loads(x) for x in batch["lines"] if not x.endswith("{")}
    with ServerThread(EngineConfig(model=str(model_path), **ENGINE)) as server, \
            httpx.Client(base_url=server.url, timeout=120) as client:
        for cid in ("refused-best-of", "refused-dimensions", "bad-type", "no-such-model"):
            online = client.post(bodies[cid]["url"], json=bodies[cid]["body"])
            assert online.status_code == got[cid]["response"]["status_code"]
            assert online.json() == got[cid]["response"]["body"], cid


@pytest.mark.slow
def test_a_resumed_run_keeps_the_first_runs_lines_and_computes_only_the_rest(batch):
    half, total = batch["half"], len(batch["lines"])
    assert processed(batch["first"])[0] == half and processed(batch["first"])[2] == 0
    done, failed, skipped = processed(batch["second"])
    assert (done, skipped) == (total - half, half)
    assert failed + processed(batch["first"])[1] == 7
    text = batch["out"].read_text()
    assert text.startswith(batch["first_text"])        # the first run's lines byte for byte
    assert len(done_keys(batch["out"])) == total


@pytest.mark.slow
def test_a_finished_output_is_not_run_again_and_a_cut_off_line_is_dropped(batch, model_path, tmp_path):
    out = tmp_path / "results.jsonl"
    full = batch["out"].read_text()
    kept = full.splitlines(keepends=True)
    out.write_text("".join(kept[:-1]) + kept[-1][:20])     # the last line cut off mid-write
    keys = done_keys(out)
    assert len(keys) == len(batch["lines"]) - 1 and out.read_text() == "".join(kept[:-1])
    inp = tmp_path / "all.jsonl"
    inp.write_text("\n".join(batch["lines"]) + "\n")
    again = run_batch(model_path, inp, out)
    assert processed(again)[:1] == (1,) and processed(again)[2] == len(batch["lines"]) - 1
    assert len(read_output(out)) == len(batch["lines"])


def test_a_repeated_custom_id_refuses_the_file_naming_the_line(model_path, tmp_path):
    inp = tmp_path / "dup.jsonl"
    body = {"model": "tiny", "prompt": "x", "max_tokens": 2}
    inp.write_text("\n".join([line("a", "/v1/completions", body), line("b", "/v1/completions", body),
                              line("a", "/v1/completions", body)]) + "\n")
    run = subprocess.run([sys.executable, "-m", "kvflow.cli", "run-batch", "-i", str(inp), "-o",
                          str(tmp_path / "out.jsonl"), str(model_path), *FLAGS], capture_output=True, text=True,
                         timeout=300, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert run.returncode == 2
    assert "line 3: custom_id 'a' is already used by line 1" in run.stderr
    assert not (tmp_path / "out.jsonl").exists()


@pytest.mark.slow
def test_the_progress_bar_shows_on_a_terminal_only(batch, model_path, tmp_path):
    import pty

    for run in (batch["first"], batch["second"]):      # not a TTY: no bar, only the summary
        assert "output tok/s" not in run.stderr
    inp = tmp_path / "in.jsonl"
    inp.write_text("\n".join(batch["lines"][:4]) + "\n")
    master, slave = pty.openpty()
    flags = [f for f in FLAGS if f != "--no-progress"]
    proc = subprocess.Popen([sys.executable, "-m", "kvflow.cli", "run-batch", "-i", str(inp), "-o",
                             str(tmp_path / "out.jsonl"), str(model_path), *flags], cwd=REPO, stdout=subprocess.DEVNULL,
                            stderr=slave, env={**os.environ, "PYTHONPATH": str(REPO), "TERM": "xterm"})
    os.close(slave)
    seen = b""
    while True:
        try:
            chunk = os.read(master, 4096)
        except OSError:          # the child closed the terminal
            break
        if not chunk:
            break
        seen += chunk
    assert proc.wait(timeout=300) == 0, seen[-2000:]
    os.close(master)
    text = seen.decode("utf-8", "replace")
    assert "4/4" in text and "output tok/s" in text and "failed" in text, text[-2000:]


@pytest.mark.slow
def test_an_interrupted_run_keeps_what_finished_and_a_rerun_completes_it(model_path, tmp_path):
    import signal
    import time

    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text("".join(line(f"c{i}", "/v1/completions", {"model": "tiny", "prompt": f"count {i}",
                                                              "max_tokens": 60, "ignore_eos": True}) + "\n"
                           for i in range(60)))
    # SIGINT as a terminal delivers it: a suite started in the background of a shell inherits it ignored (and so
    # would the child, which then never sees the interrupt)
    proc = subprocess.Popen([sys.executable, "-m", "kvflow.cli", "run-batch", "-i", str(inp), "-o", str(out),
                             str(model_path), *FLAGS, "--max-concurrency", "2"], cwd=REPO, stderr=subprocess.PIPE,
                            text=True, env={**os.environ, "PYTHONPATH": str(REPO)},
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.monotonic() + 300
    while not (out.exists() and out.read_text().count("\n") >= 3):
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    stderr = proc.communicate(timeout=120)[1]
    assert proc.returncode == 130, stderr[-2000:]
    assert "interrupted after" in stderr and "rerun the same command to resume" in stderr
    before = out.read_text()
    kept = len(before.splitlines())
    assert 3 <= kept < 60
    again = run_batch(model_path, inp, out)
    assert processed(again) == (60 - kept, 0, kept)
    text = out.read_text()
    assert text.startswith(before)
    ids = [json.loads(x)["custom_id"] for x in text.splitlines()]
    assert sorted(ids) == sorted(f"c{i}" for i in range(60))
