"""/v1/messages' request, response and stream events: Anthropic's shapes as pydantic models. Each field is implemented
(a field of a model here) or refused with a 400 naming its path (serving/request_fields.py, MESSAGES_REFUSED);
refused fields land in a model's `model_extra` (extra="allow") until the route's `check` reads them."""
from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal, Union

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag

from kvflow import sampling_params as limits
from kvflow.server.common.schema import Text, documented

MESSAGES_PATH = "/v1/messages"
COUNT_TOKENS_PATH = "/v1/messages/count_tokens"


# ---- request ----------------------------------------------------------------------------------------------------
class MessagesPart(BaseModel):
    """A part of a Messages request, of kind KIND (request_fields.MESSAGES_FIELDS' key)."""
    model_config = ConfigDict(extra="allow", protected_namespaces=())
    KIND: ClassVar[str] = ""


def _by_type(tags: dict[str | None, str], other: str) -> Discriminator:
    """A discriminator on `type`: tags[type], else `other` (a model that exists to be refused by name, instead of
    pydantic's "does not match any tag")."""
    def tag(value: Any) -> str:
        kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
        return tags.get(kind, other) if kind is None or isinstance(kind, str) else other
    return Discriminator(tag)


class CacheControl(MessagesPart):
    """A prompt-cache breakpoint. kvflow's prefix cache keeps every full block of every prompt anyway, so the
    breakpoint asks for what is done; a lifetime other than the default is refused (LRU promises none)."""
    KIND: ClassVar[str] = "cache_control"
    type: Literal["ephemeral"]


class TextBlock(MessagesPart):
    KIND: ClassVar[str] = "text"
    type: Literal["text"]
    text: Text
    cache_control: CacheControl | None = None


class ToolUseBlock(MessagesPart):
    """An assistant's earlier tool call."""
    KIND: ClassVar[str] = "tool_use"
    type: Literal["tool_use"]
    id: Text
    name: Text
    input: dict[str, Any]
    cache_control: CacheControl | None = None


class ThinkingBlock(MessagesPart):
    """An assistant's earlier thinking (a thinking block of an earlier reply, passed back): its text reaches the chat
    template as the assistant message's reasoning, for templates that read it. The signature is not checked: kvflow
    signs nothing."""
    KIND: ClassVar[str] = "thinking"
    type: Literal["thinking"]
    thinking: Text
    signature: Text | None = None


class UnsupportedBlock(MessagesPart):
    """A block kvflow does not read (image, document, search_result, redacted_thinking, server tools' results ...): a 400
    naming its place and type."""
    KIND: ClassVar[str] = "unsupported"
    type: Text


ToolResultContent = Annotated[Union[Annotated[TextBlock, Tag("TextBlock")],
                                    Annotated[UnsupportedBlock, Tag("UnsupportedBlock")]],
                              _by_type({"text": "TextBlock"}, "UnsupportedBlock")]


class ToolResultBlock(MessagesPart):
    """A tool's answer to a tool_use block, in a user message."""
    KIND: ClassVar[str] = "tool_result"
    type: Literal["tool_result"]
    tool_use_id: Text
    content: Union[Text, list[ToolResultContent]] = ""
    is_error: bool = False
    cache_control: CacheControl | None = None


ContentBlock = Annotated[Union[Annotated[TextBlock, Tag("TextBlock")], Annotated[ToolUseBlock, Tag("ToolUseBlock")],
                               Annotated[ToolResultBlock, Tag("ToolResultBlock")],
                               Annotated[ThinkingBlock, Tag("ThinkingBlock")],
                               Annotated[UnsupportedBlock, Tag("UnsupportedBlock")]],
                         _by_type({"text": "TextBlock", "tool_use": "ToolUseBlock", "tool_result": "ToolResultBlock",
                                   "thinking": "ThinkingBlock"}, "UnsupportedBlock")]


class InputMessage(MessagesPart):
    KIND: ClassVar[str] = "message"
    role: Literal["user", "assistant", "system"]      # "system": a system message in place (newer clients)
    content: Union[Text, list[ContentBlock]]


