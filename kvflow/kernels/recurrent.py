"""The recurrent layers' kernels: what a hybrid model's convolution, Gated DeltaNet and Mamba2 layers compute per
token, over a state kept per request in a slot of the layer's state tensors (layers/recurrent_state.py).

Every function takes the step's runs (`StateBatch`: consecutive rows continuing one slot) and walks each run token
after token, the sequential recurrence, for prefill and decode alike: a token's arithmetic is then the same whatever
the scheduler's split of its prompt and whatever shares its step (batch invariance), and the state after any row can
be copied out exactly (`snapshot_rows` -> `snapshot_slots`: prefix-cache checkpoints, per-draft snapshots). This is
what llama.cpp runs on CPUs; the chunked form's bits move with the chunk boundaries.

The state is float32 whatever the compute dtype (a narrower state rounds at step boundaries, which move with the
scheduler). Reductions run in one fixed order per (token, head).

`causal_conv1d`, `gated_delta_rule` and `ssm_scan` run kvflow's C kernels (csrc/recurrent.c) where they run here
(build.usable(); not with KVFLOW_NATIVE_KERNELS=0) on CPU float32 tensors, and otherwise their torch definitions
(`*_reference`, any device and dtype), which say what they compute. The two give the same values within float32
rounding, not the same bits (their sums run in other orders); each is batch invariant on its own. The C kernels run
the (run, head) pairs on several threads, so they take a step whose runs and snapshots each have a slot of their
own (a ValueError otherwise), as the scheduler gives them.
"""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvflow.kernels import build, ops


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


def causal_conv1d_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, state: torch.Tensor,
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
        if silu:
            # row by row: torch's elementwise kernels take their vector exp for most elements of a tensor and libm's
            # for those past the last full vector (or a thread's share), so on the [n, C] block a channel's bits
            # would move with n; on each row they depend on the channel alone
            for i in range(n):
                acc[i] = F.silu(acc[i])
        out[a:b] = acc.to(x.dtype)
        for row, dst in snaps:
            state[dst] = window[row - a + 1:row - a + K].to(state.dtype)
        state[slot] = window[n:].to(state.dtype)
    return out


def _l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def gated_delta_rule_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                               beta: torch.Tensor, state: torch.Tensor, batch: StateBatch) -> torch.Tensor:
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
        for t in range(a, b):
            S = S * gf[t].exp()[:, None, None]
            u = (S * kf[t][:, :, None]).sum(dim=1)                        # [Hv, dv]
            d = (vf[t] - u) * bf[t][:, None]
            S = S + kf[t][:, :, None] * d[:, None, :]
            out[t] = (S * qf[t][:, :, None]).sum(dim=1).to(v.dtype)
            for row, dst in snaps:
                if row == t:
                    state[dst] = S
        state[slot] = S
    return out


def ssm_scan_reference(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                       D: torch.Tensor, state: torch.Tensor, batch: StateBatch) -> torch.Tensor:
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
        for t in range(a, b):
            dA = torch.exp(dtf[t] * Af)                                   # [H]
            S = S * dA[:, None, None] + (dtf[t][:, None] * xf[t])[:, :, None] * Bf[t][:, None, :]
            out[t] = ((S * Cf[t][:, None, :]).sum(dim=-1) + Df[:, None] * xf[t]).to(x.dtype)
            for row, dst in snaps:
                if row == t:
                    state[dst] = S
        state[slot] = S
    return out


