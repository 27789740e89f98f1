"""Mistral's tool calls (`--tool-call-parser mistral`, vLLM's name), in both of its tokenizers' forms:

    Let me check.[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, ...]    (before v11)
    Let me check.[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]add[ARGS]{"a": 1}  (v11 on)

The text before the first [TOOL_CALLS] is the content (as written; none when empty); without [TOOL_CALLS] the whole
output is. vLLM picks the form by the tokenizer's version; kvflow by what follows the marker: a JSON list (or one
object) is the first form, a name the second. In the second a call's name ends at [ARGS] (or, where a tokenizer's
text has no [ARGS], at its "{"; a [CALL_ID] part is left out) and its arguments are the text up to the next
[TOOL_CALLS], passed on as written even when they are no valid JSON, as vLLM does: a client then sees what the model
tried. In the first, a list whose items are not all {"name": ..., "arguments"?: ...} objects, or one the output left
unfinished, makes the whole output content.

Call ids are 9 letters and digits, as vLLM makes them: Mistral's templates refuse other ids in the history.
"""
from __future__ import annotations

import json
import random
import string

from kvflow.server.serving.tool_call_text import (ExtractedToolCalls, PartialCall, dumps, held_back, scan_call,
                                                  scan_call_list, skip_space, tool_call)

NAMES = ("mistral",)
TOOL_CALLS, ARGS, CALL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"
_ALPHANUMERIC = string.ascii_letters + string.digits
_DECODER = json.JSONDecoder()


def mistral_call_id() -> str:
    """9 letters and digits: mistral-common's rule for a tool call's id."""
    return "".join(random.choices(_ALPHANUMERIC, k=9))


def scan(text: str, final: bool = False) -> tuple[str, list[PartialCall], bool]:
    """(content, calls, whole) of a (possibly growing) output; `whole` is False when the JSON form is unfinished
    (with `final`: never finished) or is no list of calls."""
    at = text.find(TOOL_CALLS)
    if at == -1:
        return text[: len(text) - (0 if final else held_back(text, TOOL_CALLS))], [], True
    content, body_at = text[:at], skip_space(text, at + len(TOOL_CALLS))
    if body_at == len(text):
        return content, [], True
    if text[body_at] in "[{":
        return (content, *_json_calls(text[body_at:]))
    calls = []
    segments = text[body_at:].split(TOOL_CALLS)
    for i, segment in enumerate(segments):
        growing = i == len(segments) - 1 and not final
        if growing:                      # hold back what may be the next marker's start
            segment = segment[: len(segment) - held_back(segment, TOOL_CALLS)]
        ends = [p for p in (segment.find(ARGS), segment.find("{")) if p != -1]
        if not ends:                     # no arguments (yet): a name still being written, or no call (vLLM skips it)
            if growing:
                calls.append(PartialCall(None, "", False))
            continue
        cut = min(ends)
        name = segment[:cut].split(CALL_ID)[0].strip()
        if not name:
            continue
        arguments = segment[cut + (len(ARGS) if segment.startswith(ARGS, cut) else 0):].strip()
        calls.append(PartialCall(name, arguments or ("" if growing else "{}"), not growing))
    return content, calls, True


def _json_calls(body: str) -> tuple[list[PartialCall], bool]:
    """The first form's calls: a JSON list of {"name", "arguments"} objects (or one such object)."""
    try:
        value, end = _DECODER.raw_decode(body)
    except json.JSONDecodeError:         # still being written (or never finished)
        return (scan_call_list(body) if body[0] == "[" else [scan_call(body)]), False
    items = value if isinstance(value, list) else [value]
    if not items or not all(isinstance(c, dict) and isinstance(c.get("name"), str) for c in items):
        return [], False
    calls = scan_call_list(body[:end]) if body[0] == "[" else [scan_call(body[:end])]
    # an object without "arguments" is a call without any, as vLLM reads it
    return [c if c.done else PartialCall(c.name, "{}", True) for c in calls], True


class MistralToolParser:
    """[TOOL_CALLS] and a JSON list of calls, or [TOOL_CALLS]name[ARGS]{...} per call; the text before is content."""
    needs_special_tokens = True     # [TOOL_CALLS] and [ARGS] are special tokens in Mistral's tokenizers

    def extract(self, text: str) -> ExtractedToolCalls:
        content, calls, whole = scan(text, final=True)
        if not calls or not whole:
            return ExtractedToolCalls(text or None)
        json_form = text[skip_space(text, text.find(TOOL_CALLS) + len(TOOL_CALLS))] in "[{"
        return ExtractedToolCalls(content or None, [
            tool_call(c.name, json.loads(c.arguments) if json_form else c.arguments, mistral_call_id())
            for c in calls])

    def partial(self, text: str, final: bool = False) -> tuple[str, list[PartialCall]]:
        content, calls, _ = scan(text, final)
        return content, calls


def written(calls: list[dict]) -> str:
    """Earlier calls as the format writes them ({"name", "arguments"} dicts in), in its newer form."""
    return "".join(f"{TOOL_CALLS}{c['name']}{ARGS}{dumps(c['arguments'])}" for c in calls)


INSTRUCTION = ("To call one, write [TOOL_CALLS] then the function's name, [ARGS] and its arguments as a JSON object "
               "(again for each further call); otherwise answer normally.")
