"""The request fields of OpenAI's and vLLM's chat, completions and (de)tokenize schemas that kvflow does not
implement, as data: each is refused with a 400 naming it when a request sets it to anything but its default, never
accepted and dropped (the field rule). The fields kvflow implements are its pydantic models' own
(`server/protocol.py`); `tests/test_request_fields.py` checks that every field of vLLM's lists below is one or the
other. A field that neither schema defines is ignored, as vLLM does, and logged once per name. Beside
`use_beam_search`, each implemented field is one beam search reads (`BEAM_SEARCH_READS`) or a 400 naming it
(`BEAM_SEARCH_REFUSED`).

Sources: OpenAI's API reference (chat completions, completions) and vLLM's `entrypoints/openai/protocol.py`
(`ChatCompletionRequest`, `CompletionRequest`) and `entrypoints/serve/tokenize/protocol.py`
(`TokenizeCompletionRequest`, `TokenizeChatRequest`, `DetokenizeRequest`), written down by hand.
"""
from __future__ import annotations

# every field vLLM's request models define, per route (OpenAI's and vLLM's extras)
VLLM_FIELDS = {
    "chat": (
        "messages", "model", "frequency_penalty", "logit_bias", "logprobs", "top_logprobs", "max_tokens",
        "max_completion_tokens", "n", "presence_penalty", "response_format", "seed", "stop", "stream",
        "stream_options", "temperature", "top_p", "tools", "tool_choice", "reasoning_effort", "include_reasoning",
        "thinking_token_budget", "parallel_tool_calls", "user",
        "best_of", "use_beam_search", "top_k", "min_p", "repetition_penalty", "length_penalty", "stop_token_ids",
        "include_stop_str_in_output", "ignore_eos", "min_tokens", "skip_special_tokens",
        "spaces_between_special_tokens", "truncate_prompt_tokens", "truncation_side", "prompt_logprobs",
        "allowed_token_ids", "bad_words",
        "echo", "add_generation_prompt", "continue_final_message", "add_special_tokens", "documents",
        "chat_template", "chat_template_kwargs", "mm_processor_kwargs", "structured_outputs", "guided_json",
        "guided_regex", "guided_choice", "guided_grammar", "structural_tag", "guided_decoding_backend",
        "guided_whitespace_pattern", "priority", "request_id", "logits_processors", "return_tokens_as_token_ids",
        "return_token_ids", "cache_salt", "kv_transfer_params", "vllm_xargs"),
    "completions": (
        "model", "prompt", "best_of", "echo", "frequency_penalty", "logit_bias", "logprobs", "max_tokens", "n",
        "presence_penalty", "seed", "stop", "stream", "stream_options", "suffix", "temperature", "top_p", "user",
        "use_beam_search", "top_k", "min_p", "repetition_penalty", "length_penalty", "stop_token_ids",
        "include_stop_str_in_output", "ignore_eos", "min_tokens", "skip_special_tokens",
        "spaces_between_special_tokens", "truncate_prompt_tokens", "truncation_side", "allowed_token_ids",
        "prompt_logprobs",
        "add_special_tokens", "response_format", "structured_outputs", "guided_json", "guided_regex",
        "guided_choice", "guided_grammar", "structural_tag", "guided_decoding_backend", "guided_whitespace_pattern",
        "priority", "request_id", "logits_processors", "return_tokens_as_token_ids", "return_token_ids",
        "cache_salt", "kv_transfer_params", "vllm_xargs", "prompt_embeds", "bad_words"),
    # vLLM's TokenizeCompletionRequest and TokenizeChatRequest (one kvflow model), DetokenizeRequest
    "tokenize": (
        "model", "prompt", "add_special_tokens", "return_token_strs", "messages", "add_generation_prompt",
        "continue_final_message", "chat_template", "chat_template_kwargs", "media_io_kwargs", "mm_processor_kwargs",
        "tools"),
    "detokenize": ("model", "tokens"),
}

