"""The one check of a request against the engine: its field values (SamplingParams), the token ids it names
against the vocabulary, its length against the context. Frontends call it
before queueing anything, so the caller gets the error at once; it raises InvalidRequestError with `param`
and `code` set, which the server turns into a 400 without reading the message."""
from __future__ import annotations

from dataclasses import dataclass

from kvflow.errors import InvalidRequestError
from kvflow.pooling_params import PoolingParams
from kvflow.sampling_params import SamplingParams


# why a model refuses a kind of request, by the task it lacks
TASK_REFUSALS = {
    "generate": "it does not generate text (serve a decoder for completions and chat)",
    "embed": "it does not make embeddings (serve an embedding model, e.g. BertModel, or a decoder)",
    "score": "it does not score text pairs (serve a cross-encoder such as BertForSequenceClassification, a decoder "
             "reranker with --hf-overrides classifier_from_token, or an embedding model, which scores by cosine "
             "similarity)",
}


@dataclass(frozen=True)
class RequestValidator:
    vocab_size: int
    max_model_len: int
    # what the model serves (ModelConfig.tasks) and its architecture, named when a request asks for something else
    tasks: tuple[str, ...] = ("generate", "embed")
    architecture: str = ""

    def check_task(self, task: str) -> None:
        """InvalidRequestError (param "model") when the model does not serve `task`, saying why."""
        if task not in self.tasks:
            raise InvalidRequestError(f"the model ({self.architecture or 'this model'}) serves "
                                      f"{', '.join(self.tasks)}: {TASK_REFUSALS[task]}", param="model",
                                      code="model_not_supported")

    def admit(self, prompt_token_ids: list[int], params: SamplingParams,
              pooling: PoolingParams | None = None) -> tuple[list[int], int]:
        """The prompt as the engine runs it (`truncate_prompt_tokens` applied) and max_tokens resolved (0 for an
        embedding request, `pooling`); raises InvalidRequestError for anything the engine cannot run. The one check:
        the engine trusts what it admits."""
        k = params.truncate_prompt_tokens
        if k is not None and k > self.max_model_len:
            raise InvalidRequestError(f"truncate_prompt_tokens ({k}) is greater than this model's maximum context "
                                      f"length ({self.max_model_len})", param="truncate_prompt_tokens",
                                      code="invalid_value")
        prompt_token_ids = params.truncated(list(prompt_token_ids), self.max_model_len)
        return prompt_token_ids, self.validate(prompt_token_ids, params, pooling)

    def validate(self, prompt_token_ids: list[int], params: SamplingParams,
                 pooling: PoolingParams | None = None) -> int:
        """Raise InvalidRequestError for anything the engine cannot run; return max_tokens, resolved."""
        params.validate()
        self.check_task("generate" if pooling is None else pooling.task)
        if pooling is not None and (params.n != 1 or params.prompt_logprobs is not None):
            name = "n" if params.n != 1 else "prompt_logprobs"
            raise InvalidRequestError(f"an embedding request samples nothing: {name} does not apply to it",
                                      param=name, code="invalid_value")
        params.check_vocabulary(self.vocab_size)
        if params.bad_words and params.bad_words_token_ids is None:
            raise InvalidRequestError("bad_words must be tokenized before the engine sees the request (LLM and "
                                      "the server do it)", param="bad_words")
        if params.structured_outputs and params.structured is None:
            raise InvalidRequestError("structured_outputs must be compiled before the engine sees the request "
                                      "(LLM and the server do it)", param="structured_outputs")
        if params.thinking_token_budget is not None and params.thinking is None:
            raise InvalidRequestError("thinking_token_budget needs to know where the reasoning ends: a server "
                                      "started with --reasoning-parser NAME sets it", param="thinking_token_budget")
        n = len(prompt_token_ids)
        if n == 0:
            raise InvalidRequestError("the prompt is empty: give at least one token", param="prompt",
                                      code="invalid_value")
        # the length first: a prompt of millions of tokens is refused without a Python pass over them (this
        # runs on the server's event loop)
        limit = self.max_model_len
        if pooling is not None and n > limit:       # nothing is generated: the prompt may fill the context
            raise InvalidRequestError(
                f"the prompt has {n} tokens, more than this model's maximum context length ({limit} tokens); "
                f"shorten the prompt or set truncate_prompt_tokens", param="prompt", code="context_length_exceeded")
        if pooling is None and n >= limit:
            raise InvalidRequestError(
                f"the prompt has {n} tokens, which leaves no room to generate within this model's maximum "
                f"context length ({limit} tokens); shorten the prompt", param="prompt",
                code="context_length_exceeded")
        vocab = self.vocab_size
        if any(isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab for t in prompt_token_ids):
            raise InvalidRequestError(f"prompt token ids must be integers in [0, {vocab})", param="prompt",
                                      code="invalid_value")
        if pooling is not None:
            return 0
        if params.max_tokens is None:
            return limit - n
        if n + params.max_tokens > limit:
            raise InvalidRequestError(
                f"the prompt ({n} tokens) plus max_tokens ({params.max_tokens}) is {n + params.max_tokens} "
                f"tokens, more than this model's maximum context length ({limit} tokens); shorten the prompt "
                f"or lower max_tokens", param="prompt", code="context_length_exceeded")
        return params.max_tokens
