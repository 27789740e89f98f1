"""OpenTelemetry traces (`--otlp-traces-endpoint`, vLLM's flag): one span per request, exported over OTLP/HTTP.

The span is vLLM's request span: name `llm_request`, kind SERVER, from the server's receipt of the request to the
end of its response, a child of the client's W3C `traceparent` when it sent one, with vLLM's attribute names
(vllm/tracing.py `SpanAttributes`): gen_ai.request.id, gen_ai.response.model, gen_ai.request.{n, max_tokens,
temperature, top_p}, gen_ai.usage.{prompt_tokens, completion_tokens}, gen_ai.latency.{time_in_queue,
time_to_first_token, e2e, time_in_model_prefill, time_in_model_decode, time_in_model_inference}; kvflow adds its
own under `kvflow.` (finish reason, cached tokens, model version, the client's X-Request-Id) and the HTTP status as
OpenTelemetry's `http.response.status_code` / `error.type`.

This module is imported only when the flag is set, and it is the only one that imports OpenTelemetry: with the flag
off tracing costs nothing (not even the import). The SDK's BatchSpanProcessor exports from its own thread: ending a
span on the event loop only queues it. Only OTLP over HTTP (protobuf) is shipped: vLLM's default OTLP protocol is
gRPC, whose exporter pulls in grpcio; `OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=grpc` is refused with a message saying so.
"""
from __future__ import annotations

import logging
import os
from urllib.parse import urlsplit

logger = logging.getLogger("kvflow.tracing")

SPAN_NAME = "llm_request"


class SpanAttributes:
    """vLLM's names (vllm/tracing.py), kept as vLLM spells them so its trace queries work unchanged."""
    GEN_AI_USAGE_COMPLETION_TOKENS = "gen_ai.usage.completion_tokens"
    GEN_AI_USAGE_PROMPT_TOKENS = "gen_ai.usage.prompt_tokens"
    GEN_AI_REQUEST_MAX_TOKENS = "gen_ai.request.max_tokens"
    GEN_AI_REQUEST_TOP_P = "gen_ai.request.top_p"
    GEN_AI_REQUEST_TEMPERATURE = "gen_ai.request.temperature"
    GEN_AI_RESPONSE_MODEL = "gen_ai.response.model"
    GEN_AI_REQUEST_ID = "gen_ai.request.id"
    GEN_AI_REQUEST_N = "gen_ai.request.n"
    GEN_AI_LATENCY_TIME_IN_QUEUE = "gen_ai.latency.time_in_queue"
    GEN_AI_LATENCY_TIME_TO_FIRST_TOKEN = "gen_ai.latency.time_to_first_token"
    GEN_AI_LATENCY_E2E = "gen_ai.latency.e2e"
    GEN_AI_LATENCY_TIME_IN_MODEL_PREFILL = "gen_ai.latency.time_in_model_prefill"
    GEN_AI_LATENCY_TIME_IN_MODEL_DECODE = "gen_ai.latency.time_in_model_decode"
    GEN_AI_LATENCY_TIME_IN_MODEL_INFERENCE = "gen_ai.latency.time_in_model_inference"


def traces_url(endpoint: str) -> str:
    """The OTLP/HTTP traces URL: as given when it has a path, else with the standard /v1/traces."""
    parts = urlsplit(endpoint if "://" in endpoint else f"http://{endpoint}")
    if parts.path in ("", "/"):
        return parts._replace(path="/v1/traces").geturl()
    return parts.geturl()


