"""What the request log and the traces say about one HTTP request of the generate routes.

`RequestObserver` (ASGI middleware, installed only when `--request-log` or `--otlp-traces-endpoint` is on) opens a
`RequestRecord` per POST to a generate route and makes it the context's current record; the routes fill it in
as they go (`OpenAIServing`: model, ids, the engine streams, structured output, tool calls, finish reasons as the
response shows them, an error inside a stream) and the middleware sees the HTTP status, an error body and whether
the response ended or the client went away. When the response has ended, the record becomes one line (`line()`),
handed to each sink: the request log's writer (a queue put) and the tracer (a span handed to the SDK's batch
processor). Nothing here blocks the event loop.

Token counts are the engine streams' own, the numbers `usage` is made of, so a line's counts equal the response's
usage.
"""
from __future__ import annotations

import contextvars
import json
import logging
import time
from dataclasses import dataclass, field

from kvflow.metrics import timing_fields

logger = logging.getLogger("kvflow.server")

# the routes that run the model (their POSTs get a record)
GENERATE_PATHS = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages",
                            "/v1/embeddings", "/invocations"})
ERROR_BODY_LIMIT = 65536
CLIENT_CLOSED = 499     # nginx's status for a client that went away before the response ended

_current: contextvars.ContextVar["RequestRecord | None"] = contextvars.ContextVar("kvflow_request_record",
                                                                                  default=None)


def current_record() -> "RequestRecord | None":
    """The record of the HTTP request being served in this context (None: no observer, or no HTTP request)."""
    return _current.get()


@dataclass
class RequestRecord:
    route: str
    arrival: float
    client_request_id: str | None = None           # the client's X-Request-Id header
    trace_headers: dict[str, str] = field(default_factory=dict)   # W3C traceparent / tracestate
    log_prompts: bool = False
    # filled in by the routes
    request_id: str | None = None
    model: str | None = None
    user: str | None = None
    stream: bool = False
    structured_output: str | None = None           # json_schema, json_object, regex, choice, grammar, tool_choice...
    tool_calls: list[str] = field(default_factory=list)    # names of the calls the response made
    finish_reasons: dict[int, str] = field(default_factory=dict)   # choice index -> as the response shows it
    prompt: object = None                          # the prompt as sent (only with --request-log-prompts)
    streams: list = field(default_factory=list)    # the engine's RequestStreams
    error_status: int | None = None                # an error inside a 200 stream (the engine failed it)
    error_type: str | None = None
    error_message: str | None = None
    # filled in by the middleware
    status: int | None = None
    completed: bool = False                        # the response's last byte was sent
    end: float | None = None
    _error_body: bytearray = field(default_factory=bytearray)

    def note_request(self, req, request_id: str, prompt) -> None:
        """A generate request as the route read it: its id, the client's `user`, stream, and (only with
        --request-log-prompts) its prompt as sent."""
        # the id the client sees: the adapters over the chat route answer with their own (the Responses API's
        # resp_..., the chat request's request_id; the Messages API's msg_ + it)
        chat_id = getattr(req, "request_id", None)
        self.request_id = {"/v1/responses": chat_id, "/v1/messages": f"msg_{chat_id}"}.get(self.route) \
            if chat_id else request_id
        self.request_id = self.request_id or request_id
        self.user = getattr(req, "user", None)
        self.stream = bool(getattr(req, "stream", False))
        if self.log_prompts:
            self.prompt = prompt() if callable(prompt) else prompt

    def choice_finished(self, index: int, finish_reason: str | None, tool_calls=()) -> None:
        """A choice as the response shows it: its finish reason (tool_calls when calls were parsed) and the names
        of its calls."""
        if finish_reason is not None:
            self.finish_reasons[index] = finish_reason
        self.tool_calls.extend(tool_calls)

    def attach(self, streams) -> None:
        for s in streams:
            s.recorded = True
        self.streams.extend(streams)

    def fail_in_stream(self, err) -> None:
        """An APIError sent as an SSE event after a 200."""
        self.error_status, self.error_type, self.error_message = err.status_code, err.type, err.message

    # ---- the line ----------------------------------------------------------------------------------------------
    def line(self) -> dict:
        streams = self.streams
        timings = [c.timings for s in streams for c in s.state.choices]
        engine_reasons = [c.finish_reason for s in streams for c in s.state.choices]
        reasons = [self.finish_reasons.get(i, r) for i, r in enumerate(engine_reasons)]
        status, error_type, message = self.status, self.error_type, self.error_message
        if self._error_body:
            try:
                err = json.loads(bytes(self._error_body))
                err = err.get("error", err) if isinstance(err, dict) else {}
                error_type = error_type or err.get("type")
                message = message or err.get("message")
            except (ValueError, AttributeError):
                pass
        if status is None:                          # no response at all: the app failed before it answered
            status, error_type = 500, error_type or "internal_error"
        elif not self.completed:                    # the client left before the response ended
            status, error_type = CLIENT_CLOSED, "client_closed_request"
        elif self.error_status is not None:
            status = self.error_status
        errors = [s.error for s in streams if s.error]
        if message is None and errors:
            message = errors[0]
        if status >= 400 and error_type is None:
            error_type = "error"
        line = {
            "time": round(self.arrival, 6),
            "id": self.request_id,
            "client_request_id": self.client_request_id,
            "user": self.user,
            "route": self.route,
            "model": self.model,
            "stream": self.stream,
            "status": status,
            "error_type": error_type,
            "error": message,
            "prompt_tokens": sum(s.num_prompt_tokens for s in streams),
            "cached_tokens": sum(s.num_cached_tokens for s in streams),
            "completion_tokens": sum(s.num_completion_tokens for s in streams),
            "n": streams[0].params.n if streams else None,
            "finish_reason": reasons[0] if len(reasons) == 1 else (reasons or None),
            "tool_calls": list(self.tool_calls),
            "structured_output": self.structured_output,
            "priority": streams[0].priority if streams else None,
            **timing_fields(timings, self.end),
        }
        if self.log_prompts:
            line["prompt"] = self.prompt
        return line


