"""Sampler: from one row of logits per sampling row to one token each, in a batch.

Greedy rows take the argmax. Other rows are tempered, cut by top-k / top-p / min-p, and drawn with the
exponential race (argmax of p / E, E ~ Exp(1)), which equals sampling from p. Unseeded rows draw their noise
from the engine's generator (seeded by `--seed`). A seeded request draws from a generator seeded anew each
step from its seed and position: its tokens depend on nothing else in the batch, and a preempted request
recomputes the same ones.

Rows with a grammar matcher (structured outputs) first get every token the grammar forbids set to -inf, in one
batched call for all of them, before penalties and temperature; the other rows are not touched, and a batch
without a constrained row pays one Python check. Log-probabilities are the model's, before any of this. A row
with a forced token (a spent thinking budget's end marker) gets that token whatever it drew.
"""
from __future__ import annotations

import torch

from kvflow.runner.step import PromptLogprob, PromptLogprobsRow, SampledTokens, SamplingRow
from kvflow.structured_output import allocate_bitmask, apply_structured_masks

NEG_INF = float("-inf")


class Sampler:
    def __init__(self, device: torch.device, seed: int = 0):
        self.device = device
        self.generator = torch.Generator(device=device).manual_seed(seed)
        self._bitmask: torch.Tensor | None = None     # reused across steps: [rows, words] int32 on the CPU

    @torch.no_grad()
    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow]) -> SampledTokens:
        """logits: [N, V] float32, row i for rows[i]."""
        params = [r.params for r in rows]
        raw_logprobs = None
        if any(p.logprobs is not None for p in params):
            raw_logprobs = torch.log_softmax(logits, dim=-1)
        self._apply_grammars(logits, rows)
        logits = self._apply_penalties_and_limits(logits, rows)

        if all(p.temperature == 0.0 for p in params):
            tokens = logits.argmax(dim=-1)
        else:
            tokens = self._sample(logits, rows)
        token_list = tokens.tolist()
        if any(r.forced_token_id is not None for r in rows):    # written in place of the draw; logprobs the model's
            token_list = [t if r.forced_token_id is None else r.forced_token_id for t, r in zip(token_list, rows)]
        return SampledTokens(token_list, self._logprobs(raw_logprobs, token_list, params))

    def _apply_grammars(self, logits: torch.Tensor, rows: list[SamplingRow]) -> None:
        """In place: constrained rows may only take what their grammar allows next (idempotent)."""
        matchers = [r.matcher for r in rows]
        active = [m for m in matchers if m is not None]
        if not active:
            return
        words = (active[0].vocab_size + 31) // 32
        if self._bitmask is None or self._bitmask.shape[0] < len(active) or self._bitmask.shape[1] != words:
            self._bitmask = allocate_bitmask(max(len(active), 64), active[0].vocab_size)
        apply_structured_masks(logits, matchers, self._bitmask)

    def _apply_penalties_and_limits(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        cloned = False
        vocab = logits.shape[-1]
        for i, r in enumerate(rows):
            p = r.params
            if not (p.has_penalties or r.blocked_token_ids or p.logit_bias or p.allowed_token_ids
                    or p.bad_words_token_ids):
                continue
            if not cloned:
                logits, cloned = logits.clone(), True
            row = logits[i]
            if p.allowed_token_ids:
                allowed = torch.tensor([t for t in p.allowed_token_ids if t < vocab], dtype=torch.long,
                                       device=row.device)
                kept = row[allowed]
                row.fill_(NEG_INF)
                row[allowed] = kept
            if p.bad_words_token_ids:
                banned = banned_by_bad_words(p.bad_words_token_ids, r.token_ids[r.num_prompt_tokens:])
                if banned:
                    row[torch.tensor([t for t in banned if t < vocab], dtype=torch.long, device=row.device)] = NEG_INF
            if p.logit_bias:
                ids = torch.tensor([t for t in p.logit_bias if t < vocab], dtype=torch.long, device=row.device)
                bias = torch.tensor([b for t, b in p.logit_bias.items() if t < vocab], dtype=row.dtype,
                                    device=row.device)
                row[ids] += bias
            if r.blocked_token_ids:
                blocked = [t for t in r.blocked_token_ids if t < vocab]
                row[torch.tensor(blocked, dtype=torch.long, device=row.device)] = NEG_INF
            if p.repetition_penalty != 1.0:
                seen = torch.tensor(sorted(set(r.token_ids)), dtype=torch.long, device=row.device)
                vals = row[seen]
                row[seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
            if p.presence_penalty or p.frequency_penalty:
                out = torch.tensor(r.token_ids[r.num_prompt_tokens:], dtype=torch.long, device=row.device)
                if out.numel():
                    counts = torch.bincount(out, minlength=row.shape[0]).to(row.dtype)
                    row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(row.dtype)
        return logits

    def _sample(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        params = [r.params for r in rows]
        greedy = torch.tensor([p.temperature == 0.0 for p in params], device=logits.device)
        temps = torch.tensor([p.temperature or 1.0 for p in params], device=logits.device)
        scaled = logits / temps[:, None]

        vocab = logits.shape[-1]
        top_k = [min(p.top_k, vocab) for p in params]
        top_p = [p.top_p for p in params]
        if any(k > 0 for k in top_k) or any(tp < 1.0 for tp in top_p):
            scaled = self._top_k_top_p(scaled, top_k, top_p)
        probs = torch.softmax(scaled, dim=-1)
        min_p = [p.min_p for p in params]
        if any(m > 0 for m in min_p):
            mp = torch.tensor(min_p, device=probs.device)[:, None]
            probs = probs.masked_fill(probs < mp * probs.max(dim=-1, keepdim=True).values, 0.0)

        noise = torch.empty_like(probs).exponential_(generator=self.generator)
        for i, r in enumerate(rows):
            if r.seed is not None and r.params.temperature > 0:
                noise[i].exponential_(generator=torch.Generator(device=probs.device).manual_seed(r.seed))
        sampled = (probs / noise).argmax(dim=-1)
        return torch.where(greedy, logits.argmax(dim=-1), sampled)

    @staticmethod
    def _top_k_top_p(logits: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        V = logits.shape[-1]
        k = torch.tensor([kk if kk > 0 else V for kk in top_k], device=logits.device)
        ranks = torch.arange(V, device=logits.device)[None, :]
        sorted_logits = sorted_logits.masked_fill(ranks >= k[:, None], NEG_INF)
        probs = torch.softmax(sorted_logits, dim=-1)
        before = probs.cumsum(dim=-1) - probs        # mass strictly before each token
        p = torch.tensor(top_p, device=logits.device)[:, None]
        sorted_logits = sorted_logits.masked_fill(before > p, NEG_INF)
        return torch.full_like(logits, NEG_INF).scatter(-1, order, sorted_logits)

    @staticmethod
    def _logprobs(raw: torch.Tensor | None, tokens: list[int], params) -> list:
        if raw is None:
            return [None] * len(tokens)
        result = []
        for i, p in enumerate(params):
            if p.logprobs is None:
                result.append(None)
                continue
            entry = {tokens[i]: raw[i, tokens[i]].item()}
            if p.logprobs > 0:
                vals, ids = raw[i].topk(p.logprobs)
                for t, v in zip(ids.tolist(), vals.tolist()):
                    entry.setdefault(t, v)
            result.append(entry)
        return result


def banned_by_bad_words(bad_words_token_ids: list[list[int]], output_ids: list[int]) -> set[int]:
    """The tokens that would complete a bad word now: each word's last token, where the output so far ends with
    the word's other tokens (a one-token word is banned everywhere). Only the output counts, as in vLLM."""
    banned = set()
    for ids in bad_words_token_ids:
        *head, last = ids
        if not head or (len(output_ids) >= len(head) and output_ids[len(output_ids) - len(head):] == head):
            banned.add(last)
    return banned


@torch.no_grad()
def prompt_logprobs(logits: torch.Tensor, rows: list[PromptLogprobsRow]) -> list[list[PromptLogprob]]:
    """logits: [positions, V] float32, the rows' positions in order. Per row and position: the log-probability and
    rank (1 = most likely) of the prompt token that follows, and the top `num_top` tokens with theirs."""
    logprobs = torch.log_softmax(logits, dim=-1)
    targets = torch.tensor([t for r in rows for t in r.target_ids], dtype=torch.long, device=logits.device)
    target_lp = logprobs.gather(1, targets[:, None])
    ranks = ((logprobs > target_lp).sum(dim=-1) + 1).tolist()
    num_top = max(r.num_top for r in rows)
    top_lp, top_ids = logprobs.topk(num_top, dim=-1) if num_top else (None, None)
    target_list, target_lps = targets.tolist(), target_lp[:, 0].tolist()
    top_lp_list = top_lp.tolist() if num_top else None
    top_id_list = top_ids.tolist() if num_top else None
    result, at = [], 0
    for r in rows:
        positions = []
        for j in range(at, at + len(r.target_ids)):
            entry = {target_list[j]: (target_lps[j], ranks[j])}
            for k in range(r.num_top):
                entry.setdefault(top_id_list[j][k], (top_lp_list[j][k], k + 1))
            positions.append(entry)
        result.append(positions)
        at += len(r.target_ids)
    return result
