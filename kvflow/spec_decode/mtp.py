"""Multi-token prediction (`mtp`): the drafts of the model's own MTP head. The runner makes them right after the step
that sampled a request's last token (runner/mtp_drafter.py) and they come back with the sampled tokens; this proposer
keeps them until the request's next step, and hands them out only while they still follow the request's tokens: its
token count is the one they were made for (a request that sat out a step, or was preempted and recomputed, has moved
on or gets new ones)."""
from __future__ import annotations


class MtpProposer:
    def __init__(self, k: int) -> None:
        self.k = k
        self._drafts: dict[str, tuple[int, tuple[int, ...]]] = {}   # request -> (its token count, drafts to follow)

    def drafted(self, request_id: str, num_tokens: int, drafts: tuple[int, ...]) -> None:
        """The runner's drafts to follow the request's first `num_tokens` tokens (none: forget the old ones)."""
        if drafts:
            self._drafts[request_id] = (num_tokens, tuple(drafts))
        else:
            self._drafts.pop(request_id, None)

    def propose(self, request_id: str, token_ids: list[int], k: int) -> list[int]:
        made_for, drafts = self._drafts.get(request_id, (-1, ()))
        return list(drafts[:min(k, self.k)]) if made_for == len(token_ids) else []

    def finished(self, request_id: str, token_ids: list[int], num_prompt_tokens: int) -> None:
        """Nothing to learn from a finished request (`forget` drops its drafts)."""

    def forget(self, request_id: str) -> None:
        """The request is gone (finished, failed or aborted): its drafts with it."""
        self._drafts.pop(request_id, None)
