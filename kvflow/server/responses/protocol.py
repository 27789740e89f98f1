"""OpenAI's Responses API (/v1/responses): the request, the response object, its output items and the typed stream
events, as pydantic models in the shapes of openai-python's `types/responses` (which its stream parser reads).

The request keeps the field rule of the other routes: a field of OpenAI's or vLLM's Responses schema is either a
field here or refused with a 400 naming it (`request_fields.REFUSED["responses"]`); nothing is accepted and dropped.
kvflow keeps no responses (store=false), so `previous_response_id`, `store: true` and the other fields that need
server-side state are refused: a client sends the whole conversation as `input` instead. Nested options are checked
where they are translated (`responses_api.py`), naming their path (`text.format.type`, `tools[0].type`, ...).
"""
from __future__ import annotations

import time
import uuid
from typing import Any, ClassVar, Literal, Union

from pydantic import Field, model_validator

from kvflow import sampling_params as limits
from kvflow.server.common.errors import APIError
from kvflow.server.common.schema import OpenAIModel, Text, documented
from kvflow.server.serving.protocol import apply_field_rule
from kvflow.server.serving.request_fields import RESPONSES_STATEFUL, refused_field

# the one `include` value kvflow implements
INCLUDE_LOGPROBS = "message.output_text.logprobs"


def response_id() -> str:
    return f"resp_{uuid.uuid4().hex}"


# ---- request ----------------------------------------------------------------------------------------------------
class ResponsesRequest(OpenAIModel):
    """POST /v1/responses. `input` items, `text`, `tools`, `tool_choice` and `reasoning` stay plain JSON here and
    are checked item by item by the adapter, so that a 400 names the exact path at fault."""
    model: Text | None = None
    input: Union[Text, list[dict[str, Any]]]
    instructions: Text | None = None                 # a system message before the input
    max_output_tokens: int | None = documented(minimum=1)
    temperature: float | None = documented(minimum=0, maximum=limits.MAX_TEMPERATURE)
    top_p: float | None = documented(exclusiveMinimum=0, maximum=1)
    stream: bool | None = False
    text: dict[str, Any] | None = None               # {"format": {"type": "text" | "json_object" | "json_schema"}}
    tools: list[dict[str, Any]] | None = None        # function tools only
    tool_choice: Union[Text, dict[str, Any], None] = None   # "none" | "auto" | "required" | {"type": "function", "name"}
    parallel_tool_calls: bool | None = None          # false: one call at most (as on chat: not under "auto")
    include: list[Text] | None = documented(description=f"only {INCLUDE_LOGPROBS!r}")
    top_logprobs: int | None = documented(minimum=0, maximum=limits.MAX_LOGPROBS)
    reasoning: dict[str, Any] | None = documented(description="only `effort`, for chat templates that read "
                                                              "`reasoning_effort`")
    metadata: dict[Text, Text] | None = documented(maxProperties=16)   # returned on the response object
    user: Text | None = None
    # vLLM's extras, with the chat route's meaning
    top_k: int | None = documented(minimum=-1, maximum=limits.MAX_TOP_K)
    logit_bias: dict[Text, float] | None = None
    repetition_penalty: float | None = documented(exclusiveMinimum=0, maximum=limits.MAX_REPETITION_PENALTY)
    seed: int | None = documented(minimum=limits.MIN_SEED, maximum=limits.MAX_SEED)
    stop: Union[Text, list[Text], None] = documented(maxItems=limits.MAX_STOP_STRINGS,
                                                     maxLength=limits.MAX_STOP_STRING_CHARS)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    structured_outputs: dict[str, Any] | None = None
    request_id: Text | None = documented(description="the response's id (default: resp_ and a random hex)")

    ROUTE: ClassVar[str] = "responses"               # request_fields.py's key

    @model_validator(mode="before")
    @classmethod
    def _refuse_what_is_not_implemented(cls, data: Any) -> Any:
        """A field of OpenAI's or vLLM's Responses schema that kvflow does not implement is a 400 naming it unless
        left at its default (one that needs kept responses says so); a field neither defines is ignored."""
        if not isinstance(data, dict):
            return data
        name = refused_field(cls.ROUTE, data)
        if name in RESPONSES_STATEFUL:
            shown = f"{name}: true" if data[name] is True else name
            raise APIError(400, f"{shown} is not supported by kvflow: it keeps no responses on the server "
                                "(store=false); send the whole conversation as `input`", param=name)
        return apply_field_rule(cls.ROUTE, data, cls.model_fields)

    @property
    def include_logprobs(self) -> bool:
        return INCLUDE_LOGPROBS in (self.include or ())


