"""LLM: the offline API. Encodes prompts, drives EngineCore in-process until all are done, decodes text."""
from __future__ import annotations

import dataclasses
import itertools
from typing import Sequence

from kvflow.config import EngineConfig
from kvflow.core.engine_core import EngineCore
from kvflow.detokenizer import IncrementalDetokenizer
from kvflow.models.loader import load_model_config, resolve_model_path
from kvflow.outputs import CompletionOutput, RequestOutput
from kvflow.sampling_params import SamplingParams
from kvflow.tokenizer import Tokenizer

Prompt = str | list[int] | dict


class LLM:
    """`LLM(model=None, **engine_args)`: engine_args are EngineConfig's fields (dtype, max_model_len, ...)."""

    def __init__(self, model: str | None = None, **engine_args):
        self.config = EngineConfig(model=model, **engine_args)
        load_model_config(resolve_model_path(self.config.model))   # fail on the architecture first
        self.tokenizer = Tokenizer.from_model(resolve_model_path(self.config.tokenizer or self.config.model))
        self.engine = EngineCore(self.config, eos_token_ids=self.tokenizer.eos_token_ids)
        self._ids = itertools.count()

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None) -> list[RequestOutput]:
        """Complete each prompt (text, token ids, or {"prompt_token_ids": [...]}); outputs in input order."""
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts
                                                 and isinstance(prompts[0], int)):
            prompts = [prompts]
        encoded = [self._encode(p) for p in prompts]
        return self._run(encoded, sampling_params)

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             add_generation_prompt: bool = True) -> list[RequestOutput]:
        """One conversation (a list of {"role", "content"}) or a list of them, rendered by the chat template."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        encoded = [(None, self.tokenizer.apply_chat_template(c, add_generation_prompt=add_generation_prompt))
                   for c in conversations]
        return self._run(encoded, sampling_params)

    # ---- internals -----------------------------------------------------------------------------
    def _encode(self, prompt: Prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, dict):
            return prompt.get("prompt"), list(prompt["prompt_token_ids"])
        return None, list(prompt)

    def _run(self, encoded: list[tuple[str | None, list[int]]], sampling_params) -> list[RequestOutput]:
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params] * len(encoded)
        if len(sampling_params) != len(encoded):
            raise ValueError(f"got {len(sampling_params)} sampling params for {len(encoded)} prompts")

        results: list[RequestOutput] = []
        children: dict[str, tuple[CompletionOutput, IncrementalDetokenizer]] = {}
        added = []
        try:
            for (text, ids), params in zip(encoded, sampling_params):
                rid = str(next(self._ids))
                out = RequestOutput(rid, text, ids)
                results.append(out)
                for i in range(params.n):
                    child = dataclasses.replace(params, n=1, seed=None if params.seed is None else params.seed + i)
                    cid = f"{rid}-{i}"
                    self.engine.add_request(cid, ids, child)
                    added.append(cid)
                    completion = CompletionOutput(i, "", [], logprobs=[] if params.logprobs is not None else None)
                    out.outputs.append(completion)
                    detok = IncrementalDetokenizer(self.tokenizer, skip_special_tokens=params.skip_special_tokens,
                                                   stop=params.stop,
                                                   include_stop_str_in_output=params.include_stop_str_in_output)
                    children[cid] = (completion, detok)
            by_id = {r.request_id: r for r in results}
            while self.engine.has_unfinished_requests():
                for eo in self.engine.step():
                    completion, detok = children[eo.request_id]
                    by_id[eo.request_id.rsplit("-", 1)[0]].num_cached_tokens = eo.num_cached_tokens
                    if completion.finish_reason is not None:
                        continue                      # already ended by a stop string
                    completion.token_ids += eo.new_token_ids
                    if completion.logprobs is not None and eo.new_logprobs:
                        completion.logprobs += eo.new_logprobs
                    completion.text += detok.add(eo.new_token_ids)
                    if detok.stop_str is not None:
                        completion.finish_reason, completion.stop_reason = "stop", detok.stop_str
                        self.engine.abort([eo.request_id])
                    elif eo.finished:
                        completion.text += detok.flush()
                        completion.finish_reason, completion.stop_reason = eo.finish_reason, eo.stop_reason
        except BaseException:
            self.engine.abort(added)   # nothing is left holding blocks if a prompt was rejected midway
            while self.engine.has_unfinished_requests() and not self.engine.requests:
                self.engine.step()
            raise
        return results
