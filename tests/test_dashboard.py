"""/dashboard in a real browser: Debian's chromium, headless, driven by Playwright (executable_path pointed at it).
With 8 streams running on the real server, the page shows >= 8 request lanes and a growing step timeline within
5 s; a screenshot is saved under the test's tmp dir (KVFLOW_DASHBOARD_SCREENSHOT=PATH copies it there: the README's
docs/images/dashboard.png). Without a page open, the hub sends nothing."""
from __future__ import annotations

import os
import re
import shutil
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from kvflow.config import EngineConfig
from kvflow.server.testing import ServerThread
from tiny_models import make_tiny_hf_model

CHROMIUM = next((p for p in (os.environ.get("KVFLOW_CHROMIUM"), shutil.which("chromium"),
                             shutil.which("chromium-browser"), shutil.which("google-chrome")) if p), None)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = make_tiny_hf_model(tmp_path_factory.mktemp("tiny-dash"), family="llama", seed=5,
                              max_position_embeddings=4096)
    cfg = EngineConfig(model=str(path), dtype="float32", max_model_len=4096, kv_cache_memory="64MiB",
                       max_num_seqs=16, served_model_name="tiny")
    with ServerThread(cfg) as s:
        yield s


class Streams:
    """n streaming completions running in threads until stopped (each closes its stream when told)."""

    def __init__(self, server, n: int, max_tokens: int = 3000):
        self.stop = threading.Event()
        self.chunks = [0] * n

        def run(i):
            with httpx.Client(timeout=60) as http, http.stream(
                    "POST", server.base_url + "/completions",
                    json={"model": "tiny", "prompt": f"stream {i} " + "lorem ipsum " * (5 + 7 * i),
                          "max_tokens": max_tokens, "stream": True, "ignore_eos": True}) as resp:
                for line in resp.iter_lines():
                    if line.startswith("data: {"):
                        self.chunks[i] += 1
                    if self.stop.is_set():
                        return

        self.threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(n)]
        for t in self.threads:
            t.start()

    def close(self):
        self.stop.set()
        for t in self.threads:
            t.join(30)


@pytest.mark.slow
def test_nothing_sent_without_a_page(server):
    hub = server.app.state.dashboard
    sent = hub.messages_sent
    streams = Streams(server, 4, max_tokens=40)
    for t in streams.threads:
        t.join(60)
    server.wait_idle()
    assert hub.clients == 0 and hub.messages_sent == sent
    assert len(hub.steps) > 0 and len(hub.finished) >= 4      # the rings still filled (cheap, bounded)
    assert hub.steps.maxlen and hub.finished.maxlen


@pytest.mark.skipif(CHROMIUM is None, reason="no chromium here: install Debian's chromium (apt-get install "
                                             "chromium; .ci/run does) to run the dashboard in a real browser")
