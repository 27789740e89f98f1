"""OpenAI tool calling: request validation, the grammar for forced calls, and parsers for "auto".

tool_choice "required" and a named function are enforced by the grammar (`ToolRequest.spec()`): the
model writes `[{"name": ..., "arguments": {...}}, ...]`, or just the named function's arguments, so the
arguments always validate against the function's parameter schema. "auto" leaves the model free and
parses its own tool-call syntax with a parser chosen by name, as vLLM's `--tool-call-parser`:
  hermes       <tool_call>{"name": ..., "arguments": {...}}</tool_call>  (Hermes, Qwen2.5, Qwen3 templates)
  json         a bare JSON object {"name", "arguments"} or a list of them (optionally in a ``` fence)
  qwen3_coder  <tool_call><function=NAME><parameter=KEY>value</parameter>...</function></tool_call>
  qwen3_xml      (Qwen3-Coder, Qwen3.5; one format, vLLM's two names: qwen3_xml_tool_calls.py)
  llama3_json  {"name": ..., "parameters": {...}}; ...  (Llama 3.x, optionally after <|python_tag|>;
  llama4_json    llama3_json_tool_calls.py)
  pythonic     [get_weather(city="Paris"), ...]  (Llama 3.2 / 4, optionally in <|python_start|>...<|python_end|>;
  llama4_pythonic  read with ast: pythonic_tool_calls.py)
  mistral      [TOOL_CALLS][{"name", "arguments"}, ...] or [TOOL_CALLS]name[ARGS]{...}  (9-character call ids:
                 mistral_tool_calls.py)
  granite      <|tool_call|>[{"name", "arguments"}, ...]  (Granite 3.x; or <tool_call>: granite_tool_calls.py)
  gemma4       <|tool_call>call:NAME{key:<|"|>text<|"|>,n:1}<tool_call|>  (Gemma 4's notation: gemma4_tool_calls.py)
Where a parser's markers are special tokens (`needs_special_tokens`), a request with tools under it keeps special
tokens in its text, as vLLM's adjust_request does (RequestPreparer). Every mode yields OpenAI `tool_calls` entries,
whole (`extract_tool_calls`) or as stream deltas (`ToolCallStreamer`: a first chunk with index, id, type, name and
arguments "", then argument fragments).
"""
from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from kvflow.errors import InvalidRequestError
from kvflow.server.serving.gemma4_tool_calls import NAMES as GEMMA4_NAMES, Gemma4ToolParser
from kvflow.server.serving.granite_tool_calls import NAMES as GRANITE_NAMES, GraniteToolParser
from kvflow.server.serving.llama3_json_tool_calls import NAMES as LLAMA3_JSON_NAMES, Llama3JsonToolParser
from kvflow.server.serving.mistral_tool_calls import NAMES as MISTRAL_NAMES, MistralToolParser, mistral_call_id
from kvflow.server.serving.pythonic_tool_calls import NAMES as PYTHONIC_NAMES, PythonicToolParser
from kvflow.server.serving.qwen3_xml_tool_calls import NAMES as QWEN3_XML_NAMES, ScanMemo, scan_calls
from kvflow.server.serving.tool_call_text import (ExtractedToolCalls, PartialCall, call_from_json, held_back,
                                                  scan_call, scan_call_list, tool_call, tool_call_id)
from kvflow.structured_output.spec import StructuredSpec, json_schema_spec

_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")   # OpenAI's rule for function names


# ---------------------------------------------------------------------------------------------- request
@dataclass(frozen=True)
class ToolRequest:
    functions: Mapping[str, dict]     # name -> {"name", "description"?, "parameters"}
    mode: str                         # "none" | "auto" | "required" | "function"
    name: str | None = None           # the forced function when mode == "function"
    parser: str | None = None         # the auto-mode parser name
    parallel: bool = True             # parallel_tool_calls: false allows one call at most
    call_id: Callable[[], str] = tool_call_id   # the server's parser's call ids, in every mode

    def spec(self) -> StructuredSpec | None:
        """The grammar constraint for this tool choice (None for "none" and "auto")."""
        if self.mode == "function":
            return json_schema_spec(self.functions[self.name]["parameters"], "tool_choice")
        if self.mode == "required":
            calls = [{"type": "object", "properties": {"name": {"const": f["name"]}, "arguments": f["parameters"]},
                      "required": ["name", "arguments"], "additionalProperties": False}
                     for f in self.functions.values()]
            one = {} if self.parallel else {"maxItems": 1}
            return json_schema_spec({"type": "array", "minItems": 1, **one, "items": {"anyOf": calls}}, "tools")
        return None


