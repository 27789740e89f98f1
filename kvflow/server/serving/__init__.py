"""The one serving seam: OpenAIServing (submit, start_chat / start_completions, collect, chunks) and what it speaks:
OpenAI's chat and completion schema, chat templates, tool calls, the request field tables. Every surface adapts
onto it."""
