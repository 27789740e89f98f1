"""Sampler: from one row of logits per sampling request to one token each, in a batch.

Greedy rows take the argmax. Other rows are tempered, cut by top-k / top-p / min-p, and drawn with the
exponential race (argmax of p / E, E ~ Exp(1)), which equals sampling from p. A seeded request draws its
noise from its own generator, so its tokens do not depend on what else is in the batch.
"""
from __future__ import annotations

import torch

from kvflow.request import Request

NEG_INF = float("-inf")


class Sampler:
    def __init__(self, device: torch.device):
        self.device = device

    @torch.no_grad()
    def __call__(self, logits: torch.Tensor, requests: list[Request]):
        """logits: [N, V] float32, row i for requests[i]. Returns (token ids, logprobs per row or None)."""
        params = [r.params for r in requests]
        raw_logprobs = None
        if any(p.logprobs is not None for p in params):
            raw_logprobs = torch.log_softmax(logits, dim=-1)
        logits = self._apply_penalties_and_limits(logits, requests)

        if all(p.temperature == 0.0 for p in params):
            tokens = logits.argmax(dim=-1)
        else:
            tokens = self._sample(logits, requests)
        token_list = tokens.tolist()
        return token_list, self._logprobs(raw_logprobs, token_list, params)

    def _apply_penalties_and_limits(self, logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        cloned = False
        for i, r in enumerate(requests):
            p = r.params
            blocked = None
            if r.num_output_tokens < p.min_tokens:      # EOS and stop ids may not end it yet
                blocked = list(p.stop_token_ids) + ([] if p.ignore_eos else list(r.eos_token_ids))
            if not (p.has_penalties or blocked):
                continue
            if not cloned:
                logits, cloned = logits.clone(), True
            row = logits[i]
            if blocked:
                row[torch.tensor(blocked, dtype=torch.long, device=row.device)] = NEG_INF
            if p.repetition_penalty != 1.0:
                seen = torch.tensor(sorted(set(r.token_ids)), dtype=torch.long, device=row.device)
                vals = row[seen]
                row[seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
            if p.presence_penalty or p.frequency_penalty:
                out = torch.tensor(r.output_token_ids, dtype=torch.long, device=row.device)
                if out.numel():
                    counts = torch.bincount(out, minlength=row.shape[0]).to(row.dtype)
                    row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(row.dtype)
        return logits

    def _sample(self, logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        params = [r.params for r in requests]
        greedy = torch.tensor([p.temperature == 0.0 for p in params], device=logits.device)
        temps = torch.tensor([p.temperature or 1.0 for p in params], device=logits.device)
        scaled = logits / temps[:, None]

        top_k = [p.top_k for p in params]
        top_p = [p.top_p for p in params]
        if any(k > 0 for k in top_k) or any(tp < 1.0 for tp in top_p):
            scaled = self._top_k_top_p(scaled, top_k, top_p)
        probs = torch.softmax(scaled, dim=-1)
        min_p = [p.min_p for p in params]
        if any(m > 0 for m in min_p):
            mp = torch.tensor(min_p, device=probs.device)[:, None]
            probs = probs.masked_fill(probs < mp * probs.max(dim=-1, keepdim=True).values, 0.0)

        noise = torch.empty_like(probs).exponential_()
        for i, r in enumerate(requests):
            if r.params.seed is not None and r.params.temperature > 0:
                if r.generator is None:
                    r.generator = torch.Generator(device=probs.device).manual_seed(r.params.seed)
                noise[i].exponential_(generator=r.generator)
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
    def _logprobs(raw: torch.Tensor | None, tokens: list[int], params) -> list | None:
        if raw is None:
            return None
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
