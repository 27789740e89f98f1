"""The recurrent layers' kernels (kvflow/kernels/recurrent.py): kvflow's C kernels (csrc/recurrent.c) against their
torch definitions, within float32 rounding, over several runs of different lengths in one call with snapshots, GQA
(Hv = 2 Hk) and Mamba2 groups (G = 2); both against transformers' own recurrences (Qwen3.5's
torch_recurrent_gated_delta_rule, Granite 4.0 H's decode update) and F.conv1d; each one's batch invariance, bit for
bit: a run's outputs and state are the same whatever shares its call and wherever its tokens are split across calls;
and the torch definitions serving where the C kernels do not (KVFLOW_NATIVE_KERNELS=0, other dtypes)."""
from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pytest
import torch
import torch.nn.functional as F

from kvflow.kernels import build, ops, recurrent
from kvflow.kernels.recurrent import StateBatch

needs_native = pytest.mark.skipif(
    not build.usable(),
    reason="kvflow's kernels cannot run on this machine (no AVX2/FMA or no C compiler): the torch definitions serve")

# the implementations under test: the public functions (the C kernels here, on CPU float32) and the definitions
IMPLS = [pytest.param("native", marks=needs_native), "reference"]
SLOTS = 12
TOLERANCE = {"rtol": 1e-5, "atol": 1e-5}      # float32 rounding: the two sum in different orders


def state_batch(lengths: list[int], slots: list[int], snapshots: list[tuple[int, int]] = ()) -> StateBatch:
    """Consecutive runs of these lengths on these slots; snapshots: (flat row, slot) pairs, rows ascending."""
    starts = [0]
    for n in lengths:
        starts.append(starts[-1] + n)
    long = lambda values: torch.tensor(list(values), dtype=torch.long)
    return StateBatch(long(starts), long(slots), long(r for r, _ in snapshots), long(s for _, s in snapshots))


@dataclass(frozen=True)
class Kernel:
    """One of the three kernels with inputs of a shape that exercises its vector paths and their tails."""
    name: str
    rows: Callable[[int, torch.Generator], dict[str, torch.Tensor]]     # the inputs of T rows
    params: Callable[[torch.Generator], dict]                           # the layer's own (weights, A, D)
    slot_shape: tuple[int, ...]
    native: Callable
    reference: Callable

    def state(self, seed: int) -> torch.Tensor:
        return 0.5 * torch.randn(SLOTS, *self.slot_shape, generator=torch.Generator().manual_seed(seed))

    def call(self, impl: str, rows: dict, params: dict, state: torch.Tensor, batch: StateBatch) -> torch.Tensor:
        return (self.native if impl == "native" else self.reference)(**rows, **params, state=state, batch=batch)


# conv: two blocks of 256 channels, the second ending in 4 channels past the last vector
CONV_C, CONV_K = 300, 4
# GDN: GQA (Hv = 2 Hk); dv = 44 is a block of 32 columns, one of 8 and 4 columns past the last vector
GDN_HK, GDN_HV, GDN_DK, GDN_DV = 2, 4, 16, 44
# Mamba2: two groups; N = 36 is 4 vectors and 4 values past them
SSM_H, SSM_P, SSM_G, SSM_N = 8, 16, 2, 36


def _conv_rows(T, g):
    return {"x": torch.randn(T, CONV_C, generator=g)}


def _conv_params(g):
    return {"weight": 0.5 * torch.randn(CONV_C, CONV_K, generator=g), "bias": torch.randn(CONV_C, generator=g),
            "silu": True}


def _gdn_rows(T, g):
    return {"q": torch.randn(T, GDN_HK, GDN_DK, generator=g), "k": torch.randn(T, GDN_HK, GDN_DK, generator=g),
            "v": torch.randn(T, GDN_HV, GDN_DV, generator=g), "g": -2 * torch.rand(T, GDN_HV, generator=g),
            "beta": torch.sigmoid(torch.randn(T, GDN_HV, generator=g))}


def _ssm_rows(T, g):
    return {"x": torch.randn(T, SSM_H, SSM_P, generator=g), "dt": 0.01 + 0.5 * torch.rand(T, SSM_H, generator=g),
            "B": torch.randn(T, SSM_G, SSM_N, generator=g), "C": torch.randn(T, SSM_G, SSM_N, generator=g)}


def _ssm_params(g):
    return {"A": -0.5 - 4 * torch.rand(SSM_H, generator=g), "D": torch.randn(SSM_H, generator=g)}


