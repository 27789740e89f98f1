"""/health means "can serve": 200 while the engine is alive and accepting, 503 (code draining) while a shutdown
drains in-flight requests (and engine_dead once the engine is gone: tests/test_server_faults.py); /health/live
stays 200 while draining. The real server, its real shutdown path (EngineServer: stop listening, drain, then close
connections)."""
from __future__ import annotations

import threading
import time

import httpx
import pytest

from kvflow.config import EngineConfig
from kvflow.server.testing import ServerThread
from tiny_models import make_tiny_hf_model


@pytest.mark.slow
def test_health_is_readiness_and_live_is_liveness(tmp_path):
    path = make_tiny_hf_model(tmp_path, family="llama", seed=6, max_position_embeddings=4096)
    cfg = EngineConfig(model=str(path), dtype="float32", max_model_len=4096, kv_cache_memory="16MiB", max_num_seqs=4)
    server = ServerThread(cfg, shutdown_grace_period=20).start()
    done = threading.Event()
    got = {}
    try:
        with httpx.Client(base_url=server.url, timeout=30) as http:     # one keep-alive connection
            assert http.get("/health").status_code == 200
            assert http.get("/health/live").status_code == 200

            def stream():
                with httpx.Client(timeout=60) as other, other.stream(
                        "POST", server.base_url + "/completions",
                        json={"prompt": "drain me", "max_tokens": 600, "stream": True, "ignore_eos": True}) as r:
                    got["lines"] = [line for line in r.iter_lines() if line]
                done.set()

            threading.Thread(target=stream, daemon=True).start()
            deadline = time.monotonic() + 30
            while not server.engine._streams and time.monotonic() < deadline:
                time.sleep(0.01)
            server.server.should_exit = True            # SIGTERM's path: drain, then close
            seen = None
            while not done.is_set() and time.monotonic() < deadline:
                r = http.get("/health")
                if r.status_code == 503:
                    seen = r.json()["error"]["code"]
                    assert http.get("/health/live").status_code == 200        # alive while draining
                    break
                time.sleep(0.01)
            assert seen == "draining"
        done.wait(60)
        assert got["lines"][-1] == "data: [DONE]" and len(got["lines"]) > 100    # the stream finished whole
    finally:
        server.stop()


@pytest.mark.slow
def test_load_counts_the_requests_in_flight_only_when_tracking_is_on(tmp_path):
    """vLLM's GET /load: with --enable-server-load-tracking, the generate requests in flight (a stream until it
    ends); without it, 0."""
    import openai

    model = make_tiny_hf_model(tmp_path / "tiny", family="llama", seed=5)
    config = EngineConfig(model=str(model), dtype="float32", max_model_len=256, kv_cache_memory="8MiB",
                          enforce_eager=True, served_model_name="tiny")
    for tracking in (True, False):
        with ServerThread(config, enable_server_load_tracking=tracking) as server:
            assert httpx.get(server.url + "/load").json() == {"server_load": 0}
            client = openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0)
            stream = client.completions.create(model="tiny", prompt="x", max_tokens=200, stream=True,
                                               extra_body={"ignore_eos": True})
            next(iter(stream))                      # the stream is open: its request is in flight
            assert httpx.get(server.url + "/load").json() == {"server_load": int(tracking)}
            for _ in stream:
                pass
            deadline = time.monotonic() + 10
            while httpx.get(server.url + "/load").json()["server_load"] and time.monotonic() < deadline:
                time.sleep(0.02)
            assert httpx.get(server.url + "/load").json() == {"server_load": 0}
            client.completions.create(model="tiny", prompt="x", max_tokens=2)
            assert httpx.get(server.url + "/load").json() == {"server_load": 0}
