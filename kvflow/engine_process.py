"""The engine in its own process, as vLLM v1 and SGLang run it: `EngineCore`'s step loop in a child process
(`python -m kvflow.engine_process`), the frontend (HTTP, tokenizer, detokenizer, output processor) in the server
process. Only the typed messages of `core/messages.py` cross, pickled over one socket pair.

Why a process: in one interpreter, a step's Python (scheduling, the runner's metadata, eager layers) and the
event loop's (SSE, detokenizing, JSON) take turns on one GIL, so a step at 1-8 rows was run on one core fewer to
leave the event loop a core (docs/performance.md). In its own process the engine's Python no longer waits on the
frontend's; larger steps use every core, small ones still leave one to the frontend (async_engine.from_config:
two threads there collapsed whenever anything preempted one).

    parent: p = EngineProcess(config, eos_token_ids); p.start()   # spawns, waits for EngineReady
            p.listen(on_message); p.send(AddRequest | AbortRequests); p.call("check"); p.stop()
            p.post(lambda call_id: Sleep(call_id, level)) -> Future of its UtilityResult (WakeUp likewise)
    child:  reads messages on a thread into its inbox, steps while there is work, sends one StepResult per turn

The child dies with its parent (PR_SET_PDEATHSIG) and ignores SIGINT/SIGTERM: the frontend decides shutdown
(drain, then `Shutdown`), so a Ctrl-C to the process group does not kill the engine under streams still
running. An exception in the loop is sent as `EngineDead` before the child exits 1; a child that vanishes
without one (killed, crashed) is reported by the parent's reader from the socket's end and the exit status.
"""
from __future__ import annotations

import collections
import itertools
import logging
import os
import pickle
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import Future
from multiprocessing.connection import Connection

from kvflow.core.messages import (AbortRequests, EngineDead, EngineReady, Shutdown, Sleep, StepResult, UtilityCall,
                                  UtilityResult, WakeUp)

log = logging.getLogger("kvflow.engine_process")

# An idle engine loop wakes this often to ask the core whether it can still step (a tensor-parallel worker may
# have died while nothing ran): an idle server notices, reports unhealthy and can exit.
HEALTH_CHECK_INTERVAL_S = 1.0


class EngineStartError(RuntimeError):
    """The engine process failed before it was ready (its own error message is the text)."""


def _describe_exit(code: int | None) -> str:
    if code is None:
        return "is still running"
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with status {code}"


