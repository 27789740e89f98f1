"""What a request asks the output to be, parsed from every request form kvflow accepts.

One frozen, hashable `StructuredSpec` per request: it is the compile cache's key, so payloads are
strings (a JSON schema re-dumped compactly; keys keep their order, which is the order the grammar
writes the properties in).
`param` names the request field for error messages and is left out of equality and hashing.

Accepted forms (one per request; two at once is a 400, as in vLLM):
  response_format: {"type": "text" | "json_object" | "json_schema" | "structural_tag", ...}  (OpenAI, vLLM)
  structured_outputs: {"json" | "regex" | "choice" | "grammar" | "json_object" | "structural_tag": ...}  (vLLM)
  guided_json, guided_regex, guided_choice, guided_grammar  (older vLLM clients)
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Mapping

from kvflow.errors import InvalidRequestError
from kvflow.structured_output.limits import MAX_CHOICES, TOO_COMPLEX

KINDS = ("json_schema", "json_object", "regex", "choice", "grammar", "structural_tag")


@dataclass(frozen=True)
class StructuredSpec:
    kind: str       # one of KINDS
    payload: str    # canonical JSON for json_schema / choice / structural_tag; the text for regex / grammar
    param: str | None = field(default=None, compare=False, hash=False)  # the request field, for 400s

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown structured output kind {self.kind!r}")


def _loads(text: str, what: str, param: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise InvalidRequestError(f"{what} is not valid JSON: {e}", param=param) from None
    except RecursionError:     # ~1000 levels: Python's own limit (llguidance's is 128)
        raise InvalidRequestError(f"{what} is nested too deeply", param=param, code=TOO_COMPLEX) from None


def _dumps(value: Any, what: str, param: str) -> str:
    try:
        return json.dumps(value, ensure_ascii=False)
    except RecursionError:     # the request body's parser let it through; llguidance would refuse it anyway
        raise InvalidRequestError(f"{what} is nested too deeply", param=param, code=TOO_COMPLEX) from None


def json_schema_spec(schema: Any, param: str) -> StructuredSpec:
    """A JSON schema given as a dict/bool or as a JSON string. (Nesting past 128 levels, serde_json's limit, is
    refused by the compiler; past Python's recursion limit, here.)"""
    if isinstance(schema, str):
        schema = _loads(schema, "the JSON schema", param)
    if not isinstance(schema, (dict, bool)):
        raise InvalidRequestError("the JSON schema must be a JSON object", param=param)
    return StructuredSpec("json_schema", _dumps(schema, "the JSON schema", param), param)


def _choice_spec(choices: Any, param: str) -> StructuredSpec:
    if not isinstance(choices, (list, tuple)) or not choices or not all(isinstance(c, str) for c in choices):
        raise InvalidRequestError("choice must be a non-empty list of strings", param=param)
    if len(choices) > MAX_CHOICES:
        raise InvalidRequestError(f"choice has {len(choices)} entries; at most {MAX_CHOICES} are supported",
                                  param=param, code=TOO_COMPLEX)
    return StructuredSpec("choice", json.dumps(list(choices), ensure_ascii=False), param)


def _text_spec(kind: str, text: Any, param: str) -> StructuredSpec:
    if not isinstance(text, str) or not text:
        raise InvalidRequestError(f"{kind} must be a non-empty string", param=param)
    return StructuredSpec(kind, text, param)


def _structural_tag_spec(tag: Any, param: str) -> StructuredSpec:
    """vLLM's structural tag: {"structures": [{"begin", "schema", "end"}], "triggers": [...]}."""
    if isinstance(tag, str):
        tag = _loads(tag, "structural_tag", param)
    structures = tag.get("structures") if isinstance(tag, dict) else None
    triggers = tag.get("triggers") if isinstance(tag, dict) else None
    if (not isinstance(structures, list) or not structures or not isinstance(triggers, list) or not triggers
            or not all(isinstance(s, dict) and isinstance(s.get("begin"), str) and isinstance(s.get("end"), str)
                       and isinstance(s.get("schema"), (dict, bool)) for s in structures)):
        raise InvalidRequestError("structural_tag needs 'structures' (a list of {begin, schema, end}) and "
                                  "'triggers' (a list of strings)", param=param)
    if not all(any(s["begin"].startswith(t) for t in triggers) for s in structures):
        raise InvalidRequestError("each structure's 'begin' must start with one of the 'triggers'", param=param)
    payload = {"structures": structures, "triggers": triggers}
    return StructuredSpec("structural_tag", _dumps(payload, "structural_tag", param), param)


def _from_response_format(rf: Any) -> StructuredSpec | None:
    param = "response_format"
    if not isinstance(rf, Mapping):
        raise InvalidRequestError("response_format must be an object", param=param)
    kind = rf.get("type")
    if kind in (None, "text"):
        return None
    if kind == "json_object":
        return StructuredSpec("json_object", "", param)
    if kind == "json_schema":
        js = rf.get("json_schema")
        if not isinstance(js, Mapping) or "schema" not in js:
            raise InvalidRequestError("response_format.json_schema must be an object with a 'schema'",
                                      param="response_format.json_schema")
        # 'strict' changes nothing here: the grammar always enforces the schema
        return json_schema_spec(js["schema"], "response_format.json_schema.schema")
    if kind == "structural_tag":
        return _structural_tag_spec(rf, param)
    raise InvalidRequestError(f"unsupported response_format type {kind!r}: expected 'text', 'json_object', "
                              "'json_schema' or 'structural_tag'", param="response_format.type")


def _from_structured_outputs(so: Any) -> StructuredSpec | None:
    param = "structured_outputs"
    if not isinstance(so, Mapping):
        raise InvalidRequestError("structured_outputs must be an object", param=param)
    given = {k: v for k, v in so.items()
             if k in ("json", "regex", "choice", "grammar", "json_object", "structural_tag") and v not in (None, False)}
    if len(given) > 1:
        raise InvalidRequestError(f"structured_outputs takes one of json, regex, choice, grammar, json_object, "
                                  f"structural_tag; got {sorted(given)}", param=param)
    if not given:
        return None
    (key, value), = given.items()
    sub = f"{param}.{key}"
    if key == "json":
        return json_schema_spec(value, sub)
    if key == "json_object":
        return StructuredSpec("json_object", "", sub)
    if key == "choice":
        return _choice_spec(value, sub)
    if key == "structural_tag":
        return _structural_tag_spec(value, sub)
    return _text_spec(key, value, sub)


# request field -> its spec (None: the field asks for nothing, e.g. response_format {"type": "text"})
_FIELDS = {
    "response_format": _from_response_format,
    "structured_outputs": _from_structured_outputs,
    "guided_json": lambda v: json_schema_spec(v, "guided_json"),
    "guided_regex": lambda v: _text_spec("regex", v, "guided_regex"),
    "guided_choice": lambda v: _choice_spec(v, "guided_choice"),
    "guided_grammar": lambda v: _text_spec("grammar", v, "guided_grammar"),
}


def spec_from_request(body: Mapping[str, Any]) -> StructuredSpec | None:
    """The structured-output constraint of a chat or text completion request body, or None.

    Raises InvalidRequestError (param = the field at fault) on malformed input or on two constraints at once.
    Whether a schema/regex/grammar compiles is checked later by the compiler, which names the same param.
    """
    found = [build(body[key]) for key, build in _FIELDS.items() if body.get(key) is not None]
    if body.get("guided_json_object"):   # vLLM's older spelling of json_object mode
        found.append(StructuredSpec("json_object", "", "guided_json_object"))
    found = [spec for spec in found if spec is not None]
    if len(found) > 1:
        raise InvalidRequestError("only one structured output constraint may be given; got "
                                  + ", ".join(s.param or s.kind for s in found), param=found[1].param)
    return found[0] if found else None
