"""IncrementalDetokenizer: token ids in, safe text deltas out, with stop-string holdback.

Each `add` decodes only a small window of ids (vLLM's / TGI's prefix_offset / read_offset scheme):
`prefix_offset..read_offset` is text already emitted and is decoded again only so the new tokens get
their context (leading spaces, multi-byte characters split across tokens). Text whose decoding ends in
U+FFFD (an unfinished UTF-8 character) waits for the next token. Text that could be the start of a
stop string waits until it either completes the stop string or cannot. The token that ended a request (EOS or a stop
token id) is no part of the text unless include_stop_str_in_output, as in vLLM: with skip_special_tokens=False its
text (`</s>`, `<|im_end|>`) would otherwise end every answer.
"""
from __future__ import annotations

from typing import Iterable

from kvflow.tokenizer import Tokenizer

_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, *, skip_special_tokens: bool = True,
                 stop: Iterable[str] | None = (), include_stop_str_in_output: bool = False):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.stop = list(stop or ())
        self.include_stop_str_in_output = include_stop_str_in_output
        self.token_ids: list[int] = []
        self.text = ""                   # everything emitted so far
        self.stop_str: str | None = None  # the stop string that ended the output, if any
        self._prefix_offset = 0
        self._read_offset = 0
        self._pending = ""               # decoded, but held back as a possible stop-string start

    @property
    def stopped(self) -> bool:
        return self.stop_str is not None

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def _decode_new(self, final: bool) -> str:
        """Text of the tokens past read_offset, or "" while it ends in a broken character (unless final)."""
        if self._read_offset >= len(self.token_ids):
            return ""
        window = self.token_ids[self._prefix_offset:]
        prefix_text = self._decode(self.token_ids[self._prefix_offset:self._read_offset])
        new_text = self._decode(window)
        if not final and new_text.endswith(_REPLACEMENT):
            return ""
        delta = new_text[len(prefix_text):]  # prefix_text was emitted already
        self._prefix_offset = self._read_offset
        self._read_offset = len(self.token_ids)
        return delta

    def _release(self, final: bool) -> str:
        """Move what is safe from _pending to the output; detect stop strings."""
        pending = self._pending
        hits = [(at, s) for s in self.stop if (at := pending.find(s)) != -1]
        if hits:
            at, self.stop_str = min(hits, key=lambda hit: hit[0])      # the earliest; the first listed on a tie
            out, self._pending = pending[:at + len(self.stop_str) if self.include_stop_str_in_output else at], ""
        else:
            # hold back the longest suffix of pending that is a proper prefix of a stop string
            keep = 0 if final or not self.stop else max(
                (k for s in self.stop for k in range(1, min(len(s) - 1, len(pending)) + 1) if pending.endswith(s[:k])),
                default=0)
            out, self._pending = pending[:len(pending) - keep], pending[len(pending) - keep:]
        self.text += out
        return out

    def add(self, token_ids: Iterable[int], stop_terminated: bool = False) -> str:
        """Append new token ids; return the text that is now safe to show (may be ""). `stop_terminated`: the last
        of them is the EOS or stop token id that ended the request, left out of the text unless
        include_stop_str_in_output (vLLM's Detokenizer.update)."""
        if self.stop_str is not None:
            return ""
        token_ids = list(token_ids)
        if stop_terminated and not self.include_stop_str_in_output:
            token_ids = token_ids[:-1]
        self.token_ids.extend(token_ids)
        self._pending += self._decode_new(final=False)
        if not self._pending:
            return ""
        return self._release(final=False)

    def flush(self) -> str:
        """At the end of the request: everything still held back (nothing if a stop string matched)."""
        if self.stop_str is not None:
            return ""
        self._pending += self._decode_new(final=True)
        return self._release(final=True)
