"""Pure ASGI middleware at the edge, run before any route reads the body.

`error_shapes`: path prefix -> how that surface renders an APIError (Anthropic's Messages API has a shape of its
own); every other path answers in OpenAI's. The app passes the surfaces' renderers in, so this needs none of them."""
from __future__ import annotations

import time
from typing import Callable

from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from kvflow.server.common.errors import APIError

ErrorShapes = dict[str, Callable[[APIError], dict]]
# /tokenize covers /tokenizer_info
PROTECTED_PREFIXES = ("/v1/", "/tokenize", "/detokenize", "/invocations", "/score", "/rerank")


class AuthAndArrival:
    """Stamp the arrival time; check the API key on the OpenAI routes (/health, /ping and /metrics stay open)."""

    def __init__(self, app, api_key: str | None, error_shapes: ErrorShapes | None = None) -> None:
        self.app = app
        self.api_key = api_key
        self.error_shapes = error_shapes or {}

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            scope.setdefault("state", {}).setdefault("arrival_time", time.time())   # RequestObserver's, if first
            if self.api_key is not None and scope["path"].startswith(PROTECTED_PREFIXES) \
                    and scope.get("method") != "OPTIONS":
                headers = dict(scope.get("headers") or [])
                auth = headers.get(b"authorization", b"").decode("latin-1")
                key = headers.get(b"x-api-key", b"").decode("latin-1")    # how Anthropic's clients send it
                if auth != f"Bearer {self.api_key}" and not (key and key == self.api_key):
                    err = APIError(401, "Incorrect or missing API key: pass it as 'Authorization: Bearer <key>' "
                                        "or 'x-api-key: <key>'", code="invalid_api_key")
                    body = error_body(scope, err, self.error_shapes)
                    await JSONResponse(body, status_code=401)(scope, receive, send)
                    return
        await self.app(scope, receive, send)


class BodySizeLimit:
    """413 for a body over `max_bytes`: at once from Content-Length, else (chunked) as soon as the bytes read
    so far pass the limit, so that neither the body nor its JSON parse ever exceed it. `uploads`: the paths whose
    POST bodies have a limit of their own (path -> (bytes, the flag that sets it)): /v1/files."""

    def __init__(self, app, max_bytes: int, uploads: dict[str, tuple[int, str]] | None = None,
                 error_shapes: ErrorShapes | None = None) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.uploads = uploads or {}
        self.error_shapes = error_shapes or {}

    def too_large(self, limit: tuple[int, str] | None = None) -> HTTPException:
        max_bytes, flag = limit or (self.max_bytes, "--max-request-body-size")
        return HTTPException(413, f"the request body is larger than {max_bytes} bytes ({flag})")

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        limit = self.uploads.get(scope["path"]) if scope.get("method") == "POST" else None
        max_bytes = limit[0] if limit else self.max_bytes
        length = dict(scope.get("headers") or []).get(b"content-length", b"")
        if length.isdigit() and int(length) > max_bytes:
            err = APIError(413, self.too_large(limit).detail, code="request_too_large")
            # the client may still be sending: tell it we will not read the rest
            await JSONResponse(error_body(scope, err, self.error_shapes), status_code=413,
                               headers={"Connection": "close"})(scope, receive, send)
            return
        received = 0

        async def limited_receive():
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > max_bytes:
                    raise self.too_large(limit)     # raised inside the route's body read: the app answers 413
            return message

        await self.app(scope, limited_receive, send)


class ServerLoad:
    """vLLM's server load (--enable-server-load-tracking): the requests in flight on the routes that run the model,
    each counted from its arrival until its response (a stream to its end) is sent or the client goes away."""

    def __init__(self, app, paths: frozenset[str], load: "LoadCount") -> None:
        self.app = app
        self.paths = paths
        self.load = load

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope.get("method") != "POST" or scope["path"] not in self.paths:
            return await self.app(scope, receive, send)
        self.load.count += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.load.count -= 1


class LoadCount:
    count: int = 0          # read by GET /load; only the event loop changes it


def error_body(scope, err: APIError, shapes: ErrorShapes) -> dict:
    """The error in the shape of the API the path belongs to (`shapes`), else OpenAI's."""
    for prefix, render in shapes.items():
        if scope["path"].startswith(prefix):
            return render(err)
    return err.body()
