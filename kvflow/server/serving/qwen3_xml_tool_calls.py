"""Qwen3-Coder's and Qwen3.5's XML tool-call format: reading it out of a model's text, writing it into a prompt.

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    <parameter=days>
    3
    </parameter>
    </function>
    </tool_call>

vLLM names it twice, `--tool-call-parser qwen3_coder` and `qwen3_xml` (both one parser in vLLM today). A value is
raw text, one newline either side trimmed, and becomes the JSON type its tool's schema declares for the parameter,
as vLLM converts it (`convert_value`): strings (and parameters the schema does not declare) stay text; integers,
numbers and booleans are parsed; objects and arrays are read as JSON, else as Python literals; "null" is null
unless the parameter is a plain string; a value that does not convert stays text.

`scan_calls` reads a text that may still be growing. Its arguments are JSON text that only ever grows as the text
does: "{" once the function's name is known, each parameter once its value is complete (a string parameter's value
character by character as it arrives), "}" at </function>; `final=True` reads the text as the whole output (an
unclosed call or value then ends at the end of the text), which gives exactly what the stream ends with. Parameter
values are code and prose, so a closing tag inside one is a tag only where the format's structure follows it:
</parameter> followed by <parameter=, </function> or </tool_call>; a missing </parameter> ends at a new parameter
line the schema declares or at the call's </function>.
"""
from __future__ import annotations

import ast
import json
import math
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

NAMES = ("qwen3_coder", "qwen3_xml")          # vLLM's --tool-call-parser names for this format
TOOL_CALL, TOOL_CALL_END = "<tool_call>", "</tool_call>"
FUNCTION, FUNCTION_END = "<function=", "</function>"
PARAMETER, PARAMETER_END = "<parameter=", "</parameter>"
# each scan of a growing text finds its tags with these (in C: a stream rescans its text at every token)
_CALL_STARTS = re.compile(r"<tool_call>|<function=")
_VALUE_ENDS = re.compile(r"</parameter>|</function>|(?<=\n)<parameter=")
_NAME = re.compile(r"[^{}<>\"' \t\r\n]*")   # vLLM's test: with one of these it is a template's leftover, not a name
_SPACE = re.compile(r"[ \t\r\n]*")
_STRING_TYPES = ("string", "str", "text", "varchar", "char", "enum")


@dataclass
class XmlCall:
    name: str
    arguments: str        # JSON text, growing with the model's text
    closed: bool          # its arguments are complete


@dataclass
class XmlScan:
    content: str          # the text before the first call (while a call may be starting there, before that too)
    calls: list[XmlCall]


@dataclass
class ScanMemo:
    """What scanning a growing text found that more text cannot change, so that the next scan reads only what is
    new: a stream scans its text at every token, and a call's values can be whole files. Valid while each text
    extends the last (scan_calls starts over when one does not)."""
    text: str = ""
    content: str | None = None      # the text before the first call, once one started
    closed: list[XmlCall] = field(default_factory=list)
    after: int = 0                  # no call starts between the closed calls' end and here
    call_at: int = -1               # the open call's body: its complete parameters, and where the next one starts
    call_parts: list[str] = field(default_factory=list)
    call_seen: set[str] = field(default_factory=set)
    call_next: int = 0
    value_at: int = -1              # the open value: how far it is certainly value text, and that text's JSON escape
    value_literal: int = 0
    value_escaped: tuple[int, str] = (0, "")


# ---------------------------------------------------------------------------------------------- reading
def scan_calls(text: str, functions: Mapping[str, Mapping], final: bool = False,
               memo: ScanMemo | None = None) -> XmlScan:
    """The content and the calls in a model's text; `functions`: the request's tools by name (their schemas
    type the values). `memo`: carried from the scan of the text this one extends (a stream's)."""
    if memo is None or final:
        memo = ScanMemo()       # the end is read afresh: where the growing text was undecided, the whole one decides
    elif not text.startswith(memo.text):
        memo.__init__()         # not the text it was carried from: start over
    memo.text = text
    calls = list(memo.closed)
    pos = memo.after
    while True:
        start, name, body = _next_call(text, pos, final)
        if name is None:
            memo.after = start
            return XmlScan(text[:start] if memo.content is None else memo.content, calls)
        if memo.content is None:
            memo.content = text[:start]
        call, pos = _read_call(text, body, name, _properties(functions, name), final, memo)
        calls.append(call)
        if not call.closed:
            memo.after = start
            return XmlScan(memo.content, calls)
        memo.closed.append(call)
        memo.after = pos


