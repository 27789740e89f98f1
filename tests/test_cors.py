"""CORS (vLLM's --allowed-origins, --allowed-methods, --allowed-headers, --allow-credentials) over real HTTP: a
preflight and a simple request from an allowed origin get starlette's CORS headers, other origins get none, and a
server started without the flags sends no Access-Control-* header at all."""
from __future__ import annotations

import httpx
import pytest

from kvflow.config import EngineConfig
from kvflow.server.cli import add_serve_parser, configs_from_args
from kvflow.server.common.config import ServerConfig
from kvflow.server.testing import ServerThread
from tiny_models import make_tiny_hf_model

ORIGIN = "http://localhost:3000"
KEY = "s3cret"


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return make_tiny_hf_model(tmp_path_factory.mktemp("tiny-cors"), family="llama", seed=5)


def engine_config(path) -> EngineConfig:
    return EngineConfig(model=str(path), dtype="float32", max_model_len=256, kv_cache_memory="4MiB",
                        served_model_name="tiny", enforce_eager=True)


@pytest.fixture(scope="module")
def cors(model_path):
    with ServerThread(engine_config(model_path), api_key=KEY, allowed_origins=[ORIGIN],
                      allowed_methods=["GET", "POST"], allowed_headers=["Authorization", "Content-Type"],
                      allow_credentials=True) as s:
        yield s


@pytest.fixture(scope="module")
def plain(model_path):
    with ServerThread(engine_config(model_path), api_key=KEY) as s:
        yield s


def cors_headers(r: httpx.Response) -> dict[str, str]:
    return {k: v for k, v in r.headers.items() if k.lower().startswith("access-control-")}


def test_a_preflight_from_an_allowed_origin_is_answered_with_the_configured_policy(cors):
    r = httpx.options(cors.base_url + "/chat/completions", headers={
        "Origin": ORIGIN, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type"}, timeout=30)
    assert r.status_code == 200, r.text      # before the API key check: a preflight carries no credentials
    headers = cors_headers(r)
    assert headers["access-control-allow-origin"] == ORIGIN
    assert headers["access-control-allow-credentials"] == "true"
    assert set(headers["access-control-allow-methods"].replace(" ", "").split(",")) == {"GET", "POST"}
    assert {"authorization", "content-type"} <= set(headers["access-control-allow-headers"].lower()
                                                    .replace(" ", "").split(","))
    refused = httpx.options(cors.base_url + "/chat/completions", headers={
        "Origin": "http://evil.example", "Access-Control-Request-Method": "POST"}, timeout=30)
    assert refused.status_code == 400 and "access-control-allow-origin" not in cors_headers(refused)
    bad_method = httpx.options(cors.base_url + "/chat/completions", headers={
        "Origin": ORIGIN, "Access-Control-Request-Method": "DELETE"}, timeout=30)
    assert bad_method.status_code == 400


def test_a_simple_request_from_an_allowed_origin_carries_the_cors_headers(cors):
    auth = {"Authorization": f"Bearer {KEY}"}
    r = httpx.get(cors.base_url + "/models", headers={"Origin": ORIGIN, **auth}, timeout=30)
    assert r.status_code == 200 and r.json()["data"][0]["id"] == "tiny"
    assert cors_headers(r)["access-control-allow-origin"] == ORIGIN
    assert cors_headers(r)["access-control-allow-credentials"] == "true"
    r = httpx.post(cors.base_url + "/completions", headers={"Origin": ORIGIN, **auth},
                   json={"model": "tiny", "prompt": "hi", "max_tokens": 2}, timeout=60)
    assert r.status_code == 200 and cors_headers(r)["access-control-allow-origin"] == ORIGIN
    # an error the edge answers (no key) still tells the browser it may read it
    r = httpx.get(cors.base_url + "/models", headers={"Origin": ORIGIN}, timeout=30)
    assert r.status_code == 401 and cors_headers(r)["access-control-allow-origin"] == ORIGIN
    other = httpx.get(cors.base_url + "/models", headers={"Origin": "http://evil.example", **auth}, timeout=30)
    assert other.status_code == 200 and "access-control-allow-origin" not in cors_headers(other)


def test_without_the_flags_no_access_control_header_is_sent(plain):
    auth = {"Authorization": f"Bearer {KEY}"}
    r = httpx.get(plain.base_url + "/models", headers={"Origin": ORIGIN, **auth}, timeout=30)
    assert r.status_code == 200 and not cors_headers(r)
    preflight = httpx.options(plain.base_url + "/chat/completions", headers={
        "Origin": ORIGIN, "Access-Control-Request-Method": "POST"}, timeout=30)
    assert not cors_headers(preflight) and preflight.status_code == 405


def test_the_flags_read_vllms_json_lists_and_need_allowed_origins():
    import argparse
    parser = argparse.ArgumentParser()
    add_serve_parser(parser.add_subparsers())
    args = parser.parse_args(["serve", "m", "--allowed-origins", '["http://a.io", "http://b.io"]',
                              "--allowed-methods", '["GET"]', "--allow-credentials"])
    _, server = configs_from_args(args)
    assert server.allowed_origins == ("http://a.io", "http://b.io") and server.allowed_methods == ("GET",)
    assert server.allow_credentials and server.allowed_headers is None
    with pytest.raises(SystemExit):      # argparse: not a JSON list
        parser.parse_args(["serve", "m", "--allowed-origins", "http://a.io"])
    with pytest.raises(ValueError, match="--allowed-origins"):
        ServerConfig(allowed_methods=["GET"])
    with pytest.raises(ValueError, match="JSON list of strings"):
        ServerConfig(allowed_origins=[1])
