"""Speculative decoding's drafts from the model's own multi-token-prediction head (`--speculative-config
'{"method": "mtp", "num_speculative_tokens": N}'`), made right after each step's sampling, as vLLM v1 makes them.

The head at position p reads the target's final hidden state at p and the token at p + 1, and predicts the token at
p + 2 (models/qwen3_5.py `MultiTokenPredictor`). Its attention layer keeps its own KV (one more attention layer's
K/V tensors in the blocks, from the same budget), so it runs over every position the target computes:

- **The step's pass**: every row of the step, at the rows' positions, with the step's attention metadata. A row's
  token is the one after its position: the next row's within a chunk; after a chunk's last row, the next prompt
  token the scheduler sends (`StepBatch.next_token_ids`) or, where the row samples, the token it sampled. A
  speculating request's row j thus takes its target j — the next draft where it was accepted, the corrected token at
  the first rejection; the rows after that write MTP KV at positions the next step computes again (overwritten
  before any row reads them, as the target's own KV is).
- **The first draft** of each request that sampled and may speculate in its next step (the scheduler says how many
  drafts it could verify, `StepBatch.drafts_wanted`: none for a grammar, without room, or while more requests run
  than speculate): the argmax of the head's logits at its last valid row — its only sampling row (a decode, a
  prompt's last chunk) or, speculating, the row of its last accepted draft (counted as the scheduler counts it: the
  leading drafts equal to the targets).
- **Drafts 2..N**: one row per request at positions p + 1, p + 2, ..., each reading the previous draft and the
  head's own output hidden state (vLLM's chain). They write MTP KV past the request's tokens, into the lookahead
  blocks the scheduler allocates for it (core/scheduler.py); a request whose block table ends sooner, or that
  reaches max_model_len, gets fewer drafts.

Drafts are argmax whatever the request samples with: the scheduler's verification keeps the output what decoding
without them gives.
"""
from __future__ import annotations

from typing import Callable

import torch

from kvflow.layers.attention_metadata import AttentionMetadata
from kvflow.runner.step import StepBatch


class MtpDrafter:
    """`prepare_inputs`: the runner's (a StepBatch -> ids, positions, metadata, logits rows), for the chain's steps."""

    def __init__(self, model, num_speculative_tokens: int, max_model_len: int, block_size: int,
                 prepare_inputs: Callable):
        self.model = model
        self.k = num_speculative_tokens
        self.max_model_len = max_model_len
        self.block_size = block_size
        self.prepare_inputs = prepare_inputs

    def draft(self, batch: StepBatch, ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
              hidden: torch.Tensor, sampled: list[int]) -> dict[int, tuple[int, ...]]:
        """The step's MTP pass (always: the head's KV must cover every computed position), then the drafts of each
        request the scheduler wants them for (`StepBatch.drafts_wanted`), by sampling row
        (`SampledTokens.draft_token_ids`). `ids` .. `hidden`: the step's flat rows as the target computed them;
        `sampled`: the token of each sampling row."""
        lens = batch.num_new_tokens
        ends, sampling_row, next_ids = [], [], []
        end, row = 0, 0
        for i, (n, samples) in enumerate(zip(lens, batch.samples)):
            end += n
            ends.append(end - 1)
            if samples:
                sampling_row.append(row)
                next_ids.append(sampled[row])
                row += 1
            else:
                sampling_row.append(-1)
                after = batch.next_token_ids[i] if batch.next_token_ids else -1
                next_ids.append(max(after, 0))          # nothing follows: the row's MTP KV is never read
        mtp_ids = torch.cat([ids[1:], ids[:1]])
        mtp_ids[torch.tensor(ends, device=ids.device)] = torch.tensor(next_ids, dtype=ids.dtype, device=ids.device)
        out = self.model.mtp_forward(mtp_ids, positions, hidden, meta)
        wanted = batch.drafts_wanted or [self.k if r >= 0 else 0 for r in sampling_row]
        chosen = [e for e in self._last_valid_rows(batch, sampling_row, sampled) if wanted[e] > 0]
        if not chosen:
            return {}
        h = out[torch.tensor([ends[e] for e in chosen], device=out.device)]
        drafts = [[t] for t in self.model.compute_logits(h).argmax(-1).tolist()]
        # drafts 2..: the chain, one row per request that wants more and still has room
        last = [batch.num_computed_tokens[e] + lens[e] - 1 for e in chosen]     # each request's last valid position
        tables = [batch.block_tables[e] for e in chosen]
        alive = list(range(len(chosen)))            # the requests `h` holds a row of, in its order
        for step in range(1, max(wanted[e] for e in chosen)):
            keep = [j for j, a in enumerate(alive) if step < wanted[chosen[a]] and last[a] + step < self.max_model_len
                    and (last[a] + step) // self.block_size < len(tables[a])]
            if not keep:
                break
            alive = [alive[j] for j in keep]
            chain = StepBatch(num_decodes=len(alive), token_ids=[drafts[a][-1] for a in alive],
                              num_computed_tokens=[last[a] + step for a in alive], num_new_tokens=[1] * len(alive),
                              block_tables=[tables[a] for a in alive], samples=[False] * len(alive))
            chain_ids, chain_pos, chain_meta, _ = self.prepare_inputs(chain)
            if len(keep) < len(h):
                h = h[torch.tensor(keep, device=h.device)]
            h = self.model.mtp_forward(chain_ids, chain_pos, h, chain_meta)
            for a, t in zip(alive, self.model.compute_logits(h).argmax(-1).tolist()):
                drafts[a].append(t)
        return {sampling_row[e]: tuple(d) for e, d in zip(chosen, drafts)}

    @staticmethod
    def _last_valid_rows(batch: StepBatch, sampling_row: list[int], sampled: list[int]) -> list[int]:
        """The row (entry of `batch`) that ends each sampling request's step: its only row, or for a speculating
        request (its first row followed by `verified_drafts` draft rows) the row of its last accepted draft."""
        chosen, e = [], 0
        while e < len(batch.num_new_tokens):
            k = batch.verified_drafts[e] if batch.verified_drafts else 0
            if k:
                first = sampling_row[e]
                accepted = 0
                # row e + j + 1 holds draft j + 1 (decode rows, first in the batch: its index in the flat ids too)
                while accepted < k and sampled[first + accepted] == batch.token_ids[e + accepted + 1]:
                    accepted += 1
                chosen.append(e + accepted)
                e += k + 1
                continue
            if sampling_row[e] >= 0:
                chosen.append(e)
            e += 1
        return chosen
