"""/score and /rerank: relevance scores of text pairs (cross-encoders, decoder rerankers, embedding models)."""
