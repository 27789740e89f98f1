"""The recurrent layers' kernels: what a hybrid model's convolution, Gated DeltaNet and Mamba2 layers compute per
token, over a state kept per request in a slot of the layer's state tensors (layers/recurrent_state.py).

Every function takes the step's runs (`StateBatch`: consecutive rows continuing one slot) and walks each run token
after token, the sequential recurrence, for prefill and decode alike: a token's arithmetic is then the same whatever
the scheduler's split of its prompt and whatever shares its step (batch invariance), and the state after any row can
be copied out exactly (`snapshot_rows` -> `snapshot_slots`: prefix-cache checkpoints, per-draft snapshots). This is
what llama.cpp runs on CPUs; the chunked form's bits move with the chunk boundaries.

The state is float32 whatever the compute dtype (a narrower state rounds at step boundaries, which move with the
scheduler). Reductions run in one fixed order per (token, head).

These are the torch definitions (any device). kvflow's C kernels (csrc/recurrent.c), where they are built, compute the
same things on CPU.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class StateBatch:
    """The step's rows as the recurrent layers (layers/recurrent_state.py) see them: runs of consecutive rows that
    continue one request's state, each in its own slot of every recurrent layer's state tensors. A prefill chunk is
    one run; a decode is a run of one row; a speculating request's last token and drafts are one run (row j's state
    depends on row j - 1). Every run updates its slot in place, token after token, in the same order whatever else
    shares the step or wherever the scheduler split the prompt. CPU tensors (the kernels loop over them)."""
    run_starts: torch.Tensor      # [runs + 1] long: each run's first row in the flat batch, then the number of rows
    run_slots: torch.Tensor       # [runs] long: the state slot each run reads and updates
    # after these rows (flat batch rows, ascending), a copy of their run's state goes to these slots: prefix-cache
    # checkpoints at block boundaries and speculative decoding's per-draft snapshots. Empty: none this step
    snapshot_rows: torch.Tensor
    snapshot_slots: torch.Tensor


def _runs(batch: StateBatch):
    """(first row, end row, slot, [(row, snapshot slot) in the run]) per run."""
    starts, slots = batch.run_starts.tolist(), batch.run_slots.tolist()
    snaps = list(zip(batch.snapshot_rows.tolist(), batch.snapshot_slots.tolist()))
    for i, slot in enumerate(slots):
        a, b = starts[i], starts[i + 1]
        yield a, b, slot, [(r, s) for r, s in snaps if a <= r < b]


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, state: torch.Tensor,
                  batch: StateBatch, silu: bool) -> torch.Tensor:
    """Depthwise causal convolution over time, channel by channel. x [T, C] (the step's rows), weight [C, K],
    bias [C] or None, state [slots, K - 1, C]: the run's last K - 1 inputs before its first row (updated in place to
    the last K - 1 inputs after it). Output [T, C]: y_t = sum_j w[:, j] x_{t-K+1+j} (j = 0..K-1, in that order),
    + bias, then SiLU if `silu`; in x's dtype."""
    K = weight.shape[1]
    out = torch.empty_like(x)
    w = weight.float()
    for a, b, slot, snaps in _runs(batch):
        window = torch.cat([state[slot].float(), x[a:b].float()])          # [K - 1 + n, C]
        n = b - a
        acc = torch.zeros(n, x.shape[1], dtype=torch.float32, device=x.device)
        for j in range(K):
            acc = acc + w[:, j] * window[j:j + n]
        if bias is not None:
            acc = acc + bias.float()
        out[a:b] = (F.silu(acc) if silu else acc).to(x.dtype)
        for row, dst in snaps:
            state[dst] = window[row - a + 1:row - a + K].to(state.dtype)
        state[slot] = window[n:].to(state.dtype)
    return out


def _l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                     state: torch.Tensor, batch: StateBatch) -> torch.Tensor:
    """Gated DeltaNet (Qwen3.5's linear-attention layers), token by token. q, k [T, Hk, dk] (after the convolution;
    l2-normalised here, q also scaled by dk ** -0.5), v [T, Hv, dv], g [T, Hv] (log decay, <= 0), beta [T, Hv]; value
    head h reads q/k head h // (Hv / Hk). state [slots, Hv, dk, dv] float32, updated in place. Per token and v-head:
        S = exp(g) S;  u = S^T k;  S = S + k (beta (v - u))^T;  o = S^T q
    Output [T, Hv, dv] in v's dtype."""
    Hk, Hv, dk = k.shape[1], v.shape[1], k.shape[2]
    out = torch.empty_like(v)
    qf = _l2norm(q.float()) * dk ** -0.5
    kf = _l2norm(k.float())
    if Hv != Hk:
        qf, kf = qf.repeat_interleave(Hv // Hk, dim=1), kf.repeat_interleave(Hv // Hk, dim=1)
    vf, gf, bf = v.float(), g.float(), beta.float()
    for a, b, slot, snaps in _runs(batch):
        S = state[slot].clone()                                           # [Hv, dk, dv]
        snap_at = dict(snaps)
        for t in range(a, b):
            S = S * gf[t].exp()[:, None, None]
            u = (S * kf[t][:, :, None]).sum(dim=1)                        # [Hv, dv]
            d = (vf[t] - u) * bf[t][:, None]
            S = S + kf[t][:, :, None] * d[:, None, :]
            out[t] = (S * qf[t][:, :, None]).sum(dim=1).to(v.dtype)
            if t in snap_at:
                state[snap_at[t]] = S
        state[slot] = S
    return out


def ssm_scan(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor, D: torch.Tensor,
             state: torch.Tensor, batch: StateBatch) -> torch.Tensor:
    """Mamba2's selective state update (Granite 4.0 H), token by token. x [T, H, P], dt [T, H] (after softplus, bias
    and clamp), A [H] (-exp(A_log)), B, C [T, G, N] (head h uses group h // (H / G)), D [H]; state [slots, H, P, N]
    float32, updated in place. Per token and head:
        S = exp(dt A) S + (dt x) B^T;  y = S C + D x
    Output [T, H, P] in x's dtype."""
    H, G = x.shape[1], B.shape[1]
    out = torch.empty_like(x)
    xf, dtf, Af, Df = x.float(), dt.float(), A.float(), D.float()
    Bf, Cf = B.float().repeat_interleave(H // G, dim=1), C.float().repeat_interleave(H // G, dim=1)   # [T, H, N]
    for a, b, slot, snaps in _runs(batch):
        S = state[slot].clone()                                           # [H, P, N]
        snap_at = dict(snaps)
        for t in range(a, b):
            dA = torch.exp(dtf[t] * Af)                                   # [H]
            S = S * dA[:, None, None] + (dtf[t][:, None] * xf[t])[:, :, None] * Bf[t][:, None, :]
            out[t] = ((S * Cf[t][:, None, :]).sum(dim=-1) + Df[:, None] * xf[t]).to(x.dtype)
            if t in snap_at:
                state[snap_at[t]] = S
        state[slot] = S
    return out
