"""Per-request grammar state: which tokens may come next, fed the tokens actually sampled.

A thin wrapper over llguidance's LLMatcher. EOS is in the grammar's vocabulary: the mask allows it only
once the grammar is complete, and once nothing but EOS can follow (or EOS was taken) the matcher is
terminated. A rejected token, or a lexer or parser limit hit while computing a mask, puts the matcher in an
error state that it never leaves; its mask then allows only EOS, so a request that went wrong ends instead of
sampling from an empty set, and `accept` returns False for every token from then on, that EOS included (llguidance
itself accepts it: the request would end as a 200 with whatever text it had, as if the grammar were satisfied).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Iterable

import llguidance

from kvflow.structured_output.limits import clean_error

if TYPE_CHECKING:      # the frontend compiles grammars without torch; only the sampler's masks are tensors
    import torch


class Matcher:
    __slots__ = ("_m", "vocab_size", "_on_error")

    def __init__(self, ll_matcher: llguidance.LLMatcher, vocab_size: int, on_error: Callable[[], None] | None = None):
        self._m = ll_matcher
        self.vocab_size = vocab_size   # the grammar's vocabulary: bits per mask row
        self._on_error = on_error      # called once the matcher fails (its CompiledGrammar drops the shared lexer)

    def accept(self, token_id: int) -> bool:
        """Advance by one sampled token; False (and the error state) if the grammar forbids it or failed."""
        return self._accepted(self._m.consume_token(int(token_id)))

    def accept_tokens(self, token_ids: Iterable[int]) -> bool:
        return self._accepted(self._m.consume_tokens([int(t) for t in token_ids]))

    def _accepted(self, consumed: bool) -> bool:
        if consumed and not self._m.is_error():
            return True
        if self._on_error is not None:
            on_error, self._on_error = self._on_error, None
            on_error()
        return False

    def fill_mask(self, bitmask: torch.Tensor, row: int = 0) -> None:
        """Write the allowed-next-token bits into bitmask[row] (int32, CPU, 32 tokens per word)."""
        import torch

        v = bitmask[row]
        assert bitmask.dtype == torch.int32 and bitmask.device.type == "cpu" and v.is_contiguous()
        self._m.unsafe_compute_mask_ptr(v.data_ptr(), v.numel() * 4)

    def is_terminated(self) -> bool:
        """True when the request can finish: EOS was taken, or nothing but EOS may follow."""
        return self._m.is_stopped()

    def is_complete(self) -> bool:
        """The text so far satisfies the grammar (EOS would be allowed now)."""
        return self._m.is_accepting()

    @property
    def error(self) -> str | None:
        return (clean_error(self._m.get_error()) or "error") if self._m.is_error() else None
