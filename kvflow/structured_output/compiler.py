"""Spec -> compiled grammar for one tokenizer, cached, and callable off the engine thread.

A new spec is compiled in three steps, each bounded (the limits and why: limits.py):
  1. the grammar check process (grammar_check.py) turns it into llguidance's grammar text and validates it, in a
     child: a grammar that crashes llguidance or runs for ever costs a restarted child and a 400;
  2. the template matcher is built here with parser_limits(), on a thread with a big stack (BUILD_THREAD_STACK_BYTES,
     8x what the check had, so what the check survived cannot overflow it);
  3. the probe runs the first PROBE_TOKENS tokens of a generation on a copy: llguidance builds its lexer lazily, so
     a regex like `(a{1000}){1000}` passes 1 and 2 and only blows its fuel on the first token.
Each request then gets a deep copy of the template (~1 µs). The copies share the template's lexer, so one that
fails may have spent it for all: a failed matcher has its template rebuilt for the requests after it (_Template).

The cache is an LRU keyed by the spec. A compile in flight is shared: a second request for the same schema waits
for the first compile instead of starting its own. Compile errors are deterministic (a timeout nearly so), so
they are cached too, and are re-raised with the param of the request that asked.

Use `submit()` / `compile_async()` from the server so that a new schema never runs on the event loop or the step
loop; the engine process rebuilds the pickled grammar on its reader thread (`_rebuild`), off the step loop too.
"""
from __future__ import annotations

import asyncio
import queue
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable

import llguidance
import llguidance.hf
import numpy as np

from kvflow.errors import InvalidRequestError
from kvflow.structured_output.grammar_check import GrammarChecker, GrammarCheckError
from kvflow.structured_output.limits import (BUILD_THREAD_STACK_BYTES, PROBE_BRANCHES, PROBE_TIME_LIMIT_S, PROBE_TOKENS,
                                             TOO_COMPLEX, clean_error, parser_limits)
from kvflow.structured_output.matcher import Matcher
from kvflow.structured_output.spec import StructuredSpec

# Compact separators as json.dumps writes them and no free whitespace: a model fed random or
# indecisive logits can otherwise pad JSON with whitespace until max_tokens.
DEFAULT_JSON_OPTIONS: dict[str, Any] = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def grammar_tokenizer(tokenizer) -> llguidance.LLTokenizer:
    """llguidance's view of a kvflow Tokenizer (~0.3 s on a 49k vocab: build once per model)."""
    return llguidance.hf.from_tokenizer(tokenizer.hf, n_vocab=tokenizer.vocab_size,
                                        eos_token=sorted(tokenizer.eos_token_ids))


class _CompileError(Exception):
    """A spec that does not compile; its message becomes the 400's message."""

    def __init__(self, message: str, too_complex: bool = False):
        super().__init__(message)
        self.too_complex = too_complex


# ---------------------------------------------------------------------------------------------- builder threads
class _BuilderThreads:
    """Runs a function on one of `count` threads with BUILD_THREAD_STACK_BYTES of stack (started on first use).
    Every llguidance grammar build in a process goes through here: its recursion depth grows with the grammar."""

    def __init__(self, count: int):
        self._count = count
        self._tasks: queue.SimpleQueue = queue.SimpleQueue()
        self._started = False
        self._lock = threading.Lock()
        self._local = threading.local()

    def run(self, fn: Callable, *args):
        """fn(*args) on a builder thread (here if this is one); waits for it."""
        if getattr(self._local, "builder", False):
            return fn(*args)
        return self.submit(fn, *args).result()

    def submit(self, fn: Callable, *args) -> Future:
        self._start()
        future: Future = Future()
        self._tasks.put((future, fn, args))
        return future

    def _start(self) -> None:
        with self._lock:
            if self._started:
                return
            # stack_size is process-wide for threads started meanwhile: set it only around these starts
            old = threading.stack_size(BUILD_THREAD_STACK_BYTES)
            try:
                for i in range(self._count):
                    threading.Thread(target=self._loop, name=f"grammar-build-{i}", daemon=True).start()
            finally:
                threading.stack_size(old)
            self._started = True

    def _loop(self) -> None:
        self._local.builder = True
        while True:
            future, fn, args = self._tasks.get()
            try:
                future.set_result(fn(*args))
            except BaseException as e:
                future.set_exception(e)


_builders = _BuilderThreads(2)


def _new_template(ll_tokenizer: llguidance.LLTokenizer, grammar: str) -> llguidance.LLMatcher:
    """A template matcher with kvflow's limits (call on a builder thread). Its first mask is computed on a copy,
    so that the lexer's first states are built here and not in the first step that uses it."""
    template = llguidance.LLMatcher(ll_tokenizer, grammar, log_level=0, limits=parser_limits())
    if not template.is_error():
        template.deep_copy().compute_bitmask()
    return template


