"""The OpenAI routes as plain methods over an engine (openai/routes.py only wires them into FastAPI): `OpenAIServing`,
the seam every surface adapts onto (`start_chat` / `start_completions`, `collect`, `chunks`; `preparer.submit` for
the surfaces that build their own engine requests).

Each job has its own module: a request checked, templated, encoded and submitted (request_preparer.py); the accepted
request, `Generation` (generation.py); its choices collected into whole responses (choice_renderer.py) or streamed
as SSE chunks (chunk_stream.py); what the seam asks of the engine (engine_client.py).

Beam search (`use_beam_search`, vLLM's) takes the same path: each prompt's `AsyncEngine.beam_search` stream stands
where a request's stream would (it yields its n beams whole, best first, once the search is done), and the fields it
does not read are 400s (request_fields.BEAM_SEARCH_REFUSED).
"""
from __future__ import annotations

import asyncio
from typing import AsyncIterator

from starlette.requests import Request

from kvflow.async_engine import EngineDeadError, RequestFailedError
from kvflow.server.common.config import DEFAULT_MAX_N
from kvflow.server.common.errors import APIError
from kvflow.server.serving.choice_renderer import ChoiceRenderer, ChoiceResult, collect_choices
from kvflow.server.serving.chunk_stream import EventStream, sse_events, stream_chunks
from kvflow.server.serving.engine_client import EngineClient
from kvflow.server.serving.generation import Generation
from kvflow.server.serving.protocol import (ChatCompletionChunk, ChatCompletionRequest, CompletionChunk,
                                            CompletionRequest, DetokenizeRequest, DetokenizeResponse, ModelCard,
                                            ModelList, ModelPermission, TokenizeRequest, TokenizeResponse,
                                            TokenizerInfoResponse)
from kvflow.server.serving.request_preparer import RequestPreparer, arrival_time
from kvflow.server.serving.sse_pings import DEFAULT_SSE_PING_INTERVAL


def streamed_progress(req: ChatCompletionRequest | CompletionRequest) -> bool:
    """return_progress (llama-server's), which only a stream can carry: a 400 naming it otherwise."""
    if req.return_progress and not req.stream:
        raise APIError(400, "return_progress sends prompt_progress chunks: it needs stream: true",
                       param="return_progress")
    return req.return_progress