KERNELS = {k.name: k for k in (
    Kernel("causal_conv1d", _conv_rows, _conv_params, (CONV_K - 1, CONV_C), recurrent.causal_conv1d,
           recurrent.causal_conv1d_reference),
    Kernel("gated_delta_rule", _gdn_rows, lambda g: {}, (GDN_HV, GDN_DK, GDN_DV), recurrent.gated_delta_rule,
           recurrent.gated_delta_rule_reference),
    Kernel("ssm_scan", _ssm_rows, _ssm_params, (SSM_H, SSM_P, SSM_N), recurrent.ssm_scan,
           recurrent.ssm_scan_reference),
)}


def inputs(kernel: Kernel, T: int, seed: int) -> tuple[dict, dict]:
    g = torch.Generator().manual_seed(seed)
    return kernel.rows(T, g), kernel.params(g)


def rows_of(rows: dict, a: int, b: int) -> dict:
    return {name: t[a:b] for name, t in rows.items()}


def cat_rows(*parts: dict) -> dict:
    return {name: torch.cat([p[name] for p in parts]) for name in parts[0]}


@needs_native
@pytest.mark.parametrize("name", KERNELS)
def test_native_matches_definition(name):
    """Five runs of 3, 1, 9, 2 and 6 rows in one call, on scattered slots, with snapshots after a run's first row
    (the convolution's window then still holds state rows), mid-run, a run's last row and a one-row run: outputs and
    every slot (snapshot slots, and untouched slots left as they were) as the torch definition gives them."""
    assert recurrent._native() is not None          # the public function runs the C kernel here
    kernel = KERNELS[name]
    rows, params = inputs(kernel, 21, seed=1)
    batch = state_batch([3, 1, 9, 2, 6], [4, 0, 7, 2, 9], [(0, 10), (5, 11), (12, 1), (15, 3)])
    start = kernel.state(2)
    native_state, reference_state = start.clone(), start.clone()
    out = kernel.call("native", rows, params, native_state, batch)
    expected = kernel.call("reference", rows, params, reference_state, batch)
    torch.testing.assert_close(out, expected, **TOLERANCE)
    torch.testing.assert_close(native_state, reference_state, **TOLERANCE)
    for slot in (5, 6, 8):                          # no run's, no snapshot's
        assert torch.equal(native_state[slot], start[slot])
    for slot in (4, 0, 7, 2, 9, 10, 11, 1, 3):      # the runs' and the snapshots'
        assert not torch.equal(native_state[slot], start[slot])


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("name", KERNELS)
def test_batch_invariance(name, impl):
    """A run of 11 rows (with a snapshot after its 6th) gives the same bits alone, beside other runs (a call big
    enough for the C kernels' threads), and split across two calls at rows 1, 2, 5 and 10, alone or beside others."""
    kernel = KERNELS[name]
    rows, params = inputs(kernel, 11, seed=3)
    others, _ = inputs(kernel, 4 + 1 + 40 + 2 + 13, seed=4)
    start = kernel.state(5)
    slot, snap = 6, 11

    state = start.clone()
    alone = kernel.call(impl, rows, params, state, state_batch([11], [slot], [(5, snap)]))
    final, snapshot = state[slot].clone(), state[snap].clone()

    state = start.clone()
    mixed = cat_rows(rows_of(others, 0, 5), rows, rows_of(others, 5, 45))
    out = kernel.call(impl, mixed, params, state,
                      state_batch([4, 1, 11, 40], [0, 3, slot, 9], [(2, 1), (5 + 5, snap), (17, 2)]))
    assert torch.equal(out[5:16], alone)
    assert torch.equal(state[slot], final) and torch.equal(state[snap], snapshot)

    for split in (1, 2, 5, 10):
        for beside in (False, True):
            state = start.clone()
            if beside:      # each chunk shares its call with other runs, before and after it
                first = kernel.call(impl, cat_rows(rows_of(others, 45, 47), rows_of(rows, 0, split)), params,
                                    state, state_batch([2, split], [0, slot]))[2:]
                second = kernel.call(impl, cat_rows(rows_of(rows, split, 11), rows_of(others, 47, 60)), params,
                                     state, state_batch([11 - split, 13], [slot, 4]))[:11 - split]
            else:
                first = kernel.call(impl, rows_of(rows, 0, split), params, state, state_batch([split], [slot]))
                second = kernel.call(impl, rows_of(rows, split, 11), params, state, state_batch([11 - split], [slot]))
            assert torch.equal(torch.cat([first, second]), alone), (split, beside)
            assert torch.equal(state[slot], final), (split, beside)