class EngineProcess:
    """The frontend's handle on one engine process."""

    def __init__(self, config, eos_token_ids, *, boot_timeout: float | None = None) -> None:
        self.config = config
        self.eos_token_ids = sorted(eos_token_ids)
        self.boot_timeout = boot_timeout
        self.ready: EngineReady | None = None
        self._proc: subprocess.Popen | None = None
        self._conn: Connection | None = None
        self._send_lock = threading.Lock()
        self._calls: dict[int, Future] = {}
        self._call_ids = itertools.count()
        self._reader: threading.Thread | None = None
        self._stopping = False

    # ---- lifecycle ---------------------------------------------------------------------------------------------
    def start(self) -> EngineReady:
        """Spawn the child, send it its settings, wait until its model is loaded."""
        self.spawn()
        return self.wait_ready()

    def spawn(self) -> None:
        """Start the child and send it its settings (several engines load at once: spawn each, then wait)."""
        parent_sock, child_sock = socket.socketpair()
        level = logging.getLogger("kvflow").getEffectiveLevel()
        try:
            self._proc = subprocess.Popen([sys.executable, "-m", "kvflow.engine_process", str(child_sock.fileno())],
                                          pass_fds=(child_sock.fileno(),))
        finally:
            child_sock.close()
        self._conn = Connection(parent_sock.detach())
        self._conn.send((self.config, self.eos_token_ids, level))

    def wait_ready(self) -> EngineReady:
        try:
            first = self._recv_first()
        except BaseException:
            self.kill()
            raise
        if isinstance(first, EngineDead):
            self.kill()
            raise EngineStartError(first.reason)
        self.ready = first
        return first

    def listen(self, on_message) -> None:
        """`on_message(message)` is called on a reader thread for every StepResult, and once with EngineDead
        when the engine is gone (messages sent before this call wait in the socket)."""
        self._reader = threading.Thread(target=self._read, args=(on_message,), name="kvflow-engine-reader",
                                        daemon=True)
        self._reader.start()

    def _recv_first(self):
        deadline = None if self.boot_timeout is None else time.monotonic() + self.boot_timeout
        while not self._conn.poll(0.2):
            if self._proc.poll() is not None:
                raise EngineStartError(f"the engine process {_describe_exit(self._proc.returncode)} while starting")
            if deadline is not None and time.monotonic() > deadline:
                raise EngineStartError(f"the engine process was not ready after {self.boot_timeout:.0f} s")
        try:
            return self._conn.recv()
        except EOFError:
            self._proc.wait(10)
            raise EngineStartError(f"the engine process {_describe_exit(self._proc.returncode)} while starting") \
                from None

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    @property
    def is_alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def stop(self, timeout: float = 10.0) -> None:
        """Ask the engine to stop after its current step; kill it if it does not exit in time."""
        self._stopping = True
        if self._proc is None:
            return
        if self._proc.poll() is None:
            try:
                self.send(Shutdown())
            except OSError:
                pass
            try:
                self._proc.wait(timeout)
            except subprocess.TimeoutExpired:
                log.warning("the engine process did not stop within %.0f s: killing it", timeout)
        self.kill()

    def kill(self) -> None:
        self._stopping = True
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait(10)
        if self._reader is not None and self._reader is not threading.current_thread():
            self._reader.join(5)
        if self._conn is not None:
            self._conn.close()

    # ---- messages ----------------------------------------------------------------------------------------------
    def send(self, *messages) -> None:
        """From any thread. Several messages go as one write (one wake-up of the engine)."""
        data = messages[0] if len(messages) == 1 else list(messages)
        with self._send_lock:
            self._conn.send(data)

    def post(self, make) -> Future:
        """Send `make(call_id)` (a Sleep or WakeUp) and return the Future of its UtilityResult, from any thread."""
        call_id = next(self._call_ids)
        future = self._calls[call_id] = Future()
        self.send(make(call_id))
        return future

    def call(self, method: str, *args, timeout: float = 30.0):
        """Run `EngineCore.<method>(*args)` in the engine between steps; its return value. Not from the event
        loop (it blocks)."""
        call_id = next(self._call_ids)
        future = self._calls[call_id] = Future()
        self.send(UtilityCall(call_id, method, args))
        result: UtilityResult = future.result(timeout)
        if result.error is not None:
            raise RuntimeError(f"engine call {method} failed: {result.error}")
        return result.value

    def _read(self, on_message) -> None:
        reason = None
        try:
            while True:
                message = self._conn.recv()
                if isinstance(message, UtilityResult):
                    future = self._calls.pop(message.call_id, None)
                    if future is not None:
                        future.set_result(message)
                    continue
                if isinstance(message, EngineDead):
                    reason = message.reason
                    break
                on_message(message)
        except (EOFError, OSError):
            pass
        except Exception as e:  # noqa: BLE001 - an unreadable message is the engine's death, said as such
            reason = f"reading the engine's message failed: {type(e).__name__}: {e}"
        if self._stopping and reason is None:
            return
        if reason is None:
            try:
                self._proc.wait(5)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait(5)
            reason = f"the engine process (pid {self._proc.pid}) {_describe_exit(self._proc.returncode)}"
        for future in self._calls.values():
            future.set_result(UtilityResult(-1, error=reason))
        on_message(EngineDead(reason))


