"""LLM: the offline API. Encodes prompts, drives EngineCore in-process until all are done, decodes text
through the same OutputProcessor the server uses. `SamplingParams(structured_outputs={"json": schema})` is
compiled here, before the engine sees it (the grammar compiler is built on first use, ~0.5 s). `beam_search` is
vLLM's: each step's beams run as one-token requests that share their prompt's KV blocks (kvflow/beam_search.py)."""
from __future__ import annotations

import dataclasses
import itertools
import weakref
from typing import Sequence

from kvflow import scoring
from kvflow.beam_search import BeamSearch, BeamSearchOutput, BeamSearchParams
from kvflow.config import EngineConfig
from kvflow.core.engine_core import EngineCore
from kvflow.core.messages import AddRequest
from kvflow.lora_request import LoRARequest
from kvflow.models.model_files import resolve_model_files
from kvflow.output_processor import OutputProcessor, RequestState
from kvflow.outputs import CompletionOutput, RequestOutput
from kvflow.pooling_params import PoolingParams
from kvflow.sampling_params import SamplingParams
from kvflow.structured_output import GrammarCompiler, spec_from_request
from kvflow.tokenizer import Tokenizer

Prompt = str | list[int] | dict


class LLM:
    """`LLM(model=None, **engine_args)`: engine_args are EngineConfig's fields (dtype, max_model_len, ...).
    Use it as a context manager, or call `shutdown()`, to stop tensor-parallel workers at once; otherwise
    they stop when the LLM is garbage-collected or the interpreter exits."""

    def __init__(self, model: str | None = None, **engine_args):
        self.config = EngineConfig(model=model, **engine_args)
        files = resolve_model_files(self.config.model, self.config.tokenizer, self.config.hf_overrides)   # fails on the architecture
        self.tokenizer = Tokenizer.from_files(files)
        self.engine = EngineCore(self.config, eos_token_ids=self.tokenizer.eos_token_ids, files=files)
        self._finalizer = weakref.finalize(self, self.engine.shutdown)
        self._ids = itertools.count()
        self._grammar_compiler: GrammarCompiler | None = None
        self._checked_loras: dict[int, LoRARequest] = {}    # adapters checked against the base model

    @property
    def grammar_compiler(self) -> GrammarCompiler:
        if self._grammar_compiler is None:
            self._grammar_compiler = GrammarCompiler(self.tokenizer)
        return self._grammar_compiler

    def shutdown(self) -> None:
        self._finalizer()

    # ---- sleep mode (vLLM's; needs LLM(enable_sleep_mode=True)) --------------------------------------------------
    def sleep(self, level: int = 1) -> None:
        """Release memory between uses: level 1 the KV cache (and a hybrid's recurrent state), level 2 the weights
        too; the prefix cache is forgotten. Generating raises until `wake_up`."""
        self._check_sleep_mode()
        self.engine.sleep(level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Bring back what `tags` name ("weights", "kv_cache"; None: everything): the weights from the model's
        files, the KV cache as planned at load. Greedy outputs are the same as before the sleep."""
        self._check_sleep_mode()
        self.engine.wake_up(tags)

    def is_sleeping(self) -> bool:
        return bool(self.engine.sleeping)

    def _check_sleep_mode(self) -> None:
        if not self.config.enable_sleep_mode:
            raise ValueError("sleep mode is off: LLM(..., enable_sleep_mode=True)")

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None) -> list[RequestOutput]:
        """Complete each prompt (text, token ids, or {"prompt_token_ids": [...]}); outputs in input order.
        `lora_request`: the LoRA adapter every prompt runs under, or one (or None: the base model) per prompt
        (needs `LLM(enable_lora=True)`)."""
        encoded = [self._encode(p) for p in self._prompt_list(prompts)]
        return self._run(encoded, sampling_params, lora_request)

    def embed(self, prompts: Prompt | Sequence[Prompt], pooling_params: PoolingParams | None = None,
              truncate_prompt_tokens: int | None = None) -> list[list[float]]:
        """One vector per prompt (as `generate` takes them), in input order: the final hidden states (after the
        model's last norm) pooled as the engine's `pooling` says (last token, mean, or cls), L2-normalised unless
        `PoolingParams(normalize=False)` (or, by default, a sentence-transformers folder without a Normalize
        module). Prefill only, in the same continuous batch as any generation (an encoder: each prompt whole in one
        step)."""
        params = SamplingParams(truncate_prompt_tokens=truncate_prompt_tokens)
        pooling = pooling_params or PoolingParams(normalize=self.engine.model_config.normalize)
        encoded = [ids for _, ids in (self._encode(p) for p in self._prompt_list(prompts))]
        admitted = [self.engine.validator.admit(ids, params, pooling) for ids in encoded]
        states = self._drive(OutputProcessor(self.tokenizer),
                             [AddRequest(str(next(self._ids)), ids, params, max_tokens=max_tokens, pooling=pooling)
                              for ids, max_tokens in admitted])
        failed = next((state for state in states if state.embedding is None), None)
        if failed is not None:
            raise RuntimeError(f"embedding request {failed.request_id} failed: {failed.choices[0].stop_reason}")
        return [state.embedding for state in states]

    def score(self, text_1: str | Sequence[str], text_2: str | Sequence[str], truncate_prompt_tokens: int | None = None,
              use_activation: bool = True) -> list[float]:
        """vLLM's LLM.score: one relevance score per pair of `text_1` against `text_2` (1:1, 1:N or N:N in order), in
        pair order. A score model (a cross-encoder, a decoder reranker) scores each pair as one prompt, its logit
        through a sigmoid unless `use_activation` is off; an embedding model by the cosine of the two vectors
        (`kvflow/scoring.py`). Prefill only, in the same continuous batch as anything else."""
        firsts, seconds = scoring.pairs([text_1] if isinstance(text_1, str) else list(text_1),
                                        [text_2] if isinstance(text_2, str) else list(text_2))
        method = scoring.scoring_method(self.engine.validator)
        params = SamplingParams(truncate_prompt_tokens=truncate_prompt_tokens)
        if method == scoring.CROSS_ENCODING:
            k = truncate_prompt_tokens
            prompts, pooling = scoring.pair_prompts(self.tokenizer, firsts, seconds,
                                                    self.engine.max_model_len if k == -1 else k,
                                                    use_activation and self.engine.model_config.score_sigmoid)
        else:
            texts = scoring.distinct_texts(firsts, seconds)
            prompts, pooling = [self.tokenizer.encode(t) for t in texts], [PoolingParams()] * len(texts)
        admitted = [self.engine.validator.admit(ids, params, p) for ids, p in zip(prompts, pooling)]
        states = self._drive(OutputProcessor(self.tokenizer),
                             [AddRequest(str(next(self._ids)), ids, params, max_tokens=max_tokens, pooling=p)
                              for (ids, max_tokens), p in zip(admitted, pooling)])
        failed = next((state for state in states if state.embedding is None), None)
        if failed is not None:
            raise RuntimeError(f"scoring request {failed.request_id} failed: {failed.choices[0].stop_reason}")
        outputs = [state.embedding for state in states]
        if method == scoring.CROSS_ENCODING:
            return [out[0] for out in outputs]
        return scoring.cosine_scores(firsts, seconds, texts, outputs)

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             add_generation_prompt: bool = True) -> list[RequestOutput]:
        """One conversation (a list of {"role", "content"}) or a list of them, rendered by the chat template."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        encoded = [(None, self.tokenizer.apply_chat_template(c, add_generation_prompt=add_generation_prompt))
                   for c in conversations]
        return self._run(encoded, sampling_params)

    def beam_search(self, prompts: Prompt | Sequence[Prompt], params: BeamSearchParams,
                    lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
                    concurrency_limit: int | None = None) -> list[BeamSearchOutput]:
        """vLLM's LLM.beam_search: for each prompt (as `generate` takes them, or {"prompt": text}), its best
        `params.beam_width` beams, best first, each with its tokens (the prompt's and its own), cumulative logprob and
        text. Each step runs every live beam of every prompt as a one-token request, together in the continuous
        batch; the beams share their prompt's KV blocks through the prefix cache, even with prefix caching off.
        `concurrency_limit`: at most this many prompts searched at once (vLLM's). A bad prompt raises
        InvalidRequestError before anything runs."""
        if concurrency_limit is not None and (isinstance(concurrency_limit, bool)
                                              or not isinstance(concurrency_limit, int) or concurrency_limit < 1):
            raise ValueError(f"concurrency_limit must be a positive integer, got {concurrency_limit!r}")
        params.validate()
        encoded = [ids for _, ids in (self._encode(p) for p in self._prompt_list(prompts))]
        loras = self._loras(lora_request, len(encoded))
        # the prompt against the context, max_tokens resolved (None: what is left of it), before anything runs
        limits = SamplingParams(max_tokens=params.max_tokens)
        searches = [BeamSearch(ids, params, max_tokens, self.tokenizer.eos_token_ids)
                    for ids, max_tokens in (self.engine.validator.admit(ids, limits) for ids in encoded)]
        step = params.step_params()
        limit = concurrency_limit or max(1, len(searches))
        for start in range(0, len(searches), limit):
            group = list(zip(searches[start:start + limit], loras[start:start + limit]))
            while live := [(search, lora) for search, lora in group if not search.done]:
                # each step's tokens fit (prompt + max_tokens <= context); the beams share their prompt's KV blocks
                requests = [AddRequest(str(next(self._ids)), tokens, step, max_tokens=1, lora=lora, cache_prefix=True)
                            for search, lora in live for tokens in search.step_prompts()]
                # no detokenizer: a step's token is a candidate, not text yet
                states = self._drive(OutputProcessor(None, keep_logprobs=True), requests)
                k = 0
                for search, _ in live:
                    n = len(search.beams)
                    search.advance([self._step_logprobs(state) for state in states[k:k + n]])
                    k += n
        return [search.output(self.tokenizer.decode) for search in searches]

    @staticmethod
    def _step_logprobs(state: RequestState) -> dict[int, float] | None:
        """A beam step's result: its one token's logprobs (None when it ended without a token)."""
        choice = state.choices[0]
        if choice.finish_reason == "error":
            raise RuntimeError(f"beam search step {state.request_id} failed: {choice.stop_reason}")
        return choice.logprobs[0] if choice.logprobs else None

    # ---- internals -----------------------------------------------------------------------------
    @staticmethod
    def _prompt_list(prompts: Prompt | Sequence[Prompt]) -> Sequence[Prompt]:
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts
                                                 and isinstance(prompts[0], int)):
            return [prompts]
        return prompts

    def _encode(self, prompt: Prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, dict):
            if "prompt_token_ids" not in prompt:          # vLLM's TextPrompt: {"prompt": text}
                return prompt["prompt"], self.tokenizer.encode(prompt["prompt"])
            return prompt.get("prompt"), list(prompt["prompt_token_ids"])
        return None, list(prompt)

    def _compile(self, params: SamplingParams) -> SamplingParams:
        """What the frontend resolves before the engine sees a request: the grammar, the bad words' ids."""
        params = params.with_bad_words_resolved(self.tokenizer.encode)
        if not params.structured_outputs or params.structured is not None:
            return params
        spec = spec_from_request({"structured_outputs": params.structured_outputs})
        if spec is None:    # e.g. {"json": None}: nothing to constrain
            return dataclasses.replace(params, structured_outputs=None)
        return dataclasses.replace(params, structured=self.grammar_compiler.compile(spec))

    def _loras(self, lora_request, n: int) -> list[LoRARequest | None]:
        """One LoRARequest (or None) per prompt, each checked against the base model once (a bad adapter raises
        LoRAAdapterError, a ValueError naming the problem, before anything runs)."""
        loras = list(lora_request) if isinstance(lora_request, (list, tuple)) else [lora_request] * n
        if len(loras) != n:
            raise ValueError(f"got {len(loras)} LoRA requests for {n} prompts")
        if any(lora is not None for lora in loras):
            from kvflow.models.lora_adapter import inspect_adapter

            if not self.config.enable_lora:
                raise ValueError("lora_request needs LLM(enable_lora=True)")
            for lora in {lora.lora_int_id: lora for lora in loras if lora is not None}.values():
                if self._checked_loras.get(lora.lora_int_id) != lora:
                    inspect_adapter(lora.lora_path, self.engine.model_config, self.config.max_lora_rank,
                                    lora.lora_name, self.config.lora_target_modules)
                    self._checked_loras[lora.lora_int_id] = lora
        return loras

    def _run(self, encoded: list[tuple[str | None, list[int]]], sampling_params,
             lora_request=None) -> list[RequestOutput]:
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params or SamplingParams()] * len(encoded)
        if len(sampling_params) != len(encoded):
            raise ValueError(f"got {len(sampling_params)} sampling params for {len(encoded)} prompts")
        loras = self._loras(lora_request, len(encoded))
        compiled = {id(p): self._compile(p) for p in sampling_params}     # once per distinct params object
        sampling_params = [compiled[id(p)] for p in sampling_params]
        # reject a bad prompt before running any; the core trusts what the validator admitted
        admitted = [self.engine.validator.admit(ids, params) for (_, ids), params in zip(encoded, sampling_params)]
        states = self._drive(OutputProcessor(self.tokenizer, keep_logprobs=True),
                             [AddRequest(str(next(self._ids)), ids, params, max_tokens=max_tokens, lora=lora)
                              for (ids, max_tokens), params, lora in zip(admitted, sampling_params, loras)])
        return [RequestOutput(state.request_id, text, state.prompt_token_ids,
                              [CompletionOutput(c.index, c.text, c.token_ids, c.finish_reason, c.stop_reason,
                                                c.logprobs) for c in state.choices],
                              num_cached_tokens=state.num_cached_tokens,
                              prompt_logprobs=None if state.prompt_logprobs is None else [
                                  None if p is None else {t: lp for t, (lp, _rank) in p.items()}
                                  for p in state.prompt_logprobs])
                for (text, _), state in zip(encoded, states)]

    def _drive(self, processor: OutputProcessor, requests: list[AddRequest]) -> list[RequestState]:
        """Add the admitted requests (max_tokens resolved) and step the engine until every one is done; their
        states, in order."""
        states: list[RequestState] = []
        added = []
        try:
            for request in requests:
                for core in processor.add_request(request):
                    self.engine.add_request(core)
                    added.append(core.request_id)
                states.append(processor.requests[request.request_id])
            while self.engine.has_unfinished_requests():
                processed = processor.process(self.engine.step())
                if processed.to_abort:
                    self.engine.abort(processed.to_abort)
        except BaseException:
            self.engine.abort(added)   # nothing is left holding blocks if something failed midway
            while self.engine.has_unfinished_requests() and not self.engine.requests:
                self.engine.step()
            raise
        return states
