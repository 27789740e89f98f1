"""vLLM's chat-template options of a request, checked once, for every route that renders a chat into prompt ids
(/tokenize's chat form today; /v1/chat/completions calls the same code once it takes these fields):
`add_generation_prompt`, `continue_final_message`, `add_special_tokens`, `chat_template`, `chat_template_kwargs`.

vLLM's rules, kept: `continue_final_message` and `add_generation_prompt` cannot both be true; a request's own
`chat_template` (also as `chat_template_kwargs["chat_template"]`) is refused unless the server runs with
`--trust-request-chat-template`, because a template is code the server runs (in transformers' Jinja sandbox, but
for as long as it takes); `chat_template_kwargs` reach the template as variables. Two places where vLLM lets a
value be lost without a word are 400s naming it here instead: a kwarg that contradicts the request field which
sets the same template variable, and a kwarg that is one of transformers' rendering switches (`tokenize`,
`return_dict`, ...), which would change what `apply_chat_template` returns rather than what the template reads.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

from kvflow.server.common.errors import APIError

# parameters of transformers' apply_chat_template that are not template variables
RENDERING_SWITCHES = ("conversation", "tokenize", "return_dict", "return_tensors", "padding", "truncation",
                      "max_length", "return_assistant_tokens_mask", "tokenizer_kwargs", "sanitize_control_tokens")
# template variables that a request field of the same name sets
FIELD_VARIABLES = ("add_generation_prompt", "continue_final_message", "tools", "documents")

UNTRUSTED_TEMPLATE = ("Chat template is passed with request, but --trust-request-chat-template is not set. "
                      "Refused request with untrusted chat template.")   # vLLM's words


@dataclass(frozen=True)
class ChatTemplateOptions:
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False       # the template writes the special tokens; true adds the tokenizer's too
    chat_template: str | None = None       # the request's own template (None: the model's)
    template_kwargs: Mapping[str, Any] = field(default_factory=dict)   # more template variables

    @classmethod
    def from_request(cls, req: Any, *, trust_request_chat_template: bool) -> "ChatTemplateOptions":
        """The options of a request model that has some of vLLM's chat-template fields (a missing one is at
        vLLM's default); APIError 400 naming the field for what vLLM refuses or kvflow cannot honour."""
        def value(name: str, default):
            v = getattr(req, name, None)
            return default if v is None else v

        add_generation_prompt = bool(value("add_generation_prompt", True))
        continue_final_message = bool(value("continue_final_message", False))
        if add_generation_prompt and continue_final_message:
            raise APIError(400, "Cannot set both `continue_final_message` and `add_generation_prompt` to True.",
                           param="continue_final_message")
        chat_template = value("chat_template", None)
        kwargs = dict(value("chat_template_kwargs", {}))
        if not trust_request_chat_template:
            if chat_template is not None:
                raise APIError(400, UNTRUSTED_TEMPLATE, param="chat_template")
            if kwargs.get("chat_template") is not None:
                raise APIError(400, UNTRUSTED_TEMPLATE, param="chat_template_kwargs")
        if "chat_template" in kwargs:
            raise APIError(400, "give the template as the request's chat_template, not in chat_template_kwargs",
                           param="chat_template_kwargs.chat_template")
        for name in RENDERING_SWITCHES:
            if name in kwargs:
                raise APIError(400, f"chat_template_kwargs.{name} is a switch of the renderer, not a template "
                                    "variable: kvflow sets it", param=f"chat_template_kwargs.{name}")
        fields = {"add_generation_prompt": add_generation_prompt, "continue_final_message": continue_final_message,
                  "tools": getattr(req, "tools", None), "documents": getattr(req, "documents", None)}
        for name in FIELD_VARIABLES:
            if name not in kwargs or fields[name] is None:
                continue       # tools / documents the request does not give: the kwarg is the only value
            if kwargs[name] != fields[name]:
                raise APIError(400, f"chat_template_kwargs.{name} contradicts the request's {name}: set {name} "
                                    "itself", param=f"chat_template_kwargs.{name}")
            del kwargs[name]   # the field passes it
        return cls(add_generation_prompt, continue_final_message, bool(value("add_special_tokens", False)),
                   chat_template, kwargs)

    def template(self, default: str | None) -> str | None:
        """The template these options render with, given the model's."""
        return self.chat_template if self.chat_template is not None else default

    def render_args(self) -> dict[str, Any]:
        """Keyword arguments of RequestPreparer.chat_prompt_ids."""
        return dict(self.template_kwargs, add_generation_prompt=self.add_generation_prompt,
                    continue_final_message=self.continue_final_message, add_special_tokens=self.add_special_tokens,
                    chat_template=self.chat_template)


# chat request fields that are variables only some templates read
OPTIONAL_TEMPLATE_VARIABLES = ("documents", "reasoning_effort")


def template_variables(req: Any, template: str | None) -> dict[str, Any]:
    """The request's `documents` (RAG) and `reasoning_effort` as template variables, when the template names them;
    a 400 naming the field when it does not, since the value would have no effect (vLLM passes it on regardless,
    and the output ignores it without a word)."""
    found = {}
    for name in OPTIONAL_TEMPLATE_VARIABLES:
        value = getattr(req, name, None)
        if value is None:
            continue
        if not template or name not in template:
            raise APIError(400, f"{name} is not supported by this model's chat template (it never reads {name}): "
                                "leave it unset", param=name)
        found[name] = value
    return found