# Fields vLLM's request models once defined and dropped, refused the same way when set (a client written for them hears
# that kvflow does not do what they asked): early_stopping, the beam search stopping rule of vLLM's engine-side beam
# search (until 0.6); vLLM's frontend beam search, which kvflow's mirrors, has none (it runs every beam to max_tokens
# or EOS) and ignores the field
VLLM_FORMER_FIELDS = {"chat": ("early_stopping",), "completions": ("early_stopping",)}

# OpenAI fields vLLM does not define either (it ignores them with a warning); refused the same way when set
OPENAI_ONLY = ("store", "metadata", "modalities", "audio", "prediction", "service_tier", "web_search_options",
               "functions", "function_call", "verbosity", "safety_identifier", "prompt_cache_key")

_MISSING = object()

# name -> the value that means "not asked for" (vLLM's default); anything else is refused
# Why each is refused: best_of (chat): no best-of search (vLLM v1 has none either); early_stopping: see
# VLLM_FORMER_FIELDS; spaces_between_special_tokens=false: kvflow writes special tokens as the fast tokenizer decodes
# them, as vLLM's fast detokenizer does, and has no slow path that inserts or removes spaces; structural_tag,
# guided_decoding_backend, guided_whitespace_pattern: one grammar backend (llguidance), JSON without free
# whitespace; logits_processors: no user code in the engine; cache_salt,
# kv_transfer_params, vllm_xargs, prompt_embeds, mm_processor_kwargs: not built.
_COMMON = {
    "early_stopping": None, "spaces_between_special_tokens": True,
    "structural_tag": None, "guided_decoding_backend": None, "guided_whitespace_pattern": None,
    "logits_processors": None, "cache_salt": None, "kv_transfer_params": None, "vllm_xargs": None,
    **{name: None for name in OPENAI_ONLY},
}
REFUSED = {
    "chat": {**_COMMON, "best_of": None, "mm_processor_kwargs": None},
    "completions": {**_COMMON, "prompt_embeds": None},
    "tokenize": {"media_io_kwargs": None, "mm_processor_kwargs": None},     # text only: no media, no processor
    "detokenize": {},
}

# ---- beam search (use_beam_search) -------------------------------------------------------------------------------
# vLLM's beam search reads n (the beam width), max_tokens / max_completion_tokens, ignore_eos, temperature,
# length_penalty, include_stop_str_in_output and skip_special_tokens (BeamSearchParams, `to_beam_search_params` in
# vLLM's protocol), and the prompt's fields; completions refuse stream ("Streaming is not currently supported with
# beam search"), chat streams the finished beams (each choice's text in one chunk). The sampling fields below it drops: set beside use_beam_search to anything but these values (unset, or
# what asks for nothing), each is a 400 naming it. Why, where vLLM reads one after all: logprobs / top_logprobs (vLLM
# shows each beam step's 2 * n candidates, cut at the API's count, and fails with echo), structured outputs (vLLM's
# newer beam search constrains with them; kvflow's does not yet). A forced tool_choice is refused by the server (it is a
# grammar too), a length_penalty without use_beam_search by the request model (nothing reads it there).
_BEAM_SEARCH_COMMON = {
    "top_p": (1.0,), "top_k": (0, -1), "min_p": (0.0,), "seed": (), "stop": ([], ""),
    "stop_token_ids": ([],), "presence_penalty": (0.0,), "frequency_penalty": (0.0,), "repetition_penalty": (1.0,),
    "logit_bias": ({},), "min_tokens": (0,), "bad_words": ([],), "allowed_token_ids": (), "prompt_logprobs": (),
    "response_format": ({"type": "text"},), "structured_outputs": (), "guided_json": (), "guided_regex": (),
    "guided_choice": (), "guided_grammar": (), "guided_json_object": (False,),
    "return_tokens_as_token_ids": (False,),  # shapes logprobs, which beam search does not return
    "return_progress": (False,),             # llama-server's prompt progress: a beam search's prompts send none
}
BEAM_SEARCH_REFUSED = {
    "chat": {**_BEAM_SEARCH_COMMON, "logprobs": (False,), "top_logprobs": (0,), "thinking_token_budget": ()},
    "completions": {**_BEAM_SEARCH_COMMON, "logprobs": (), "stream": (False,),
                    "stream_options": ()},        # stream_options needs stream
}


