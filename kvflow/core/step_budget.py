"""StepBudget: what is left of one step's budgets while the scheduler hands the step out.

A step computes at most `max_num_batched_tokens` tokens. Within that:
- prompt tokens (prefill and recompute chunks) take at most `max_prefill_tokens_while_decoding` while a running
  request is generating (0: no cap): a long chunk is a long gap between the streaming requests' tokens;
- requests of a priority value above `background_above` (a lower value runs, or ran within the scheduler's
  FOREGROUND_GRACE_S) take at most `max_background_seqs` rows;
- requests of values above 0 take at most `max_background_tokens` tokens (0: no cap), at all times;
- draft tokens take at most `draft_rows` rows: a speculating request is 1 + k decode rows, and the step stays within
  the largest compiled decode bucket.

The scheduler builds one per step (`Scheduler._step_budget`), asks `take_row` before it schedules a request (how
many tokens it may compute; 0: it may not run) and `take`s what it scheduled. Every counter the scheduler spends
during a step lives here (`max_num_seqs` bounds the running batch, not a step).
"""
from __future__ import annotations

from kvflow.request import Request


class StepBudget:
    __slots__ = ("tokens", "prefill_tokens", "background_above", "background_rows", "background_tokens", "draft_rows")

    def __init__(self, tokens: int, prefill_tokens: int, background_above: float, background_rows: int,
                 background_tokens: int, draft_rows: int):
        self.tokens = tokens                        # the step's tokens left, every request's
        self.prefill_tokens = prefill_tokens        # prompt tokens left (`tokens` or less: the cap while decoding)
        self.background_above = background_above    # a value above this is background this step
        self.background_rows = background_rows      # background rows left
        self.background_tokens = background_tokens  # tokens left for values above 0
        self.draft_rows = draft_rows                # draft rows left (0: no speculation this step)

    def take_row(self, req: Request) -> int:
        """Count `req` as one of the step's rows; the tokens it may compute, 0 when it may not run (a background request
        with no background row left, or no token left for its value). A background request takes its row before its
        tokens are looked at. The scheduler stops at a 0: the requests come in priority order, so the rest may not
        run either."""
        if req.priority > self.background_above:
            if self.background_rows <= 0:
                return 0
            self.background_rows -= 1
        return self.tokens if req.priority <= 0 else min(self.tokens, self.background_tokens)

    def take(self, req: Request, num_tokens: int, prefill: bool = False, num_drafts: int = 0) -> None:
        """Spend `num_tokens` of the step on `req` (`prefill`: prompt tokens; `num_drafts` of them draft rows)."""
        self.tokens -= num_tokens
        if prefill:
            self.prefill_tokens -= num_tokens
        if req.priority > 0:
            self.background_tokens -= num_tokens
        self.draft_rows -= num_drafts
