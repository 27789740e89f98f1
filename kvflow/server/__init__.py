"""The HTTP server, by surface: `common/` (errors, schema pieces, config, middleware, flags, the request record, the
uvicorn wrapper) < `serving/` (OpenAIServing, the one serving seam, and the OpenAI schema it speaks) < one package per
API (`openai/`, `embeddings/`, `responses/`, `messages/`, `batch/`, and `observe/`, the operator's view), none of
which imports another < `app.py` (mounts them), `cli.py` (`kvflow serve`), `run_batch.py` (`kvflow run-batch`).
tests/test_architecture.py enforces the order."""
