"""OpenAI's request and response schema (plus vLLM's sampling extras), as pydantic models.

Values are checked once, by SamplingParams (kvflow/sampling_params.py); the limits shown here in the OpenAPI
document (`json_schema_extra`) are its constants, published so that clients and fuzzers see them, not enforced
a second time. What pydantic does check is shape: types, and that text is valid Unicode.
"""
from __future__ import annotations

import logging
import time
import uuid
from typing import Any, ClassVar, Literal, Union

from pydantic import ConfigDict, Field, model_validator

from kvflow import sampling_params as limits
from kvflow.beam_search import MAX_BEAM_WIDTH, BeamSearchParams
from kvflow.errors import InvalidRequestError
from kvflow.sampling_params import SamplingParams
from kvflow.server.common.errors import APIError
from kvflow.server.common.schema import OpenAIModel, Text, documented
from kvflow.server.serving.request_fields import REFUSED, beam_search_refused, refused_field

logger = logging.getLogger("kvflow.server")
_IGNORED_LOGGED: set[str] = set()       # unknown field names already logged (once each)

def apply_field_rule(route: str, data: dict, implemented) -> dict:
    """The field rule of one route (request_fields.py): a field it refuses, set, is a 400 naming it; a field that
    neither it implements nor refuses is ignored, as vLLM does, and logged once per name."""
    name = refused_field(route, data)
    if name is not None:
        raise APIError(400, f"{name} is not supported by kvflow: leave it unset (or at its default)", param=name)
    for unknown in set(data) - set(implemented) - set(REFUSED[route]) - _IGNORED_LOGGED:
        _IGNORED_LOGGED.add(unknown)
        logger.warning("ignoring the request field %r: neither OpenAI nor vLLM defines it", unknown)
    return data


# ---- requests ---------------------------------------------------------------------------------------------------
class StreamOptions(OpenAIModel):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


class ContentPart(OpenAIModel):
    model_config = ConfigDict(extra="allow")
    type: Text
    text: Text | None = None


class FunctionCall(OpenAIModel):
    name: Text
    arguments: Text                     # a JSON string, as OpenAI sends it


class ToolCall(OpenAIModel):
    id: Text
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(OpenAIModel):
    role: Text       # any role goes to the chat template, as vLLM does (the template may refuse it: a 400)
    content: Union[Text, list[ContentPart], None] = None
    name: Text | None = None
    tool_calls: list[ToolCall] | None = None     # an assistant's earlier calls
    tool_call_id: Text | None = None             # a tool message: the call it answers
    # an assistant's earlier reasoning (what --reasoning-parser returned), for templates that read it (Qwen3's
    # `reasoning_content`; both names reach the template, as vLLM accepts both)
    reasoning: Text | None = None
    reasoning_content: Text | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        parts = []
        for p in self.content:
            if p.type != "text" or p.text is None:
                raise APIError(400, f"content part of type {p.type!r} is not supported: only text parts are",
                               param="messages")
            parts.append(p.text)
        return "\n".join(parts)


# vLLM's request field: the scheduler's priority, a lower value first; honoured only under --scheduling-policy
# priority (RequestPreparer.priority), as vLLM. Bounded so that the Batch API's offset cannot overflow anything.
MAX_PRIORITY = 2**31 - 1
PRIORITY_FIELD = Field(0, ge=-MAX_PRIORITY, le=MAX_PRIORITY,
                       description="scheduling priority, a lower value first (vLLM's); needs --scheduling-policy "
                                   "priority")


