"""Gemma 4's tool calls (`--tool-call-parser gemma4`, vLLM's name), in Gemma's own notation rather than JSON:

    Let me check.<|tool_call>call:get_weather{city:<|"|>Paris<|"|>,days:3}<tool_call|><|tool_call>call:add{a:1}...

Keys are bare, strings are delimited by <|"|>, objects {k:v,...} and arrays [v,...] nest, and a bare value is true,
false, null (none, nil), a number (a float when it has a "."), else text; calls follow one another without a
separator. The text before the first <|tool_call> is the content (stripped; none when empty); text between or after
calls is dropped, as vLLM reads it. A call is `call:NAME{` and its arguments up to their closing "}", so a "}" inside
a string value is the string's. Its arguments stream as JSON text that only grows: "{" once the name is known, each
top-level `"key": value` once a top-level "," or the closing "}" completes it, "}" at the end. A call the output left
unfinished (max_tokens) is no call when the whole output is read (a stream has sent what there was of it), as vLLM's
whole reading finds none there.
"""
from __future__ import annotations

import math
import re
from typing import Any

from kvflow.server.serving.tool_call_text import ExtractedToolCalls, PartialCall, dumps, held_back, tool_call

NAMES = ("gemma4",)
TOOL_CALL, TOOL_CALL_END, QUOTE, CALL = "<|tool_call>", "<tool_call|>", '<|"|>', "call:"
_NAME = re.compile(r"[\w\-.]+")


def _split(text: str, start: int, closer: str) -> tuple[list[str], int | None]:
    """The top-level comma-separated pieces of a container's body from `start` (just past its opener), and where it
    ends (just past its `closer`); None while it is unfinished (the last piece is then left out)."""
    pieces, depth, i, piece_at = [], 0, start, start
    while i < len(text):
        if text.startswith(QUOTE, i):
            close = text.find(QUOTE, i + len(QUOTE))
            if close == -1:
                return pieces, None
            i = close + len(QUOTE)
            continue
        c = text[i]
        if c in "{[":
            depth += 1
        elif c in "}]":
            if depth == 0 and c == closer:
                pieces.append(text[piece_at:i])
                return pieces, i + 1
            depth = max(depth - 1, 0)
        elif c == "," and depth == 0:
            pieces.append(text[piece_at:i])
            piece_at = i + 1
        i += 1
    return pieces, None


def _bare(value: str) -> Any:
    if value in ("true", "false"):
        return value == "true"
    if value.lower() in ("null", "none", "nil"):
        return None
    try:
        number = float(value) if "." in value else int(value)
    except ValueError:
        return value
    return number if math.isfinite(number) else value


def _value(text: str) -> Any:
    """One complete value in Gemma's notation -> the JSON value."""
    text = text.strip()
    if text.startswith(QUOTE) and text.endswith(QUOTE) and len(text) >= 2 * len(QUOTE):
        return text[len(QUOTE):-len(QUOTE)]
    if text[:1] in ("{", "["):
        pieces, end = _split(text, 1, "}" if text[0] == "{" else "]")
        pieces = [p for p in pieces if p.strip()]
        if text[0] == "[":
            return [_value(p) for p in pieces]
        return dict(pair for p in pieces if (pair := _pair(p)) is not None)
    return _bare(text)


def _pair(piece: str) -> tuple[str, Any] | None:
    """`key:value` (the key bare or delimited) -> (key, JSON value); None for a piece without a key."""
    piece = piece.strip()
    if piece.startswith(QUOTE) and (close := piece.find(QUOTE, len(QUOTE))) != -1:
        key, rest = piece[len(QUOTE):close], piece[close + len(QUOTE):].lstrip()
        if not rest.startswith(":"):
            return None
        return key, _value(rest[1:])
    colon = piece.find(":")
    if colon <= 0:
        return None
    return piece[:colon].strip(), _value(piece[colon + 1:])


def _arguments(pieces: list[str], closed: bool) -> str:
    """The complete pieces as the arguments' JSON text (a key given twice: the first counts)."""
    parts, seen = [], set()
    for piece in pieces:
        pair = _pair(piece)
        if pair is not None and pair[0] not in seen:
            seen.add(pair[0])
            parts.append(f"{dumps(pair[0])}: {dumps(pair[1])}")
    return "{" + ", ".join(parts) + ("}" if closed else "")


def scan(text: str, final: bool = False) -> tuple[str, list[PartialCall]]:
    """The content and the calls of a (possibly growing) output."""
    at = text.find(TOOL_CALL)
    if at == -1:
        return text[: len(text) - (0 if final else held_back(text, TOOL_CALL))], []
    content, calls = text[:at], []
    while at != -1:
        head = at + len(TOOL_CALL)
        rest = text[head:head + len(CALL)]
        if not text.startswith(CALL, head):
            if not final and CALL.startswith(rest):
                calls.append(PartialCall(None, "", False))     # still coming
                break
            at = text.find(TOOL_CALL, head)                    # not a call
            continue
        brace = text.find("{", head + len(CALL))
        name = text[head + len(CALL): len(text) if brace == -1 else brace].strip()
        if brace == -1 or not _NAME.fullmatch(name):
            if brace == -1 and not final and _NAME.fullmatch(name or "x"):
                calls.append(PartialCall(None, "", False))     # the name is still coming
                break
            at = text.find(TOOL_CALL, head)
            continue
        pieces, end = _split(text, brace + 1, "}")
        calls.append(PartialCall(name, _arguments(pieces, end is not None), end is not None))
        if end is None:
            break
        at = text.find(TOOL_CALL, end)
    return content, calls


class Gemma4ToolParser:
    """<|tool_call>call:NAME{key:value,...}<tool_call|>, any number of them; the text before the first is content."""
    needs_special_tokens = True     # <|tool_call>, <tool_call|> and <|"|> are special tokens in Gemma 4's tokenizer

    def extract(self, text: str) -> ExtractedToolCalls:
        content, calls = scan(text, final=True)
        calls = [c for c in calls if c.done]
        if not calls:
            return ExtractedToolCalls(text or None)
        return ExtractedToolCalls(content.strip() or None, [tool_call(c.name, c.arguments) for c in calls])

    def partial(self, text: str, final: bool = False) -> tuple[str, list[PartialCall]]:
        return scan(text, final)


def _written(value: Any) -> str:
    """A JSON value in Gemma's notation, as its template writes an earlier call's arguments."""
    if isinstance(value, str):
        return QUOTE + value + QUOTE
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    if isinstance(value, dict):
        return "{" + ",".join(f"{k}:{_written(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ",".join(_written(v) for v in value) + "]"
    return str(value)


def written(calls: list[dict]) -> str:
    """Earlier calls as the format writes them ({"name", "arguments"} dicts in)."""
    return "".join(f"{TOOL_CALL}{CALL}{c['name']}{_written(c['arguments'] if isinstance(c['arguments'], dict) else {})}"
                   f"{TOOL_CALL_END}" for c in calls)


INSTRUCTION = ('To call one, write <|tool_call>call:NAME{key:value,...}<tool_call|>, strings between <|"|> and '
               '<|"|>, other values as JSON; otherwise answer normally.')