class MessagesTool(MessagesPart):
    """A client tool: the model may call it with an `input` that follows `input_schema`."""
    KIND: ClassVar[str] = "tool"
    name: Text
    input_schema: dict[str, Any]
    description: Text | None = None
    type: Literal["custom"] | None = None
    # true: the input must follow the schema. Kept where the grammar enforces it (tool_choice any or tool; none
    # calls nothing), a 400 under "auto", which leaves the model free
    strict: bool | None = None
    cache_control: CacheControl | None = None


class ServerTool(MessagesPart):
    """One of Anthropic's server tools (bash, text editor, web search, code execution ...): a 400 naming it."""
    KIND: ClassVar[str] = "server_tool"
    type: Text


AnyTool = Annotated[Union[Annotated[MessagesTool, Tag("MessagesTool")], Annotated[ServerTool, Tag("ServerTool")]],
                    _by_type({None: "MessagesTool", "custom": "MessagesTool"}, "ServerTool")]


class MessagesToolChoice(MessagesPart):
    KIND: ClassVar[str] = "tool_choice"
    type: Literal["auto", "any", "tool", "none"]
    name: Text | None = None                      # type "tool": the tool to call
    # one tool_use block at most: the chat route's parallel_tool_calls=false (the grammar's under "any"; a named tool
    # is one call anyway; a 400 under "auto", where the model writes its calls freely)
    disable_parallel_tool_use: bool = False


class MessagesMetadata(MessagesPart):
    KIND: ClassVar[str] = "metadata"
    # Anthropic's opaque end-user id (for its abuse detection): it changes nothing in a reply there either, and
    # coding agents send it on every request. Passed on as the chat route's `user`, OpenAI's field of that meaning.
    user_id: Text | None = None


class JsonOutputFormat(MessagesPart):
    KIND: ClassVar[str] = "format"
    type: Literal["json_schema"]
    json_schema: dict[str, Any] = Field(alias="schema")


class OutputConfig(MessagesPart):
    KIND: ClassVar[str] = "output_config"
    format: JsonOutputFormat | None = None        # structured outputs: the text is JSON that follows the schema


class MessagesRequest(MessagesPart):
    """POST /v1/messages (Anthropic's MessageCreateParams)."""
    KIND: ClassVar[str] = "request"
    model: Text
    messages: list[InputMessage] = Field(min_length=1)
    max_tokens: int = Field(json_schema_extra={"minimum": 1})         # required, as Anthropic's
    system: Union[Text, list[TextBlock], None] = None
    stop_sequences: list[Text] | None = documented(maxItems=limits.MAX_STOP_STRINGS,
                                                   items={"maxLength": limits.MAX_STOP_STRING_CHARS})
    stream: bool | None = False
    temperature: float | None = documented(minimum=0, maximum=limits.MAX_TEMPERATURE)   # default 1, as Anthropic's
    top_p: float | None = documented(exclusiveMinimum=0, maximum=1)
    top_k: int | None = documented(minimum=-1, maximum=limits.MAX_TOP_K)
    tools: list[AnyTool] | None = None
    tool_choice: MessagesToolChoice | None = None     # unset with tools: "auto", as Anthropic's
    metadata: MessagesMetadata | None = None
    output_config: OutputConfig | None = None
    # {"type": "enabled", "budget_tokens": N}: the chat route's thinking_token_budget (needs --reasoning-parser);
    # {"type": "disabled"}: nothing asked (a reasoning model's thinking blocks come back as it writes them)
    thinking: dict[str, Any] | None = None
    service_tier: Literal["auto", "standard_only"] | None = None   # one tier here, the standard one: either holds
    cache_control: CacheControl | None = None         # a breakpoint on the last cacheable block: see CacheControl
    # vLLM's extra, as on chat: template variables (e.g. enable_thinking: false for Qwen3's template)
    chat_template_kwargs: dict[str, Any] | None = None


class CountTokensRequest(MessagesRequest):
    """POST /v1/messages/count_tokens (Anthropic's MessageCountTokensParams): a Messages request without max_tokens.
    The fields that shape only the reply (max_tokens, temperature, stop_sequences, ...) are taken as /v1/messages
    takes them, so that one body serves both routes, and change no count; `stream` is refused (nothing streams)."""
    max_tokens: int | None = Field(default=None, json_schema_extra={"minimum": 1})