class _SamplingRequest(OpenAIModel):
    model: Text | None = None
    max_tokens: int | None = documented(minimum=1)
    temperature: float | None = documented(minimum=0, maximum=limits.MAX_TEMPERATURE)
    top_p: float | None = documented(exclusiveMinimum=0, maximum=1)
    n: int = documented(1, minimum=1)                    # maximum: --max-n, filled in by openai_api
    stop: Union[Text, list[Text], None] = documented(maxItems=limits.MAX_STOP_STRINGS,
                                                     maxLength=limits.MAX_STOP_STRING_CHARS)
    seed: int | None = documented(minimum=limits.MIN_SEED, maximum=limits.MAX_SEED)
    presence_penalty: float | None = documented(0.0, minimum=-limits.MAX_PENALTY, maximum=limits.MAX_PENALTY)
    frequency_penalty: float | None = documented(0.0, minimum=-limits.MAX_PENALTY, maximum=limits.MAX_PENALTY)
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: Text | None = None
    logit_bias: dict[Text, float] | None = documented(
        maxProperties=limits.MAX_LOGIT_BIAS_ENTRIES, propertyNames={"pattern": "^[0-9]+$"},
        additionalProperties={"type": "number", "minimum": -limits.MAX_LOGIT_BIAS, "maximum": limits.MAX_LOGIT_BIAS})
    # vLLM's extras
    top_k: int | None = documented(minimum=-1, maximum=limits.MAX_TOP_K)
    min_p: float | None = documented(minimum=0, maximum=1)
    min_tokens: int = documented(0, minimum=0)
    ignore_eos: bool = False
    repetition_penalty: float | None = documented(exclusiveMinimum=0, maximum=limits.MAX_REPETITION_PENALTY)
    stop_token_ids: list[int] | None = documented(maxItems=limits.MAX_STOP_TOKEN_IDS, items={"minimum": 0})
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    truncate_prompt_tokens: int | None = documented(minimum=-1, description="keep the prompt's last k tokens "
                                                    "(-1: the last max_model_len)")
    truncation_side: Literal["left", "right"] | None = None     # "right": keep the first k tokens instead
    prompt_logprobs: int | None = documented(minimum=0, maximum=limits.MAX_LOGPROBS)
    allowed_token_ids: list[int] | None = documented(items={"minimum": 0})
    bad_words: list[Text] | None = documented(maxItems=limits.MAX_BAD_WORDS)
    request_id: Text | None = documented(description="the response's id is built from it (cmpl-/chatcmpl-ID)")
    priority: int = PRIORITY_FIELD
    # vLLM's beam search (kvflow/beam_search.py): n is the beam width; request_fields.BEAM_SEARCH_REFUSED
    use_beam_search: bool = documented(False, description=f"vLLM's beam search, n the beam width (at most "
                                                          f"{MAX_BEAM_WIDTH}); completions: not streamed")
    length_penalty: float = documented(1.0, description="beam search: score = cumulative logprob / "
                                                        "(prompt + output tokens) ** length_penalty")
    return_token_ids: bool | None = None             # prompt_token_ids and each choice's token_ids
    return_tokens_as_token_ids: bool | None = None   # logprobs' tokens as "token_id:N"
    # llama-server's: a stream's prompt_progress chunks while its prompt is computed (each prompt chunk's step)
    return_progress: bool = documented(False, description="streams only: a chunk with prompt_progress {total, cache, "
                                                          "processed, time_ms} after each step that computed some of "
                                                          "the prompt (llama-server's)")
    # structured outputs (kvflow.structured_output.spec_from_request checks their shape and names the field)
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: Union[dict[str, Any], Text, None] = None
    guided_regex: Text | None = None
    guided_choice: list[Text] | None = None
    guided_grammar: Text | None = None
    guided_json_object: bool | None = None

    STRUCTURED_FIELDS: ClassVar[tuple[str, ...]] = ("response_format", "structured_outputs", "guided_json",
                                                    "guided_regex", "guided_choice", "guided_grammar",
                                                    "guided_json_object")

    # SamplingParams' field -> this request's name for it, where they differ
    PARAM_NAMES: ClassVar[dict[str, str]] = {}
    ROUTE: ClassVar[str] = ""            # request_fields.py's key for this route

    @model_validator(mode="before")
    @classmethod
    def _refuse_what_is_not_implemented(cls, data: Any) -> Any:
        """A field OpenAI or vLLM defines and kvflow does not implement is a 400 naming it, unless left at its
        default; a field neither defines is ignored, as vLLM does, and logged once per name."""
        if not isinstance(data, dict) or not cls.ROUTE:
            return data
        if data.get("stream_options") is not None and not data.get("stream"):     # as vLLM answers
            raise APIError(400, "stream_options can only be set when stream is true", param="stream_options")
        if data.get("prompt_logprobs") is not None and data.get("stream"):       # as vLLM answers
            raise APIError(400, "prompt_logprobs are not available when stream is true", param="prompt_logprobs")
        return apply_field_rule(cls.ROUTE, data, cls.model_fields)

    @model_validator(mode="after")
    def _beam_search_fields(self):
        """Beside use_beam_search, a sampling field vLLM's beam search drops is a 400 naming it (stream: vLLM's
        own refusal); without it, length_penalty (nothing else reads it) is."""
        if not self.ROUTE:
            return self
        if not self.use_beam_search:
            if self.length_penalty != 1.0:
                raise APIError(400, "length_penalty applies to beam search only: set use_beam_search",
                               param="length_penalty")
            return self
        name = beam_search_refused(self.ROUTE, {f: getattr(self, f) for f in type(self).model_fields})
        if name == "stream":        # completions (vLLM's answer); chat streams the finished beams
            raise APIError(400, "streaming is not supported with beam search (use_beam_search)", param="stream")
        if name is not None:
            raise APIError(400, f"{name} is not supported with use_beam_search: vLLM's beam search does not read "
                                "it (leave it unset)", param=name)
        return self

    def to_beam_search_params(self, params: SamplingParams) -> BeamSearchParams:
        """The beam search this request asks for, from its checked SamplingParams (`to_sampling_params`): n beams,
        max_tokens, ignore_eos, temperature (unset: 1.0, as vLLM's default; > 0 lets each beam's sampled token join
        its candidates), length_penalty, include_stop_str_in_output, skip_special_tokens."""
        try:
            return BeamSearchParams(beam_width=params.n, max_tokens=params.max_tokens, ignore_eos=params.ignore_eos,
                                    temperature=params.temperature, length_penalty=self.length_penalty,
                                    include_stop_str_in_output=params.include_stop_str_in_output,
                                    skip_special_tokens=params.skip_special_tokens)
        except InvalidRequestError as e:
            raise APIError.bad_request(e, {"beam_width": "n", **self.PARAM_NAMES}) from None

    def _sampling_params(self, max_tokens: int | None, logprobs: int | None,
                         prompt_logprobs: int | None = None,
                         thinking_token_budget: int | None = None) -> SamplingParams:
        bad_keys = [k for k in self.logit_bias or {} if not _is_int(k)]
        if bad_keys:       # each one named (the first 10)
            named = ", ".join(map(repr, bad_keys[:10])) + (", ..." if len(bad_keys) > 10 else "")
            raise InvalidRequestError(f"logit_bias keys must be token ids (integers as strings), not {named}",
                                      param="logit_bias", code="invalid_value")
        logit_bias = {int(k): v for k, v in (self.logit_bias or {}).items()}
        try:
            return SamplingParams(
                n=self.n,
                temperature=1.0 if self.temperature is None else self.temperature,
                top_p=1.0 if self.top_p is None else self.top_p,
                top_k=0 if self.top_k is None else self.top_k,
                min_p=0.0 if self.min_p is None else self.min_p,
                seed=self.seed,
                max_tokens=max_tokens,
                min_tokens=self.min_tokens,
                stop=self.stop,
                stop_token_ids=self.stop_token_ids,
                ignore_eos=self.ignore_eos,
                presence_penalty=self.presence_penalty or 0.0,
                frequency_penalty=self.frequency_penalty or 0.0,
                repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
                logit_bias=logit_bias,
                logprobs=logprobs,
                skip_special_tokens=self.skip_special_tokens,
                include_stop_str_in_output=self.include_stop_str_in_output,
                prompt_logprobs=self.prompt_logprobs if prompt_logprobs is None else prompt_logprobs,
                bad_words=self.bad_words or None,
                allowed_token_ids=self.allowed_token_ids,
                truncate_prompt_tokens=self.truncate_prompt_tokens,
                truncation_side=self.truncation_side or "left",
                thinking_token_budget=thinking_token_budget,
            )
        except InvalidRequestError as e:
            raise APIError.bad_request(e, self.PARAM_NAMES) from None

    def structured_request(self) -> dict[str, Any]:
        """The structured-output fields as spec_from_request reads them."""
        return {k: getattr(self, k) for k in self.STRUCTURED_FIELDS if getattr(self, k) is not None}

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.continuous_usage_stats)


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = documented(minimum=1)
    logprobs: bool | None = False
    top_logprobs: int | None = documented(minimum=0, maximum=limits.MAX_LOGPROBS)
    # the chat template (vLLM's extras)
    add_generation_prompt: bool = True
    continue_final_message: bool = False     # leave the last (assistant) message open: the model continues it
    add_special_tokens: bool = False         # the tokenizer's BOS etc. on top of what the template writes
    chat_template: Text | None = None        # a Jinja template for this request instead of the model's
    chat_template_kwargs: dict[str, Any] | None = None
    documents: list[dict[str, Any]] | None = None      # for templates that read `documents` (RAG)
    reasoning_effort: Text | None = None               # for templates that read `reasoning_effort`
    # false: the reasoning is split off and not returned (needs --reasoning-parser: without one nothing is split)
    include_reasoning: bool = True
    # vLLM's: at most this many reasoning tokens, then the end-of-thinking marker is forced (needs --reasoning-parser)
    thinking_token_budget: int | None = documented(minimum=0)
    echo: bool = False                       # the reply starts with the last message when it is the assistant's
    # tool calling (kvflow.server.serving.tool_calls.parse_tool_request checks them and names the field)
    tools: list[dict[str, Any]] | None = None
    tool_choice: Union[Text, dict[str, Any], None] = None   # "none" | "auto" | "required" | a named function
    parallel_tool_calls: bool | None = None      # false: one call at most (tool_calls.parse_tool_request)

    PARAM_NAMES: ClassVar[dict[str, str]] = {"logprobs": "top_logprobs", "prompt": "messages"}
    ROUTE: ClassVar[str] = "chat"

    def to_sampling_params(self) -> SamplingParams:
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError(400, "top_logprobs requires logprobs to be true", param="top_logprobs")
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        # echo with logprobs: the echoed prompt's logprobs too, unless asked for separately (as vLLM)
        echoed = (self.num_logprobs if self.echo and self.prompt_logprobs is None and not self.stream else None)
        return self._sampling_params(max_tokens, self.num_logprobs, echoed, self.thinking_token_budget)

    @property
    def num_logprobs(self) -> int | None:
        """Top log-probabilities per token, None when not asked for."""
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(_SamplingRequest):
    prompt: Union[Text, list[Text], list[int], list[list[int]]]
    max_tokens: int | None = documented(16, minimum=1)
    logprobs: int | None = documented(minimum=0, maximum=limits.MAX_LOGPROBS)
    echo: bool | None = False            # the prompt's text first (and its tokens' logprobs, with logprobs)
    suffix: Text | None = None
    best_of: int | None = documented(description="only equal to n (no best-of search)")
    add_special_tokens: bool = True      # the tokenizer's BOS etc. when encoding a text prompt
    ROUTE: ClassVar[str] = "completions"

    def to_sampling_params(self) -> SamplingParams:
        if self.suffix:
            raise APIError(400, "suffix is not supported", param="suffix")
        if self.best_of is not None and self.best_of != self.n:
            raise APIError(400, "best_of is only supported equal to n (no best-of search)", param="best_of")
        echoed = self.logprobs if self.echo and self.prompt_logprobs is None else None
        return self._sampling_params(self.max_tokens, self.logprobs, echoed)

    @property
    def num_logprobs(self) -> int | None:
        return self.logprobs

    def prompts(self) -> list[str | list[int]]:
        return prompt_list(self.prompt, "prompt")


