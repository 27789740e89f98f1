"""Llama 3.1 / 3.2 / 3.3's JSON tool calls (`--tool-call-parser llama3_json`, vLLM's name; `llama4_json` too):

    {"name": "get_weather", "parameters": {"city": "Paris"}}

optionally after `<|python_tag|>`, several calls separated by `;`. Meta's templates ask for "parameters"; "arguments"
is read as well. As vLLM streams it, the output is calls only when it starts with one (leading whitespace and the
tag aside): the calls are then the leading run of call objects, and what follows them is dropped (vLLM's whole
reading drops the text around calls too); an output whose first object is not a call ({"name": a string, and
"parameters" or "arguments"}) is content as written. `extract` reads the finished text as `partial` does, the
arguments as `json.dumps` of their value; a call the output left unfinished (max_tokens) makes the whole output
content, as vLLM's whole reading does, where a stream has already sent what there was of it.
"""
from __future__ import annotations

import json
from typing import Any

from kvflow.server.serving.tool_call_text import (PartialCall, ScannedToolParser, dumps, held_back, scan_call,
                                                  skip_space)

NAMES = ("llama3_json", "llama4_json")
PYTHON_TAG = "<|python_tag|>"
_DECODER = json.JSONDecoder()


def _is_call(obj: Any) -> bool:
    return isinstance(obj, dict) and isinstance(obj.get("name"), str) and ("parameters" in obj or "arguments" in obj)


def scan(text: str, final: bool = False) -> tuple[str, list[PartialCall], bool]:
    """(content, calls, whole) of a (possibly growing) output; each call's arguments the model's own JSON text.
    `whole` is False while (or, with `final`, because) a call is unfinished: the whole output is then content."""
    pos = skip_space(text, 0)
    if text.startswith(PYTHON_TAG, pos):
        pos = skip_space(text, pos + len(PYTHON_TAG))
        if pos == len(text) and not final:
            return "", [], False               # the call is still to come
    elif not final and held_back(text[pos:], PYTHON_TAG) == len(text) - pos:
        return "", [], False                   # nothing yet, or the tag may be starting
    if pos == len(text) or text[pos] != "{":
        return text, [], True                  # prose (or nothing)
    calls: list[PartialCall] = []
    while True:
        try:
            obj, end = _DECODER.raw_decode(text, pos)
        except json.JSONDecodeError:           # still being written (or, with final, never finished)
            call = scan_call(text[pos:])
            if call.name is not None and (call.arguments or call.done):   # a name counts once its arguments begin
                calls.append(PartialCall(call.name, call.arguments, False))
            return ("" if calls or not final else text), calls, False
        if not _is_call(obj):                  # not a call: the output is prose; after calls, the rest is dropped
            return (text, [], True) if not calls else ("", calls, True)
        calls.append(scan_call(text[pos:end]))
        nxt = skip_space(text, end)
        if text.startswith(";", nxt):
            nxt = skip_space(text, nxt + 1)
        if nxt == len(text) and not final:
            return "", calls, True             # another call may follow
        if nxt == len(text) or text[nxt] != "{":
            return "", calls, True             # the end of the run (what follows is dropped)
        pos = nxt


class Llama3JsonToolParser(ScannedToolParser):
    """Llama 3's `{"name": ..., "parameters": {...}}` calls, `;`-separated, optionally after <|python_tag|>."""

    scan = staticmethod(scan)


def written(calls: list[dict]) -> str:
    """Earlier calls as the format writes them ({"name", "arguments"} dicts in)."""
    return "; ".join(dumps({"name": c["name"], "parameters": c["arguments"]}) for c in calls)


INSTRUCTION = ('To call one, answer with only {"name": <function name>, "parameters": <arguments object>} (several '
               'separated by "; "); otherwise answer normally.')
