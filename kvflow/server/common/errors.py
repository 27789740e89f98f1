"""Errors as the client sees them: `APIError` (a status, OpenAI's error body, the `param` it names), the 400 for a
body its route's pydantic model refused, and the JSON response that carries one. Every surface raises these; a
surface with an error shape of its own (Anthropic's Messages) renders the same APIError its way."""
from __future__ import annotations

from fastapi.responses import JSONResponse

from kvflow.server.common.schema import OpenAIModel


# ---- errors -----------------------------------------------------------------------------------------------------
class ErrorInfo(OpenAIModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(OpenAIModel):
    error: ErrorInfo


class APIError(Exception):
    """An error the client should see, in OpenAI's shape."""

    def __init__(self, status_code: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict | None = None) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    @classmethod
    def bad_request(cls, e: ValueError, rename: dict[str, str] | None = None) -> "APIError":
        """400 for a request the engine refused: `param` and `code` from the error's fields, never its text
        (`rename` maps SamplingParams' names to the API's where they differ)."""
        param = getattr(e, "param", None)
        return cls(400, str(e), param=(rename or {}).get(param, param), code=getattr(e, "code", None))


def validation_error(errors: list[dict]) -> APIError:
    """The 400 for a body its route's pydantic model refused (`ValidationError.errors()`): the server's answer to a
    RequestValidationError, and `kvflow run-batch`'s to a line's body."""
    first = errors[0] if errors else {}
    if first.get("type") == "json_invalid":
        msg = f"malformed JSON body: {first.get('ctx', {}).get('error', first.get('msg', ''))}"
        return APIError(400, msg, param=None)
    msgs = []
    for e in errors[:5]:
        p = validation_param(e.get("loc", ()))
        msgs.append(f"{p}: {e.get('msg')}" if p else str(e.get("msg")))
    return APIError(400, "; ".join(msgs) or "invalid request", param=validation_param(first.get("loc", ())))


def validation_param(loc) -> str | None:
    parts = [str(x) for x in loc if x not in ("body", "query", "path")]
    # drop pydantic's union-branch names ("str", "list[int]", "function-after[...]") that follow the field
    keep = [p for p in parts if p not in ("str", "int", "float", "bool")
            and not p.startswith(("list[", "dict[", "function-"))]
    return ".".join(keep) or None


def error_response(err: APIError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status_code, headers=err.headers)


# ---- errors in the OpenAPI document ------------------------------------------------------------------------------
DESCRIPTIONS = {400: "invalid request (the error's `param` names the field)", 401: "missing or wrong API key",
                404: "unknown model", 413: "request body larger than --max-request-body-size",
                429: "queue full (--max-queue-len): retry after Retry-After seconds",
                500: "the engine failed on this request", 503: "the engine died or the server is shutting down"}


def error_responses(*codes: int) -> dict:
    """The OpenAPI `responses` entries of these error statuses (OpenAI's error body)."""
    return {c: {"model": ErrorResponse, "description": DESCRIPTIONS[c]} for c in codes}


GENERATE_ERRORS = error_responses(400, 401, 404, 413, 429, 500, 503)    # every route that runs the model


def streamed_or(model) -> dict:
    """The OpenAPI 200 of a route that answers `model`, or Server-Sent Events with `stream: true`."""
    return {200: {"model": model, "description": "the response, or with `stream: true` Server-Sent Events of "
                                                 "chunks ending with `data: [DONE]`",
                  "content": {"text/event-stream": {"schema": {"type": "string"}}}}}
