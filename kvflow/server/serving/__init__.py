"""The one serving seam: OpenAIServing (start_chat / start_completions, collect, chunks; preparer.submit) over an
EngineClient, split by job (request_preparer, choice_renderer, chunk_stream), and what it speaks: OpenAI's chat and
completion schema, chat templates, tool calls, reasoning, the request field tables. Every surface adapts onto it."""