def parse_tool_request(tools: Any, tool_choice: Any = None, *, tool_parser: str | None = None,
                       parallel_tool_calls: bool | None = None) -> ToolRequest | None:
    """Validate OpenAI `tools` / `tool_choice`; None when the request uses no tools.

    tool_parser: the server's --tool-call-parser; "auto" is refused without one (as vLLM does).
    parallel_tool_calls=False: at most one call, enforced by the grammar ("required"; a named function is one call
    anyway); under "auto" the model's own syntax is not constrained, so it is a 400 there rather than a promise
    kvflow could not keep.
    """
    if tools is None or tools == []:
        if tool_choice not in (None, "none"):
            raise InvalidRequestError("tool_choice is only allowed when tools are given", param="tool_choice")
        return None
    if not isinstance(tools, list):
        raise InvalidRequestError("tools must be a list", param="tools")
    functions: dict[str, dict] = {}
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, Mapping) and tool.get("type", "function") == "function" else None
        if not isinstance(fn, Mapping):
            raise InvalidRequestError("each tool must be {'type': 'function', 'function': {...}}", param=f"tools[{i}]")
        name = fn.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise InvalidRequestError(f"invalid function name {name!r}: 1-64 of a-z, A-Z, 0-9, _ and -",
                                      param=f"tools[{i}].function.name")
        if name in functions:
            raise InvalidRequestError(f"duplicate function name {name!r}", param=f"tools[{i}].function.name")
        # no parameters: the function takes none, so its arguments are exactly {}
        params = fn.get("parameters", {"type": "object", "properties": {}, "additionalProperties": False})
        if not isinstance(params, Mapping):
            raise InvalidRequestError("parameters must be a JSON schema object", param=f"tools[{i}].function.parameters")
        functions[name] = {**fn, "parameters": dict(params)}

    if tool_choice is None:
        tool_choice = "auto"
    if isinstance(tool_choice, Mapping):
        name = (tool_choice.get("function") or {}).get("name") if tool_choice.get("type") == "function" else None
        if not isinstance(name, str):
            raise InvalidRequestError("tool_choice must be 'none', 'auto', 'required' or "
                                      "{'type': 'function', 'function': {'name': ...}}", param="tool_choice")
        if name not in functions:
            raise InvalidRequestError(f"tool_choice names function {name!r}, which is not in tools", param="tool_choice")
        return ToolRequest(functions, "function", name, call_id=CALL_IDS.get(tool_parser, tool_call_id))
    if tool_choice not in ("none", "auto", "required"):
        raise InvalidRequestError(f"unknown tool_choice {tool_choice!r}", param="tool_choice")
    if tool_choice == "auto":
        if tool_parser is None:
            raise InvalidRequestError('"auto" tool choice needs a server started with --enable-auto-tool-choice '
                                      '--tool-call-parser NAME', param="tool_choice")
        get_tool_parser(tool_parser)
        if parallel_tool_calls is False:
            raise InvalidRequestError('parallel_tool_calls=false is supported with tool_choice "required" or a named '
                                      'function (the grammar allows one call), not with "auto"',
                                      param="parallel_tool_calls")
    return ToolRequest(functions, tool_choice, parser=tool_parser if tool_choice == "auto" else None,
                       parallel=parallel_tool_calls is not False, call_id=CALL_IDS.get(tool_parser, tool_call_id))


@functools.lru_cache(maxsize=16)
def template_supports_tools(chat_template: str | None) -> bool:
    """Whether a chat template reads the variable `tools` at all (if not, tools cannot reach the model's prompt).
    The variable, not the word: SmolLM3's template writes "<tools>" as text and reads its tools from `xml_tools`.
    A template Jinja cannot parse here (an extension's tag) is judged by the word."""
    if not chat_template:
        return False
    import jinja2
    from jinja2 import nodes

    source = _GENERATION_TAGS.sub("", chat_template)     # transformers' {% generation %} marks (its extension)
    try:
        tree = jinja2.Environment(extensions=["jinja2.ext.loopcontrols"]).parse(source)
    except jinja2.TemplateSyntaxError:
        return re.search(r"\btools\b", chat_template) is not None
    return any(n.name == "tools" and n.ctx == "load" for n in tree.find_all(nodes.Name))


_GENERATION_TAGS = re.compile(r"{%-?\s*(end)?generation\s*-?%}")


