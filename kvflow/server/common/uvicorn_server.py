"""uvicorn's server with one change to shutdown: the engine drains before connections close.

uvicorn alone stops listening, waits for connections up to its graceful timeout and then cancels them: a
stream still running ends with no error and no `[DONE]`, and the engine's "shutting down" error comes only
after the connections are gone. Here shutdown (SIGTERM, SIGINT, `should_exit`) first stops listening, then
runs the engine's shutdown (stop accepting, let in-flight requests finish within the grace period, fail the
rest: their SSE streams end with an error event and `[DONE]`, collected ones answer 503), and only then lets
uvicorn close the connections, which by then have finished writing.
"""
from __future__ import annotations

import socket

import uvicorn
from fastapi import FastAPI

from kvflow.server.common.config import ServerConfig

# after the engine's shutdown every response has its last bytes queued: this only bounds the flush
FLUSH_TIMEOUT_S = 5


class EngineServer(uvicorn.Server):
    def __init__(self, app: FastAPI, config: ServerConfig, **uvicorn_kw) -> None:
        super().__init__(uvicorn.Config(app, host=config.host, port=config.port, log_level=config.log_level,
                                        access_log=config.log_level == "debug", timeout_keep_alive=5,
                                        timeout_graceful_shutdown=FLUSH_TIMEOUT_S, **uvicorn_kw))
        self.serving = app.state.serving

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        for server in self.servers:      # stop accepting new connections first (uvicorn repeats it, harmlessly)
            server.close()
        for sock in sockets or []:
            sock.close()
        await self.serving.shutdown_engine()
        await super().shutdown(sockets)
