"""Server faults: API key, overload (429), engine death, SIGTERM, CLI flags that are not supported yet."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest

from kvflow.config import EngineConfig
from kvflow.server.testing import ServerThread, free_port
from engine_faults import inject_into_engine
from tiny_models import make_tiny_hf_model

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return make_tiny_hf_model(tmp_path_factory.mktemp("tiny-faults"), family="llama", seed=1)


def config(model_path, **kw):
    args = dict(model=str(model_path), dtype="float32", max_model_len=512, kv_cache_memory="16MiB",
                served_model_name="tiny")
    args.update(kw)
    return EngineConfig(**args)


def error_of(resp: httpx.Response, status: int) -> dict:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    return err


@pytest.mark.slow
def test_api_key(model_path):
    with ServerThread(config(model_path), api_key="s3cret") as server:
        body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        error_of(httpx.post(server.url + "/v1/chat/completions", json=body), 401)
        error_of(httpx.post(server.url + "/v1/chat/completions", json=body,
                            headers={"Authorization": "Bearer wrong"}), 401)
        error_of(httpx.get(server.url + "/v1/models"), 401)
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=server.base_url, api_key="wrong", max_retries=0).models.list()
        ok = openai.OpenAI(base_url=server.base_url, api_key="s3cret", max_retries=0)
        assert ok.chat.completions.create(**body).choices[0].message.content is not None
        assert httpx.get(server.url + "/health").status_code == 200     # health and metrics stay open
        assert httpx.get(server.url + "/metrics").status_code == 200


def read_sse(resp) -> list[dict]:
    events = []
    for line in resp.iter_lines():
        if line.startswith("data: ") and line != "data: [DONE]":
            events.append(json.loads(line[6:]))
        elif line == "data: [DONE]":
            events.append("DONE")
    return events


@pytest.mark.slow
def test_overload_429_and_accepted_requests_finish(model_path):
    with ServerThread(config(model_path, max_num_seqs=1), max_queue_len=1) as server, \
            httpx.Client(base_url=server.url, timeout=60) as http:
        body = {"model": "tiny", "prompt": "count with me", "max_tokens": 60, "temperature": 0, "stream": True,
                "ignore_eos": True}
        with http.stream("POST", "/v1/completions", json=body) as a:
            assert a.status_code == 200
            lines = a.iter_lines()
            next(line for line in lines if line.startswith("data: "))      # A is running
            with http.stream("POST", "/v1/completions", json=body) as b:    # B waits (max_num_seqs=1)
                assert b.status_code == 200
                c = http.post("/v1/completions", json={**body, "stream": False})
                err = error_of(c, 429)
                assert c.headers["retry-after"] == "1"
                assert "max-queue-len" in err["message"]
                with pytest.raises(openai.RateLimitError):
                    openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0).completions.create(
                        model="tiny", prompt="x", max_tokens=2)
                rest_a = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
                events_b = read_sse(b)
            assert rest_a[-1]["choices"][0]["finish_reason"] == "length"
            assert events_b[-1] == "DONE"
            assert events_b[-2]["choices"][0]["finish_reason"] == "length"
            text_b = "".join(e["choices"][0]["text"] for e in events_b[:-1])
            assert len(text_b) > 0
        server.wait_idle()
        server.core("check")


@pytest.mark.slow
def test_engine_death_gives_errors_and_503(model_path):
    with ServerThread(config(model_path)) as server:
        client = openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0, timeout=30)
        result: dict = {}

        def non_streamed():
            try:
                client.completions.create(model="tiny", prompt="wait for it", max_tokens=450, temperature=0,
                                          extra_body={"ignore_eos": True})
                result["ok"] = True
            except openai.APIStatusError as e:
                result["status"] = e.status_code
                result["body"] = e.body

        stream = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "go"}],
                                                max_tokens=450, temperature=0, stream=True,
                                                extra_body={"ignore_eos": True})
        it = iter(stream)
        next(it), next(it)
        t = threading.Thread(target=non_streamed)
        t.start()
        time.sleep(0.3)

        os.kill(server.engine.process.pid, signal.SIGKILL)      # the engine process dies mid-step
        with pytest.raises(openai.APIError, match="engine loop died"):
            for _ in it:
                pass
        t.join(30)
        assert not t.is_alive()
        assert result.get("status") == 503, result
        assert httpx.get(server.url + "/health").status_code == 503
        r = httpx.post(server.url + "/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 2})
        error_of(r, 503)
        assert "SIGKILL" in httpx.get(server.url + "/health").json()["error"]["message"]
        text = httpx.get(server.url + "/metrics").text
        assert 'kvflow:engine_alive{model_name="tiny"} 0.0' in text


@pytest.mark.slow
def test_sigterm_lets_in_flight_finish_then_exits_0(model_path, tmp_path):
    port = free_port()
    log_path = tmp_path / "requests.jsonl"
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvflow.cli", "serve", str(model_path), "--port", str(port), "--host", "127.0.0.1",
         "--dtype", "float32", "--max-model-len", "512", "--kv-cache-memory", "16MiB", "--served-model-name",
         "tiny", "--request-log", str(log_path), "--shutdown-grace-period", "30"],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, proc.stdout.read()
            try:
                if httpx.get(base + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "server did not start"
            time.sleep(0.2)
        body = {"model": "tiny", "prompt": "a long answer", "max_tokens": 300, "temperature": 0, "stream": True,
                "ignore_eos": True}
        with httpx.stream("POST", base + "/v1/completions", json=body, timeout=60) as r:
            lines = r.iter_lines()
            next(line for line in lines if line.startswith("data: "))
            proc.send_signal(signal.SIGTERM)
            time.sleep(0.5)
            with pytest.raises(httpx.HTTPError):   # no longer accepting
                httpx.get(base + "/health", timeout=2)
            events = [line for line in lines if line.startswith("data: ")]
        assert events[-1] == "data: [DONE]"
        assert json.loads(events[-2][6:])["choices"][0]["finish_reason"] == "length"
        assert proc.wait(60) == 0
        out = proc.stdout.read()
        assert "weights loaded" in out and "KV cache" in out and "max_model_len" in out
        entries = [json.loads(line) for line in log_path.read_text().splitlines()]
        assert len(entries) == 1
        e = entries[0]
        assert e["model"] == "tiny" and e["completion_tokens"] == 300 and e["finish_reason"] == "length"
        assert e["error"] is None and e["ttft"] > 0 and e["e2e"] >= e["ttft"] and e["queue_time"] >= 0
        assert set(e) >= {"id", "prompt_tokens", "cached_tokens"}
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.parametrize("flags, message", [
    (["--quantization", "int3"], "quantization must be one of"),
    (["--tensor-parallel-size", "0"], "tensor_parallel_size must be >= 1"),
    (["--tensor-parallel-size", "2", "--nnodes", "2"], "needs distributed_init_method"),
    (["--kv-cache-dtype", "fp16"], "kv_cache_dtype must be"),
    (["--scheduling-policy", "magic"], "scheduling_policy"),
    (["--max-queue-len", "0"], "max-queue-len"),
])
def test_unsupported_flags_fail_cleanly(flags, message, capsys):
    from kvflow.cli import main

    assert main(["serve", *flags]) == 2
    assert message in capsys.readouterr().err


def test_flags_reach_the_config():
    import argparse

    from kvflow.server.cli import add_serve_parser, config_from_args

    parser = argparse.ArgumentParser()
    add_serve_parser(parser.add_subparsers())
    args = parser.parse_args(["serve", "m", "--no-enable-prefix-caching", "--max-num-seqs", "7", "--block-size", "32",
                              "--max-num-batched-tokens", "64", "--kv-cache-memory", "1GiB", "--dtype", "float32",
                              "--served-model-name", "a", "b", "--scheduling-policy", "static", "--max-model-len",
                              "100", "--gpu-memory-utilization", "0.5", "--device", "cpu"])
    cfg = config_from_args(args)
    assert (cfg.model, cfg.enable_prefix_caching, cfg.max_num_seqs, cfg.block_size, cfg.max_num_batched_tokens,
            cfg.kv_cache_memory, cfg.dtype, cfg.served_model_name, cfg.scheduling_policy, cfg.max_model_len,
            cfg.gpu_memory_utilization, cfg.device) == \
        ("m", False, 7, 32, 64, 2 ** 30, "float32", "a", "static", 100, 0.5, "cpu")
    assert config_from_args(parser.parse_args(["serve"])).enable_prefix_caching is True


def start_serve(model_path, *flags) -> tuple[subprocess.Popen, str]:
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvflow.cli", "serve", str(model_path), "--port", str(port), "--host", "127.0.0.1",
         "--dtype", "float32", "--max-model-len", "512", "--kv-cache-memory", "16MiB", "--served-model-name",
         "tiny", *flags], cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
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
def test_sigterm_past_the_grace_period_ends_every_stream_with_error_and_done(model_path):
    """Streams still running when the grace period ends get an SSE error event and [DONE] (not a cut
    connection); a collected request gets 503; the server exits 0 soon after the grace period."""
    grace = 0.5
    proc, base = start_serve(model_path, "--shutdown-grace-period", str(grace))
    try:
        body = {"model": "tiny", "prompt": "a long answer", "max_tokens": 450, "temperature": 0, "stream": True,
                "ignore_eos": True}
        results: dict = {}
        started = threading.Barrier(7)    # 5 streams, the collected request, this thread

        def stream(i):
            with httpx.stream("POST", base + "/v1/completions", json=body, timeout=60) as r:
                lines = r.iter_lines()
                first = next(line for line in lines if line.startswith("data: "))
                started.wait(30)
                results[i] = [first] + [line for line in lines if line.startswith("data: ")]

        def collected():
            started.wait(30)
            r = httpx.post(base + "/v1/completions", json={**body, "stream": False}, timeout=60)
            results["collected"] = r

        threads = [threading.Thread(target=stream, args=(i,)) for i in range(5)] + [threading.Thread(target=collected)]
        for t in threads:
            t.start()
        started.wait(60)
        time.sleep(0.3)                         # the collected request is in flight too
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        for t in threads:
            t.join(60)
        assert proc.wait(60) == 0
        exit_s = time.monotonic() - t0
        assert exit_s < grace + 10, exit_s
        errors = 0
        for i in range(5):
            events = results[i]
            assert events[-1] == "data: [DONE]", events[-3:]
            last = json.loads(events[-2][6:])
            if "error" in last:
                errors += 1
                assert last["error"]["type"] == "service_unavailable" and "shutting down" in last["error"]["message"]
            else:
                assert last["choices"][0]["finish_reason"] == "length"
        assert errors > 0, "every stream finished within the grace period: the test proves nothing"
        r = results["collected"]
        assert r.status_code in (200, 503), r.text
        if r.status_code == 503:
            assert r.json()["error"]["code"] == "service_unavailable"
        assert "Traceback" not in proc.stdout.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


# ---- failure isolation: one request's fault ends that request, not the engine ------------------------------------
@pytest.mark.slow
def test_a_fault_in_one_requests_sampling_fails_it_alone(model_path, monkeypatch, tmp_path):
    inject_into_engine(monkeypatch, tmp_path / "fault", """
        from kvflow.runner.sampler import Sampler

        real = Sampler.__call__

        def faulty(self, logits, rows):        # an injected bug that only this request's data triggers
            if any(r.params.seed == 13 for r in rows):
                raise RuntimeError("injected sampling fault")
            return real(self, logits, rows)

        Sampler.__call__ = faulty
    """)
    with ServerThread(config(model_path)) as server:
        client = openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0, timeout=60)
        results = {}

        def run(name, **kw):
            try:
                r = client.completions.create(model="tiny", prompt=f"isolate {name}", max_tokens=24,
                                              temperature=0.8, extra_body={"ignore_eos": True}, **kw)
                results[name] = r.usage.completion_tokens
            except openai.APIStatusError as e:
                results[name] = e.status_code

        threads = [threading.Thread(target=run, args=(f"ok{i}",), kwargs={"seed": i}) for i in range(4)]
        threads.append(threading.Thread(target=run, args=("bad",), kwargs={"seed": 13}))
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert results == {"ok0": 24, "ok1": 24, "ok2": 24, "ok3": 24, "bad": 500}
        assert server.engine.is_alive and httpx.get(server.url + "/health").status_code == 200
        server.wait_idle()
        server.core("check")


@pytest.mark.slow
def test_a_fault_in_one_requests_detokenization_fails_it_alone(model_path, monkeypatch):
    from kvflow.detokenizer import IncrementalDetokenizer

    real = IncrementalDetokenizer.add

    def faulty(self, token_ids, stop_terminated=False):
        if "!" in self.stop:               # only the request that asked for this stop string
            raise UnicodeError("injected detokenizer fault")
        return real(self, token_ids, stop_terminated)

    monkeypatch.setattr(IncrementalDetokenizer, "add", faulty)
    with ServerThread(config(model_path)) as server:
        client = openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0, timeout=60)
        with pytest.raises(openai.InternalServerError):
            client.completions.create(model="tiny", prompt="x", max_tokens=8, stop=["!"])
        chunks = list(client.completions.create(model="tiny", prompt="x", max_tokens=8, stream=True,
                                                extra_body={"ignore_eos": True}))
        assert chunks[-1].choices[0].finish_reason == "length"
        assert server.engine.is_alive
        server.wait_idle()
        server.core("check")


@pytest.mark.slow
def test_offline_llm_with_tensor_parallel_exits_with_the_scripts_status(model_path, tmp_path):
    """`del llm` before exit, or a `with` block: status 0, no worker processes left behind."""
    script = tmp_path / "offline.py"
    script.write_text(f"""
from kvflow import LLM, SamplingParams

if __name__ == "__main__":       # the workers are spawned: they import this file again
    llm = LLM({str(model_path)!r}, dtype="float32", max_model_len=128, kv_cache_memory="8MiB",
              tensor_parallel_size=2)
    pids = [p.pid for _, p in llm.engine.executor.workers]
    print(llm.generate("hi", SamplingParams(max_tokens=2))[0].outputs[0].token_ids)
    del llm
    with LLM({str(model_path)!r}, dtype="float32", max_model_len=128, kv_cache_memory="8MiB",
             tensor_parallel_size=2) as llm2:
        pids += [p.pid for _, p in llm2.engine.executor.workers]
    print("PIDS", *pids)
""")
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    pids = [int(p) for p in done.stdout.split("PIDS")[1].split()]
    assert len(pids) == 2
    for pid in pids:
        assert not Path(f"/proc/{pid}").exists() or "zombie" in Path(f"/proc/{pid}/status").read_text().lower()