class ProbeVocabulary:
    """The tokens the probe may pick, per tokenizer (~0.1 s to build): each token's bytes' length and first byte;
    EOS and tokens with no bytes left out."""

    def __init__(self, ll_tokenizer: llguidance.LLTokenizer):
        pieces = [ll_tokenizer.decode_bytes([t]) for t in range(ll_tokenizer.vocab_size)]
        self.vocab_size = len(pieces)
        self.length = np.array([len(p) for p in pieces], dtype=np.int64)
        self.first_byte = np.array([p[0] if p else 256 for p in pieces], dtype=np.int64)
        self.usable = self.length > 0
        self.usable[list(ll_tokenizer.eos_tokens)] = False

    def branches(self, mask: bytes, longest: int) -> list[int]:
        """Of the tokens the mask allows: the `longest` longest, and the longest for each first byte; longest first."""
        bits = np.unpackbits(np.frombuffer(mask, dtype=np.uint8), bitorder="little")[: self.vocab_size]
        allowed = np.flatnonzero(bits.astype(bool) & self.usable)
        allowed = allowed[np.argsort(-self.length[allowed], kind="stable")]
        _, first = np.unique(self.first_byte[allowed], return_index=True)
        keep = np.union1d(np.arange(min(longest, len(allowed))), first)
        return allowed[keep].tolist()


def probe(template: llguidance.LLMatcher, vocabulary: ProbeVocabulary, steps: int, branches: int,
          time_limit_s: float) -> str | None:
    """Generate `steps` tokens on copies of the template; None if all went well, else what failed.

    Each step tries, on a copy each, the `branches` longest tokens the grammar allows and the longest for each
    first byte, then goes on with the longest that does not end the generation: a schema's 2000 optional
    properties overflow the parser on `{"` but not on `{}`, a nested repeat blows the lexer's fuel only once its
    bytes are taken."""
    deadline = time.monotonic() + time_limit_s
    m = template.deep_copy()
    for _ in range(steps):
        mask = m.compute_bitmask()
        if m.is_error():
            return clean_error(m.get_error())
        following = None
        for token in vocabulary.branches(mask, branches):
            branch = m.deep_copy()
            if not branch.consume_token(token) or branch.is_error():
                return clean_error(branch.get_error())
            if following is None and not branch.is_stopped():
                following = branch
            if time.monotonic() > deadline:
                return f"its first tokens take longer than {time_limit_s:g} s"
        if following is None:
            return None
        m = following
    return None


class _Template:
    """A grammar's template matcher, shared by every CompiledGrammar of that grammar in a process (the compile
    cache's entry, or the engine's rebuilt one). Every matcher is a deep copy, and the copies share the
    template's lexer: once a lexer runs out of fuel or states, every later copy fails (its mask allows only EOS:
    before, a 200 with empty content). So a failed matcher has the template rebuilt, on a builder thread, for the
    requests after it; the copies already running share the spent lexer and fail as theirs."""

    __slots__ = ("grammar", "ll_tokenizer", "_current")

    def __init__(self, grammar: str, ll_tokenizer: llguidance.LLTokenizer, matcher: llguidance.LLMatcher):
        self.grammar = grammar
        self.ll_tokenizer = ll_tokenizer
        self._current: llguidance.LLMatcher | Future = matcher

    def copy(self) -> llguidance.LLMatcher:
        current = self._current
        if isinstance(current, Future):    # a rebuild after a failure: ready by now unless it came at once
            current = self._current = current.result()
        return current.deep_copy()

    def spent(self) -> None:
        if not isinstance(self._current, Future):
            self._current = _builders.submit(_new_template, self.ll_tokenizer, self.grammar)


class CompiledGrammar:
    def __init__(self, spec: StructuredSpec, template: _Template, vocab_size: int):
        self.spec = spec
        self.vocab_size = vocab_size
        self.grammar = template.grammar   # llguidance's serialized grammar
        self._template = template

    def matcher(self) -> Matcher:
        """A fresh matcher in the initial state, for one sequence."""
        return Matcher(self._template.copy(), self.vocab_size, on_error=self._template.spent)

    def __reduce__(self):
        # crossing into the engine process: the grammar travels as llguidance's serialized text, and the matcher
        # template is rebuilt there (once per grammar, cached) as the message is read, off the step loop
        return _rebuild, (self.spec, self.grammar, self.vocab_size)


# The engine process's side of the pickled grammars: `set_rebuild_tokenizer` (called at its start) gives the
# tokenizer the templates are rebuilt with, built on first use; rebuilt templates are kept by grammar text.
_rebuild_tokenizer = None
_rebuilt: OrderedDict[str, _Template] = OrderedDict()
_rebuild_lock = threading.Lock()
REBUILT_CACHE_SIZE = 256


