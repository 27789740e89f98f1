"""Granite 3.x's tool calls (`--tool-call-parser granite`, vLLM's name):

    <|tool_call|>[{"name": "get_weather", "arguments": {"city": "Paris"}}, ...]

Granite 3.0 writes the <|tool_call|> token, Granite 3.1 on the text <tool_call>; either may be there (a tokenizer's
skip_special_tokens drops the token) or neither. As vLLM reads it, the output is calls only when it is such a list
(leading whitespace and the markers aside) whose items are all {"name": ..., "arguments": ...}; the content is then
none. Anything else is content as written, and so is a list the output left unfinished (max_tokens), where a stream
has sent what there was. Text after the list is dropped (a stream has sent the calls by then).
"""
from __future__ import annotations

import json

from kvflow.server.serving.tool_call_text import (PartialCall, ScannedToolParser, dumps, scan_call_list, skip_space)

NAMES = ("granite",)
TOOL_CALL_TOKEN, TOOL_CALL_TAG = "<|tool_call|>", "<tool_call>"
_DECODER = json.JSONDecoder()


def scan(text: str, final: bool = False) -> tuple[str, list[PartialCall], bool]:
    """(content, calls, whole) of a (possibly growing) output; `whole` is False while (with `final`: because) the
    list is unfinished."""
    pos = skip_space(text, 0)
    for marker in (TOOL_CALL_TOKEN, TOOL_CALL_TAG):
        if text.startswith(marker, pos):
            pos = skip_space(text, pos + len(marker))
    rest = text[pos:]
    if not final and (not rest or TOOL_CALL_TOKEN.startswith(rest) or TOOL_CALL_TAG.startswith(rest)):
        return "", [], False                 # nothing yet, or a marker may be starting
    if not rest or rest[0] != "[":
        return text, [], True
    try:
        value, end = _DECODER.raw_decode(rest)
    except json.JSONDecodeError:             # still being written (or never finished)
        return "", scan_call_list(rest), False
    if not (isinstance(value, list) and value and all(
            isinstance(c, dict) and isinstance(c.get("name"), str) and "arguments" in c for c in value)):
        return text, [], True
    return "", scan_call_list(rest[:end]), True


class GraniteToolParser(ScannedToolParser):
    """<|tool_call|> (or <tool_call>) and a JSON list of {"name", "arguments"} calls."""

    scan = staticmethod(scan)


def written(calls: list[dict]) -> str:
    """Earlier calls as the format writes them ({"name", "arguments"} dicts in)."""
    return TOOL_CALL_TOKEN + dumps([{"name": c["name"], "arguments": c["arguments"]} for c in calls])


INSTRUCTION = ('To call them, answer with only <|tool_call|>[{"name": <function name>, "arguments": <arguments '
               'object>}, ...]; otherwise answer normally.')