class CountTokensResponse(BaseModel):
    """The prompt /v1/messages would run for the same body: every token of it (no cache split)."""
    input_tokens: int


# ---- response ---------------------------------------------------------------------------------------------------
StopReason = Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"]


class MessagesUsage(BaseModel):
    """As Anthropic counts: the prompt is input_tokens + cache_read_input_tokens (its tokens found in kvflow's
    prefix cache); nothing is billed as a cache write, so cache_creation_input_tokens is 0."""
    input_tokens: int
    output_tokens: int
    cache_creation_input_tokens: int | None = None
    cache_read_input_tokens: int | None = None


class TextContent(BaseModel):
    type: Literal["text"] = "text"
    text: str


class ThinkingContent(BaseModel):
    """The model's reasoning (--reasoning-parser), before its answer. `signature` is Anthropic's check that Claude
    wrote the block; kvflow signs nothing and sends a random one, as vLLM does, for clients that expect it."""
    type: Literal["thinking"] = "thinking"
    thinking: str
    signature: str


class ToolUseContent(BaseModel):
    type: Literal["tool_use"] = "tool_use"
    id: str
    name: str
    input: dict[str, Any]


ContentOut = Union[ThinkingContent, TextContent, ToolUseContent]


class MessagesResponse(BaseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    model: str
    content: list[ContentOut]
    stop_reason: StopReason | None = None          # null only in a stream's message_start
    stop_sequence: str | None = None
    usage: MessagesUsage


# the stream's events, in order: message_start, ping, per content block (content_block_start,
# content_block_delta..., content_block_stop), message_delta (stop reason, usage), message_stop; or `error`
class MessageStartEvent(BaseModel):
    type: Literal["message_start"] = "message_start"
    message: MessagesResponse


class PingEvent(BaseModel):
    type: Literal["ping"] = "ping"


class ContentBlockStartEvent(BaseModel):
    type: Literal["content_block_start"] = "content_block_start"
    index: int
    content_block: ContentOut


class TextDelta(BaseModel):
    type: Literal["text_delta"] = "text_delta"
    text: str


class ThinkingDelta(BaseModel):
    type: Literal["thinking_delta"] = "thinking_delta"
    thinking: str


class SignatureDelta(BaseModel):
    """A thinking block's signature, just before its content_block_stop (as Anthropic sends it)."""
    type: Literal["signature_delta"] = "signature_delta"
    signature: str


class InputJsonDelta(BaseModel):
    type: Literal["input_json_delta"] = "input_json_delta"
    partial_json: str


class ContentBlockDeltaEvent(BaseModel):
    type: Literal["content_block_delta"] = "content_block_delta"
    index: int
    delta: Union[TextDelta, ThinkingDelta, SignatureDelta, InputJsonDelta]


class ContentBlockStopEvent(BaseModel):
    type: Literal["content_block_stop"] = "content_block_stop"
    index: int


class StopDelta(BaseModel):
    stop_reason: StopReason
    stop_sequence: str | None = None


class MessageDeltaEvent(BaseModel):
    type: Literal["message_delta"] = "message_delta"
    delta: StopDelta
    usage: MessagesUsage            # totals: the client overwrites message_start's counts with them


class MessageStopEvent(BaseModel):
    type: Literal["message_stop"] = "message_stop"


class MessagesErrorDetail(BaseModel):
    type: str
    message: str


class MessagesErrorResponse(BaseModel):
    """Anthropic's error body, also the data of a stream's `error` event."""
    type: Literal["error"] = "error"
    error: MessagesErrorDetail


StreamEvent = Union[MessageStartEvent, PingEvent, ContentBlockStartEvent, ContentBlockDeltaEvent,
                    ContentBlockStopEvent, MessageDeltaEvent, MessageStopEvent, MessagesErrorResponse]


def sse(event: StreamEvent) -> str:
    """One Server-Sent Event: Anthropic's clients dispatch on the `event:` line (the data's `type` repeats it)."""
    return f"event: {event.type}\ndata: {event.model_dump_json()}\n\n"
