"""/v1/embeddings: OpenAI's Embeddings API with vLLM's extras."""
