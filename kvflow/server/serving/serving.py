"""The OpenAI routes as plain methods over an AsyncEngine (openai_api.py only wires them into FastAPI).

Chat and completions differ in how a request becomes prompt token ids and in the shape of a choice; from
`Generation` on they share one path: submit, then stream (SSE) or collect, with the same logprobs, usage and
error handling. Tokenization and chat templating run in a worker thread, so a huge prompt never holds the
event loop (the Rust tokenizer releases the GIL) and other streams and /health keep going.

Beam search (`use_beam_search`, vLLM's) takes the same path: each prompt's `AsyncEngine.beam_search` stream stands
where a request's stream would (it yields its n beams whole, best first, once the search is done: a streamed chat
gets each beam's text in one chunk, as vLLM's; completions refuse stream, as vLLM's), and the fields it does not read
are 400s (request_fields.BEAM_SEARCH_REFUSED).

With --reasoning-parser each chat choice's text is split into its reasoning and its answer (serving/reasoning.py: the
same state machine whole and streamed, so both cut at the same place); tool calls are parsed from the answer only.

Structured outputs and forced tool calls are compiled here, on the grammar compiler's threads (one compiler
per server, built on first use), before the request reaches the engine: a new schema never stalls the step
loop, only its own request's TTFT. Tool calls are parsed back out of the text per choice, whole or streamed.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import time
from dataclasses import dataclass, field
from typing import AsyncIterator

from starlette.requests import Request
from starlette.responses import StreamingResponse

from kvflow.async_engine import (AddRequest, CompletionDelta, EngineDeadError, EngineOverloadedError,
                                 EngineShutdownError, RequestFailedError, RequestStream)
from kvflow.server.common.config import DEFAULT_MAX_N
from kvflow.server.common.errors import APIError
from kvflow.server.serving.protocol import (ChatCompletionChoice, ChatCompletionChunk, ChatCompletionRequest,
                                            ChatCompletionResponse, ChatCompletionStreamChoice, ChatLogprobs,
                                            ChatResponseMessage, CompletionChoice, CompletionChunk,
                                            CompletionTokensDetails,
                                            CompletionLogprobs, CompletionRequest, CompletionResponse, DeltaMessage,
                                            DetokenizeRequest, DetokenizeResponse, ModelCard, ModelList,
                                            PromptLogprob, PromptTokensDetails, TokenizeRequest, TokenizeResponse,
                                            TokenLogprob, ToolCall, TopLogprob, UsageInfo, random_id)
from kvflow.beam_search import BeamSearchParams
from kvflow.pooling_params import PoolingParams
from kvflow.sampling_params import SamplingParams
from kvflow.server.serving.chat_template import ChatTemplateOptions, template_variables
from kvflow.server.common.request_record import current_record
from kvflow.server.serving.protocol import ModelPermission, TokenizerInfoResponse
from kvflow.server.serving.reasoning import ReasoningRequest, ReasoningSplitter, reasoning_request, reasoning_tokens
from kvflow.server.serving.tool_prompt import chat_messages
from kvflow.structured_output import GrammarCompiler, spec_from_request
from kvflow.server.serving.tool_calls import ExtractedToolCalls, ToolCallStreamer, ToolRequest, extract_tool_calls, parse_tool_request


@dataclass
class Generation:
    """One accepted request: its engine streams (one per prompt, each with n choices) and how to show them."""
    request_id: str
    model: str
    chat: bool
    streams: list[RequestStream]
    num_logprobs: int | None           # top log-probabilities per token; None: no logprobs
    include_usage: bool = False
    continuous_usage: bool = False
    tools: ToolRequest | None = None   # chat with tools that may be called: parse calls out of the text
    created: int = field(default_factory=lambda: int(time.time()))
    # per prompt, the text each of its choices starts with (completions' echo: the prompt; chat's echo: the last
    # message, when it is the assistant's); None: no echo
    echo: list[str] | None = None
    return_token_ids: bool = False
    tokens_as_ids: bool = False        # logprobs' tokens as "token_id:N"
    reasoning: ReasoningRequest | None = None   # chat under --reasoning-parser: split each choice's text
    # per choice, its reasoning tokens so far (usage's completion_tokens_details)
    reasoning_counts: dict[int, int] = field(default_factory=dict)

    @property
    def n(self) -> int:
        return self.streams[0].params.n

    def stream_of(self, index: int) -> RequestStream:
        """The engine stream (prompt) of choice `index`."""
        return self.streams[index // self.n]

    @property
    def echoes_logprobs(self) -> bool:
        """Completions' echo with logprobs: the echoed prompt's tokens carry their logprobs too."""
        return self.echo is not None and not self.chat and self.num_logprobs is not None


@dataclass
class PreparedRequest:
    """A chat or completion request, checked, as the engine is to be given it: what /v1/chat/completions and
    /v1/completions submit, and what their /render routes show."""
    request_id: str
    model: str                          # the served name (or LoRA adapter) it runs under
    params: SamplingParams              # n, the output constraint compiled; max_tokens as asked
    prompt_ids: list[list[int]]         # one per prompt, as encoded (truncate_prompt_tokens not applied yet)
    priority: int                       # the scheduler's
    messages: list[dict] | None = None  # chat: the messages the template rendered
    tools: ToolRequest | None = None    # chat: the tools and tool_choice
    prompts: list[str | list[int]] | None = None   # completions: the prompts as given
    beam: BeamSearchParams | None = None   # use_beam_search: a beam search per prompt instead of `params`' sampling

    def engine_request_id(self, index: int) -> str:
        return engine_request_id(self.request_id, index, len(self.prompt_ids))


def engine_request_id(request_id: str, index: int, num_prompts: int) -> str:
    """The engine's id of prompt `index` of a request (OpenAIServing.submit: one engine request per prompt)."""
    return request_id if num_prompts == 1 else f"{request_id}-p{index}"


