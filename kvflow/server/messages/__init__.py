"""/v1/messages: Anthropic's Messages API, an adapter over the chat route."""
