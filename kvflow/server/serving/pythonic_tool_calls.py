"""Pythonic tool calls (`--tool-call-parser pythonic` / `llama4_pythonic`, vLLM's names; Llama 3.2's and Llama 4's
templates ask for them):

    [get_weather(city="Paris", days=3), add(a=1, b=2)]

The output is calls when it starts with "[" (leading whitespace, and Llama 4's <|python_start|>, aside): a Python list
of calls, each a function name and keyword arguments whose values are literals (strings, numbers, True / False /
None, lists, tuples and dicts of them). Each keyword argument is read with Python's `ast` (never evaluated) once it
is complete, so a call's arguments grow as JSON text, one argument at a time: the call is announced with "{" and its
first argument once that is complete (or at its ")" when it has none), then `"key": value` per argument, "}" at its
")". Text after the list is dropped (as a stream has already sent the calls); anything else — no list, a positional
argument, a value that is no literal, unbalanced brackets — makes the whole output content as written, as vLLM reads
it; so does a list the output left unfinished (max_tokens). A stream has then sent the calls announced before the
flaw, as far as they went: waiting for the whole list would stream nothing.
"""
from __future__ import annotations

import ast
import math
import re
from functools import lru_cache
from typing import Any

from kvflow.server.serving.tool_call_text import (ExtractedToolCalls, PartialCall, dumps, held_back, skip_space,
                                                  tool_call)

NAMES = ("pythonic", "llama4_pythonic")   # vLLM's two parsers differ only in Llama 4's markers, read here
PYTHON_START, PYTHON_END = "<|python_start|>", "<|python_end|>"
_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


class _NotCalls(Exception):
    """The output is no list of calls (the whole of it is then content)."""


def _literal(node: ast.AST) -> Any:
    """A keyword argument's value: a JSON value written as a Python literal."""
    if isinstance(node, ast.Constant) and (node.value is None or isinstance(node.value, (str, bool, int, float))):
        if isinstance(node.value, float) and not math.isfinite(node.value):
            raise _NotCalls
        return node.value
    if (isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd))
            and isinstance(node.operand, ast.Constant) and type(node.operand.value) in (int, float)):
        return -node.operand.value if isinstance(node.op, ast.USub) else node.operand.value
    if isinstance(node, (ast.List, ast.Tuple)):
        return [_literal(e) for e in node.elts]
    if isinstance(node, ast.Dict):
        if not all(isinstance(k, ast.Constant) and isinstance(k.value, str) for k in node.keys):
            raise _NotCalls
        return {k.value: _literal(v) for k, v in zip(node.keys, node.values)}
    raise _NotCalls


@lru_cache(maxsize=1024)          # a stream reads its text again at every token: each argument is parsed once
def _keyword(piece: str) -> tuple[str, str]:
    """One complete `key=value` -> (key, `"key": value` as JSON text)."""
    try:
        node = ast.parse(f"f({piece})", mode="eval").body
    except (SyntaxError, ValueError, MemoryError, RecursionError):
        raise _NotCalls from None
    if not isinstance(node, ast.Call) or node.args or len(node.keywords) != 1 or node.keywords[0].arg is None:
        raise _NotCalls
    key = node.keywords[0].arg
    try:
        return key, f"{dumps(key)}: {dumps(_literal(node.keywords[0].value))}"
    except RecursionError:
        raise _NotCalls from None


def _string_end(text: str, i: int) -> int | None:
    """Where the Python string literal whose quote is at i ends (just past it); None while unfinished."""
    quote = text[i]
    triple = text.startswith(quote * 3, i)
    j = i + (3 if triple else 1)
    while j < len(text):
        c = text[j]
        if c == "\\":
            j += 2
            continue
        if triple and text.startswith(quote * 3, j):
            return j + 3
        if not triple and c == quote:
            return j + 1
        if not triple and c == "\n":
            raise _NotCalls
        j += 1
    return None


