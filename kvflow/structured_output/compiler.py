"""Spec -> compiled grammar for one tokenizer, cached, and callable off the engine thread.

llguidance builds its token-level lexer when an LLMatcher is constructed (and releases the GIL while
doing so), so "compiling" is building one template matcher; each request gets a deep copy of it (~1 µs).
The cache is an LRU keyed by the spec. A compile in flight is shared: a second request for the same
schema waits for the first compile instead of starting its own. Compile errors are deterministic, so they
are cached too, and are re-raised with the param of the request that asked.

Use `submit()` / `compile_async()` from the server so that a new schema never runs on the step loop.
"""
from __future__ import annotations

import asyncio
import json
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import llguidance
import llguidance.hf

from kvflow.errors import InvalidRequestError
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


class CompiledGrammar:
    def __init__(self, spec: StructuredSpec, grammar: str, template: llguidance.LLMatcher, vocab_size: int):
        self.spec = spec
        self.vocab_size = vocab_size
        self.grammar = grammar   # llguidance's serialized grammar
        self._template = template

    def matcher(self) -> Matcher:
        """A fresh matcher in the initial state, for one sequence."""
        return Matcher(self._template.deep_copy(), self.vocab_size)

    def __reduce__(self):
        # crossing into the engine process: the grammar travels as llguidance's serialized text, and the matcher
        # template is rebuilt there (once per grammar, cached) as the message is read, off the step loop
        return _rebuild, (self.spec, self.grammar, self.vocab_size)


# The engine process's side of the pickled grammars: `set_rebuild_tokenizer` (called at its start) gives the
# tokenizer the templates are rebuilt with, built on first use; rebuilt templates are kept by grammar text.
_rebuild_tokenizer = None
_rebuilt: OrderedDict[str, llguidance.LLMatcher] = OrderedDict()
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
            template = llguidance.LLMatcher(_rebuild_tokenizer, grammar, log_level=0)
            _rebuilt[grammar] = template
            while len(_rebuilt) > REBUILT_CACHE_SIZE:
                _rebuilt.popitem(last=False)
        else:
            _rebuilt.move_to_end(grammar)
    return CompiledGrammar(spec, grammar, template, vocab_size)


class GrammarCompiler:
    def __init__(self, tokenizer, *, cache_size: int = 256, max_workers: int = 2,
                 json_options: dict[str, Any] | None = None,
                 ll_tokenizer: llguidance.LLTokenizer | None = None):
        self.ll_tokenizer = ll_tokenizer or grammar_tokenizer(tokenizer)
        self.vocab_size: int = self.ll_tokenizer.vocab_size   # bits per mask row
        self.json_options = dict(DEFAULT_JSON_OPTIONS if json_options is None else json_options)
        self.cache_size = cache_size
        self._cache: OrderedDict[StructuredSpec, Future] = OrderedDict()
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="grammar-compile")

    # ---- public
    def compile(self, spec: StructuredSpec) -> CompiledGrammar:
        """Blocking, cached. Raises InvalidRequestError(param=spec.param) if the spec does not compile."""
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
            raise InvalidRequestError(f"invalid {spec.kind.replace('_', ' ')}: {e}", param=spec.param) from None

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

    # ---- spec -> llguidance grammar
    def _grammar(self, spec: StructuredSpec) -> str:
        kind, payload = spec.kind, spec.payload
        try:
            if kind == "json_schema":
                return llguidance.LLMatcher.grammar_from_json_schema(payload, defaults=self.json_options)
            if kind == "json_object":
                return llguidance.LLMatcher.grammar_from_json_schema('{"type": "object"}', defaults=self.json_options)
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
        except (ValueError, AssertionError) as e:
            raise _CompileError(str(e)) from None
        raise _CompileError(f"unknown kind {kind!r}")

    def _build(self, spec: StructuredSpec) -> CompiledGrammar:
        grammar = self._grammar(spec)
        template = llguidance.LLMatcher(self.ll_tokenizer, grammar, log_level=0)
        if template.is_error():
            raise _CompileError(template.get_error().strip())
        return CompiledGrammar(spec, grammar, template, self.vocab_size)
