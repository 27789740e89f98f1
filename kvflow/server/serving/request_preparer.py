"""A chat or completion request made ready for the engine, and submitted: `RequestPreparer`.

One path for the generate routes, their /render routes, /tokenize and the surfaces that submit their own requests
(embeddings): the model checked (or a LoRA adapter chosen), the sampling parameters built, the output constraint
compiled, the chat template rendered with the request's tools, the prompt encoded, then one engine request per
prompt. Tokenization and chat templating run in a worker thread, so a huge prompt never holds the event loop (the
Rust tokenizer releases the GIL) and other streams and /health keep going.

Structured outputs and forced tool calls are compiled here, on the grammar compiler's threads (one compiler per
server, built on first use), before the request reaches the engine: a new schema never stalls the step loop, only
its own request's TTFT.
"""
from __future__ import annotations

import asyncio
import dataclasses
import time
from dataclasses import dataclass

from starlette.requests import Request

from kvflow.async_engine import (AddRequest, EngineDeadError, EngineOverloadedError, EngineShutdownError,
                                 EngineSleepingError, RequestStream)
from kvflow.beam_search import BeamSearchParams
from kvflow.pooling_params import PoolingParams
from kvflow.sampling_params import SamplingParams
from kvflow.server.common.errors import APIError
from kvflow.server.common.request_record import current_record
from kvflow.server.serving.chat_template import ChatTemplateOptions, template_variables
from kvflow.server.serving.engine_client import EngineClient
from kvflow.server.serving.protocol import ChatCompletionRequest, CompletionRequest, TokenizeRequest, random_id
from kvflow.server.serving.reasoning import ReasoningRequest, reasoning_request, thinking_spec
from kvflow.server.serving.tool_calls import ToolRequest, needs_special_tokens, parse_tool_request
from kvflow.server.serving.tool_prompt import chat_messages
from kvflow.structured_output import GrammarCompiler, spec_from_request

# a request to a sleeping engine (POST /sleep) is a 503 with this Retry-After: waking is the operator's (POST /wake_up)
SLEEPING_RETRY_AFTER_S = 5


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
    reasoning: ReasoningRequest | None = None   # chat under --reasoning-parser: how its choices split

    def engine_request_id(self, index: int) -> str:
        return engine_request_id(self.request_id, index, len(self.prompt_ids))


def engine_request_id(request_id: str, index: int, num_prompts: int) -> str:
    """The engine's id of prompt `index` of a request (RequestPreparer.submit: one engine request per prompt)."""
    return request_id if num_prompts == 1 else f"{request_id}-p{index}"


def arrival_time(raw: Request | None) -> float:
    """When the request arrived (stamped by the ASGI middleware, before the body was read)."""
    return raw.scope.get("state", {}).get("arrival_time", time.time()) if raw is not None else time.time()