# ---------------------------------------------------------------------------------------------- parsing
class HermesToolParser:
    """<tool_call>{"name": "f", "arguments": {...}}</tool_call>, any number of them, text around them."""
    OPEN, CLOSE = "<tool_call>", "</tool_call>"
    needs_special_tokens = True     # <tool_call> is a special token in some models' tokenizers
    _BLOCK = re.compile(r"<tool_call>(.*?)(</tool_call>|$)", re.S)

    def extract(self, text: str) -> ExtractedToolCalls:
        calls, content, pos = [], [], 0
        for m in self._BLOCK.finditer(text):
            try:
                call = call_from_json(json.loads(m.group(1)))
            except json.JSONDecodeError:
                call = None
            if call is None:   # not a call after all: leave the text as the model wrote it
                continue
            content.append(text[pos: m.start()])
            calls.append(call)
            pos = m.end()
        if not calls:         # the model's text as it wrote it, as a stream sends it
            return ExtractedToolCalls(text or None)
        content.append(text[pos:])
        joined = "".join(content).strip()
        return ExtractedToolCalls(joined or None, calls)

    def partial(self, text: str, final: bool = False) -> tuple[str, list[PartialCall]]:
        content, calls, pos = [], [], 0
        for m in self._BLOCK.finditer(text):
            content.append(text[pos: m.start()])
            calls.append(scan_call(m.group(1)))
            pos = m.end()
        tail = text[pos:]
        content.append(tail[: len(tail) - held_back(tail, self.OPEN)])
        return "".join(content), calls


class JsonToolParser:
    """A bare {"name", "arguments"} object or a list of them, possibly in a ```json fence."""
    _FENCE = re.compile(r"^\s*```(?:json)?\s*(.*?)\s*(?:```\s*)?$", re.S)

    def __init__(self, call_id: Callable[[], str] = tool_call_id):
        self.call_id = call_id

    def _unfence(self, text: str) -> str:
        m = self._FENCE.match(text)
        return m.group(1) if m else text.strip()

    def extract(self, text: str) -> ExtractedToolCalls:
        try:
            obj = json.loads(self._unfence(text))
        except json.JSONDecodeError:
            return ExtractedToolCalls(text or None)
        calls = [call_from_json(o, self.call_id) for o in (obj if isinstance(obj, list) else [obj])]
        if not calls or None in calls:
            return ExtractedToolCalls(text or None)
        return ExtractedToolCalls(None, calls)

    def partial(self, text: str, final: bool = False) -> tuple[str, list[PartialCall]]:
        start = text.lstrip()
        if "```".startswith(start) or (start.startswith("```") and "\n" not in start):
            return "", []            # nothing yet, or a fence whose first line is still coming
        body = self._unfence(text)
        if not body:
            return "", []
        if body[0] not in "{[":
            return text, []          # prose: stream it as content
        if body[0] == "{":
            return "", [scan_call(body)]
        return "", scan_call_list(body)


class Qwen3XmlToolParser:
    """<tool_call><function=f><parameter=p>value</parameter></function></tool_call>, any number of them; the text
    before the first is the content. The request's schemas type the values (qwen3_xml_tool_calls.py)."""

    def __init__(self, functions: Mapping[str, dict]):
        self.functions = functions
        self._memo = ScanMemo()            # partial() reads one growing text: each scan goes on from the last

    def extract(self, text: str) -> ExtractedToolCalls:
        scan = scan_calls(text, self.functions, final=True)
        if not scan.calls:
            return ExtractedToolCalls(text or None)
        return ExtractedToolCalls(scan.content.strip() or None, [tool_call(c.name, c.arguments) for c in scan.calls])

    def partial(self, text: str, final: bool = False) -> tuple[str, list[PartialCall]]:
        scan = scan_calls(text, self.functions, final, self._memo)
        return scan.content, [PartialCall(c.name, c.arguments, c.closed) for c in scan.calls]


# name -> the parser for a request's functions (keys: config.TOOL_PARSERS)
TOOL_PARSERS: dict[str, Callable[[Mapping[str, dict]], Any]] = {
    "hermes": lambda functions: HermesToolParser(),
    "json": lambda functions: JsonToolParser(),
    **dict.fromkeys(QWEN3_XML_NAMES, Qwen3XmlToolParser),
    **dict.fromkeys(LLAMA3_JSON_NAMES, lambda functions: Llama3JsonToolParser()),
    **dict.fromkeys(PYTHONIC_NAMES, lambda functions: PythonicToolParser()),
    **dict.fromkeys(MISTRAL_NAMES, lambda functions: MistralToolParser()),
    **dict.fromkeys(GRANITE_NAMES, lambda functions: GraniteToolParser()),
    **dict.fromkeys(GEMMA4_NAMES, lambda functions: Gemma4ToolParser()),
}
# a parser whose model family needs its own call ids (in every tool_choice: the ids come back in the history, where
# the family's template checks them)
CALL_IDS: dict[str, Callable[[], str]] = dict.fromkeys(MISTRAL_NAMES, mistral_call_id)