# ---- response ---------------------------------------------------------------------------------------------------
class ResponseLogprob(OpenAIModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ResponseTokenLogprob(ResponseLogprob):
    top_logprobs: list[ResponseLogprob] = Field(default_factory=list)


class ResponseOutputText(OpenAIModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)
    logprobs: list[ResponseTokenLogprob] | None = None     # with include ["message.output_text.logprobs"]


class ResponseOutputMessage(OpenAIModel):
    type: Literal["message"] = "message"
    id: str
    role: Literal["assistant"] = "assistant"
    status: Literal["in_progress", "completed", "incomplete"]
    content: list[ResponseOutputText]


class ReasoningText(OpenAIModel):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str


class ResponseReasoningItem(OpenAIModel):
    """The model's reasoning (--reasoning-parser), before the message it led to. kvflow writes no summaries and
    encrypts nothing: the text is in `content`."""
    type: Literal["reasoning"] = "reasoning"
    id: str
    summary: list[Any] = Field(default_factory=list)
    content: list[ReasoningText]
    encrypted_content: None = None
    status: Literal["in_progress", "completed", "incomplete"]


class ResponseFunctionToolCall(OpenAIModel):
    type: Literal["function_call"] = "function_call"
    id: str
    call_id: str                        # what the client's function_call_output answers
    name: str
    arguments: str                      # a JSON string, as OpenAI sends it
    status: Literal["in_progress", "completed", "incomplete"]


ResponseOutputItem = Union[ResponseReasoningItem, ResponseOutputMessage, ResponseFunctionToolCall]


class InputTokensDetails(OpenAIModel):
    cached_tokens: int = 0              # prompt tokens served from the prefix cache


class OutputTokensDetails(OpenAIModel):
    reasoning_tokens: int = 0           # output tokens of the reasoning items (0 without --reasoning-parser)


class ResponseUsage(OpenAIModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)
    total_tokens: int


class IncompleteDetails(OpenAIModel):
    reason: Literal["max_output_tokens"] = "max_output_tokens"


class ResponseError(OpenAIModel):
    code: str = "server_error"
    message: str


class ResponsesResponse(OpenAIModel):
    """The response object, whole (status completed or incomplete) or as the stream's lifecycle events carry it.
    The request's settings are echoed as OpenAI does; `store` is false: nothing is kept."""
    id: str
    object: Literal["response"] = "response"
    created_at: int = Field(default_factory=lambda: int(time.time()))
    completed_at: int | None = None
    status: Literal["in_progress", "completed", "incomplete", "failed"]
    error: ResponseError | None = None
    incomplete_details: IncompleteDetails | None = None
    model: str
    instructions: str | None = None
    output: list[ResponseOutputItem] = Field(default_factory=list)
    usage: ResponseUsage | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_logprobs: int | None = None
    text: dict[str, Any] = Field(default_factory=lambda: {"format": {"type": "text"}})
    tools: list[dict[str, Any]] = Field(default_factory=list)
    tool_choice: Union[str, dict[str, Any]] = "auto"
    parallel_tool_calls: bool = True
    reasoning: dict[str, Any] | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    previous_response_id: None = None
    store: bool = False
    background: bool = False
    truncation: Literal["disabled"] = "disabled"
    service_tier: Literal["auto"] = "auto"


# ---- stream events (sent as `event: <type>` + `data: <json>`; sequence_number counts from 0) ---------------------
class ResponseLifecycleEvent(OpenAIModel):
    type: Literal["response.created", "response.in_progress", "response.completed", "response.incomplete",
                  "response.failed"]
    sequence_number: int = 0
    response: ResponsesResponse


class ResponseOutputItemEvent(OpenAIModel):
    type: Literal["response.output_item.added", "response.output_item.done"]
    sequence_number: int = 0
    output_index: int
    item: ResponseOutputItem


class ResponseContentPartEvent(OpenAIModel):
    type: Literal["response.content_part.added", "response.content_part.done"]
    sequence_number: int = 0
    item_id: str
    output_index: int
    content_index: int = 0
    part: Union[ResponseOutputText, ReasoningText]


class ResponseTextDeltaEvent(OpenAIModel):
    type: Literal["response.output_text.delta"] = "response.output_text.delta"
    sequence_number: int = 0
    item_id: str
    output_index: int
    content_index: int = 0
    delta: str
    logprobs: list[ResponseTokenLogprob] = Field(default_factory=list)


class ResponseTextDoneEvent(OpenAIModel):
    type: Literal["response.output_text.done"] = "response.output_text.done"
    sequence_number: int = 0
    item_id: str
    output_index: int
    content_index: int = 0
    text: str
    logprobs: list[ResponseTokenLogprob] = Field(default_factory=list)


class ResponseReasoningTextDeltaEvent(OpenAIModel):
    type: Literal["response.reasoning_text.delta"] = "response.reasoning_text.delta"
    sequence_number: int = 0
    item_id: str
    output_index: int
    content_index: int = 0
    delta: str


class ResponseReasoningTextDoneEvent(OpenAIModel):
    type: Literal["response.reasoning_text.done"] = "response.reasoning_text.done"
    sequence_number: int = 0
    item_id: str
    output_index: int
    content_index: int = 0
    text: str


class ResponseFunctionCallArgumentsDeltaEvent(OpenAIModel):
    type: Literal["response.function_call_arguments.delta"] = "response.function_call_arguments.delta"
    sequence_number: int = 0
    item_id: str
    output_index: int
    delta: str


class ResponseFunctionCallArgumentsDoneEvent(OpenAIModel):
    type: Literal["response.function_call_arguments.done"] = "response.function_call_arguments.done"
    sequence_number: int = 0
    item_id: str
    output_index: int
    arguments: str


ResponseStreamEvent = Union[ResponseLifecycleEvent, ResponseOutputItemEvent, ResponseContentPartEvent,
                            ResponseTextDeltaEvent, ResponseTextDoneEvent, ResponseReasoningTextDeltaEvent,
                            ResponseReasoningTextDoneEvent, ResponseFunctionCallArgumentsDeltaEvent,
                            ResponseFunctionCallArgumentsDoneEvent]
