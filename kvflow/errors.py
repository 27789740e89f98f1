"""Errors a caller can act on. The server maps their fields (never their text) to OpenAI's error JSON."""
from __future__ import annotations


class InvalidRequestError(ValueError):
    """A request the engine will not run: `param` names the offending field as the API spells it,
    `code` is a stable machine-readable reason (OpenAI's `error.code`)."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code