def test_dashboard_in_chromium(server, tmp_path):
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed (the test extra has it)")
    streams = Streams(server, 8)
    try:
        deadline = time.monotonic() + 30
        while sum(1 for c in streams.chunks if c) < 8 and time.monotonic() < deadline:   # all 8 are decoding
            time.sleep(0.05)
        with sync_api.sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=["--no-sandbox"])
            page = browser.new_page(viewport={"width": 1400, "height": 900})
            errors = []
            page.on("pageerror", lambda e: errors.append(str(e)))
            t0 = time.monotonic()
            page.goto(server.url + "/dashboard")
            page.wait_for_function("document.querySelectorAll('#lanes-svg .lane').length >= 8", timeout=5000)
            page.wait_for_function("+document.getElementById('timeline').dataset.steps > 0", timeout=5000)
            first = int(page.get_attribute("#timeline", "data-steps"))
            page.wait_for_function(f"+document.getElementById('timeline').dataset.steps > {first}", timeout=5000)
            assert time.monotonic() - t0 < 5 + 5      # the page's load, then the growth, each within 5 s
            assert server.app.state.dashboard.clients == 1
            lanes = page.locator("#lanes-svg .lane").count()
            assert lanes >= 8
            assert int(page.get_attribute("#kv", "data-blocks")) > 0       # the KV block map arrived
            assert page.text_content("#t-running") not in ("–", "0")
            page.locator("#lanes-svg .lane").last.click()                  # a lane's details
            assert "prompt tokens" in page.text_content("#detail")
            # a fuller picture: short requests sharing a prefix come and go beside the 8 streams
            shared = "You are a helpful assistant. " * 20
            with httpx.Client(timeout=60) as http:
                http.post(server.base_url + "/completions", json={"model": "tiny", "prompt": shared,
                                                                  "max_tokens": 4, "ignore_eos": True})
                with ThreadPoolExecutor(6) as pool:
                    list(pool.map(lambda i: http.post(server.base_url + "/completions", json={
                        "model": "tiny", "prompt": shared + f"question {i}", "max_tokens": 8 + 4 * i,
                        "ignore_eos": True}), range(6)))
            page.wait_for_timeout(1000)
            assert page.locator("#lanes-svg .lane").count() >= 15
            assert page.text_content("#t-ttft") != "–"                     # finished requests' percentiles
            assert re.fullmatch(r"this view: \d+\.\d\d% of the server's time", page.text_content("#cost"))
            shot = tmp_path / "dashboard.png"
            page.screenshot(path=str(shot), full_page=True)
            assert shot.stat().st_size > 10_000
            if os.environ.get("KVFLOW_DASHBOARD_SCREENSHOT"):
                shutil.copy(shot, os.environ["KVFLOW_DASHBOARD_SCREENSHOT"])
            assert not errors, errors
            browser.close()
    finally:
        streams.close()
    deadline = time.monotonic() + 10
    while server.app.state.dashboard.clients and time.monotonic() < deadline:    # the closed page's stream ends
        time.sleep(0.05)
    assert server.app.state.dashboard.clients == 0


def test_event_stream_numbers(server):
    """The stream the page reads: finished requests with the response's token counts, the steps that ran them,
    the KV block map with every block, the last minute's percentiles."""
    import json
    import openai

    client = openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0)
    usages = {}
    for i in range(3):
        r = client.completions.create(model="tiny", prompt=f"numbers {i} " + "alpha beta " * 20, max_tokens=5 + i, extra_body={"ignore_eos": True})
        usages[r.id] = r.usage
    server.wait_idle()
    with httpx.Client(timeout=30) as http, http.stream("GET", server.url + "/dashboard/events") as resp:
        assert resp.headers["content-type"].startswith("text/event-stream")
        line = next(x for x in resp.iter_lines() if x.startswith("data: "))
    msg = json.loads(line[6:])
    fields = msg["config"]["step_fields"]
    assert all(len(s) == len(fields) for s in msg["steps"])
    seqs = [s[0] for s in msg["steps"]]
    assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)
    finished = {r["id"]: r for r in msg["finished"]}
    for rid, u in usages.items():
        r = finished[rid]
        assert (r["prompt_tokens"], r["output_tokens"]) == (u.prompt_tokens, u.completion_tokens)
        assert r["reason"] == "length" and 0 < r["ttft"] and r["arrival"] <= r["first_token"] <= r["end"]
    generated = sum(s[fields.index("generated")] for s in msg["steps"])
    assert generated >= sum(u.completion_tokens for u in usages.values())
    assert msg["stats"]["ttft"]["p50"] is not None and msg["stats"]["finished_last_minute"] >= 3
    cost = msg["cost"]          # what the hub has spent: its steps and finished requests, this message's KV map
    assert 0 < cost["frontend_s"] < cost["uptime_s"] and 0 < cost["engine_s"] < cost["uptime_s"]
    metrics = httpx.get(server.url + "/metrics").text
    blocks = int(metrics.split('num_gpu_blocks="')[1].split('"')[0])
    assert len(msg["kv_map"]) == blocks and set(msg["kv_map"]) <= set("0123")
    assert "1" in msg["kv_map"]        # the finished prompts' full blocks stay in the prefix cache
    deadline = time.monotonic() + 10
    while server.app.state.dashboard.clients and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.app.state.dashboard.clients == 0
