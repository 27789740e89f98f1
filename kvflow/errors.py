"""Errors that carry an OpenAI-style 400: the message, the request field at fault and an optional code."""
from __future__ import annotations


class InvalidRequestError(ValueError):
    def __init__(self, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code