class OpenAIServing:
    """The routes, and one path for chat and completions over one engine: `preparer` readies and submits a request,
    `renderer` shapes its choices whole, `chunks` streams them."""

    def __init__(self, engine: EngineClient, *, served_model_names: list[str] | tuple[str, ...] | None = None,
                 max_n: int = DEFAULT_MAX_N, shutdown_grace_period: float = 30.0,
                 tool_call_parser: str | None = None, trust_request_chat_template: bool = False,
                 return_tokens_as_token_ids: bool = False, reasoning_parser: str | None = None,
                 reasoning_budget_message: str | None = None, enable_per_request_metrics: bool = False,
                 sse_ping_interval: float | None = DEFAULT_SSE_PING_INTERVAL) -> None:
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.names = list(served_model_names or [engine.served_model_name])
        self.shutdown_grace_period = shutdown_grace_period
        self._shutdown: asyncio.Future | None = None
        self.return_tokens_as_token_ids = return_tokens_as_token_ids     # the default of the request field
        self.reasoning_parser = reasoning_parser     # None: the output is not split (think markers stay in content)
        self.enable_per_request_metrics = enable_per_request_metrics     # responses carry vLLM's `metrics`
        self.sse_ping_interval = sse_ping_interval   # every stream's keep-alive (sse_pings.py); None: none
        self.preparer = RequestPreparer(engine, self.names, max_n=max_n, tool_call_parser=tool_call_parser,
                                        trust_request_chat_template=trust_request_chat_template,
                                        reasoning_parser=reasoning_parser,
                                        reasoning_budget_message=reasoning_budget_message)
        self.renderer = ChoiceRenderer(engine.tokenizer)

    # ---- routes ------------------------------------------------------------------------------------------------
    def models(self) -> ModelList:
        root = str(self.engine.model_path)
        cards = [ModelCard(id=name, root=root, parent=None, max_model_len=self.engine.max_model_len,
                           permission=[ModelPermission()]) for name in self.names]
        # LoRA adapters as vLLM lists them: parent = the base model's name, root = the adapter's path
        cards += [ModelCard(id=name, root=lora.lora_path, parent=self.names[0], max_model_len=self.engine.max_model_len,
                            permission=[ModelPermission()]) for name, lora in self.engine.loras.items()]
        return ModelList(data=cards)

    async def chat(self, req: ChatCompletionRequest, raw: Request | None = None, *, priority: int = 0):
        return await self.respond(await self.start_chat(req, raw, priority=priority), bool(req.stream), raw)

    async def completions(self, req: CompletionRequest, raw: Request | None = None, *, priority: int = 0):
        return await self.respond(await self.start_completions(req, raw, priority=priority), bool(req.stream), raw)

    async def tokenize(self, req: TokenizeRequest) -> TokenizeResponse:
        """vLLM's /tokenize: a prompt's ids, or a chat's, the very ids /v1/chat/completions would run."""
        preparer = self.preparer
        preparer.check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise APIError(400, "give exactly one of prompt or messages", param="prompt")
        if req.prompt is not None:
            chat_field = req.chat_field_set()
            if chat_field is not None:
                raise APIError(400, f"{chat_field} applies to the chat form (messages) only", param=chat_field)
            add_special_tokens = True if req.add_special_tokens is None else req.add_special_tokens
            ids = await asyncio.to_thread(self.tokenizer.encode, req.prompt, add_special_tokens)
        else:
            messages, render_args = preparer.chat_render_args(req, preparer.tokenize_tools(req))
            ids = await asyncio.to_thread(preparer.chat_prompt_ids, messages, **render_args)
        token_strs = self.tokenizer.convert_ids_to_tokens(list(ids)) if req.return_token_strs else None
        return TokenizeResponse(count=len(ids), max_model_len=self.engine.max_model_len, tokens=list(ids),
                                token_strs=token_strs)

    async def detokenize(self, req: DetokenizeRequest) -> DetokenizeResponse:
        self.preparer.check_model(req.model)
        self.preparer.check_token_ids(req.tokens, "tokens")
        text = await asyncio.to_thread(self.tokenizer.decode, req.tokens, False)
        return DetokenizeResponse(prompt=text)

    def tokenizer_info(self) -> TokenizerInfoResponse:
        return TokenizerInfoResponse(**self.tokenizer.config())

    async def shutdown_engine(self) -> None:
        """The engine's shutdown, once (uvicorn's shutdown and the app's lifespan both ask for it)."""
        if self._shutdown is None:
            self._shutdown = asyncio.ensure_future(self.engine.shutdown(self.shutdown_grace_period))
        await asyncio.shield(self._shutdown)
        self.preparer.close()

    # ---- request -> Generation ---------------------------------------------------------------------------------
    async def start_chat(self, req: ChatCompletionRequest, raw: Request | None = None, *,
                         priority: int = 0) -> Generation:
        """A chat request submitted: its Generation, to respond with (or for another API's adapter to read through
        `collect` or `chunks`). `priority`: the base the request's own priority adds to (RequestPreparer.priority)."""
        arrival = arrival_time(raw)
        prepared = await self.preparer.prepare_chat(req, priority=priority)
        streams = self.preparer.submit(prepared.request_id, prepared.prompt_ids, prepared.params, arrival,
                                       req.PARAM_NAMES, priority=prepared.priority, model=prepared.model,
                                       beam=prepared.beam, return_progress=streamed_progress(req))
        # vLLM's echo: the reply starts with the last message when that is the assistant's (a prefill to continue)
        echo = [prepared.messages[-1]["content"]] if req.echo and req.messages[-1].role == "assistant" else None
        # the tools whose calls are parsed back out of the text (tool_choice "none": no calls to parse)
        tools = prepared.tools if prepared.tools is not None and prepared.tools.mode != "none" else None
        gen = Generation(prepared.request_id, prepared.model, True, streams, req.num_logprobs, req.include_usage,
                         req.continuous_usage, tools=tools, echo=echo, return_token_ids=bool(req.return_token_ids),
                         tokens_as_ids=self.tokens_as_ids(req),
                         per_request_metrics=self.enable_per_request_metrics and prepared.beam is None,
                         return_progress=req.return_progress)
        gen.reasoning = prepared.reasoning
        return gen

    async def start_completions(self, req: CompletionRequest, raw: Request | None = None, *,
                                priority: int = 0) -> Generation:
        arrival = arrival_time(raw)
        prepared = await self.preparer.prepare_completions(req, priority=priority)
        prompts, prompt_ids = prepared.prompts, prepared.prompt_ids
        streams = self.preparer.submit(prepared.request_id, prompt_ids, prepared.params, arrival, req.PARAM_NAMES,
                                       priority=prepared.priority, model=prepared.model, beam=prepared.beam,
                                       return_progress=streamed_progress(req))
        # echo: the prompt as given, or as the engine runs it when that is token ids or truncated
        echo = [p if isinstance(p, str) and len(s.prompt_token_ids) == len(ids)
                else self.tokenizer.decode(s.prompt_token_ids, False)
                for p, ids, s in zip(prompts, prompt_ids, streams)] if req.echo else None
        gen = Generation(prepared.request_id, prepared.model, False, streams, req.num_logprobs, req.include_usage,
                         req.continuous_usage, echo=echo, return_token_ids=bool(req.return_token_ids),
                         tokens_as_ids=self.tokens_as_ids(req),
                         per_request_metrics=self.enable_per_request_metrics and prepared.beam is None,
                         return_progress=req.return_progress)
        return gen

    def tokens_as_ids(self, req: ChatCompletionRequest | CompletionRequest) -> bool:
        """Logprobs' tokens as "token_id:N": the request's return_tokens_as_token_ids, else the server's flag."""
        return bool(self.return_tokens_as_token_ids if req.return_tokens_as_token_ids is None
                    else req.return_tokens_as_token_ids)

    # ---- Generation -> response: one path for chat and completions ---------------------------------------------
    async def respond(self, gen: Generation, stream: bool, raw: Request | None):
        if stream:
            return EventStream(sse_events(self.chunks(gen), gen.streams, self.failure), gen.streams,
                               self.sse_ping_interval)
        return self.renderer.response(gen, await self.collect(gen, raw))

    async def collect(self, gen: Generation, raw: Request | None) -> list[ChoiceResult]:
        """Every choice whole (an APIError if the engine failed the request; 499 if the client went away)."""
        try:
            return await collect_choices(gen, raw)
        except RequestFailedError as e:
            raise self.failure(e) from None

    def chunks(self, gen: Generation) -> AsyncIterator[ChatCompletionChunk | CompletionChunk]:
        """The stream's chunks as the engine produces them (to serialize with exclude_unset); raises
        RequestFailedError if the engine fails the request. The caller closes the streams."""
        return stream_chunks(gen, self.renderer)

    def failure(self, e: RequestFailedError) -> APIError:
        """The error a request the engine failed answers with (or sends as its stream's last event)."""
        if isinstance(e, EngineDeadError):
            return APIError(503, str(e), type="service_unavailable", code="engine_dead")
        if not self.engine.is_accepting:    # failed by the engine's shutdown after the grace period
            return APIError(503, str(e), type="service_unavailable", code="service_unavailable")
        return APIError(500, str(e), type="internal_error")