def get_tool_parser(name: str, functions: Mapping[str, dict] | None = None):
    try:
        return TOOL_PARSERS[name](functions or {})
    except KeyError:
        raise InvalidRequestError(f"unknown tool call parser {name!r}; known: {', '.join(TOOL_PARSERS)}",
                                  param="tool_call_parser") from None


def needs_special_tokens(parser: str | None) -> bool:
    """Whether the parser named `parser` reads markers that are special tokens in its models' tokenizers (a parser
    class's `needs_special_tokens`: hermes, mistral, gemma4, as vLLM's parsers whose adjust_request sets
    skip_special_tokens=False). A request with tools under such a parser is detokenized with the special tokens,
    which skip_special_tokens would drop before the parser sees them."""
    return parser is not None and getattr(get_tool_parser(parser), "needs_special_tokens", False)


def extract_tool_calls(request: ToolRequest, text: str) -> ExtractedToolCalls:
    """The whole generated text -> content and tool_calls (finish_reason "tool_calls" if any)."""
    if request.mode == "function":
        return ExtractedToolCalls(None, [tool_call(request.name, json.loads(text), request.call_id())])
    if request.mode == "required":
        return JsonToolParser(request.call_id).extract(text)
    if request.mode == "auto":
        return get_tool_parser(request.parser, request.functions).extract(text)
    return ExtractedToolCalls(text)


# ---------------------------------------------------------------------------------------------- streaming
class ToolCallStreamer:
    """Growing generated text -> OpenAI chat-completion-chunk deltas, content and tool calls.

    push(new_text) returns the deltas to send now, in order: {"content": ...} or {"tool_calls": [...]}.
    A call is announced (index, id, type, name, arguments "") once its name is complete; its arguments then
    follow as fragments of the arguments' JSON text (the model's own, or the parser's as the text grows).
    finish() reads the text once more as the whole output (a parser may end an unclosed call there) and flushes
    held-back text.
    """

    def __init__(self, request: ToolRequest):
        self._partial: Callable[[str, bool], tuple[str, list[PartialCall]]]
        self._call_id = request.call_id
        if request.mode == "function":
            self._partial = lambda text, final=False: ("", [PartialCall(request.name, text, False)])
        elif request.mode == "required":
            self._partial = JsonToolParser().partial
        elif request.mode == "auto":
            parser = get_tool_parser(request.parser, request.functions)
            self._partial = parser.partial
        else:
            self._partial = lambda text, final=False: (text, [])
        self.text = ""
        self._content_sent = 0
        self._args_sent: list[int] = []   # per announced call: characters of arguments sent
        self.ids: list[str] = []
        self.names: list[str] = []         # the announced calls' function names

    @property
    def has_tool_calls(self) -> bool:
        return bool(self.ids)

    def push(self, new_text: str) -> list[dict]:
        self.text += new_text
        return self._deltas(final=False)

    def finish(self) -> list[dict]:
        """At the end of generation: what the whole output adds (an unclosed call's end), then prose that was held
        back (a partial tag, JSON that was no call)."""
        deltas = self._deltas(final=True)
        if not self.ids and len(self.text) > self._content_sent:
            deltas.append({"content": self.text[self._content_sent:]})
            self._content_sent = len(self.text)
        return deltas

    def _deltas(self, final: bool) -> list[dict]:
        content, calls = self._partial(self.text, final)
        deltas = []
        if len(content) > self._content_sent and not self.ids:   # no prose between or after calls
            deltas.append({"content": content[self._content_sent:]})
            self._content_sent = len(content)
        for i, call in enumerate(calls):
            if call.name is None:
                break                  # announce calls in order, each once its name is known
            if i == len(self.ids):
                self.ids.append(self._call_id())
                self.names.append(call.name)
                self._args_sent.append(0)
                deltas.append({"tool_calls": [{"index": i, "id": self.ids[i], "type": "function",
                                               "function": {"name": call.name, "arguments": ""}}]})
            if len(call.arguments) > self._args_sent[i]:
                deltas.append({"tool_calls": [{"index": i, "function": {
                    "arguments": call.arguments[self._args_sent[i]:]}}]})
                self._args_sent[i] = len(call.arguments)
        return deltas
