"""What every tool-call parser shares: the OpenAI `tool_calls` entries it yields, what it hands the streamer, and
reading `{"name": ..., "arguments": {...}}` JSON objects out of a text that may still be growing.

A parser has `extract(text) -> ExtractedToolCalls` (the whole output) and `partial(text, final) -> (content,
[PartialCall])` (a growing output: its content so far and its calls so far, each call's arguments as JSON text that
only grows as the text does). The streamer names the calls it announces with the request's `call_id` factory
(tool_calls.CALL_IDS: Mistral's 9-character ids).
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable

_DECODER = json.JSONDecoder()
_ARGUMENTS = re.compile(r'"(?:arguments|parameters)"\s*:\s*')
_NAME_KEY = re.compile(r'"name"\s*:\s*("(?:[^"\\]|\\.)*")')


def tool_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def tool_call(name: str, arguments: Any, call_id: str | None = None) -> dict:
    """One OpenAI tool_calls entry; arguments as a JSON string."""
    args = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return {"id": call_id or tool_call_id(), "type": "function", "function": {"name": name, "arguments": args}}


@dataclass
class PartialCall:
    name: str | None      # known once its JSON string is complete
    arguments: str        # the JSON text of the arguments so far
    done: bool            # the arguments value is complete


@dataclass
class ExtractedToolCalls:
    content: str | None
    tool_calls: list[dict] = field(default_factory=list)


class ScannedToolParser:
    """A format read by its `scan(text, final) -> (content, calls, whole)` whose calls' arguments are JSON text: read
    whole, the calls when the text ends in a whole run of them (otherwise all of it is content, as vLLM answers
    output it cannot read); streamed, what the scan has so far. A subclass sets `scan`."""

    @staticmethod
    def scan(text: str, final: bool) -> tuple[str, list[PartialCall], bool]:
        raise NotImplementedError

    def extract(self, text: str) -> ExtractedToolCalls:
        content, calls, whole = self.scan(text, True)
        if not calls or not whole:
            return ExtractedToolCalls(text or None)
        return ExtractedToolCalls(None, [tool_call(c.name, json.loads(c.arguments)) for c in calls])

    def partial(self, text: str, final: bool = False) -> tuple[str, list[PartialCall]]:
        content, calls, _ = self.scan(text, final)
        return content, calls


def scan_call(body: str) -> PartialCall:
    """Name and raw arguments of a (possibly unfinished) {"name": ..., "arguments": ...} object.

    Until the arguments value parses, everything after `"arguments":` belongs to it: a JSON value's
    prefix never holds its own end. raw_decode finds the end once it is there.
    """
    args = _ARGUMENTS.search(body)
    head = body[: args.start()] if args else body
    arguments, done, end = "", False, len(body)
    if args:
        try:
            _, end = _DECODER.raw_decode(body, args.end())
            arguments, done = body[args.end():end], True
        except json.JSONDecodeError:
            arguments = body[args.end():]
    name = _NAME_KEY.search(head) or (done and _NAME_KEY.search(body[end:]))
    return PartialCall(json.loads(name.group(1)) if name else None, arguments, done)


def scan_call_list(body: str) -> list[PartialCall]:
    """The calls of a (possibly unfinished) JSON list of call objects; `body` starts at its "["."""
    calls, pos = [], 1
    while True:
        while pos < len(body) and body[pos] in " \t\r\n,":
            pos += 1
        if pos >= len(body) or body[pos] == "]":
            return calls
        try:
            _, end = _DECODER.raw_decode(body, pos)
        except json.JSONDecodeError:
            return calls + [scan_call(body[pos:])]
        calls.append(scan_call(body[pos:end]))
        pos = end


def call_from_json(obj: Any, call_id: Callable[[], str] = tool_call_id) -> dict | None:
    """A {"name": ..., "arguments" (or "parameters"): ...} object as an OpenAI entry (no arguments: {}); None if it
    is not one."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    return tool_call(obj["name"], obj.get("arguments", obj.get("parameters", {})), call_id())


def held_back(text: str, tag: str) -> int:
    """Length of the longest suffix of text that could be the start of tag."""
    return next((k for k in range(min(len(tag) - 1, len(text)), 0, -1) if tag.startswith(text[-k:])), 0)


def skip_space(text: str, pos: int) -> int:
    while pos < len(text) and text[pos] in " \t\r\n":
        pos += 1
    return pos


def dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)