def set_rebuild_tokenizer(make_ll_tokenizer) -> None:
    """`make_ll_tokenizer()` -> llguidance.LLTokenizer, called once, on the first grammar that arrives."""
    global _rebuild_tokenizer
    _rebuild_tokenizer = make_ll_tokenizer


def _rebuild(spec: StructuredSpec, grammar: str, vocab_size: int) -> CompiledGrammar:
    global _rebuild_tokenizer
    with _rebuild_lock:
        template = _rebuilt.get(grammar)
        if template is None:
            if _rebuild_tokenizer is None:
                raise RuntimeError("a compiled grammar arrived in a process with no tokenizer to rebuild it")
            if not isinstance(_rebuild_tokenizer, llguidance.LLTokenizer):
                _rebuild_tokenizer = _rebuild_tokenizer()
            # the frontend checked and probed this grammar with the same limits; its first mask is built here
            template = _Template(grammar, _rebuild_tokenizer, _builders.run(_new_template, _rebuild_tokenizer, grammar))
            _rebuilt[grammar] = template
            while len(_rebuilt) > REBUILT_CACHE_SIZE:
                _rebuilt.popitem(last=False)
        else:
            _rebuilt.move_to_end(grammar)
    return CompiledGrammar(spec, template, vocab_size)


class GrammarCompiler:
    def __init__(self, tokenizer, *, cache_size: int = 256, max_workers: int = 2,
                 json_options: dict[str, Any] | None = None,
                 ll_tokenizer: llguidance.LLTokenizer | None = None, check_timeout_s: float | None = None):
        self.ll_tokenizer = ll_tokenizer or grammar_tokenizer(tokenizer)
        self.vocab_size: int = self.ll_tokenizer.vocab_size   # bits per mask row
        self.json_options = dict(DEFAULT_JSON_OPTIONS if json_options is None else json_options)
        self.cache_size = cache_size
        self._cache: OrderedDict[StructuredSpec, Future] = OrderedDict()
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="grammar-compile")
        self._checker = GrammarChecker(self.json_options, timeout_s=check_timeout_s)
        self._probe_vocabulary: ProbeVocabulary | None = None

    # ---- public
    def compile(self, spec: StructuredSpec) -> CompiledGrammar:
        """Blocking, cached. Raises InvalidRequestError(param=spec.param) if the spec does not compile or is
        beyond the limits (code "grammar_too_complex")."""
        with self._lock:
            fut = self._cache.get(spec)
            owner = fut is None
            if owner:
                fut = self._cache[spec] = Future()
                while len(self._cache) > self.cache_size:
                    self._cache.popitem(last=False)
            else:
                self._cache.move_to_end(spec)
        if owner:
            try:
                fut.set_result(self._build(spec))
            except _CompileError as e:
                fut.set_exception(e)
            except BaseException as e:   # not the spec's fault: do not keep it
                with self._lock:
                    if self._cache.get(spec) is fut:
                        del self._cache[spec]
                fut.set_exception(e)
                raise
        try:
            return fut.result()
        except _CompileError as e:
            what = spec.kind.replace("_", " ")
            if e.too_complex:
                raise InvalidRequestError(f"the {what} is beyond the grammar compiler's limits: {e}",
                                          param=spec.param, code=TOO_COMPLEX) from None
            raise InvalidRequestError(f"invalid {what}: {e}", param=spec.param) from None

    def submit(self, spec: StructuredSpec) -> Future:
        """compile() on the compiler's thread pool; the future holds a CompiledGrammar or the error."""
        return self._pool.submit(self.compile, spec)

    async def compile_async(self, spec: StructuredSpec) -> CompiledGrammar:
        return await asyncio.wrap_future(self.submit(spec))

    def cache_info(self) -> dict[str, int]:
        with self._lock:
            return {"size": len(self._cache), "max_size": self.cache_size}

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._checker.close()

    # ---- spec -> template
    def _build(self, spec: StructuredSpec) -> CompiledGrammar:
        try:
            grammar = self._checker.check(spec.kind, spec.payload)
        except GrammarCheckError as e:
            raise _CompileError(str(e), e.too_complex) from None
        matcher = _builders.run(self._build_and_probe, grammar)
        return CompiledGrammar(spec, _Template(grammar, self.ll_tokenizer, matcher), self.vocab_size)

    def _build_and_probe(self, grammar: str) -> llguidance.LLMatcher:
        template = _new_template(self.ll_tokenizer, grammar)
        if template.is_error():
            raise _CompileError(clean_error(template.get_error()))
        if self._probe_vocabulary is None:
            self._probe_vocabulary = ProbeVocabulary(self.ll_tokenizer)
        error = probe(template, self._probe_vocabulary, PROBE_TOKENS, PROBE_BRANCHES, PROBE_TIME_LIMIT_S)
        if error:
            raise _CompileError(f"its first tokens fail: {error}", too_complex=True)
        return template