def _next_call(text: str, pos: int, final: bool) -> tuple[int, str | None, int]:
    """(where the next call starts, its name, where its body starts) from pos; name None: no call (yet) — start is
    then where one may still begin (the text's end when none can)."""
    for m in _CALL_STARTS.finditer(text, pos):
        p = head = m.start()
        if m.group() == TOOL_CALL:         # <tool_call> is a call's start only if <function= follows it
            head = _skip_space(text, m.end())
            follows = _ahead(text, head, (FUNCTION,))
            if follows is None and not final:
                return p, None, 0
            if not follows:
                continue
        name_at = head + len(FUNCTION)     # (<function= also without <tool_call>, as vLLM reads it)
        name_end = _NAME.match(text, name_at).end()
        if name_end == len(text):
            if not final:
                return p, None, 0
        elif text[name_end] == ">" and name_end > name_at:
            return p, text[name_at:name_end], name_end + 1
    cut = None if final else _cut_tag(text, pos, (TOOL_CALL, FUNCTION))
    return (cut, None, 0) if cut is not None else (len(text), None, 0)


def _read_call(text: str, body: int, name: str, properties: Mapping[str, Any], final: bool,
               memo: ScanMemo) -> tuple[XmlCall, int]:
    """A call's arguments from its body (after <function=name>) and where the text after it starts."""
    if memo.call_at != body:
        memo.call_at, memo.call_parts, memo.call_seen, memo.call_next = body, [], set(), body
    parts, seen, pos = list(memo.call_parts), set(memo.call_seen), memo.call_next
    closed = False
    while (pos := _skip_space(text, pos)) < len(text):
        if text.startswith(FUNCTION_END, pos):
            closed = True
            pos = _skip_space(text, pos + len(FUNCTION_END))
            if text.startswith(TOOL_CALL_END, pos):
                pos += len(TOOL_CALL_END)
            break
        if text.startswith((TOOL_CALL_END, TOOL_CALL, FUNCTION), pos):
            closed = True          # a call left without its </function>: it ends where the next tag is
            if text.startswith(TOOL_CALL_END, pos):
                pos += len(TOOL_CALL_END)
            break
        if text.startswith(PARAMETER, pos):
            close = text.find(">", pos + len(PARAMETER))
            if close == -1:
                break              # its name is still coming (or, in a whole text, never came)
            param = text[pos + len(PARAMETER): close]
            start = close + 1 + (text.startswith("\n", close + 1))

            def may_follow(other: str) -> bool:
                return other not in seen and other != param and (not properties or other in properties)

            end, resume = _value_end(text, start, may_follow, final, memo)
            fresh = param not in seen      # a parameter given twice: the first one counts
            seen.add(param)
            if end is None:                # still being written: a plain string streams as it comes
                if fresh and _streams_as_text(properties.get(param)):
                    parts.append(f"{_dumps(param)}: \"{_escaped_prefix(text, start, resume, memo)}")
                break
            if fresh:
                value = text[start:end]
                value = value[:-1] if value.endswith("\n") else value
                parts.append(f"{_dumps(param)}: {_dumps(convert_value(value, properties.get(param)))}")
            pos = resume
            if not final:
                memo.call_parts, memo.call_seen, memo.call_next = list(parts), set(seen), pos
            continue
        nxt = text.find("<", pos + 1)    # text that is no tag between parameters: skipped
        pos = nxt if nxt != -1 else len(text)
    closed = closed or final
    return XmlCall(name, "{" + ", ".join(parts) + ("}" if closed else ""), closed), pos


def _value_end(text: str, start: int, may_follow: Callable[[str], bool], final: bool,
               memo: ScanMemo) -> tuple[int | None, int]:
    """Where the value starting at `start` ends and where reading goes on after it: (end, resume). While that is
    not known yet (a growing text): (None, up to where the value is certain)."""
    if memo.value_at != start:
        memo.value_at, memo.value_literal, memo.value_escaped = start, start, (start, "")
    for m in _VALUE_ENDS.finditer(text, memo.value_literal):
        p, tag = m.start(), m.group()
        if tag == PARAMETER_END:
            follows = _ahead(text, _skip_space(text, m.end()), (PARAMETER, FUNCTION_END, TOOL_CALL_END))
            if follows or (follows is None and final):
                return p, m.end()
        elif tag == FUNCTION_END:          # its </parameter> left out: the call's end ends it
            follows = _ahead(text, _skip_space(text, m.end()), (TOOL_CALL_END,))
            if follows or (follows is None and final):
                return p, p
        else:                              # ... or a new parameter's line
            close = text.find(">", m.end())
            follows = None if close == -1 else may_follow(text[m.end():close])
            if follows:
                return p, p
        if follows is None and not final:
            memo.value_literal = p
            return None, p
    if final:
        return len(text), len(text)
    cut = _cut_tag(text, memo.value_literal, (PARAMETER_END, FUNCTION_END, PARAMETER))
    memo.value_literal = cut if cut is not None else len(text)
    return None, memo.value_literal


def _ahead(text: str, pos: int, tags: tuple[str, ...]) -> bool | None:
    """Whether one of the tags starts at pos; None while the text ends in what may still become one."""
    if text.startswith(tags, pos):
        return True
    rest = text[pos:pos + max(map(len, tags))]
    return None if pos + len(rest) == len(text) and any(t.startswith(rest) for t in tags) else False