@needs_native
@pytest.mark.parametrize("name", KERNELS)
def test_native_bits_do_not_depend_on_threads(name):
    """A call big enough to be split over threads gives the same bits on one thread and on two."""
    kernel = KERNELS[name]
    rows, params = inputs(kernel, 60, seed=6)
    batch = state_batch([27, 1, 32], [1, 5, 8], [(3, 2), (40, 3)])
    results = []
    try:
        for threads in (1, 2):
            ops.set_threads(threads)
            state = kernel.state(7)
            results.append((kernel.call("native", rows, params, state, batch), state))
    finally:
        ops.set_threads(None)
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])


@needs_native
@pytest.mark.skipif(build.isa() != "avx512", reason="the CPU runs no AVX-512 kernels")
def test_gated_delta_rule_avx512_gives_the_avx2_bits():
    """The delta rule's AVX-512 passes (blocks of 64 and 16 columns) and its AVX2 ones (32, 8, then columns one by
    one): dv = 91 takes every kind; outputs and state bit for bit."""
    g = torch.Generator().manual_seed(21)
    T, H, dk, dv = 9, 2, 24, 91
    q, k = torch.randn(T, H, dk, generator=g), torch.randn(T, H, dk, generator=g)
    v, gate, beta = torch.randn(T, H, dv, generator=g), -torch.rand(T, H, generator=g), torch.rand(T, H, generator=g)
    start = torch.randn(4, H, dk, dv, generator=g)
    batch = state_batch([6, 3], [0, 2], [(2, 3)])
    lib = build.library()
    results = []
    try:
        for avx512 in (1, 0):
            lib.kvflow_recurrent_use_avx512(avx512)
            state = start.clone()
            results.append((recurrent.gated_delta_rule(q, k, v, gate, beta, state, batch), state))
    finally:
        lib.kvflow_recurrent_use_avx512(int(build.isa() == "avx512"))
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])
    torch.testing.assert_close(results[0][0], recurrent.gated_delta_rule_reference(q, k, v, gate, beta, start.clone(),
                                                                                  batch), **TOLERANCE)


@pytest.mark.parametrize("name", KERNELS)
def test_other_dtypes_run_the_definition(name):
    """bfloat16 inputs (the state float32; the convolution's window in bfloat16) go to the torch definition."""
    kernel = KERNELS[name]
    rows, params = inputs(kernel, 7, seed=8)
    rows = {n: t.bfloat16() if n in ("x", "q", "k", "v", "B", "C") else t for n, t in rows.items()}
    start = kernel.state(9)
    if name == "causal_conv1d":
        start = start.bfloat16()
    batch = state_batch([3, 4], [1, 2], [(4, 3)])
    a, b = start.clone(), start.clone()
    out = kernel.native(**rows, **params, state=a, batch=batch)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, kernel.reference(**rows, **params, state=b, batch=batch)) and torch.equal(a, b)


FALLBACK_SCRIPT = """
import torch
from kvflow.kernels import recurrent
from test_recurrent_kernels import KERNELS, inputs, state_batch
assert recurrent._native() is None
for kernel in KERNELS.values():
    rows, params = inputs(kernel, 9, seed=10)
    batch = state_batch([4, 5], [0, 3], [(1, 2)])
    a, b = kernel.state(11), kernel.state(11)
    assert torch.equal(kernel.native(**rows, **params, state=a, batch=batch),
                       kernel.reference(**rows, **params, state=b, batch=batch)), kernel.name
    assert torch.equal(a, b), kernel.name
print("fallback ok")
"""


