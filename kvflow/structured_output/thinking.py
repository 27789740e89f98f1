"""Where a reasoning model's answer starts, in the engine: one state machine per request, fed every output token.

A request served under a reasoning parser carries a `ThinkingSpec` when the engine must know where its reasoning
ends: a grammar (structured outputs, a forced tool call) constrains the answer only, and a thinking budget
(`thinking_token_budget`) ends the reasoning by force. The spec holds the reasoning parser's end-of-thinking marker
as token ids (`</think>`: one token in Qwen3's and R1's vocabularies, several in others), whether the output starts
in the reasoning (False when the chat template closed it in the prompt, as an `enable_thinking: false` template that
writes an empty `<think></think>`: the answer, and the grammar, start at the first token), and the budget with what
is forced at it (an optional message, then the marker).

`ThinkingState` is its per-request state: the scheduler feeds it each output token before the grammar's matcher
(`accept` says whether the token is the answer's, the matcher's to take); the marker's tokens themselves belong to
the reasoning. Once `budget` reasoning tokens were written, `forced_token` names the next token of the forced
sequence and the sampler writes it in place of its draw; the forced tokens are not counted against the budget.
The marker is matched as token ids, as vLLM's reasoning parsers' `is_reasoning_end` does: a model that spells it in
other tokens (a BPE merge with the text around it) has not ended its reasoning for the engine.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ThinkingSpec:
    end_token_ids: tuple[int, ...]          # the end-of-thinking marker, as the tokenizer writes it
    in_reasoning: bool = True               # False: the prompt closed the reasoning; the answer starts at once
    budget: int | None = None               # at most this many reasoning tokens (None: no bound)
    forced_token_ids: tuple[int, ...] = ()  # forced once the budget is spent: a message, then the end marker

    def __post_init__(self) -> None:
        if not self.end_token_ids:
            raise ValueError("a reasoning end marker needs at least one token")
        if self.budget is not None and self.forced_token_ids[-len(self.end_token_ids):] != self.end_token_ids:
            raise ValueError("the tokens forced at a thinking budget must end with the end marker")

    def state(self) -> ThinkingState:
        return ThinkingState(self)


class ThinkingState:
    """One request's place: in the reasoning or in the answer, the reasoning tokens so far, the forced tokens."""
    __slots__ = ("spec", "in_reasoning", "thought", "forced", "_tail")

    def __init__(self, spec: ThinkingSpec) -> None:
        self.spec = spec
        self.in_reasoning = spec.in_reasoning
        self.thought = 0                 # reasoning tokens written by the model (the forced ones not counted)
        self.forced = -1                 # the index of the next forced token; -1 while none is forced
        self._tail: tuple[int, ...] = ()  # the last output tokens, as many as could start the marker
        self._start_forcing_if_spent()

    def copy(self) -> ThinkingState:
        other = ThinkingState.__new__(ThinkingState)
        other.spec, other.in_reasoning, other.thought = self.spec, self.in_reasoning, self.thought
        other.forced, other._tail = self.forced, self._tail
        return other

    def after(self, token_ids) -> ThinkingState:
        """A copy advanced over `token_ids` (a speculating request's drafts before a row)."""
        other = self.copy()
        for t in token_ids:
            other.accept(t)
        return other

    def forced_token(self) -> int | None:
        """The token the request must write next (its budget is spent); None: the model chooses."""
        return self.spec.forced_token_ids[self.forced] if self.forced >= 0 else None

    @property
    def free(self) -> bool:
        """Reasoning, nothing forced: the next token is the model's, unconstrained."""
        return self.in_reasoning and self.forced < 0

    def accept(self, token_id: int) -> bool:
        """Advance by one output token. True when it is the answer's (a grammar takes it); the marker's last token
        ends the reasoning and is the reasoning's."""
        if not self.in_reasoning:
            return True
        end = self.spec.end_token_ids
        window = self._tail + (int(token_id),)
        if window[-len(end):] == end:
            self.in_reasoning, self.forced, self._tail = False, -1, ()
            return False
        self._tail = window[len(window) - len(end) + 1:] if len(end) > 1 else ()
        if self.forced >= 0:
            self.forced += 1
        else:
            self.thought += 1
            self._start_forcing_if_spent()
        return False

    def drafts_to_verify(self, drafts: tuple[int, ...]) -> int:
        """How many of a speculating request's drafts may be verified in one step: those up to the one that ends
        the reasoning (or spends the budget), that one included; the row after it is masked by the grammar or
        forced, from this state advanced over them (`after`)."""
        sim = self.copy()
        n = 0
        for t in drafts:
            if not sim.free:
                break
            sim.accept(t)
            n += 1
        return n

    def _start_forcing_if_spent(self) -> None:
        budget = self.spec.budget
        if self.in_reasoning and self.forced < 0 and budget is not None and self.thought >= budget:
            self.forced = 0
            end = self.spec.end_token_ids
            if self.spec.forced_token_ids == end:    # no message: a marker the model had begun is finished, not redone
                self.forced = next((k for k in range(len(end) - 1, 0, -1) if self._tail[-k:] == end[:k]), 0)