# ---- the child ---------------------------------------------------------------------------------------------------
class _EngineLoop:
    """The child's main thread steps; a reader thread fills the inbox from the socket."""

    def __init__(self, conn: Connection, core) -> None:
        self.conn = conn
        self.core = core
        self.cond = threading.Condition()
        self.inbox: collections.deque = collections.deque()
        self.stop = False

    def read(self) -> None:
        try:
            while True:
                data = self.conn.recv()      # unpickling rebuilds grammars here, off the step loop
                with self.cond:
                    if isinstance(data, list):
                        self.inbox.extend(data)
                    else:
                        self.inbox.append(data)
                    self.cond.notify()
        except (EOFError, OSError):          # the frontend is gone
            with self.cond:
                self.stop = True
                self.cond.notify()

    def run(self) -> None:
        core = self.core
        has_work = False
        while True:
            with self.cond:
                if not self.inbox and not has_work and not self.stop:
                    self.cond.wait(HEALTH_CHECK_INTERVAL_S)
                messages = list(self.inbox)
                self.inbox.clear()
                stop = self.stop
            if stop or any(isinstance(m, Shutdown) for m in messages):
                return
            if not messages and not has_work:
                core.check_health()             # raises when the engine cannot step any more
                if core.load_compiled_steps():  # a compiled decode graph is ready: /metrics says so
                    t0 = time.time()
                    self.conn.send(StepResult([], core.stats(), t0, t0, 0, []))
                continue
            num_added, rejected, changed, deferred = self._apply(messages)
            if deferred:        # behind a Sleep that waits for the running requests: back to the front, in order
                with self.cond:
                    self.inbox.extendleft(reversed(deferred))
            outputs = []
            t0 = t1 = time.time()
            if core.has_unfinished_requests():
                outputs = core.step()
                t1 = time.time()
                stats = core.last_stats
            elif not changed:
                has_work = False
                continue
            else:
                stats = core.stats()
            has_work = core.has_unfinished_requests()
            self.conn.send(StepResult(outputs, stats, t0, t1, num_added, rejected))

    def _apply(self, messages: list) -> tuple[int, list[tuple[str, str]], bool, list]:
        """Hand the inbox to the core, in order. A request the core refuses fails alone. `changed`: anything but
        utility calls (those alone need no StepResult). `deferred`: a Sleep while requests are unfinished, and what
        came after it but aborts and utility calls (those apply now: an aborted stream must not hold up the
        drain)."""
        num_added, rejected, changed, deferred = 0, [], False, []
        for m in messages:
            if isinstance(m, UtilityCall):
                self._call(m)
                continue
            if isinstance(m, AbortRequests):
                changed = True
                self.core.abort(m.request_ids)
                continue
            if deferred or (isinstance(m, Sleep) and self.core.has_unfinished_requests()):
                deferred.append(m)
                continue
            changed = True
            if isinstance(m, Sleep):
                self._answer(m.call_id, self.core.sleep, m.level)
                continue
            if isinstance(m, WakeUp):
                self._answer(m.call_id, self.core.wake_up, m.tags)
                continue
            num_added += 1
            try:
                self.core.add_request(m)
            except Exception as e:  # noqa: BLE001 - validated on submit; a refusal here fails this request only
                rejected.append((m.request_id, f"{type(e).__name__}: {e}"))
        return num_added, rejected, changed, deferred

    def _answer(self, call_id: int, fn, *args) -> None:
        try:
            self.conn.send(UtilityResult(call_id, fn(*args)))
        except Exception as e:  # noqa: BLE001 - the caller gets the error; the engine goes on
            self.conn.send(UtilityResult(call_id, error=f"{type(e).__name__}: {e}"))

    def _call(self, m: UtilityCall) -> None:
        if m.method not in self.core.UTILITY_METHODS:
            self.conn.send(UtilityResult(m.call_id, error=f"{m.method!r} is not an engine utility"))
            return
        self._answer(m.call_id, getattr(self.core, m.method), *m.args)


def main(fd: int) -> int:
    from kvflow import platform

    platform.die_with_parent()
    platform.frontend_shares_cores = True
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    conn = Connection(fd)
    try:
        config, eos_token_ids, level = conn.recv()
    except EOFError:
        return 1
    logging.basicConfig(level=level, stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("kvflow").setLevel(level)
    core = None
    try:
        from kvflow.core.engine_core import EngineCore
        from kvflow.models.model_files import resolve_model_files
        from kvflow.structured_output.compiler import grammar_tokenizer, set_rebuild_tokenizer
        from kvflow.tokenizer import Tokenizer

        files = resolve_model_files(config.model, config.tokenizer, config.hf_overrides)
        set_rebuild_tokenizer(lambda: grammar_tokenizer(Tokenizer.from_files(files)))
        core = EngineCore(config, eos_token_ids, files)
        r = core.runner
        conn.send(EngineReady(os.getpid(), int(core.max_model_len), core.validator.vocab_size, r.weights_bytes,
                              r.kv_cache_bytes, core.stats(), r.num_blocks,
                              r.state_slots.live if r.state_slots is not None else None,
                              core.validator.tasks, core.validator.architecture))
        del r           # the runner is the core's alone: a sleep at level 2 lets go of it
        loop = _EngineLoop(conn, core)
        threading.Thread(target=loop.read, name="kvflow-engine-inbox", daemon=True).start()
        loop.run()
        return 0
    except BaseException as e:  # noqa: BLE001 - the frontend hears why before the process goes
        log.exception("the engine loop died")
        try:
            conn.send(EngineDead(f"the engine loop died: {type(e).__name__}: {e}"))
        except (OSError, pickle.PicklingError):
            pass
        return 1
    finally:
        if core is not None:
            core.shutdown()


if __name__ == "__main__":
    status = main(int(sys.argv[1]))
    # out at once, as multiprocessing's children leave: the interpreter's teardown (~0.3 s of freeing torch's
    # state) has nothing to hand back that the exit does not, and a stopping server waits for it
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