def test_fallback_with_native_kernels_off():
    """KVFLOW_NATIVE_KERNELS=0: the public functions compute what the torch definitions do, bit for bit."""
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "KVFLOW_NATIVE_KERNELS": "0",
           "PYTHONPATH": os.pathsep.join([str(root), str(root / "tests"), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", FALLBACK_SCRIPT], env=env, cwd=root, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0 and "fallback ok" in done.stdout, done.stderr[-2000:]


@needs_native
@pytest.mark.parametrize("name", KERNELS)
def test_native_rejects_runs_it_cannot_run(name):
    """Runs that would write one slot twice (two runs, or a snapshot onto a run's slot), a slot past the tensors,
    snapshot rows out of order: a ValueError, not a race."""
    kernel = KERNELS[name]
    rows, params = inputs(kernel, 6, seed=12)
    for batch in (state_batch([3, 3], [1, 1]), state_batch([3, 3], [1, SLOTS]), state_batch([6], [1], [(2, 1)]),
                  state_batch([6], [1], [(4, 2), (2, 3)])):
        with pytest.raises(ValueError):
            kernel.native(**rows, **params, state=kernel.state(13), batch=batch)


# ---- against transformers and torch ----

@pytest.mark.parametrize("impl", IMPLS)
def test_gated_delta_rule_matches_transformers(impl):
    """Qwen3.5's torch_recurrent_gated_delta_rule (use_qk_l2norm_in_kernel=True, from each run's state), per run of
    a call of three runs, GQA: outputs and final states."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import torch_recurrent_gated_delta_rule

    kernel = KERNELS["gated_delta_rule"]
    rows, _ = inputs(kernel, 14, seed=14)
    lengths, slots = [5, 1, 8], [3, 0, 7]
    start = kernel.state(15)
    state = start.clone()
    out = kernel.call(impl, rows, {}, state, state_batch(lengths, slots))
    a = 0
    for n, slot in zip(lengths, slots):
        r = {name: t[a:a + n][None] for name, t in rows.items()}
        expected, final = torch_recurrent_gated_delta_rule(r["q"], r["k"], r["v"], r["g"], r["beta"],
                                                           initial_state=start[slot][None].clone(),
                                                           output_final_state=True, use_qk_l2norm_in_kernel=True)
        torch.testing.assert_close(out[a:a + n], expected[0], **TOLERANCE)
        torch.testing.assert_close(state[slot], final[0], **TOLERANCE)
        a += n


@pytest.mark.parametrize("impl", IMPLS)
def test_ssm_scan_matches_transformers_decode(impl):
    """Granite 4.0 H's decode step (mamba2_selective_state_update, as GraniteMoeHybridMambaLayer's torch path calls
    it for one token: dt, A, D expanded over the head dim), token after token, per run of a call of two runs."""
    from transformers.models.granitemoehybrid.modeling_granitemoehybrid import mamba2_selective_state_update

    kernel = KERNELS["ssm_scan"]
    rows, params = inputs(kernel, 9, seed=16)
    lengths, slots = [6, 3], [2, 5]
    start = kernel.state(17)
    state = start.clone()
    out = kernel.call(impl, rows, params, state, state_batch(lengths, slots))
    P, N = SSM_P, SSM_N
    A = params["A"][:, None, None].expand(-1, P, N)
    D = params["D"][:, None].expand(-1, P)
    a = 0
    for n, slot in zip(lengths, slots):
        hf_state = start[slot][None].clone()
        for t in range(a, a + n):
            dt = rows["dt"][t][None, :, None].expand(-1, -1, P)
            y = mamba2_selective_state_update(hf_state, rows["x"][t][None], dt,
                                              A, rows["B"][t][None], rows["C"][t][None], D)
            torch.testing.assert_close(out[t], y[0], **TOLERANCE)
        torch.testing.assert_close(state[slot], hf_state[0], **TOLERANCE)
        a += n


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("C, K, n, bias, silu", [(8, 4, 1, True, True), (300, 4, 9, True, True),
                                                  (64, 3, 2, False, False), (33, 2, 5, True, False)])
def test_causal_conv1d_matches_conv1d(impl, C, K, n, bias, silu):
    """F.conv1d (depthwise, groups = C) over the run's window, its state then its rows; the state after it is the
    window's last K - 1 inputs."""
    g = torch.Generator().manual_seed(18)
    x, weight = torch.randn(n, C, generator=g), torch.randn(C, K, generator=g)
    b = torch.randn(C, generator=g) if bias else None
    state = torch.randn(3, K - 1, C, generator=g)
    window = torch.cat([state[1], x])
    fn = recurrent.causal_conv1d if impl == "native" else recurrent.causal_conv1d_reference
    out = fn(x, weight, b, state, state_batch([n], [1]), silu)
    expected = F.conv1d(window.T[None], weight[:, None, :], b, groups=C)[0].T
    torch.testing.assert_close(out, F.silu(expected) if silu else expected, **TOLERANCE)
    assert torch.equal(state[1], window[n:])
