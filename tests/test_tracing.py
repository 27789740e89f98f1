"""Traces (--otlp-traces-endpoint): the real server exports one span per request with the OpenTelemetry SDK's
OTLP/HTTP exporter to an OTLP/HTTP receiver on loopback (this test's, decoding the protobuf with
opentelemetry-proto); the span carries vLLM's attribute names with the response's numbers. With the flag off,
OpenTelemetry is not even imported."""
from __future__ import annotations

import gzip
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import openai
import pytest

pytest.importorskip("opentelemetry.sdk", reason="tracing needs the extra: pip install 'kvflow[tracing]'")
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (ExportTraceServiceRequest,  # noqa: E402
                                                                      ExportTraceServiceResponse)

from kvflow.config import EngineConfig  # noqa: E402
from kvflow.server.testing import HOST, ServerThread  # noqa: E402
from tiny_models import make_tiny_hf_model  # noqa: E402

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"


class Receiver:
    """A tiny OTLP/HTTP traces receiver: every span posted to /v1/traces, decoded."""

    def __init__(self):
        self.spans = []
        self.paths = []
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers["Content-Length"]))
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                req = ExportTraceServiceRequest.FromString(body)
                for rs in req.resource_spans:
                    service = {a.key: a.value.string_value for a in rs.resource.attributes}.get("service.name")
                    for ss in rs.scope_spans:
                        for span in ss.spans:
                            receiver.spans.append((service, span))
                receiver.paths.append(self.path)
                out = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)

            def log_message(self, *args):
                pass

        self.httpd = ThreadingHTTPServer((HOST, 0), Handler)
        self.port = self.httpd.server_address[1]
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def close(self):
        self.httpd.shutdown()


def value(v):
    kind = v.WhichOneof("value")
    return getattr(v, kind) if kind else None


@pytest.mark.slow
def test_one_span_per_request_with_vllm_attributes(tmp_path):
    receiver = Receiver()
    path = make_tiny_hf_model(tmp_path, family="llama", seed=4)
    cfg = EngineConfig(model=str(path), dtype="float32", max_model_len=256, kv_cache_memory="16MiB",
                       max_num_seqs=8, served_model_name="tiny")
    try:
        with ServerThread(cfg, otlp_traces_endpoint=f"http://{HOST}:{receiver.port}", model_version="v1") as server:
            client = openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0)
            usages = {}
            for i in range(4):
                r = client.completions.create(model="tiny", prompt=f"trace me {i}", max_tokens=3 + i, temperature=0.5,
                                              top_p=0.9, extra_body={"ignore_eos": True})
                usages[r.id] = r.usage
            chunks = list(client.chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4, stream=True,
                stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
                extra_headers={"traceparent": f"00-{TRACE_ID}-{PARENT_ID}-01"}))
            usages[chunks[0].id] = chunks[-1].usage
            with pytest.raises(openai.BadRequestError):
                client.completions.create(model="tiny", prompt="x", max_tokens=2, temperature=-1)
            server.wait_idle()
            assert server.app.state.tracer.force_flush()
        deadline = time.monotonic() + 10
        while len(receiver.spans) < 6 and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        receiver.close()
    assert set(receiver.paths) == {"/v1/traces"}
    assert len(receiver.spans) == 6, [s.name for _, s in receiver.spans]
    spans = {}
    for service, span in receiver.spans:
        assert service == "kvflow" and span.name == "llm_request"
        assert span.kind == span.SPAN_KIND_SERVER
        attrs = {a.key: value(a.value) for a in span.attributes}
        spans[attrs.get("gen_ai.request.id")] = (span, attrs)
    for rid, usage in usages.items():
        span, a = spans[rid]
        assert a["gen_ai.response.model"] == "tiny"
        assert a["gen_ai.usage.prompt_tokens"] == usage.prompt_tokens
        assert a["gen_ai.usage.completion_tokens"] == usage.completion_tokens
        assert 0 <= a["gen_ai.latency.time_in_queue"] <= a["gen_ai.latency.time_to_first_token"] \
            <= a["gen_ai.latency.e2e"]
        assert abs((span.end_time_unix_nano - span.start_time_unix_nano) / 1e9 - a["gen_ai.latency.e2e"]) < 0.01
        assert a["gen_ai.request.n"] == 1 and a["http.response.status_code"] == 200
        assert a["gen_ai.latency.time_in_model_inference"] >= a["gen_ai.latency.time_in_model_decode"] >= 0
        assert a["kvflow.model_version"] == "v1"
        if rid.startswith("cmpl"):
            assert a["gen_ai.request.temperature"] == pytest.approx(0.5)
            assert a["gen_ai.request.top_p"] == pytest.approx(0.9)
            assert a["gen_ai.request.max_tokens"] == usage.completion_tokens
    chat_span = next(s for rid, (s, _) in spans.items() if rid and rid.startswith("chatcmpl"))
    assert chat_span.trace_id.hex() == TRACE_ID and chat_span.parent_span_id.hex() == PARENT_ID   # the client's trace
    error_span, error = spans[None]
    assert error["http.response.status_code"] == 400 and error["error.type"] == "invalid_request_error"
    assert error["gen_ai.usage.prompt_tokens"] == 0


@pytest.mark.slow
def test_off_by_default_imports_nothing():
    """kvflow's tracer, OpenTelemetry's SDK and its exporter are imported only with the flag. (FastAPI itself imports
    the OpenTelemetry *API* when that is installed: not ours to avoid.)"""
    code = ("import sys\n"
            "import kvflow.server.app, kvflow.server.serving.serving, kvflow.server.common.request_record\n"
            "from kvflow.server.common.config import ServerConfig\n"
            "assert ServerConfig().otlp_traces_endpoint is None\n"
            "print(sorted(m for m in sys.modules if m.startswith(('opentelemetry.sdk', 'opentelemetry.exporter',\n"
            "                                                     'kvflow.server.observe.tracing'))))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