def _is_int(text: str) -> bool:
    try:
        int(text)
    except ValueError:
        return False
    return True


def prompt_list(value: str | list, param: str) -> list[str | list[int]]:
    """OpenAI's prompt forms (a text, texts, token ids, lists of ids) as a list of prompts; empty is a 400."""
    if isinstance(value, str):
        return [value]
    if not value:
        raise APIError(400, f"{param} must not be empty", param=param)
    if all(isinstance(x, int) for x in value):
        return [list(value)]
    return list(value)


class _TokenizerRouteRequest(OpenAIModel):
    """The field rule on /tokenize and /detokenize, as on the generation routes: a field of vLLM's model that
    kvflow refuses is a 400 naming it when set; a field vLLM does not define is ignored and logged once per name."""
    ROUTE: ClassVar[str] = ""            # request_fields.py's key for this route

    @model_validator(mode="before")
    @classmethod
    def _refuse_what_is_not_implemented(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        return apply_field_rule(cls.ROUTE, data, cls.model_fields)


class TokenizeRequest(_TokenizerRouteRequest):
    """vLLM's TokenizeCompletionRequest (`prompt`) and TokenizeChatRequest (`messages`) as one model. Exactly one
    of the two is given (OpenAIServing.tokenize checks), and a field of the chat form set beside `prompt` is a 400
    naming it, where vLLM would ignore it."""
    model: Text | None = None
    prompt: Text | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None       # None: vLLM's default, true for a prompt, false for messages
    return_token_strs: bool | None = False       # also answer the ids' vocabulary pieces as `token_strs`
    # the chat form: the same prompt ids as /v1/chat/completions (server/chat_template.py checks the options)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: Text | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Union[Text, dict[str, Any], None] = None   # kvflow's own: the prompt a chat with it would get

    ROUTE: ClassVar[str] = "tokenize"
    CHAT_FIELDS: ClassVar[tuple[str, ...]] = ("add_generation_prompt", "continue_final_message", "chat_template",
                                              "chat_template_kwargs", "tools", "tool_choice")

    def chat_field_set(self) -> str | None:
        """The first field of the chat form set to something but its default (a 400 beside `prompt`)."""
        for name in self.CHAT_FIELDS:
            value = getattr(self, name)
            if value not in (None, [], {}) and value != type(self).model_fields[name].default:
                return name
        return None


class DetokenizeRequest(_TokenizerRouteRequest):
    model: Text | None = None
    tokens: list[int]

    ROUTE: ClassVar[str] = "detokenize"


# ---- responses --------------------------------------------------------------------------------------------------
class PromptTokensDetails(OpenAIModel):
    cached_tokens: int = 0


class CompletionTokensDetails(OpenAIModel):
    reasoning_tokens: int = 0        # completion tokens the reasoning parser found in the reasoning, its markers too


class UsageInfo(OpenAIModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None
    # only with --reasoning-parser (a server without one counts no reasoning, and sends vLLM's usage as it is)
    completion_tokens_details: CompletionTokensDetails | None = Field(default=None, exclude_if=lambda v: v is None)


class TopLogprob(OpenAIModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(OpenAIModel):
    content: list[TokenLogprob] | None = None


class ChatResponseMessage(OpenAIModel):
    """OpenAI's message, every key it sends: `refusal`, `annotations`, `audio` and `function_call` are always null
    here (no refusals, web search, audio output or legacy function calling), but present, as OpenAI and vLLM send
    them, for clients that index them."""
    role: str = "assistant"
    content: str | None = None
    # --reasoning-parser: the text between the think markers. vLLM's current name is `reasoning`; it still sends
    # `reasoning_content` (the name DeepSeek's API and older vLLM use) beside it, the same text
    reasoning: str | None = None
    reasoning_content: str | None = None
    refusal: str | None = None
    annotations: list | None = None
    audio: dict | None = None
    function_call: dict | None = None
    tool_calls: list[ToolCall] | None = None


class PromptLogprob(OpenAIModel):
    """vLLM's Logprob: one token's entry in `prompt_logprobs` (keyed by its token id)."""
    logprob: float
    rank: int | None = None              # 1: the most likely token at that position
    decoded_token: str | None = None


PromptLogprobs = list[dict[int, PromptLogprob] | None]    # per prompt token; None for the first


class ChatCompletionChoice(OpenAIModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None          # return_token_ids


class PerRequestTimingMetrics(OpenAIModel):
    """vLLM's per-request timings (--enable-per-request-metrics), in milliseconds, each null when a timestamp it
    needs is missing: time_to_first_token_ms from the request's first scheduled step (queue time excluded) to its
    first token; generation_time_ms first to last token; queue_time_ms in the waiting queue until first scheduled;
    mean_itl_ms the mean gap between tokens; tokens_per_second all generated tokens over first scheduled step to
    last token."""
    time_to_first_token_ms: float | None = None
    generation_time_ms: float | None = None
    queue_time_ms: float | None = None
    mean_itl_ms: float | None = None
    tokens_per_second: float | None = None


class PromptProgressInfo(OpenAIModel):
    """llama-server's prompt_progress: of the prompt's `total` tokens, `cache` came from the prefix cache and
    `processed` have been computed (the cached ones included); `time_ms` since the request's first step began."""
    total: int
    cache: int
    processed: int
    time_ms: float


class DeltaMessage(OpenAIModel):
    role: str | None = None
    content: str | None = None
    reasoning: str | None = None             # --reasoning-parser: a piece of the reasoning (and, as vLLM, the same
    reasoning_content: str | None = None     # text as reasoning_content)
    # OpenAI's tool-call chunks: {"index", "id", "type", "function": {"name", "arguments": ""}} when a call
    # starts, then {"index", "function": {"arguments": <fragment>}}
    tool_calls: list[dict[str, Any]] | None = None


class ChatCompletionStreamChoice(OpenAIModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None          # return_token_ids: this chunk's tokens


class ChatCompletionChunk(OpenAIModel):
    """One SSE event of a streamed chat completion (sent with exclude_unset: `stop_reason` only when finished,
    `usage` only when asked for)."""
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    system_fingerprint: str | None = None
    choices: list[ChatCompletionStreamChoice]
    usage: UsageInfo | None = None
    prompt_token_ids: list[int] | None = None   # return_token_ids: on the first chunk
    # --enable-per-request-metrics (vLLM's); absent without it
    metrics: PerRequestTimingMetrics | None = Field(default=None, exclude_if=lambda v: v is None)
    # return_progress (llama-server's): on the chunks, without choices, that say how far the prompt is
    prompt_progress: PromptProgressInfo | None = Field(default=None, exclude_if=lambda v: v is None)


class ChatCompletionResponse(OpenAIModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionChoice]
    usage: UsageInfo
    service_tier: str | None = None             # always null: one tier (a request's own is refused)
    system_fingerprint: str | None = None
    prompt_logprobs: PromptLogprobs | None = None
    prompt_token_ids: list[int] | None = None   # return_token_ids
    # --enable-per-request-metrics (vLLM's); absent without it
    metrics: PerRequestTimingMetrics | None = Field(default=None, exclude_if=lambda v: v is None)


class CompletionLogprobs(OpenAIModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(OpenAIModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: PromptLogprobs | None = None
    prompt_token_ids: list[int] | None = None   # return_token_ids (streamed: on the choice's first chunk)
    token_ids: list[int] | None = None          # return_token_ids (streamed: this chunk's tokens)


class CompletionResponse(OpenAIModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo
    service_tier: str | None = None             # always null, as vLLM's
    system_fingerprint: str | None = None
    # --enable-per-request-metrics (vLLM's); absent without it
    metrics: PerRequestTimingMetrics | None = Field(default=None, exclude_if=lambda v: v is None)


class CompletionChunk(OpenAIModel):
    """One SSE event of a streamed completion (sent with exclude_unset, as ChatCompletionChunk)."""
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    system_fingerprint: str | None = None
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None
    # --enable-per-request-metrics (vLLM's); absent without it
    metrics: PerRequestTimingMetrics | None = Field(default=None, exclude_if=lambda v: v is None)
    # return_progress (llama-server's): on the chunks, without choices, that say how far the prompt is
    prompt_progress: PromptProgressInfo | None = Field(default=None, exclude_if=lambda v: v is None)


class TokenizeResponse(OpenAIModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None          # with return_token_strs: each id's vocabulary piece


class DetokenizeResponse(OpenAIModel):
    prompt: str


class TokenizerInfoResponse(OpenAIModel):
    """GET /tokenizer_info: the tokenizer's configuration, the keys of its tokenizer_config.json (vLLM's)."""
    model_config = ConfigDict(extra="allow", protected_namespaces=())
    tokenizer_class: str


class ModelPermission(OpenAIModel):
    """vLLM's (OpenAI's former) permission object of a model card: everyone may sample, nothing else."""
    id: str = Field(default_factory=lambda: random_id("modelperm"))
    object: Literal["model_permission"] = "model_permission"
    created: int = Field(default_factory=lambda: int(time.time()))
    allow_create_engine: bool = False
    allow_sampling: bool = True
    allow_logprobs: bool = True
    allow_search_indices: bool = False
    allow_view: bool = True
    allow_fine_tuning: bool = False
    organization: str = "*"
    group: str | None = None
    is_blocking: bool = False


class ModelCard(OpenAIModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "kvflow"
    root: str | None = None
    parent: str | None = None                    # the base model's name for an adapter; None for the base model
    max_model_len: int | None = None
    permission: list[ModelPermission] = Field(default_factory=list)


class ModelList(OpenAIModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"