class OpenRecords:
    """How many records are open: HTTP requests whose line is not handed to the sinks yet (tests wait for 0)."""
    count = 0


class RequestObserver:
    """ASGI middleware: a record per POST to a generate route, one line per record to each sink when the
    response has ended. `sinks`: callables taking (line, record)."""

    def __init__(self, app, sinks: list, log_prompts: bool = False, open_records: "OpenRecords | None" = None):
        self.app = app
        self.sinks = sinks
        self.log_prompts = log_prompts
        self.open_records = open_records or OpenRecords()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope.get("method") != "POST" or scope["path"] not in GENERATE_PATHS:
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers") or []}
        # the arrival AuthAndArrival stamps (it runs inside this middleware): the same clock, the same moment
        arrival = time.time()
        scope.setdefault("state", {})["arrival_time"] = arrival
        record = RequestRecord(route=scope["path"], arrival=arrival,
                               client_request_id=headers.get("x-request-id"),
                               trace_headers={k: headers[k] for k in ("traceparent", "tracestate") if k in headers},
                               log_prompts=self.log_prompts)
        self.open_records.count += 1

        async def observed_send(message):
            kind = message["type"]
            if kind == "http.response.start":
                record.status = message["status"]
            elif kind == "http.response.body":
                if record.status is not None and record.status >= 400 and len(record._error_body) < ERROR_BODY_LIMIT:
                    record._error_body += message.get("body", b"")
                if not message.get("more_body", False):
                    record.completed = True
            await send(message)

        token = _current.set(record)
        try:
            await self.app(scope, receive, observed_send)
        finally:
            _current.reset(token)
            record.end = time.time()
            try:
                line = record.line()
                for sink in self.sinks:
                    sink(line, record)
            except Exception:  # noqa: BLE001 - observing never breaks serving
                logger.exception("recording request %s failed", record.request_id)
            finally:
                self.open_records.count -= 1