def _cut_tag(text: str, start: int, tags: tuple[str, ...]) -> int | None:
    """Where (from start on) the text ends in the beginning of one of the tags, if it does."""
    for p in range(max(start, len(text) - max(map(len, tags)) + 1), len(text)):
        if text[p] == "<" and any(t.startswith(text[p:]) for t in tags):
            return p
    return None


def _escaped_prefix(text: str, start: int, certain: int, memo: ScanMemo) -> str:
    """The JSON escape of the part of a growing value that is sure to stay (a newline just before where it is
    uncertain may be the one the format trims), adding to the last scan's: JSON escapes character by character."""
    if certain > start and text[certain - 1] == "\n":
        certain -= 1
    done, escaped = memo.value_escaped if memo.value_escaped[0] <= certain else (start, "")
    if certain > done:
        escaped += _dumps(text[done:certain])[1:-1]
        memo.value_escaped = (certain, escaped)
    return escaped


def _skip_space(text: str, pos: int) -> int:
    return _SPACE.match(text, pos).end()


def _properties(functions: Mapping[str, Mapping], name: str) -> Mapping[str, Any]:
    params = (functions.get(name) or {}).get("parameters")
    props = params.get("properties") if isinstance(params, Mapping) else None
    return props if isinstance(props, Mapping) else {}


def _dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


# ---------------------------------------------------------------------------------------------- types
def _declared_type(schema: Any) -> tuple[str, bool]:
    """(the parameter's type, lowercased, and whether it admits null): the schema's `type` (a list's first non-null
    one), else anyOf's / oneOf's first non-null option's; "string" when none is declared."""
    if not isinstance(schema, Mapping):
        return "string", False
    declared = schema.get("type")
    if declared is not None:
        names = [str(t).strip().lower() for t in (declared if isinstance(declared, list) else [declared])]
        others = [t for t in names if t != "null"]
        return (others[0] if others else "null"), "null" in names
    options = schema.get("anyOf", schema.get("oneOf"))
    if isinstance(options, list):
        names = [str(o["type"]).strip().lower() for o in options if isinstance(o, Mapping) and "type" in o]
        others = [t for t in names if t != "null"]
        return (others[0] if others else "string"), "null" in names
    return "string", False


def _streams_as_text(schema: Any) -> bool:
    """Whether the value is the raw text whatever it turns out to be (so it can stream before it is complete)."""
    declared, nullable = _declared_type(schema) if schema is not None else ("string", False)
    return declared in _STRING_TYPES and not nullable


def convert_value(value: str, schema: Any) -> Any:
    """A parameter's raw text -> the JSON value its schema (None: undeclared) types it as; the text when it does not
    convert (as vLLM's Qwen3 parsers do)."""
    if schema is None:
        return value
    declared, nullable = _declared_type(schema)
    if nullable and value.lower() in ("null", "none"):
        return None
    if declared in _STRING_TYPES:
        return value
    if value.lower() in ("null", "none"):       # Qwen3.5's template writes a None argument as "None"
        return None
    try:
        if declared.startswith(("int", "uint", "long", "short", "unsigned")):
            return int(value)
        if declared.startswith(("num", "float")):
            number = float(value)
            if not math.isfinite(number):
                return value
            return int(number) if number.is_integer() else number
    except ValueError:
        return value
    if declared in ("boolean", "bool", "binary"):
        return value.lower() == "true"
    container = declared in ("object", "array", "arr") or declared.startswith(("dict", "list"))
    parsed = _literal(value, container)
    return parsed if _is_json(parsed) else value


def _literal(value: str, container: bool) -> Any:
    """An object's or array's text read as JSON, else as a Python literal (a model trained on a template that wrote
    Python reprs writes those); other types as a Python literal; the text when neither reads it."""
    if container:
        try:
            parsed = json.loads(value)
            return _python_literal(parsed) if isinstance(parsed, str) else parsed
        except (ValueError, RecursionError):
            pass
    parsed = _python_literal(value)
    return _python_literal(parsed) if container and isinstance(parsed, str) else parsed


def _python_literal(value: str) -> Any:
    try:
        return ast.literal_eval(value)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):   # model output: anything may come
        return value


def _is_json(value: Any) -> bool:
    try:
        json.dumps(value, allow_nan=False)
        return True
    except (TypeError, ValueError, RecursionError):
        return False


# ---------------------------------------------------------------------------------------------- writing
def xml_tool_call(name: str, arguments: Any) -> str:
    """One call in the format, as Qwen3.5's template writes an earlier turn's: strings as they are, objects and
    arrays as JSON, other values as JSON literals."""
    lines = [TOOL_CALL, f"{FUNCTION}{name}>"]
    for key, value in (arguments.items() if isinstance(arguments, Mapping) else ()):
        lines += [f"{PARAMETER}{key}>", value if isinstance(value, str) else _dumps(value), PARAMETER_END]
    return "\n".join(lines + [FUNCTION_END, TOOL_CALL_END])
