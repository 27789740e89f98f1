"""The grammar check process: a spec becomes llguidance grammar text and is validated in a child process.

llguidance recurses once per rule of a chain while it compiles a grammar, so a Lark grammar of ~3000 chained
rules or a JSON schema with ~1000 chained `$ref`s overflows the thread's stack and kills the process (SIGSEGV,
no exception: measured with llguidance 1.9.1), and its GBNF-to-Lark conversion is pure Python and quadratic in
the rule count (2000 rules: 3.3 s holding the GIL, 10k: minutes). In a child, such a grammar costs a killed and
restarted child and a 400; the server only ever builds grammars the child validated on an 8x smaller stack
(limits.py), within CHECK_TIMEOUT_S.

One child per concurrent check (GrammarChecker keeps the idle ones). The child imports llguidance and nothing of
torch; it needs no tokenizer (validation without one runs the same recursive compile). Messages: a 4-byte
length, then JSON. The child answers {"ready": true} once started, then one reply per request; it exits when its
stdin closes, so it dies with the server even in the middle of a check.

    python -m kvflow.structured_output.grammar_check     # the child; GrammarChecker starts it
"""
from __future__ import annotations

import json
import os
import queue
import select
import signal
import struct
import subprocess
import sys
import threading
import time
import weakref
from typing import Any

from kvflow.structured_output.limits import CHECK_THREAD_STACK_BYTES, CHECK_TIMEOUT_S, clean_error, parser_limits

_HEADER = struct.Struct(">I")
CHILD_START_TIMEOUT_S = 60.0    # python + llguidance's import: ~0.2 s idle, seconds on a loaded machine


class GrammarCheckError(Exception):
    """The spec does not give a grammar within the limits; `too_complex` when a limit (not the syntax) failed it."""

    def __init__(self, message: str, too_complex: bool = False):
        super().__init__(message)
        self.too_complex = too_complex


# ---------------------------------------------------------------------------------------------- spec -> grammar
def grammar_text(kind: str, payload: str, json_options: dict[str, Any]) -> str:
    """llguidance's serialized grammar for one spec (StructuredSpec.kind / payload). Raises on a malformed one."""
    import llguidance

    if kind == "json_schema":
        return llguidance.LLMatcher.grammar_from_json_schema(payload, defaults=json_options)
    if kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema('{"type": "object"}', defaults=json_options)
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(payload)
    if kind == "choice":
        return llguidance.grammar_from("choice", payload)
    if kind == "grammar":   # Lark, or GBNF/EBNF (llama.cpp's) which llguidance converts to Lark
        return llguidance.grammar_from("grammar", payload)
    if kind == "structural_tag":
        tag = json.loads(payload)
        tags = [llguidance.StructTag(trigger=next(t for t in tag["triggers"] if s["begin"].startswith(t)),
                                     begin=s["begin"], grammar=s["schema"], end=s["end"])
                for s in tag["structures"]]
        return llguidance.StructTag.to_grammar(tags)
    raise ValueError(f"unknown kind {kind!r}")


def check_in_this_process(request: dict[str, Any]) -> dict[str, str]:
    """{"grammar": text} or {"error": message}: what the child answers to one request."""
    import llguidance

    try:
        grammar = grammar_text(request["kind"], request["payload"], request["json_options"])
    except Exception as e:    # anything the spec makes the conversion raise (ValueError, RecursionError, ...)
        return {"error": str(e) or type(e).__name__}
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, None, limits=parser_limits())
    return {"error": clean_error(messages[0])} if is_error else {"grammar": grammar}


# ---------------------------------------------------------------------------------------------- framing
def _write(stream, obj: Any) -> None:
    data = json.dumps(obj, ensure_ascii=False).encode()
    stream.write(_HEADER.pack(len(data)) + data)
    stream.flush()


def _read_blocking(stream) -> Any | None:
    header = stream.read(_HEADER.size)
    if len(header) < _HEADER.size:
        return None
    (size,) = _HEADER.unpack(header)
    data = stream.read(size)
    return json.loads(data) if len(data) == size else None


# ---------------------------------------------------------------------------------------------- the child
def main() -> int:
    # the checks run on a thread with a known stack, the one limits.py sizes the server's builders from
    threading.stack_size(CHECK_THREAD_STACK_BYTES)
    requests: queue.SimpleQueue = queue.SimpleQueue()
    out = sys.stdout.buffer

    def serve() -> None:
        while True:
            _write(out, check_in_this_process(requests.get()))

    threading.Thread(target=serve, name="grammar-check", daemon=True).start()
    _write(out, {"ready": True})
    while (request := _read_blocking(sys.stdin.buffer)) is not None:
        requests.put(request)
    os._exit(0)   # stdin closed: the server is gone or done with this child; leave even in the middle of a check


