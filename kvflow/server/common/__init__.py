"""What every surface shares: errors in OpenAI's shape, the schema's pydantic pieces, ServerConfig, the edge's
middleware, the request record, command-line flags and logging, the uvicorn wrapper. Imports nothing else of the
server."""
