"""/v1/responses: OpenAI's Responses API, an adapter over the chat route."""