@dataclass
class ChoiceResult:
    """A collected choice."""
    text: str = ""
    tokens: list[tuple[int, dict[int, float] | None]] = field(default_factory=list)   # (token id, its logprobs)
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class OpenAIServing:
    def __init__(self, engine, *, served_model_names: list[str] | tuple[str, ...] | None = None,
                 max_n: int = DEFAULT_MAX_N, shutdown_grace_period: float = 30.0,
                 tool_call_parser: str | None = None, trust_request_chat_template: bool = False,
                 return_tokens_as_token_ids: bool = False, reasoning_parser: str | None = None) -> None:
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.names = list(served_model_names or [engine.served_model_name])
        self.max_n = max_n
        self.shutdown_grace_period = shutdown_grace_period
        self.vocab_size = engine.vocab_size
        self._shutdown: asyncio.Future | None = None
        self.tool_call_parser = tool_call_parser     # None: tool_choice "auto" is refused
        self.trust_request_chat_template = trust_request_chat_template   # a request may bring its own template
        self.return_tokens_as_token_ids = return_tokens_as_token_ids     # the default of the request field
        self.reasoning_parser = reasoning_parser     # None: the output is not split (think markers stay in content)
        self._grammar_compiler: GrammarCompiler | None = None
        self._grammar_compiler_lock = asyncio.Lock()

    # ---- routes ------------------------------------------------------------------------------------------------
    def models(self) -> ModelList:
        root = str(getattr(self.engine, "model_path", None) or self.names[0])
        cards = [ModelCard(id=name, root=root, parent=None, max_model_len=self.engine.max_model_len,
                           permission=[ModelPermission()]) for name in self.names]
        # LoRA adapters as vLLM lists them: parent = the base model's name, root = the adapter's path
        cards += [ModelCard(id=name, root=lora.lora_path, parent=self.names[0], max_model_len=self.engine.max_model_len,
                            permission=[ModelPermission()]) for name, lora in self.loras.items()]
        return ModelList(data=cards)

    @property
    def loras(self) -> dict:
        """The LoRA adapters served now, name -> LoRARequest (AsyncEngine.loras; empty without --enable-lora)."""
        return getattr(self.engine, "loras", None) or {}

    def lora_for(self, model: str):
        """The LoRARequest a request's (checked) model name selects; None: the base model."""
        return self.loras.get(model)

    async def chat(self, req: ChatCompletionRequest, raw: Request | None = None, *, priority: int = 0):
        return await self.respond(await self.start_chat(req, raw, priority=priority), bool(req.stream), raw)

    async def completions(self, req: CompletionRequest, raw: Request | None = None, *, priority: int = 0):
        return await self.respond(await self.start_completions(req, raw, priority=priority), bool(req.stream), raw)

    async def start_chat(self, req: ChatCompletionRequest, raw: Request | None = None, *,
                         priority: int = 0) -> Generation:
        """A chat request submitted: its Generation, to respond with (or for another API's adapter to read through
        `collect` or `chunks`). `priority`: the base the request's own priority adds to (see `priority`)."""
        arrival = arrival_time(raw)
        prepared = await self.prepare_chat(req, priority=priority)
        streams = self.submit(prepared.request_id, prepared.prompt_ids, prepared.params, arrival, req.PARAM_NAMES,
                              priority=prepared.priority, model=prepared.model, beam=prepared.beam)
        # vLLM's echo: the reply starts with the last message when that is the assistant's (a prefill to continue)
        echo = [prepared.messages[-1]["content"]] if req.echo and req.messages[-1].role == "assistant" else None
        # the tools whose calls are parsed back out of the text (tool_choice "none": no calls to parse)
        tools = prepared.tools if prepared.tools is not None and prepared.tools.mode != "none" else None
        gen = Generation(prepared.request_id, prepared.model, True, streams, req.num_logprobs, req.include_usage,
                         req.continuous_usage, tools=tools, echo=echo, return_token_ids=bool(req.return_token_ids),
                         tokens_as_ids=self.tokens_as_ids(req))
        if self.reasoning_parser is not None:
            # the prompt as the template wrote it: one that closed the reasoning itself leaves none to split off
            prompt_text = await asyncio.to_thread(self.tokenizer.decode, prepared.prompt_ids[0], False)
            gen.reasoning = reasoning_request(self.reasoning_parser, req.chat_template_kwargs or {}, prompt_text,
                                              include_reasoning=req.include_reasoning)
        return gen

    async def start_completions(self, req: CompletionRequest, raw: Request | None = None, *,
                                priority: int = 0) -> Generation:
        arrival = arrival_time(raw)
        prepared = await self.prepare_completions(req, priority=priority)
        prompts, prompt_ids = prepared.prompts, prepared.prompt_ids
        streams = self.submit(prepared.request_id, prompt_ids, prepared.params, arrival, req.PARAM_NAMES,
                              priority=prepared.priority, model=prepared.model, beam=prepared.beam)
        # echo: the prompt as given, or as the engine runs it when that is token ids or truncated
        echo = [p if isinstance(p, str) and len(s.prompt_token_ids) == len(ids)
                else self.tokenizer.decode(s.prompt_token_ids, False)
                for p, ids, s in zip(prompts, prompt_ids, streams)] if req.echo else None
        gen = Generation(prepared.request_id, prepared.model, False, streams, req.num_logprobs, req.include_usage,
                         req.continuous_usage, echo=echo, return_token_ids=bool(req.return_token_ids),
                         tokens_as_ids=self.tokens_as_ids(req))
        return gen

    # ---- request -> prompt: the one path of the generate routes and their /render routes ------------------------
    async def prepare_chat(self, req: ChatCompletionRequest, *, priority: int = 0) -> PreparedRequest:
        """A chat request checked and turned into the engine's inputs, short of submitting it: the model, the
        sampling parameters (the output constraint compiled), the template's prompt ids. 400 / 404 as the route."""
        model = self.check_model(req.model)
        params = self.sampling_params(req, num_prompts=1)
        tools = parse_tool_request(req.tools, req.tool_choice, tool_parser=self.tool_call_parser,
                                   parallel_tool_calls=req.parallel_tool_calls)
        beam = self.beam_search_params(req, params, tools)
        if not req.include_reasoning and self.reasoning_parser is None:
            raise APIError(400, "include_reasoning=false needs a server started with --reasoning-parser NAME: "
                                "without one no reasoning is split off the answer", param="include_reasoning")
        if beam is None:
            params = await self.constrain(params, req, tools, reasoning=self.reasoning_parser is not None)
        messages, render_args = self.chat_render_args(req, tools)
        self.check_prompt_chars(sum(len(m["content"]) for m in messages), "messages")   # text, flattened above
        prompt_ids = await asyncio.to_thread(self.chat_prompt_ids, messages, **render_args)
        request_id = f"chatcmpl-{req.request_id}" if req.request_id else random_id("chatcmpl")
        if (record := current_record()) is not None:      # the request log's and the trace's record
            record.note_request(req, request_id, lambda: [m.model_dump(exclude_none=True) for m in req.messages])
        return PreparedRequest(request_id, model, params, [prompt_ids], self.priority(req, priority),
                               messages=messages, tools=tools, beam=beam)

    async def prepare_completions(self, req: CompletionRequest, *, priority: int = 0) -> PreparedRequest:
        """A completion request checked and encoded, one prompt's ids per prompt, short of submitting it."""
        model = self.check_model(req.model)
        prompts = req.prompts()
        params = self.sampling_params(req, num_prompts=len(prompts))
        beam = self.beam_search_params(req, params)
        if beam is None:
            params = await self.constrain(params, req)
        # each prompt is its own request: the longest one decides
        self.check_prompt_chars(max((len(p) for p in prompts if isinstance(p, str)), default=0), "prompt")
        prompt_ids = await asyncio.to_thread(self.completion_prompt_ids, prompts, req.add_special_tokens)
        request_id = f"cmpl-{req.request_id}" if req.request_id else random_id("cmpl")
        if (record := current_record()) is not None:      # the request log's and the trace's record
            record.note_request(req, request_id, req.prompt)
        return PreparedRequest(request_id, model, params, prompt_ids, self.priority(req, priority), prompts=prompts,
                               beam=beam)

    def admit(self, prompt_ids: list[int], params: SamplingParams,
              param_names: dict[str, str]) -> tuple[list[int], int]:
        """The engine's own check of one prompt (AsyncEngine.submit makes it too), without submitting anything: the
        prompt as the engine runs it (truncate_prompt_tokens applied) and max_tokens resolved; a 400 naming the
        route's field otherwise."""
        try:
            return self.engine.validator.admit(prompt_ids, params)
        except ValueError as e:
            raise APIError.bad_request(e, param_names) from None

    async def tokenize(self, req: TokenizeRequest) -> TokenizeResponse:
        """vLLM's /tokenize: a prompt's ids, or a chat's, the very ids /v1/chat/completions would run."""
        self.check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise APIError(400, "give exactly one of prompt or messages", param="prompt")
        if req.prompt is not None:
            chat_field = req.chat_field_set()
            if chat_field is not None:
                raise APIError(400, f"{chat_field} applies to the chat form (messages) only", param=chat_field)
            add_special_tokens = True if req.add_special_tokens is None else req.add_special_tokens
            ids = await asyncio.to_thread(self.tokenizer.encode, req.prompt, add_special_tokens)
        else:
            messages, render_args = self.chat_render_args(req, self.tokenize_tools(req))
            ids = await asyncio.to_thread(self.chat_prompt_ids, messages, **render_args)
        token_strs = self.tokenizer.convert_ids_to_tokens(list(ids)) if req.return_token_strs else None
        return TokenizeResponse(count=len(ids), max_model_len=self.engine.max_model_len, tokens=list(ids),
                                token_strs=token_strs)

    async def detokenize(self, req: DetokenizeRequest) -> DetokenizeResponse:
        self.check_model(req.model)
        self.check_token_ids(req.tokens, "tokens")
        text = await asyncio.to_thread(self.tokenizer.decode, req.tokens, False)
        return DetokenizeResponse(prompt=text)

    def tokenizer_info(self) -> TokenizerInfoResponse:
        return TokenizerInfoResponse(**self.tokenizer.config())

    async def shutdown_engine(self) -> None:
        """The engine's shutdown, once (uvicorn's shutdown and the app's lifespan both ask for it)."""
        if self._shutdown is None:
            self._shutdown = asyncio.ensure_future(self.engine.shutdown(self.shutdown_grace_period))
        await asyncio.shield(self._shutdown)
        if self._grammar_compiler is not None:
            self._grammar_compiler.close()

    # ---- request -> engine -------------------------------------------------------------------------------------
    def check_model(self, model: str | None) -> str:
        if (record := current_record()) is not None:
            record.model = model or self.names[0]
        if not model:
            model = self.names[0]
        elif model not in self.names and model not in self.loras:
            served = ", ".join([*self.names, *self.loras])
            raise APIError(404, f"The model `{model}` does not exist. Served models: {served}",
                           param="model", code="model_not_found")
        return model

    def sampling_params(self, req: ChatCompletionRequest | CompletionRequest, num_prompts: int) -> SamplingParams:
        params = req.to_sampling_params().with_bad_words_resolved(self.tokenizer.encode)
        if params.n * num_prompts > self.max_n:
            what = f"n={params.n}" if num_prompts == 1 else f"n={params.n} times {num_prompts} prompts"
            raise APIError(400, f"{what} asks for more than {self.max_n} sequences (--max-n)",
                           param="n" if params.n > self.max_n else "prompt", code="invalid_value")
        return params

    @staticmethod
    def beam_search_params(req: ChatCompletionRequest | CompletionRequest, params: SamplingParams,
                           tools: ToolRequest | None = None) -> BeamSearchParams | None:
        """The beam search a request asks for (use_beam_search), None when it asks for none. The request model has
        refused the fields beam search does not read; a forced tool_choice, a grammar, is refused here."""
        if not req.use_beam_search:
            return None
        if tools is not None and tools.spec() is not None:
            raise APIError(400, f"tool_choice {req.tool_choice!r} constrains the output with a grammar, which beam "
                                "search does not follow", param="tool_choice")
        return req.to_beam_search_params(params)

    async def constrain(self, params: SamplingParams, req: ChatCompletionRequest | CompletionRequest,
                        tools: ToolRequest | None = None, reasoning: bool = False) -> SamplingParams:
        """`params` with the request's output constraint, if any, compiled into `structured` (400 naming the field).
        `reasoning`: a chat under --reasoning-parser, where a constraint is refused: it would apply to the answer,
        after the reasoning, but kvflow's grammars constrain the output from its first token, and one that started
        there would forbid the reasoning (or be broken by it)."""
        spec = spec_from_request(req.structured_request())
        forced = tools.spec() if tools is not None else None
        if forced is not None and spec is not None:
            raise APIError(400, f"tool_choice {req.tool_choice!r} and {spec.param} both constrain the output; "
                                "give one of them", param=spec.param)
        if reasoning and (forced or spec) is not None:
            what, param = (f"tool_choice {req.tool_choice!r}", "tool_choice") if forced is not None else (
                spec.param, spec.param)
            raise APIError(400, f"{what} constrains the output with a grammar from its first token, and with "
                                "--reasoning-parser the grammar would have to start after the reasoning, which kvflow "
                                "does not do: leave it unset, or serve without --reasoning-parser", param=param)
        if (record := current_record()) is not None and (forced or spec) is not None:
            record.structured_output = "tool_choice" if forced is not None else spec.kind
        spec = forced or spec
        if spec is None:
            return params
        compiler = await self.grammar_compiler()
        return dataclasses.replace(params, structured=await compiler.compile_async(spec))

    async def grammar_compiler(self) -> GrammarCompiler:
        """The server's one compiler, built on first use (~0.5 s for a 49k vocabulary, off the event loop)."""
        async with self._grammar_compiler_lock:
            if self._grammar_compiler is None:
                self._grammar_compiler = await asyncio.to_thread(GrammarCompiler, self.tokenizer)
        return self._grammar_compiler

    def chat_render_args(self, req, tools: ToolRequest | None) -> tuple[list[dict], dict]:
        """A chat request's template messages and chat_prompt_ids' keyword arguments: its template options
        (server/chat_template.py; 400 naming the field) and its tools (server/tool_prompt.py). One path for the
        routes that render a chat (/tokenize; the chat route can call it too)."""
        options = ChatTemplateOptions.from_request(req, trust_request_chat_template=self.trust_request_chat_template)
        template = options.template(getattr(self.tokenizer, "chat_template", None))
        messages, template_args = chat_messages(req.messages, tools, template)
        template_args.update(template_variables(req, template))
        return messages, {**options.render_args(), **template_args}

    def tokenize_tools(self, req: TokenizeRequest) -> ToolRequest | None:
        """/tokenize's tools as the chat route puts them into the prompt under the same tool_choice. Without
        tool_choice on a server that has no --tool-call-parser the chat route refuses tools ("auto" needs one) but
        vLLM's /tokenize takes them: the prompt is then that of "auto" with the json syntax."""
        if req.tool_choice is None and req.tools and self.tool_call_parser is None:
            return dataclasses.replace(parse_tool_request(req.tools, "required"), mode="auto")
        return parse_tool_request(req.tools, req.tool_choice, tool_parser=self.tool_call_parser)

    def chat_prompt_ids(self, messages: list[dict], add_generation_prompt: bool = True, *,
                        continue_final_message: bool = False, add_special_tokens: bool = False,
                        chat_template: str | None = None, **template_args) -> list[int]:
        # the tokenizer's defaults are these: only what a request asks for is passed on
        asked = {k: v for k, v in (("continue_final_message", continue_final_message),
                                   ("add_special_tokens", add_special_tokens), ("chat_template", chat_template)) if v}
        try:
            return list(self.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                                           **asked, **template_args))
        except Exception as e:  # a template that rejects the conversation (roles out of order, ...) or is broken
            raise APIError(400, f"cannot apply the chat template: {e}",
                           param="chat_template" if chat_template else "messages") from None

    def check_prompt_chars(self, chars: int, param: str) -> None:
        """Refuse a text that cannot fit the context before tokenizing it: the tokenizer sometimes holds the GIL
        for the whole text (3 s for 4 MB), which stalls the event loop. A token covers at most the longest
        vocabulary piece; 4x that leaves room for normalizers that shorten text."""
        limit = self.engine.max_model_len * 4 * self.tokenizer.max_token_chars
        if chars > limit:
            raise APIError(400, f"the prompt is {chars} characters, more than fit this model's maximum context "
                                f"length ({self.engine.max_model_len} tokens); shorten the prompt", param=param,
                           code="context_length_exceeded")

    def completion_prompt_ids(self, prompts: list[str | list[int]], add_special_tokens: bool = True) -> list[list[int]]:
        return [list(self.tokenizer.encode(p, add_special_tokens)) if isinstance(p, str) else list(p)
                for p in prompts]

    def tokens_as_ids(self, req: ChatCompletionRequest | CompletionRequest) -> bool:
        """Logprobs' tokens as "token_id:N": the request's return_tokens_as_token_ids, else the server's flag."""
        return bool(self.return_tokens_as_token_ids if req.return_tokens_as_token_ids is None
                    else req.return_tokens_as_token_ids)

    def check_token_ids(self, ids: list[int], param: str) -> list[int]:
        bad = next((t for t in ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise APIError(400, f"token id {bad} is out of range [0, {self.vocab_size})", param=param,
                           code="invalid_value")
        return list(ids)

    def priority(self, req, base: int = 0) -> int:
        """The scheduler priority of a request: `base` (the Batch API's, 0 for interactive traffic) plus the
        request's own `priority`, which vLLM honours only under --scheduling-policy priority (else a 400)."""
        if req.priority and getattr(self.engine.config, "scheduling_policy", None) != "priority":
            raise APIError(400, "priority is honoured only when the server runs with --scheduling-policy priority",
                           param="priority", code="invalid_value")
        return base + req.priority

    def submit(self, request_id: str, prompts: list[list[int]], params: SamplingParams, arrival: float,
               param_names: dict[str, str], pooling: PoolingParams | None = None,
               priority: int = 0, model: str | None = None,
               beam: BeamSearchParams | None = None) -> list[RequestStream]:
        """One engine request per prompt; all or none (the ones already submitted are closed on failure).
        `pooling`: embedding requests (server/embeddings_api.py); `priority`: the scheduler's (lower first); `beam`:
        a beam search per prompt instead (AsyncEngine.beam_search; `params` gives its prompt's truncation)."""
        streams: list[RequestStream] = []
        lora = self.lora_for(model) if model is not None else None     # `model`: a LoRA adapter's name selects it
        if beam is not None:
            param_names = {"beam_width": "n", **param_names}
        try:
            for k, ids in enumerate(prompts):
                request = AddRequest(engine_request_id(request_id, k, len(prompts)), ids, params, arrival,
                                     pooling=pooling, priority=priority, lora=lora)
                streams.append(self.engine.submit(request) if beam is None else self.engine.beam_search(request, beam))
        except BaseException as e:
            for s in streams:
                s.close()
            if isinstance(e, EngineOverloadedError):
                raise APIError(429, str(e), type="rate_limit_error", code="rate_limit_exceeded",
                               headers={"Retry-After": "1"}) from None
            if isinstance(e, (EngineShutdownError, EngineDeadError)):
                raise APIError(503, str(e), type="service_unavailable", code="service_unavailable") from None
            if isinstance(e, ValueError):       # InvalidRequestError, or a plain ValueError of an older engine
                raise APIError.bad_request(e, param_names) from None
            raise
        if (record := current_record()) is not None:
            record.attach(streams)
            record.request_id = record.request_id or request_id
        return streams

    # ---- engine -> response: one path for chat and completions -------------------------------------------------
    async def respond(self, gen: Generation, stream: bool, raw: Request | None):
        if stream:
            return EventStream(self.events(gen), gen.streams)
        results = await self.collect(gen, raw)
        head = dict(id=gen.request_id, created=gen.created, model=gen.model)
        if gen.chat:
            choices = [self.chat_choice(gen, i, r) for i, r in enumerate(results)]   # (they count the reasoning)
            first = gen.streams[0]
            if first.params.prompt_logprobs is not None:
                head["prompt_logprobs"] = self.prompt_logprobs(gen, first)
            if gen.return_token_ids:
                head["prompt_token_ids"] = list(first.prompt_token_ids)
            return ChatCompletionResponse(**head, choices=choices, usage=self.usage(gen))
        head["usage"] = self.usage(gen)
        return CompletionResponse(**head, choices=[self.completion_choice(gen, i, r) for i, r in enumerate(results)])

    async def collect(self, gen: Generation, raw: Request | None) -> list[ChoiceResult]:
        """Every choice whole (an APIError if the engine failed the request; 499 if the client went away)."""
        results = [ChoiceResult() for _ in range(len(gen.streams) * gen.n)]

        async def gather():
            async for index, d in merge(gen.streams):
                r = results[index]
                r.text += d.text
                r.tokens.extend(zip(d.token_ids, d.logprobs or [None] * len(d.token_ids)))
                if d.finish_reason is not None:
                    r.finish_reason, r.stop_reason = d.finish_reason, d.stop_reason

        try:
            await run_unless_disconnected(gather(), raw, gen.streams)
        except RequestFailedError as e:
            raise self.failure(e) from None
        return results

    def chat_choice(self, gen: Generation, index: int, r: ChoiceResult) -> ChatCompletionChoice:
        answer, reasoning = r.text, {}
        if gen.reasoning is not None:       # the answer is what follows the reasoning
            splitter = gen.reasoning.splitter()
            thought, answer = splitter.split(r.text)
            self.count_reasoning(gen, index, splitter, [t for t, _ in r.tokens])
            reasoning = reasoning_fields(gen.reasoning, splitter, thought)
            if splitter.has_reasoning:
                answer = answer or None     # as vLLM: nothing after the reasoning is no content
        echo = gen.echo[0] if gen.echo else ""
        text = echo + answer if answer is not None else (echo or None)
        message, finish = ChatResponseMessage(content=text, **reasoning), r.finish_reason
        if gen.tools is not None:
            found = tool_calls_in(gen.tools, answer or "")
            message = ChatResponseMessage(content=found.content, **reasoning,
                                          tool_calls=[ToolCall(**c) for c in found.tool_calls] or None)
            if found.tool_calls and finish == "stop":
                finish = "tool_calls"
            if (record := current_record()) is not None:
                record.choice_finished(index, finish, [c["function"]["name"] for c in found.tool_calls])
        return ChatCompletionChoice(index=index, message=message, logprobs=self.logprobs(gen, r.tokens)[0],
                                    finish_reason=finish, stop_reason=r.stop_reason,
                                    **self.token_ids(gen, [t for t, _ in r.tokens]))

    def completion_choice(self, gen: Generation, index: int, r: ChoiceResult) -> CompletionChoice:
        s = gen.stream_of(index)
        echo, prompt_tokens = self.echoed(gen, s)
        return CompletionChoice(
            index=index, text=echo + r.text, logprobs=self.logprobs(gen, prompt_tokens + r.tokens)[0],
            finish_reason=r.finish_reason, stop_reason=r.stop_reason,
            prompt_logprobs=self.prompt_logprobs(gen, s) if s.params.prompt_logprobs is not None else None,
            **self.token_ids(gen, [t for t, _ in r.tokens], s))

    def echoed(self, gen: Generation, s: RequestStream) -> tuple[str, list[tuple[int, dict[int, float] | None]]]:
        """What a completion choice starts with under echo: the prompt's text and, with logprobs, its tokens with
        their logprobs (the first token has none)."""
        if gen.echo is None:
            return "", []
        text = gen.echo[gen.streams.index(s)]
        if not gen.echoes_logprobs:
            return text, []
        lps = s.prompt_logprobs or [None] * s.num_prompt_tokens
        return text, [(t, None if p is None else {tid: lp for tid, (lp, _rank) in p.items()})
                      for t, p in zip(s.prompt_token_ids, lps)]

    @staticmethod
    def token_ids(gen: Generation, ids: list[int], s: RequestStream | None = None) -> dict:
        """return_token_ids: a choice's (or chunk's) token ids, and its prompt's when `s` is given."""
        if not gen.return_token_ids:
            return {}
        return {"token_ids": ids, **({"prompt_token_ids": list(s.prompt_token_ids)} if s is not None else {})}

    def prompt_logprobs(self, gen: Generation, s: RequestStream) -> list:
        """vLLM's prompt_logprobs: per prompt token None (the first) or {token id: {logprob, rank, decoded_token}}."""
        return [None if p is None else {tid: PromptLogprob(logprob=finite(lp), rank=rank,
                                                           decoded_token=self.token(gen, tid))
                                        for tid, (lp, rank) in p.items()}
                for p in s.prompt_logprobs or []]

    async def events(self, gen: Generation) -> AsyncIterator[str]:
        """Server-Sent Events: chunks as the engine produces them, an error event if it fails, then [DONE]."""
        try:
            async for body in self.chunks(gen):
                yield f"data: {body.model_dump_json(exclude_unset=True)}\n\n"
        except RequestFailedError as e:
            err = self.failure(e)
            if (record := current_record()) is not None:
                record.fail_in_stream(err)
            yield f"data: {json.dumps(err.body())}\n\n"
        finally:
            for s in gen.streams:
                s.close()
        yield "data: [DONE]\n\n"

    async def chunks(self, gen: Generation) -> AsyncIterator[ChatCompletionChunk | CompletionChunk]:
        """The stream's chunks as the engine produces them (to serialize with exclude_unset); raises
        RequestFailedError if the engine fails the request. The caller closes the streams."""
        offsets = [0] * (len(gen.streams) * gen.n)        # completions' text_offset of the next token
        opened = [False] * len(offsets)                   # completions: the choice's first chunk went out
        streamers = [ToolCallStreamer(gen.tools) for _ in offsets] if gen.tools is not None else None
        splitters = [gen.reasoning.splitter() for _ in offsets] if gen.reasoning is not None else None
        choice_ids: list[list[int]] = [[] for _ in offsets] if splitters else []    # to count reasoning tokens
        counted: set[int] = set()          # choices whose reasoning count is final (the reasoning has ended)

        def running_usage(opening: bool = False) -> UsageInfo | None:
            """continuous_usage_stats: usage on every chunk, as vLLM sends it; the chunks that open the stream count
            no completion tokens (they go out before any, whatever the engine has produced meanwhile)."""
            return self.usage(gen, before_completion=opening) if gen.continuous_usage else None

        if gen.chat:
            for i in range(gen.n):
                first = {"prompt_token_ids": list(gen.streams[0].prompt_token_ids)} if (
                    gen.return_token_ids and i == 0) else {}
                yield self.chunk(gen, [ChatCompletionStreamChoice(
                    index=i, delta=DeltaMessage(role="assistant", content=""), logprobs=None, finish_reason=None)],
                    running_usage(opening=True), **first)
            for i in range(gen.n if gen.echo else 0):
                yield self.chunk(gen, [ChatCompletionStreamChoice(
                    index=i, delta=DeltaMessage(content=gen.echo[0]), logprobs=None, finish_reason=None)],
                    running_usage(opening=True))
        async for index, d in merge(gen.streams):
            tokens = list(zip(d.token_ids, d.logprobs or [None] * len(d.token_ids)))
            wants_logprobs = gen.num_logprobs is not None and bool(d.token_ids)
            opening = {}
            if gen.chat:
                splitter = splitters[index] if splitters else None
                deltas, finish = chat_deltas(d, streamers[index] if streamers else None, splitter, gen.reasoning)
                if splitter is not None and index not in counted:    # counted as it goes (continuous usage)
                    choice_ids[index] += d.token_ids
                    self.count_reasoning(gen, index, splitter, choice_ids[index])
                    if finish is not None or splitter.reasoning_end is not None or not splitter.has_reasoning:
                        counted.add(index)
                if finish is not None and streamers and (record := current_record()) is not None:
                    record.choice_finished(index, finish, streamers[index].names)
            else:
                text, prompt_tokens = "", []
                if not opened[index]:      # the choice's first chunk: the echo, its prompt's ids
                    opened[index] = True
                    text, prompt_tokens = self.echoed(gen, gen.stream_of(index))
                    opening = self.token_ids(gen, [], gen.stream_of(index))
                tokens = prompt_tokens + tokens
                text += d.text
                deltas, finish = ([text] if text else []), d.finish_reason
                wants_logprobs = wants_logprobs or bool(prompt_tokens)
            # a token whose text the detokenizer holds back (an incomplete UTF-8 sequence) still sends its id
            sends_ids = gen.return_token_ids and bool(d.token_ids)
            if not deltas and finish is None and not wants_logprobs and not opening and not sends_ids:
                continue
            logprobs, offsets[index] = self.logprobs(gen, tokens, offsets[index])
            deltas = deltas or [DeltaMessage() if gen.chat else ""]
            for j, delta in enumerate(deltas):    # logprobs and token ids on the first chunk, the finish on the last
                last = j == len(deltas) - 1
                end = {"finish_reason": finish if last else None}
                if last and finish is not None:
                    end["stop_reason"] = d.stop_reason
                lp = logprobs if j == 0 else None
                ids = {**opening, **self.token_ids(gen, list(d.token_ids))} if j == 0 else {}
                if gen.chat:
                    choice = ChatCompletionStreamChoice(index=index, delta=delta, logprobs=lp, **end, **ids)
                else:
                    choice = CompletionChoice(index=index, text=delta, logprobs=lp, **end, **ids)
                yield self.chunk(gen, [choice], running_usage())
        if gen.include_usage:
            yield self.chunk(gen, [], self.usage(gen))

    @staticmethod
    def chunk(gen: Generation, choices: list, usage: UsageInfo | None = None, **fields):
        """One chunk; `usage` is present (null until the end, unless continuous) only when asked for."""
        cls = ChatCompletionChunk if gen.chat else CompletionChunk
        extra = {"usage": usage} if gen.include_usage else {}
        return cls(id=gen.request_id, object=cls.model_fields["object"].default, created=gen.created,
                   model=gen.model, system_fingerprint=None, choices=choices, **extra, **fields)

    def token(self, gen: Generation, token_id: int) -> str:
        """A token as logprobs show it: its text, or "token_id:N" (return_tokens_as_token_ids)."""
        return f"token_id:{token_id}" if gen.tokens_as_ids else self.tokenizer.id_to_piece(token_id)

    def logprobs(self, gen: Generation, tokens: list[tuple[int, dict[int, float] | None]], offset: int = 0):
        """(logprobs of these tokens in the API's format, or None when not asked; the next text offset). A token
        whose logprobs are None (an echoed prompt's first) shows null."""
        top_n = gen.num_logprobs
        if top_n is None:
            return None, offset

        def token(tid: int) -> str:
            return self.token(gen, tid)

        if gen.chat:
            def entry(tid: int, lp: float) -> TopLogprob:
                s = token(tid)
                return TopLogprob(token=s, logprob=finite(lp), bytes=list(s.encode("utf-8")))

            content = []
            for tid, lps in tokens:
                e = entry(tid, lps.get(tid, float("-inf")))
                content.append(TokenLogprob(token=e.token, logprob=e.logprob, bytes=e.bytes,
                                            top_logprobs=[entry(t, lp) for t, lp in top(lps, top_n)]))
            return ChatLogprobs(content=content), offset
        res = CompletionLogprobs(tokens=[], token_logprobs=[], top_logprobs=[], text_offset=[])
        for tid, lps in tokens:
            s = token(tid)
            res.tokens.append(s)
            res.token_logprobs.append(None if lps is None else finite(lps.get(tid, float("-inf"))))
            # as vLLM: the token itself first (the sampled one, or the prompt's under echo), then the top `logprobs`
            # tokens by rank (logprobs=0: the token alone)
            res.top_logprobs.append(None if lps is None else {
                s: finite(lps.get(tid, float("-inf"))), **{token(t): finite(lp) for t, lp in top(lps, len(lps))}})
            res.text_offset.append(offset)
            offset += len(self.tokenizer.id_to_piece(tid))
        return res, offset

    @staticmethod
    def usage(gen: Generation, before_completion: bool = False) -> UsageInfo:
        """The request's usage so far (`before_completion`: as it stood before any completion token); under
        --reasoning-parser with the reasoning tokens so far."""
        prompt = sum(s.num_prompt_tokens for s in gen.streams)
        completion = 0 if before_completion else sum(s.num_completion_tokens for s in gen.streams)
        cached = sum(s.num_cached_tokens for s in gen.streams)
        details = None
        if gen.reasoning is not None:
            details = CompletionTokensDetails(reasoning_tokens=0 if before_completion
                                              else sum(gen.reasoning_counts.values()))
        return UsageInfo(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                         prompt_tokens_details=PromptTokensDetails(cached_tokens=cached),
                         completion_tokens_details=details)

    def count_reasoning(self, gen: Generation, index: int, splitter: ReasoningSplitter, token_ids: list[int]) -> None:
        """A choice's reasoning tokens (of `token_ids`, its tokens so far), for usage: O(1) while it reasons, a few
        decodes once its reasoning has ended (then the count is final)."""
        skip = gen.stream_of(index).params.skip_special_tokens
        gen.reasoning_counts[index] = reasoning_tokens(splitter, token_ids,
                                                       lambda ids: self.tokenizer.decode(ids, skip))

    def failure(self, e: RequestFailedError) -> APIError:
        if isinstance(e, EngineDeadError):
            return APIError(503, str(e), type="service_unavailable", code="engine_dead")
        if not self.engine.is_accepting:    # failed by the engine's shutdown after the grace period
            return APIError(503, str(e), type="service_unavailable", code="service_unavailable")
        return APIError(500, str(e), type="internal_error")


class EventStream(StreamingResponse):
    """SSE response that closes (aborts) its request streams however it ends, even if never iterated."""

    def __init__(self, content, streams: list[RequestStream]) -> None:
        super().__init__(content, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self._streams = streams

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            for s in self._streams:
                s.close()


def tool_calls_in(tools: ToolRequest, text: str) -> ExtractedToolCalls:
    """A finished choice's text -> content and tool calls; text that is no call (cut by max_tokens or a stop
    string) stays content."""
    try:
        return extract_tool_calls(tools, text)
    except json.JSONDecodeError:
        return ExtractedToolCalls(text or None)


def chat_deltas(d: CompletionDelta, streamer: ToolCallStreamer | None, splitter: ReasoningSplitter | None = None,
                reasoning: ReasoningRequest | None = None) -> tuple[list[DeltaMessage], str | None]:
    """One engine delta -> the chat deltas to send (reasoning, then content or tool-call chunks) and the finish
    reason. `splitter`: the choice's reasoning splitter (--reasoning-parser); only the answer reaches `streamer`."""
    finish = d.finish_reason
    thought, answer = splitter.push(d.text) if splitter is not None and d.text else ("", d.text)
    if splitter is not None and finish is not None:
        rest = splitter.finish()
        thought, answer = thought + rest[0], answer + rest[1]
    deltas = [DeltaMessage(reasoning=thought, reasoning_content=thought)] if (
        thought and reasoning is not None and reasoning.include_reasoning) else []
    if streamer is None:
        return deltas + ([DeltaMessage(content=answer)] if answer else []), finish
    parts = streamer.push(answer) if answer else []
    if finish is not None:
        parts += streamer.finish()
        if finish == "stop" and streamer.has_tool_calls:
            finish = "tool_calls"
    return deltas + [DeltaMessage(**p) for p in parts], finish


def reasoning_fields(request: ReasoningRequest, splitter: ReasoningSplitter, thought: str) -> dict:
    """A whole choice's `reasoning` and `reasoning_content` (vLLM sends both): None where the output had no
    reasoning, an empty one, or include_reasoning is false."""
    if not splitter.has_reasoning or not request.include_reasoning or not thought:
        return {}      # as a stream, which sends no reasoning then
    return {"reasoning": thought, "reasoning_content": thought}


def arrival_time(raw: Request | None) -> float:
    """When the request arrived (stamped by the ASGI middleware, before the body was read)."""
    return raw.scope.get("state", {}).get("arrival_time", time.time()) if raw is not None else time.time()


def top(lps: dict[int, float], n: int) -> list[tuple[int, float]]:
    return sorted(lps.items(), key=lambda kv: -kv[1])[:n]


def finite(x: float) -> float:
    # JSON has no -inf; OpenAI clients expect a number
    return max(float(x), -9999.0)


async def merge(streams: list[RequestStream]) -> AsyncIterator[tuple[int, CompletionDelta]]:
    """Interleave the streams of a request as (choice index, delta); choice k*n + i is stream k's i-th."""
    n = streams[0].params.n
    if len(streams) == 1:
        async for d in streams[0]:
            yield d.index, d
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(k: int, s: RequestStream):
        try:
            async for d in s:
                await queue.put((k, d))
        except BaseException as e:  # noqa: BLE001
            await queue.put((k, e))
            return
        await queue.put((k, done))

    tasks = [asyncio.ensure_future(pump(k, s)) for k, s in enumerate(streams)]
    remaining = len(streams)
    try:
        while remaining:
            k, item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield k * n + item.index, item
    finally:
        for t in tasks:
            t.cancel()
        for s in streams:
            s.close()


async def run_unless_disconnected(coro, raw: Request | None, streams: list[RequestStream]):
    """Await `coro`; if the HTTP client disconnects first, cancel it (which aborts the streams)."""
    if raw is None:
        return await coro
    task = asyncio.ensure_future(coro)

    async def wait_disconnect():
        while True:
            message = await raw.receive()
            if message["type"] == "http.disconnect":
                return

    watcher = asyncio.ensure_future(wait_disconnect())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        watcher.cancel()
        for s in streams:
            s.close()
        raise
    if task.done():
        watcher.cancel()
        return task.result()
    task.cancel()
    for s in streams:
        s.close()
    with contextlib.suppress(BaseException):
        await task
    raise APIError(499, "client disconnected", type="client_closed_request")