# ---------------------------------------------------------------------------------------------- the server's side
class _ChildGone(Exception):
    pass


class _Child:
    def __init__(self):
        self.proc = subprocess.Popen([sys.executable, "-m", "kvflow.structured_output.grammar_check"],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        self.ready = False

    def send(self, obj: Any) -> None:
        try:
            _write(self.proc.stdin, obj)
        except (BrokenPipeError, OSError):
            raise _ChildGone() from None

    def receive(self, deadline: float) -> Any:
        """The next message; TimeoutError past the deadline, _ChildGone if the child died."""
        header = self._read_exact(_HEADER.size, deadline)
        return json.loads(self._read_exact(_HEADER.unpack(header)[0], deadline))

    def _read_exact(self, size: int, deadline: float) -> bytes:
        fd, chunks, got = self.proc.stdout.fileno(), [], 0
        while got < size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError()
            if not select.select([fd], [], [], remaining)[0]:
                continue
            chunk = os.read(fd, size - got)
            if not chunk:
                raise _ChildGone()
            chunks.append(chunk)
            got += len(chunk)
        return b"".join(chunks)

    def how_it_ended(self) -> str:
        try:
            code = self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            return "it stopped answering"
        if code < 0:
            try:
                return f"killed by {signal.Signals(-code).name}"
            except ValueError:
                return f"killed by signal {-code}"
        return f"exit status {code}"

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
        for stream in (self.proc.stdin, self.proc.stdout):
            try:
                stream.close()
            except OSError:
                pass


class GrammarChecker:
    """check(spec) in a child process, bounded by `timeout_s`; thread-safe (one child per concurrent check)."""

    def __init__(self, json_options: dict[str, Any], timeout_s: float | None = None, prestart: bool = True):
        self.json_options = json_options
        self.timeout_s = CHECK_TIMEOUT_S if timeout_s is None else timeout_s
        self._idle: list[_Child] = []
        self._lock = threading.Lock()
        self._closed = False
        if prestart:    # spawn now, so the first request does not wait for python to start
            self._idle.append(_Child())
        weakref.finalize(self, _kill_all, self._idle)   # a checker nobody closed (an LLM) leaves no children

    def check(self, kind: str, payload: str) -> str:
        """The grammar text for a spec, validated; GrammarCheckError when the spec is at fault. An error of the
        checker itself (no child could start) is a RuntimeError: not the spec's fault."""
        child = self._take()
        try:
            child.send({"kind": kind, "payload": payload, "json_options": self.json_options})
            reply = child.receive(time.monotonic() + self.timeout_s)
        except TimeoutError:
            child.kill()
            raise GrammarCheckError(f"checking it took longer than {self.timeout_s:g} s", too_complex=True) from None
        except _ChildGone:
            how = child.how_it_ended()
            child.kill()
            raise GrammarCheckError(f"it crashed the grammar compiler ({how})", too_complex=True) from None
        except BaseException:
            child.kill()
            raise
        self._give_back(child)
        if "error" in reply:
            raise GrammarCheckError(reply["error"])
        return reply["grammar"]

    def close(self) -> None:
        with self._lock:
            self._closed = True
            idle, self._idle[:] = list(self._idle), []
        _kill_all(idle)

    def _take(self) -> _Child:
        with self._lock:
            if self._closed:
                raise RuntimeError("the grammar checker is closed")
            child = self._idle.pop() if self._idle else None
        if child is not None and child.proc.poll() is not None:   # died idle (OOM killer, ...): not this spec's doing
            child.kill()
            child = None
        child = child or _Child()
        if not child.ready:
            try:
                child.ready = bool(child.receive(time.monotonic() + CHILD_START_TIMEOUT_S).get("ready"))
            except (TimeoutError, _ChildGone):
                child.ready = False
            if not child.ready:
                how = child.how_it_ended() if child.proc.poll() is not None else "it did not start in time"
                child.kill()
                raise RuntimeError(f"the grammar check process did not start ({how})")
        return child

    def _give_back(self, child: _Child) -> None:
        with self._lock:
            if not self._closed:
                self._idle.append(child)
                return
        child.kill()


def _kill_all(children: list[_Child]) -> None:
    for child in children:
        child.kill()


if __name__ == "__main__":
    sys.exit(main())
