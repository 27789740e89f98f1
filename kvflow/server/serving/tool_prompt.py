"""How a chat request's tools and tool messages reach the prompt.

A template that reads `tools` (Qwen2.5/3, Llama 3.1, Hermes ...) gets them as `tools=[...]`, and the
assistant's earlier `tool_calls` with their arguments as objects, as Hugging Face templates expect.

A template that cannot express tools (the embedded SmolLM2's) gets them from us instead: a system message
that lists the functions and says how to call them, in the syntax that will be parsed back (a JSON list for
"required", the bare arguments for a named function, the parser's syntax for "auto"), and earlier calls are
written into the assistant's content in that same syntax. For "required" and named functions the grammar
enforces the call anyway; the prompt only helps the model fill in sensible arguments. With "none" the tools
are left out of such a prompt.
"""
from __future__ import annotations

import json
from typing import Any

from kvflow.server.common.errors import APIError
from kvflow.server.serving import (gemma4_tool_calls, granite_tool_calls, llama3_json_tool_calls,
                                   mistral_tool_calls, pythonic_tool_calls)
from kvflow.server.serving.qwen3_xml_tool_calls import NAMES as QWEN3_XML_NAMES, xml_tool_call
from kvflow.server.serving.tool_calls import ToolRequest, template_supports_tools

# parser name -> (earlier calls written in its syntax, how to call in it) for the formats whose module says both
_FORMATS = {name: (module.written, module.INSTRUCTION)
            for module in (llama3_json_tool_calls, pythonic_tool_calls, mistral_tool_calls, granite_tool_calls,
                           gemma4_tool_calls)
            for name in module.NAMES}


def chat_messages(messages: list, tools: ToolRequest | None, chat_template: str | None
                  ) -> tuple[list[dict], dict[str, Any]]:
    """OpenAI messages (protocol.ChatMessage) -> the template's messages and extra template arguments."""
    native = template_supports_tools(chat_template)
    parser = tools.parser if tools is not None else None
    out = []
    for m in messages:
        msg: dict[str, Any] = {"role": m.role, "content": m.text()}
        if m.name:
            msg["name"] = m.name
        if m.tool_call_id is not None:
            msg["tool_call_id"] = m.tool_call_id
        thought = m.reasoning if m.reasoning is not None else m.reasoning_content
        if thought is not None:
            if m.role != "assistant":
                raise APIError(400, "reasoning belongs to assistant messages (the model's earlier reasoning)",
                               param="messages")
            msg["reasoning"] = msg["reasoning_content"] = thought
        if m.tool_calls:
            calls = [{"name": c.function.name, "arguments": _arguments(c.function.arguments)} for c in m.tool_calls]
            if native:
                msg["tool_calls"] = [{"id": c.id, "type": "function", "function": call}
                                     for c, call in zip(m.tool_calls, calls)]
            else:
                if parser == "hermes":
                    written = " ".join(f"<tool_call>{_dumps(c)}</tool_call>" for c in calls)
                elif parser in QWEN3_XML_NAMES:
                    written = "\n".join(xml_tool_call(c["name"], c["arguments"]) for c in calls)
                elif parser in _FORMATS:
                    written = _FORMATS[parser][0](calls)
                else:
                    written = _dumps(calls)
                msg["content"] = f"{msg['content']}\n{written}" if msg["content"] else written
        out.append(msg)
    if tools is None or tools.mode == "none":
        return out, {}
    if native:
        return out, {"tools": [{"type": "function", "function": f} for f in tools.functions.values()]}
    prompt = tools_system_prompt(tools)
    if out and out[0]["role"] in ("system", "developer"):
        out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{prompt}" if out[0]["content"] else prompt}
    else:
        out.insert(0, {"role": "system", "content": prompt})
    return out, {}


def tools_system_prompt(tools: ToolRequest) -> str:
    listed = "\n".join(_dumps({k: f[k] for k in ("name", "description", "parameters") if k in f})
                       for f in tools.functions.values())
    if tools.mode == "function":
        how = f"Call the function {tools.name}: answer with only its arguments, as one JSON object."
    elif tools.mode == "required":
        how = ('Call one or more of them: answer with only a JSON list, '
               '[{"name": <function name>, "arguments": <arguments object>}].')
    elif tools.parser == "hermes":
        how = ('To call one, write <tool_call>{"name": <function name>, "arguments": <arguments object>}'
               '</tool_call>; otherwise answer normally.')
    elif tools.parser in QWEN3_XML_NAMES:
        how = ("To call one, write <tool_call>\n<function=NAME>\n<parameter=PARAMETER>\nVALUE\n</parameter>\n"
               "</function>\n</tool_call>, a <parameter=...> block for each argument (a string as it is, other values "
               "as JSON); otherwise answer normally.")
    elif tools.parser in _FORMATS:
        how = _FORMATS[tools.parser][1]
    else:
        how = ('To call one, answer with only {"name": <function name>, "arguments": <arguments object>}; '
               'otherwise answer normally.')
    return f"You can call these functions (their parameters are JSON schemas):\n{listed}\n{how}"


def _arguments(text: str) -> Any:
    """A call's arguments as an object for the template (OpenAI sends a JSON string); kept as text if not JSON."""
    try:
        return json.loads(text)
    except (json.JSONDecodeError, TypeError):
        return text


def _dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)