class Tracer:
    """The server's tracer: `emit(line, record)` is a RequestObserver sink."""

    def __init__(self, endpoint: str, service_name: str = "kvflow", model_version=None) -> None:
        """`model_version`: a callable giving the served model's version (None while unknown)."""
        self.model_version = model_version or (lambda: None)
        protocol = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/protobuf")
        if protocol != "http/protobuf":
            raise ValueError(f"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL={protocol}: kvflow exports traces over OTLP/HTTP "
                             "(http/protobuf) only; point --otlp-traces-endpoint at the collector's HTTP port "
                             "(4318)")
        try:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
            from opentelemetry.sdk.resources import Resource
            from opentelemetry.sdk.trace import TracerProvider
            from opentelemetry.sdk.trace.export import BatchSpanProcessor
            from opentelemetry.trace import SpanKind, Status, StatusCode
            from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
        except ImportError as e:
            raise ValueError(f"--otlp-traces-endpoint needs OpenTelemetry's SDK and OTLP/HTTP exporter: "
                             f"pip install 'kvflow[tracing]' ({e})") from None
        self.url = traces_url(endpoint)
        self._provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
        self._provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=self.url)))
        self._tracer = self._provider.get_tracer("kvflow")
        self._propagator = TraceContextTextMapPropagator()
        self._kind, self._status, self._code = SpanKind.SERVER, Status, StatusCode
        logger.info("tracing: a span per request to %s", self.url)

    def emit(self, line: dict, record) -> None:
        attrs = attributes(line, record)
        version = self.model_version()
        if version is not None:
            attrs["kvflow.model_version"] = version
        context = self._propagator.extract(record.trace_headers) if record.trace_headers else None
        start = int(record.arrival * 1e9)
        end = int((record.end or record.arrival) * 1e9)
        span = self._tracer.start_span(SPAN_NAME, context=context, kind=self._kind, attributes=attrs,
                                       start_time=start)
        if line["status"] >= 500 or line["status"] == 499:
            span.set_status(self._status(self._code.ERROR, line.get("error") or line.get("error_type")))
        span.end(end_time=max(end, start))

    def force_flush(self, timeout_s: float = 10.0) -> bool:
        return self._provider.force_flush(int(timeout_s * 1000))

    def shutdown(self) -> None:
        self._provider.shutdown()


def attributes(line: dict, record) -> dict:
    """The span's attributes (None values left out: OpenTelemetry drops them with a warning)."""
    A = SpanAttributes
    attrs = {
        A.GEN_AI_REQUEST_ID: line["id"],
        A.GEN_AI_RESPONSE_MODEL: line["model"],
        A.GEN_AI_USAGE_PROMPT_TOKENS: line["prompt_tokens"],
        A.GEN_AI_USAGE_COMPLETION_TOKENS: line["completion_tokens"],
        A.GEN_AI_LATENCY_TIME_IN_QUEUE: line["queue_time"],
        A.GEN_AI_LATENCY_TIME_TO_FIRST_TOKEN: line["ttft"],
        A.GEN_AI_LATENCY_E2E: line["e2e"],
        A.GEN_AI_REQUEST_N: line["n"],
        "http.response.status_code": line["status"],
        "error.type": line["error_type"],
        "kvflow.finish_reason": (line["finish_reason"] if isinstance(line["finish_reason"], (str, type(None)))
                                 else [r or "" for r in line["finish_reason"]]),
        "kvflow.cached_tokens": line["cached_tokens"],
        "kvflow.client_request_id": line["client_request_id"],
        "kvflow.route": line["route"],
    }
    if record.streams:
        params = record.streams[0].params
        attrs[A.GEN_AI_REQUEST_MAX_TOKENS] = params.max_tokens
        attrs[A.GEN_AI_REQUEST_TEMPERATURE] = params.temperature
        attrs[A.GEN_AI_REQUEST_TOP_P] = params.top_p
        t = record.streams[0].state.choices[0].timings
        if t.scheduled is not None and t.first_token is not None:
            attrs[A.GEN_AI_LATENCY_TIME_IN_MODEL_PREFILL] = max(0.0, t.first_token - t.scheduled)
        if t.first_token is not None and t.last_token is not None:
            attrs[A.GEN_AI_LATENCY_TIME_IN_MODEL_DECODE] = max(0.0, t.last_token - t.first_token)
        if t.scheduled is not None and t.last_token is not None:
            attrs[A.GEN_AI_LATENCY_TIME_IN_MODEL_INFERENCE] = max(0.0, t.last_token - t.scheduled)
    return {k: v for k, v in attrs.items() if v is not None and v != []}