# ... and the fields it reads: the beam search's own (above), the prompt's (text, template, truncation, special tokens),
# how the answer is shown (echo, return_token_ids; chat tools without a forced tool_choice, parsed out of each beam's
# text; chat's stream and stream_options), who asks (model, user, request_id, priority); best_of only equal to n and
# suffix never, as without beam search.
# Every field of the routes' models is in one of the two tables (tests/test_request_fields.py).
BEAM_SEARCH_READS = {
    "chat": ("use_beam_search", "n", "max_tokens", "max_completion_tokens", "ignore_eos", "temperature",
             "length_penalty", "include_stop_str_in_output", "skip_special_tokens", "messages", "add_generation_prompt",
             "continue_final_message", "add_special_tokens", "chat_template", "chat_template_kwargs", "documents",
             "reasoning_effort", "include_reasoning", "truncate_prompt_tokens", "truncation_side", "echo",
             "return_token_ids", "tools",
             "tool_choice", "parallel_tool_calls", "stream", "stream_options", "model", "user", "request_id",
             "priority"),
    "completions": ("use_beam_search", "n", "max_tokens", "ignore_eos", "temperature", "length_penalty",
                    "include_stop_str_in_output", "skip_special_tokens", "prompt", "add_special_tokens",
                    "truncate_prompt_tokens", "truncation_side", "echo", "return_token_ids", "model", "user",
                    "request_id", "priority", "best_of", "suffix"),
}


def beam_search_refused(route: str, values: dict) -> str | None:
    """The first field of a beam search request (`values`: the request's fields, parsed) its beam search refuses."""
    for name, neutral in BEAM_SEARCH_REFUSED[route].items():
        value = values.get(name)
        if value is not None and value not in neutral:
            return name
    return None


# ---- /v1/embeddings (server/embeddings/routes.py) ----------------------------------------------------------------
# vLLM's EmbeddingCompletionRequest over its versions (the pooling mixins of `entrypoints/pooling/base/protocol.py`:
# `normalize` until it became `use_activation`; `additional_data` before; `padding`, `truncation_side`, `cache_salt`,
# `mm_processor_kwargs` since), and `messages`, the field of its chat form (EmbeddingChatRequest), written down by hand.
VLLM_FIELDS["embeddings"] = (
    "model", "input", "encoding_format", "dimensions", "user", "truncate_prompt_tokens", "request_id", "priority",
    "add_special_tokens", "normalize", "use_activation", "embed_dtype", "endianness", "additional_data",
    "mm_processor_kwargs", "cache_salt", "padding", "truncation_side", "messages")
# Why each is refused: dimensions: no matryoshka representation (cutting a vector that was not trained for it gives
# worse vectors, vLLM refuses it too); embed_dtype other than float32: base64 carries float32, as OpenAI; padding:
# kvflow never pads (each input is its own engine request); messages: the chat form is not built; additional_data,
# cache_salt, mm_processor_kwargs: as on chat.
REFUSED["embeddings"] = {
    "dimensions": None, "embed_dtype": "float32", "padding": None, "messages": None,
    "additional_data": None, "cache_salt": None, "mm_processor_kwargs": None,
}


# ---- /score and /rerank (server/score/routes.py) -------------------------------------------------------------------
# vLLM's ScoreRequest and RerankRequest (`entrypoints/pooling/score/protocol.py`; `softmax` and `activation` are
# `use_activation`'s former names), and Jina's / Cohere's `return_documents`, written down by hand. Why refused:
# mm_processor_kwargs: text only, no multimodal processor.
VLLM_FIELDS["score"] = ("model", "text_1", "text_2", "truncate_prompt_tokens", "mm_processor_kwargs", "priority",
                        "softmax", "activation", "use_activation")
