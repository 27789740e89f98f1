"""Run the real server (uvicorn + AsyncEngine) on a free port in a background thread: for tests and benchmarks.

    with ServerThread(EngineConfig(model=path, dtype="float32")) as server:
        client = openai.OpenAI(base_url=server.base_url, api_key="x")

Importing this module imports neither torch nor the engine (`free_port` serves `kvflow bench` too).
"""
from __future__ import annotations

import asyncio
import socket
import threading
import time

HOST = "127.0.0.1"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


class ServerThread:
    def __init__(self, config, *, api_key: str | None = None, max_queue_len: int | None = None,
                 request_log: str | None = None, served_model_names: list[str] | None = None,
                 shutdown_grace_period: float = 5.0, log_stats_interval: float = 5.0, port: int | None = None,
                 **server_config):
        from kvflow.server.common.config import ServerConfig
        from kvflow.server.app import build_app, build_engine
        from kvflow.server.common.uvicorn_server import EngineServer

        self.port = port or free_port()
        self.config = ServerConfig(host=HOST, port=self.port, api_key=api_key, max_queue_len=max_queue_len,
                                   request_log=request_log, served_model_name=served_model_names,
                                   shutdown_grace_period=shutdown_grace_period,
                                   log_stats_interval=log_stats_interval, log_level="warning", **server_config)
        self.engine = build_engine(config, self.config)
        try:
            self.app = build_app(self.engine, self.config)
        except BaseException:      # e.g. a --lora-modules adapter refused: no engine process left behind
            self.engine.stop()
            raise
        self.server = EngineServer(self.app, self.config)
        self._thread: threading.Thread | None = None

    @property
    def base_url(self) -> str:
        return f"http://{HOST}:{self.port}/v1"

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    def start(self, timeout: float = 60.0) -> "ServerThread":
        def run():   # uvicorn installs no signal handlers outside the main thread
            asyncio.run(self.server.serve())

        self._thread = threading.Thread(target=run, name=f"kvflow-server-{self.port}", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self._thread.is_alive():
                raise RuntimeError("the server thread exited during startup")
            if time.monotonic() > deadline:
                raise TimeoutError("the server did not start")
            time.sleep(0.02)
        return self

    def stop(self, timeout: float = 30.0) -> None:
        self.server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout)
        self.engine.stop()       # a no-op after the server's own shutdown stopped it

    def core(self, method: str, *args):
        """`EngineCore.<method>(*args)` in the engine process (its UTILITY_METHODS: check, counters, ...)."""
        return self.engine.call_core(method, *args)

    def _any_unfinished(self) -> bool:
        return any(self.engine.call_core("has_unfinished_requests", rank=rank)
                   for rank in range(len(self.engine.processes)))

    def wait_idle(self, timeout: float = 30.0) -> None:
        """Wait until no request is in flight on either side of the engine."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.engine._streams and not self.engine._pending_adds and self.engine.is_alive \
                    and not self._any_unfinished():
                time.sleep(0.05)   # let the engines send their last stats snapshot and go to sleep
                if not self.engine._streams and not self._any_unfinished():
                    self.wait_records(max(0.0, deadline - time.monotonic()))
                    return
            time.sleep(0.02)
        raise TimeoutError("the engine did not become idle")

    def wait_records(self, timeout: float = 10.0) -> None:
        """Wait until every HTTP request's request-log line / span is handed over, and the log is on disk."""
        deadline = time.monotonic() + timeout
        while self.app.state.open_records.count and time.monotonic() < deadline:
            time.sleep(0.005)
        if self.engine.request_log is not None:
            self.engine.request_log.flush(max(0.0, deadline - time.monotonic()))

    def __enter__(self) -> "ServerThread":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