def _read_arguments(text: str, pos: int) -> tuple[list[str], int | None]:
    """A call's complete keyword arguments from pos (just past its "("), each as `"key": value` JSON text, and where
    the call ends (past its ")"); None while it is unfinished."""
    parts: list[str] = []
    keys: set[str] = set()
    depth, start, i = 0, pos, pos

    def add(piece: str) -> None:
        key, part = _keyword(piece)
        if key in keys:
            raise _NotCalls          # Python refuses a repeated keyword too
        keys.add(key)
        parts.append(part)

    while i < len(text):
        c = text[i]
        if c in "'\"":
            end = _string_end(text, i)
            if end is None:
                return parts, None
            i = end
            continue
        if c in "([{":
            depth += 1
        elif c in ")]}":
            if depth == 0:
                if c != ")":
                    raise _NotCalls
                if text[start:i].strip():
                    add(text[start:i])
                return parts, i + 1
            depth -= 1
        elif c == "," and depth == 0:
            add(text[start:i])
            start = i + 1
        i += 1
    return parts, None


def scan(text: str, final: bool = False) -> tuple[str, list[PartialCall], bool]:
    """(content, calls, whole) of a (possibly growing) output. `whole` is False while (or, with `final`, because)
    the list is unfinished: the whole output is then content."""
    pos = skip_space(text, 0)
    if text.startswith(PYTHON_START, pos):
        pos = skip_space(text, pos + len(PYTHON_START))
        if pos == len(text) and not final:
            return "", [], False
    elif not final and held_back(text[pos:], PYTHON_START) == len(text) - pos:
        return "", [], False                     # nothing yet, or the tag may be starting
    if pos == len(text) or text[pos] != "[":
        return text, [], True
    calls: list[PartialCall] = []
    try:
        pos += 1
        while True:
            pos = skip_space(text, pos)
            if pos < len(text) and text[pos] == "]" and calls:
                return "", calls, True           # what follows the list is dropped
            name = _IDENTIFIER.match(text, pos)
            after = skip_space(text, name.end()) if name else pos
            if after == len(text):
                return ("" if calls or not final else text), calls, False    # a name still coming
            if name is None or text[after] != "(":
                raise _NotCalls
            parts, end = _read_arguments(text, after + 1)
            if not parts and end is None:        # named once an argument (or the call) is complete and valid
                calls.append(PartialCall(None, "", False))
            else:
                calls.append(PartialCall(name.group(), "{" + ", ".join(parts) + ("}" if end is not None else ""),
                                         end is not None))
            if end is None:
                return "", calls, False
            pos = skip_space(text, end)
            if pos == len(text):
                return "", calls, False
            if text[pos] == ",":
                pos += 1
            elif text[pos] != "]":
                raise _NotCalls
    except _NotCalls:
        return text, [], True


class PythonicToolParser:
    """[f(a=1), g(b="x")]: a Python list of calls with literal keyword arguments, read with ast."""

    def extract(self, text: str) -> ExtractedToolCalls:
        content, calls, whole = scan(text, final=True)
        if not calls or not whole:
            return ExtractedToolCalls(text or None)
        return ExtractedToolCalls(None, [tool_call(c.name, c.arguments) for c in calls])

    def partial(self, text: str, final: bool = False) -> tuple[str, list[PartialCall]]:
        content, calls, _ = scan(text, final)
        return content, calls


def written(calls: list[dict]) -> str:
    """Earlier calls as the format writes them ({"name", "arguments"} dicts in): values as Python literals."""
    return "[" + ", ".join(f"{c['name']}(" + ", ".join(f"{k}={v!r}" for k, v in _items(c["arguments"]))
                           + ")" for c in calls) + "]"


def _items(arguments: Any) -> list:
    return list(arguments.items()) if isinstance(arguments, dict) else []


INSTRUCTION = ("To call them, answer with only a Python list of calls, [func_name(param=value, ...), ...], the values "
               "Python literals; otherwise answer normally.")