VLLM_FIELDS["rerank"] = ("model", "query", "documents", "top_n", "truncate_prompt_tokens", "mm_processor_kwargs",
                         "priority", "softmax", "activation", "use_activation", "return_documents")
REFUSED["score"] = {"mm_processor_kwargs": None}
REFUSED["rerank"] = {"mm_processor_kwargs": None}


def refused_field(route: str, data: dict) -> str | None:
    """The first field of `data` this route refuses (set to something but its default), or None."""
    refused = REFUSED[route]
    for name, value in data.items():
        default = refused.get(name, _MISSING)
        if default is _MISSING or value is None or value == default:
            continue
        if value in ([], {}, "") and default is None:
            continue
        return name
    return None


# ---- OpenAI's Responses API (/v1/responses, server/responses_protocol.py) ---------------------------------------
# Sources: openai-python's ResponseCreateParams (OpenAI's schema) and vLLM's
# `entrypoints/openai/responses/protocol.py` ResponsesRequest, written down by hand.
RESPONSES_OPENAI_FIELDS = (
    "access_programs", "background", "background_options", "context_management", "conversation", "image", "include",
    "input", "instructions", "max_output_tokens", "max_tool_calls", "metadata", "model", "moderation",
    "parallel_tool_calls", "previous_response_id", "prompt", "prompt_cache_key", "prompt_cache_options",
    "prompt_cache_retention", "reasoning", "safety_identifier", "service_tier", "store", "stream", "stream_options",
    "temperature", "text", "tool_choice", "tools", "top_logprobs", "top_p", "truncation", "user")
VLLM_FIELDS["responses"] = (
    "background", "include", "input", "instructions", "max_output_tokens", "max_tool_calls", "metadata", "model",
    "logit_bias", "parallel_tool_calls", "previous_response_id", "prompt", "reasoning", "service_tier", "store",
    "stream", "temperature", "text", "tool_choice", "tools", "top_logprobs", "top_p", "top_k", "truncation", "user",
    "skip_special_tokens", "include_stop_str_in_output", "prompt_cache_key", "request_id", "mm_processor_kwargs",
    "priority", "cache_salt", "enable_response_messages", "previous_input_messages", "previous_response",
    "structured_outputs", "repetition_penalty", "seed", "stop", "ignore_eos", "vllm_xargs")

# Fields that would need responses kept on the server: kvflow keeps none (store=false), so the whole conversation
# comes back as `input` instead.
RESPONSES_STATEFUL = ("previous_response_id", "store", "conversation", "background", "background_options",
                      "previous_response", "previous_input_messages", "enable_response_messages")
# Why the others are refused: max_tool_calls counts built-in tools (kvflow has none); truncation "auto" would
# drop input items; service_tier, moderation, access_programs, image, context_management, safety_identifier,
# prompt (stored prompt templates), the prompt-cache options (kvflow's prefix cache needs no key) and
# stream_options (no obfuscation): not built; cache_salt, mm_processor_kwargs, vllm_xargs: as on chat; priority:
# not passed through the Responses adapter.
REFUSED["responses"] = {
    "previous_response_id": None, "store": False, "conversation": None, "background": False,
    "background_options": None, "previous_response": None, "previous_input_messages": None,
    "enable_response_messages": False,
    "max_tool_calls": None, "truncation": "disabled", "service_tier": "auto",
    "moderation": None, "access_programs": None, "image": None, "context_management": None,
    "safety_identifier": None, "prompt": None, "prompt_cache_key": None, "prompt_cache_options": None,
    "prompt_cache_retention": None, "stream_options": None,
    "priority": 0, "cache_salt": None, "mm_processor_kwargs": None, "vllm_xargs": None,
}