class RequestPreparer:
    """Checks, templates, encodes and submits requests for one engine, under the server's flags."""

    def __init__(self, engine: EngineClient, names: list[str], *, max_n: int, tool_call_parser: str | None,
                 trust_request_chat_template: bool, reasoning_parser: str | None,
                 reasoning_budget_message: str | None = None) -> None:
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.names = names                           # the served model names; the first is the default
        self.max_n = max_n
        self.tool_call_parser = tool_call_parser     # None: tool_choice "auto" is refused
        self.trust_request_chat_template = trust_request_chat_template   # a request may bring its own template
        self.reasoning_parser = reasoning_parser     # a chat's output constraint then starts after the reasoning
        self.reasoning_budget_message = reasoning_budget_message   # forced before the end marker at a thinking budget
        self._grammar_compiler: GrammarCompiler | None = None
        self._grammar_compiler_lock = asyncio.Lock()

    # ---- request -> prompt: the one path of the generate routes and their /render routes ------------------------
    async def prepare_chat(self, req: ChatCompletionRequest, *, priority: int = 0) -> PreparedRequest:
        """A chat request checked and turned into the engine's inputs, short of submitting it: the model, the
        sampling parameters (the output constraint compiled), the template's prompt ids. 400 / 404 as the route."""
        model = self.check_model(req.model)
        params = self.sampling_params(req, num_prompts=1)
        tools = parse_tool_request(req.tools, req.tool_choice, tool_parser=self.tool_call_parser,
                                   parallel_tool_calls=req.parallel_tool_calls)
        params = self.keep_tool_markers(params, tools)
        beam = self.beam_search_params(req, params, tools)
        if not req.include_reasoning and self.reasoning_parser is None:
            raise APIError(400, "include_reasoning=false needs a server started with --reasoning-parser NAME: "
                                "without one no reasoning is split off the answer", param="include_reasoning")
        if req.thinking_token_budget is not None and self.reasoning_parser is None:
            raise APIError(400, "thinking_token_budget needs a server started with --reasoning-parser NAME: without "
                                "one kvflow does not know where the reasoning ends", param="thinking_token_budget")
        if beam is None:
            params = await self.constrain(params, req, tools)
        messages, render_args = self.chat_render_args(req, tools)
        self.check_prompt_chars(sum(len(m["content"]) for m in messages), "messages")   # text, flattened above
        prompt_ids = await asyncio.to_thread(self.chat_prompt_ids, messages, **render_args)
        reasoning = None
        if self.reasoning_parser is not None:
            # the prompt as the template wrote it: one that closed the reasoning itself leaves none to split off
            prompt_text = await asyncio.to_thread(self.tokenizer.decode, prompt_ids, False)
            reasoning = reasoning_request(self.reasoning_parser, req.chat_template_kwargs or {}, prompt_text,
                                          include_reasoning=req.include_reasoning)
            params = self.bound_reasoning(params, reasoning)
        request_id = f"chatcmpl-{req.request_id}" if req.request_id else random_id("chatcmpl")
        if (record := current_record()) is not None:      # the request log's and the trace's record
            record.note_request(req, request_id, lambda: [m.model_dump(exclude_none=True) for m in req.messages])
        return PreparedRequest(request_id, model, params, [prompt_ids], self.priority(req, priority),
                               messages=messages, tools=tools, beam=beam, reasoning=reasoning)

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

    # ---- the checks ----------------------------------------------------------------------------------------------
    @property
    def loras(self) -> dict:
        """The LoRA adapters served now, name -> LoRARequest (AsyncEngine.loras; empty without --enable-lora)."""
        return self.engine.loras

    def lora_for(self, model: str):
        """The LoRARequest a request's (checked) model name selects; None: the base model."""
        return self.loras.get(model)

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

    def keep_tool_markers(self, params: SamplingParams, tools: ToolRequest | None) -> SamplingParams:
        """`params` with skip_special_tokens=False when the request has tools (tool_choice not "none") and the
        server's --tool-call-parser reads special tokens (tool_calls.needs_special_tokens): its markers would
        otherwise be dropped from the text before it reads them. As vLLM's adjust_request of those parsers, this
        holds over the request's own skip_special_tokens=true."""
        if tools is None or tools.mode == "none" or not needs_special_tokens(self.tool_call_parser):
            return params
        return dataclasses.replace(params, skip_special_tokens=False)

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
                        tools: ToolRequest | None = None) -> SamplingParams:
        """`params` with the request's output constraint, if any, compiled into `structured` (400 naming the field).
        Under --reasoning-parser it constrains the answer only (`bound_reasoning`)."""
        spec = spec_from_request(req.structured_request())
        forced = tools.spec() if tools is not None else None
        if forced is not None and spec is not None:
            raise APIError(400, f"tool_choice {req.tool_choice!r} and {spec.param} both constrain the output; "
                                "give one of them", param=spec.param)
        if (record := current_record()) is not None and (forced or spec) is not None:
            record.structured_output = "tool_choice" if forced is not None else spec.kind
        spec = forced or spec
        if spec is None:
            return params
        compiler = await self.grammar_compiler()
        return dataclasses.replace(params, structured=await compiler.compile_async(spec))

    def bound_reasoning(self, params: SamplingParams, reasoning: ReasoningRequest) -> SamplingParams:
        """A reasoning chat's params with where its reasoning ends, for the engine, when the engine needs it: a
        grammar then starts after the reasoning (at once when the prompt closed it), a thinking budget forces the
        end marker (structured_output/thinking.py). The one place a served request gets it."""
        if params.structured is None and params.thinking_token_budget is None:
            return params
        return dataclasses.replace(params, thinking=thinking_spec(
            reasoning, self.tokenizer.encode, params.thinking_token_budget, self.reasoning_budget_message))

    async def grammar_compiler(self) -> GrammarCompiler:
        """The server's one compiler, built on first use (~0.5 s for a 49k vocabulary, off the event loop)."""
        async with self._grammar_compiler_lock:
            if self._grammar_compiler is None:
                self._grammar_compiler = await asyncio.to_thread(GrammarCompiler, self.tokenizer)
        return self._grammar_compiler

    def close(self) -> None:
        """Stop the grammar compiler's threads, if it was built."""
        if self._grammar_compiler is not None:
            self._grammar_compiler.close()

    def check_prompt_chars(self, chars: int, param: str) -> None:
        """Refuse a text that cannot fit the context before tokenizing it: the tokenizer sometimes holds the GIL
        for the whole text (3 s for 4 MB), which stalls the event loop. A token covers at most the longest
        vocabulary piece; 4x that leaves room for normalizers that shorten text."""
        limit = self.engine.max_model_len * 4 * self.tokenizer.max_token_chars
        if chars > limit:
            raise APIError(400, f"the prompt is {chars} characters, more than fit this model's maximum context "
                                f"length ({self.engine.max_model_len} tokens); shorten the prompt", param=param,
                           code="context_length_exceeded")

    def check_token_ids(self, ids: list[int], param: str) -> list[int]:
        bad = next((t for t in ids if not 0 <= t < self.engine.vocab_size), None)
        if bad is not None:
            raise APIError(400, f"token id {bad} is out of range [0, {self.engine.vocab_size})", param=param,
                           code="invalid_value")
        return list(ids)

    def priority(self, req, base: int = 0) -> int:
        """The scheduler priority of a request: `base` (the Batch API's, 0 for interactive traffic) plus the
        request's own `priority`, which vLLM honours only under --scheduling-policy priority (else a 400)."""
        if req.priority and self.engine.config.scheduling_policy != "priority":
            raise APIError(400, "priority is honoured only when the server runs with --scheduling-policy priority",
                           param="priority", code="invalid_value")
        return base + req.priority

    # ---- the prompt ------------------------------------------------------------------------------------------------
    def chat_render_args(self, req, tools: ToolRequest | None) -> tuple[list[dict], dict]:
        """A chat request's template messages and chat_prompt_ids' keyword arguments: its template options
        (server/chat_template.py; 400 naming the field) and its tools (server/tool_prompt.py). One path for the
        routes that render a chat (/tokenize; the chat route can call it too)."""
        options = ChatTemplateOptions.from_request(req, trust_request_chat_template=self.trust_request_chat_template)
        template = options.template(self.tokenizer.chat_template)
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

    def completion_prompt_ids(self, prompts: list[str | list[int]], add_special_tokens: bool = True) -> list[list[int]]:
        return [list(self.tokenizer.encode(p, add_special_tokens)) if isinstance(p, str) else list(p)
                for p in prompts]

    # ---- prompt -> engine ------------------------------------------------------------------------------------------
    def submit(self, request_id: str, prompts: list[list[int]], params: SamplingParams, arrival: float,
               param_names: dict[str, str], pooling: PoolingParams | list[PoolingParams] | None = None,
               priority: int = 0, model: str | None = None,
               beam: BeamSearchParams | None = None, return_progress: bool = False) -> list[RequestStream]:
        """One engine request per prompt; all or none (the ones already submitted are closed on failure).
        `pooling`: pooling requests (server/embeddings/routes.py; a list: one per prompt, as a text pair's token
        types differ: server/score/routes.py); `priority`: the scheduler's (lower first); `beam`:
        a beam search per prompt instead (AsyncEngine.beam_search; `params` gives its prompt's truncation);
        `return_progress`: the engine says how far each prompt is after each step that computes some of it."""
        streams: list[RequestStream] = []
        lora = self.lora_for(model) if model is not None else None     # `model`: a LoRA adapter's name selects it
        if beam is not None:
            param_names = {"beam_width": "n", **param_names}
        try:
            for k, ids in enumerate(prompts):
                request = AddRequest(engine_request_id(request_id, k, len(prompts)), ids, params, arrival,
                                     pooling=pooling[k] if isinstance(pooling, list) else pooling,
                                     priority=priority, lora=lora, return_progress=return_progress)
                streams.append(self.engine.submit(request) if beam is None else self.engine.beam_search(request, beam))
        except BaseException as e:
            for s in streams:
                s.close()
            if isinstance(e, EngineOverloadedError):
                raise APIError(429, str(e), type="rate_limit_error", code="rate_limit_exceeded",
                               headers={"Retry-After": "1"}) from None
            if isinstance(e, EngineSleepingError):
                raise APIError(503, str(e), type="service_unavailable", code="engine_sleeping",
                               headers={"Retry-After": str(SLEEPING_RETRY_AFTER_S)}) from None
            if isinstance(e, (EngineShutdownError, EngineDeadError)):
                raise APIError(503, str(e), type="service_unavailable", code="service_unavailable") from None
            if isinstance(e, ValueError):       # InvalidRequestError, or a plain ValueError of an older engine
                raise APIError.bad_request(e, param_names) from None
            raise
        if (record := current_record()) is not None:
            record.attach(streams)
            record.request_id = record.request_id or request_id
        return streams