def sigmoid_mul_reference(x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """Gated attention's output gate (Qwen3.5): x [T, H * D] times sigmoid(gate), gate [T, H, D] (any strides)."""
    return x * torch.sigmoid(gate.reshape(x.shape))


def gdn_gates_reference(ba: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor) -> tuple[torch.Tensor,
                                                                                               torch.Tensor]:
    """Gated DeltaNet's per-token gates from ba [T, 2 Hv] (b then a): beta = sigmoid(b) [T, Hv] in ba's dtype, and
    the log decay g = -exp(A_log) * softplus(a + dt_bias) [T, Hv] (<= 0), in float32 whatever the dtype (as
    transformers: -inf otherwise in fp16), torch's softplus passing x above 20 as it is."""
    b, a = ba.split(A_log.shape[0], dim=-1)
    return b.sigmoid(), -A_log.float().exp() * F.softplus(a.float() + dt_bias)


def gated_rms_norm_reference(o: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Qwen3.5's RMSNormGated: RMSNorm over each value head's dv values (o [T, Hv, dv]), times weight (as it is),
    times silu(z) (z [T, Hv, dv], any strides): norm before gate, in float32, as transformers computes it."""
    normed = F.rms_norm(o.float(), o.shape[-1:], None, eps)
    return (weight * normed.to(o.dtype) * F.silu(z.float())).to(o.dtype)


def mamba2_gates_reference(raw: torch.Tensor, dt_bias: torch.Tensor, A_log: torch.Tensor,
                           limit: tuple[float, float]) -> tuple[torch.Tensor, torch.Tensor]:
    """Mamba2's time steps from raw [T, H]: dt = softplus(raw + dt_bias) clamped to `limit` (transformers' ops in
    raw's dtype: its chunked prefill clamps, its decode step does not, which the default (0, inf) makes the same), and
    A = -exp(A_log) [H] in float32."""
    dt = F.softplus(raw + dt_bias.to(raw.dtype))
    if tuple(limit) != (0.0, float("inf")):
        dt = dt.clamp(*limit)
    return dt, -torch.exp(A_log.float())


def gated_group_rms_norm_reference(y: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, group: int,
                                   eps: float) -> torch.Tensor:
    """Granite 4.0 H's RMSNormGated (the gate first): y * silu(z) [T, n], RMS-normalised over each group of `group`
    channels in float32, times the weight (in y's dtype)."""
    h = y.float() * F.silu(z.float())
    groups = h.view(*h.shape[:-1], -1, group)
    h = (groups * torch.rsqrt(groups.pow(2).mean(-1, keepdim=True) + eps)).view(h.shape)
    return weight * h.to(y.dtype)


# ---- the dispatch: kvflow's C kernels on CPU float32, else the definitions above ----

@functools.cache
def _library_here():
    return build.library() if build.usable() else None


def _native():
    """The C kernels where they run here, else None (KVFLOW_NATIVE_KERNELS=0 checked per call, the rest once)."""
    if os.environ.get("KVFLOW_NATIVE_KERNELS", "1") == "0":
        return None
    return _library_here()


def _on_native(state: torch.Tensor, *tensors: torch.Tensor) -> bool:
    """CPU float32 inputs and a contiguous CPU float32 state (updated in place through its pointer)."""
    return (state.is_cpu and state.dtype == torch.float32 and state.is_contiguous()
            and all(t.is_cpu and t.dtype == torch.float32 for t in tensors))


def state_runs(batch: StateBatch, slots: int) -> tuple[build.StateRuns, tuple[torch.Tensor, ...]]:
    """The runs as the C kernels (and the native step) read them, and the int64 tensors the struct points into (the
    caller holds them for the call). The runner's are int64 already: no copies."""
    held = tuple(t if t.dtype == torch.int64 and t.is_cpu and t.is_contiguous() else
                 t.to(device="cpu", dtype=torch.int64).contiguous()
                 for t in (batch.run_starts, batch.run_slots, batch.snapshot_rows, batch.snapshot_slots))
    starts, run_slots, rows, snap_slots = held
    runs = build.StateRuns(starts.data_ptr(), run_slots.data_ptr(), run_slots.numel(), rows.data_ptr(),
                           snap_slots.data_ptr(), rows.numel(), slots)
    return runs, held


def _check(err: int, what: str) -> None:
    if err == 2:
        raise ValueError(f"native kernel: {what}: the step's runs are not runs of these rows over these slots (a run "
                         "outside the rows, a slot out of range or taken twice, snapshot rows not ascending), or "
                         "the heads do not divide")
    if err:
        raise MemoryError(f"native kernel: out of memory for {what}")


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, state: torch.Tensor,
                  batch: StateBatch, silu: bool) -> torch.Tensor:
    """`causal_conv1d_reference`'s convolution; on kvflow's C kernel for CPU float32 x and state."""
    lib = _native()
    T, C = x.shape
    K = weight.shape[-1]
    if (lib is None or not _on_native(state, x) or weight.shape != (C, K) or state.shape[1:] != (K - 1, C)
            or (bias is not None and bias.shape != (C,))):
        return causal_conv1d_reference(x, weight, bias, state, batch, silu)
    x = x.contiguous()
    w = weight.float().contiguous()
    b = bias.float().contiguous() if bias is not None else None
    out = torch.empty_like(x)
    runs, held = state_runs(batch, state.shape[0])
    _check(lib.kvflow_causal_conv1d(x.data_ptr(), T, C, w.data_ptr(), K, b.data_ptr() if b is not None else None,
                                    state.data_ptr(), runs, int(silu), out.data_ptr(), ops.threads()),
           "causal_conv1d")
    return out


def gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                     state: torch.Tensor, batch: StateBatch) -> torch.Tensor:
    """`gated_delta_rule_reference`'s recurrence; on kvflow's C kernel for CPU float32 q, k, v and state."""
    lib = _native()
    T, Hk, dk = k.shape
    Hv, dv = v.shape[1], v.shape[2]
    if (lib is None or not _on_native(state, q, k, v) or q.shape != k.shape or v.shape[0] != T
            or g.shape != (T, Hv) or beta.shape != (T, Hv) or state.shape[1:] != (Hv, dk, dv)):
        return gated_delta_rule_reference(q, k, v, g, beta, state, batch)
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    g, beta = g.float().contiguous(), beta.float().contiguous()
    out = torch.empty_like(v)
    runs, held = state_runs(batch, state.shape[0])
    _check(lib.kvflow_gated_delta_rule(q.data_ptr(), k.data_ptr(), v.data_ptr(), g.data_ptr(), beta.data_ptr(), T,
                                       Hk, Hv, dk, dv, state.data_ptr(), runs, out.data_ptr(), ops.threads()),
           "gated_delta_rule")
    return out


def ssm_scan(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor, D: torch.Tensor,
             state: torch.Tensor, batch: StateBatch) -> torch.Tensor:
    """`ssm_scan_reference`'s selective state update; on kvflow's C kernel for CPU float32 x, B, C and state."""
    lib = _native()
    T, H, P = x.shape
    G, N = B.shape[1], B.shape[2]
    if (lib is None or not _on_native(state, x, B, C) or B.shape != (T, G, N) or C.shape != B.shape
            or dt.shape != (T, H) or A.shape != (H,) or D.shape != (H,) or state.shape[1:] != (H, P, N)):
        return ssm_scan_reference(x, dt, A, B, C, D, state, batch)
    x, B, C = x.contiguous(), B.contiguous(), C.contiguous()
    dt, A, D = dt.float().contiguous(), A.float().contiguous(), D.float().contiguous()
    out = torch.empty_like(x)
    runs, held = state_runs(batch, state.shape[0])
    _check(lib.kvflow_ssm_scan(x.data_ptr(), dt.data_ptr(), A.data_ptr(), B.data_ptr(), C.data_ptr(), D.data_ptr(),
                               T, H, P, G, N, state.data_ptr(), runs, out.data_ptr(), ops.threads()), "ssm_scan")
    return out


def sigmoid_mul(x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """`sigmoid_mul_reference`; on kvflow's C kernel (csrc/recurrent.c, which the native step calls too) for CPU
    float32 x [T, H * D] contiguous and gate [T, H, D] whose last dimension is contiguous."""
    lib = _native()
    T, H, D = gate.shape
    if (lib is None or not all(t.is_cpu and t.dtype == torch.float32 for t in (x, gate)) or not x.is_contiguous()
            or x.shape != (T, H * D) or gate.stride(2) != 1):
        return sigmoid_mul_reference(x, gate)
    out = torch.empty_like(x)
    lib.kvflow_sigmoid_mul(x.data_ptr(), T, H, D, gate.data_ptr(), gate.stride(0), gate.stride(1), out.data_ptr())
    return out


def gdn_gates(ba: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`gdn_gates_reference`; on kvflow's C kernel for CPU float32 ba whose rows are contiguous."""
    lib = _native()
    T, Hv = ba.shape[0], A_log.shape[0]
    if (lib is None or not all(t.is_cpu and t.dtype == torch.float32 for t in (ba, A_log, dt_bias))
            or ba.shape != (T, 2 * Hv) or ba.stride(1) != 1):
        return gdn_gates_reference(ba, A_log, dt_bias)
    A_log, dt_bias = A_log.contiguous(), dt_bias.contiguous()
    beta, g = torch.empty(T, Hv), torch.empty(T, Hv)
    lib.kvflow_gdn_gates(ba.data_ptr(), T, Hv, ba.stride(0), A_log.data_ptr(), dt_bias.data_ptr(), beta.data_ptr(),
                         g.data_ptr())
    return beta, g


def gated_rms_norm(o: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`gated_rms_norm_reference`; on kvflow's C kernel for CPU float32 o [T, Hv, dv] contiguous and z [T, Hv, dv]
    whose heads are dv apart in rows."""
    lib = _native()
    T, Hv, dv = o.shape
    if (lib is None or not all(t.is_cpu and t.dtype == torch.float32 for t in (o, z, weight))
            or not o.is_contiguous() or z.shape != o.shape or z.stride(2) != 1 or z.stride(1) != dv
            or weight.shape != (dv,)):
        return gated_rms_norm_reference(o, z, weight, eps)
    weight = weight.contiguous()
    out = torch.empty_like(o)
    lib.kvflow_gated_rms_norm(o.data_ptr(), T, Hv, dv, z.data_ptr(), z.stride(0), weight.data_ptr(), eps,
                              out.data_ptr(), ops.threads())
    return out


def mamba2_gates(raw: torch.Tensor, dt_bias: torch.Tensor, A_log: torch.Tensor,
                 limit: tuple[float, float]) -> tuple[torch.Tensor, torch.Tensor]:
    """`mamba2_gates_reference`; on kvflow's C kernel for CPU float32 raw whose rows are contiguous."""
    lib = _native()
    T, H = raw.shape
    if (lib is None or not all(t.is_cpu and t.dtype == torch.float32 for t in (raw, dt_bias, A_log))
            or raw.stride(1) != 1 or dt_bias.shape != (H,) or A_log.shape != (H,)):
        return mamba2_gates_reference(raw, dt_bias, A_log, limit)
    dt_bias, A_log = dt_bias.contiguous(), A_log.contiguous()
    dt, A = torch.empty(T, H), torch.empty(H)
    lib.kvflow_mamba2_gates(raw.data_ptr(), T, H, raw.stride(0), dt_bias.data_ptr(), A_log.data_ptr(),
                            float(limit[0]), float(limit[1]), dt.data_ptr(), A.data_ptr())
    return dt, A


def gated_group_rms_norm(y: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, group: int,
                         eps: float) -> torch.Tensor:
    """`gated_group_rms_norm_reference`; on kvflow's C kernel for CPU float32 y [T, n] contiguous and z [T, n]
    whose rows are contiguous."""
    lib = _native()
    T, n = y.shape
    if (lib is None or not all(t.is_cpu and t.dtype == torch.float32 for t in (y, z, weight))
            or not y.is_contiguous() or z.shape != y.shape or z.stride(1) != 1 or weight.shape != (n,) or n % group):
        return gated_group_rms_norm_reference(y, z, weight, group, eps)
    weight = weight.contiguous()
    out = torch.empty_like(y)
    lib.kvflow_gated_group_rms_norm(y.data_ptr(), T, n, group, z.data_ptr(), z.stride(0), weight.data_ptr(), eps,
                                    out.data_ptr(), ops.threads())
    return out