# ---- Anthropic's Messages API (/v1/messages, server/messages_api.py) --------------------------------------------
# Every field of Anthropic's request and of the parts of it kvflow reads, per kind of part. Source: the `anthropic`
# client's types (MessageCreateParams, TextBlockParam, ToolUseBlockParam, ToolResultBlockParam, ToolParam,
# ToolChoice*Param, MetadataParam, OutputConfigParam, CacheControlEphemeralParam) and Anthropic's API reference
# (temperature, top_p, top_k, context_management, mcp_servers, output_format), written down by hand. A field is a
# field of messages_api.py's model for its kind (implemented) or in MESSAGES_REFUSED (refused), never both.
MESSAGES_FIELDS = {
    "request": ("model", "messages", "max_tokens", "system", "stop_sequences", "stream", "temperature", "top_p",
                "top_k", "tools", "tool_choice", "metadata", "output_config", "service_tier", "cache_control",
                "thinking", "container", "context_management", "mcp_servers", "output_format", "inference_geo",
                "speed", "diagnostics", "user_profile_id", "workspace_id", "chat_template_kwargs"),
    "message": ("role", "content"),
    "text": ("type", "text", "cache_control", "citations"),
    "tool_use": ("type", "id", "name", "input", "cache_control", "caller", "toolset_name"),
    "tool_result": ("type", "tool_use_id", "content", "is_error", "cache_control", "toolset_name"),
    "thinking": ("type", "thinking", "signature"),            # an earlier reply's thinking block, passed back
    "tool": ("type", "name", "description", "input_schema", "cache_control", "strict", "defer_loading",
             "allowed_callers", "input_examples", "eager_input_streaming"),
    "tool_choice": ("type", "name", "disable_parallel_tool_use"),
    "metadata": ("user_id",),
    "output_config": ("format", "effort"),
    "format": ("type", "schema"),            # output_config.format
    "cache_control": ("type", "ttl"),
}

# kind -> name -> the values that ask for nothing kvflow lacks (unset, or what kvflow does anyway); any other value
# is a 400 naming the field's path (`thinking` is the request model's own: messages/routes.thinking_budget refuses
# "adaptive", which would switch a model's thinking on). Why each is refused: output_config.effort: no effort levels;
# container, mcp_servers, context_management, tool_use.caller, toolset_name, tool.allowed_callers, defer_loading:
# Anthropic's server-side tools, code execution and context editing, not built; output_format: the beta spelling,
# kvflow reads output_config.format; inference_geo, speed "fast", workspace_id, user_profile_id: one server, one
# speed, no accounts; diagnostics: no cache-miss reports; citations: no document sources to cite; input_examples:
# kvflow's tool prompt shows the schema only; cache_control.ttl "1h": kvflow's prefix cache evicts by LRU and can
# promise no lifetime (a breakpoint itself asks for what the prefix cache does for every full block).
MESSAGES_REFUSED = {
    "request": {"container": (), "context_management": (), "mcp_servers": ([],),
                "output_format": (), "inference_geo": (), "speed": ("standard",), "diagnostics": (),
                "user_profile_id": (), "workspace_id": ()},
    "message": {},
    "text": {"citations": ([],)},
    "tool_use": {"caller": ({"type": "direct"},), "toolset_name": ()},
    "tool_result": {"toolset_name": ()},
    "thinking": {},
    "tool": {"defer_loading": (False,), "allowed_callers": (["direct"],), "input_examples": ([],),
             "eager_input_streaming": (True,)},     # kvflow streams tool input as it is generated
    "tool_choice": {},
    "metadata": {},
    "output_config": {"effort": ()},
    "format": {},
    "cache_control": {"ttl": ("5m",)},
}


def messages_refused(kind: str, data: dict) -> str | None:
    """The first field of `data` (a part of kind `kind` of a Messages request) set to a value kvflow refuses."""
    refused = MESSAGES_REFUSED[kind]
    for name, value in data.items():
        if name in refused and value is not None and value not in refused[name]:
            return name
    return None
