"""kvflow's AVX2 kernels for 4-bit and 8-bit weights (layers/native_kernels.c): the same arithmetic as a torch
reference (int8 activations per group of 32), every row-count remainder, inside a compiled graph, and in the
default model where the machine takes them."""
from __future__ import annotations

import pytest
import torch

from kvflow.layers import native_kernels
from kvflow.layers.group_quant import GroupQuantized
from kvflow.layers.int4 import Int4Linear

pytestmark = pytest.mark.skipif(
    not (native_kernels.wanted(torch.device("cpu"), torch.float32) and native_kernels.library() is not None),
    reason="kvflow's AVX2 kernels are not used on this machine (no AVX2/FMA, native bf16, or no C compiler)")


def quantized_activations(x: torch.Tensor):
    """What the kernel does to x: per group of 32, scale max|x| / 127, codes rounded half to even."""
    groups = x.view(x.shape[0], -1, 32)
    d = groups.abs().amax(-1) / 127
    inv = torch.where(d > 0, 1 / d, torch.zeros_like(d))
    q = torch.round(groups * inv[..., None])
    return q.double(), d.double()


def reference(x, codes, scale, minimum=None):
    """sum over groups of (w_scale * x_scale) * integer dot (+ minimum * x_scale * sum of x codes), in float64."""
    q, d = quantized_activations(x)
    n = codes.shape[0]
    w = codes.double().view(n, -1, 32)
    dots = torch.einsum("mgk,ngk->mng", q, w)
    y = (dots * scale.double()[None] * d[:, None]).sum(-1)
    if minimum is not None:
        y += (minimum.double()[None] * (d * q.sum(-1))[:, None]).sum(-1)
    return y


@pytest.mark.parametrize("rows", [1, 3, 4, 5, 64, 65, 130])
@pytest.mark.parametrize("n,k", [(1, 32), (17, 96), (96, 576)])
def test_q4_kernel_matches_the_reference(rows, n, k):
    g = torch.Generator().manual_seed(rows * 1000 + n + k)
    codes = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    scale = torch.rand(n, k // 32, generator=g) * 0.02
    minimum = -torch.rand(n, k // 32, generator=g) * 0.2
    x = torch.randn(rows, k, generator=g) * 3
    got = native_kernels.q4_linear(x, native_kernels.pack_q4(codes), scale, minimum)
    want = reference(x, codes, scale, minimum)
    assert got.shape == (rows, n)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


@pytest.mark.parametrize("rows", [1, 4, 7, 70])
def test_q8_kernel_matches_the_reference_including_code_minus_128(rows):
    g = torch.Generator().manual_seed(rows)
    n, k = 50, 128
    codes = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8)
    codes[0, :] = -128
    scale = torch.rand(n, k // 32, generator=g) * 0.01
    x = torch.randn(rows, k, generator=g)
    x[0, :32] = 0                                       # an all-zero group: scale 0, no division by it
    got = native_kernels.q8_linear(x, codes, scale)
    want = reference(x, codes, scale)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


def test_native_int4_linear_holds_the_same_values_and_stays_close_to_float():
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(192, 256, generator=g) * 0.05
    gq = GroupQuantized.round_to_nearest(weight, bits=4, group=32)
    layer = Int4Linear(gq, bias=torch.randn(192, generator=g), native=True)
    assert layer.native
    torch.testing.assert_close(layer.dequantize(torch.float32), gq.dequantize(), rtol=0, atol=1e-6)
    for rows in (9, layer.kernel_rows + 1):              # the kernel; a large step dequantizes instead
        x = torch.randn(rows, 256, generator=g)
        want = x @ gq.dequantize().T + layer.bias
        err = (layer(x) - want).norm() / want.norm()
        assert err < 0.01, err                           # int8 activations: well under 1% of the output


def test_native_kernels_inside_a_compiled_graph():
    g = torch.Generator().manual_seed(1)
    layer = Int4Linear(GroupQuantized.round_to_nearest(torch.randn(64, 96, generator=g)), native=True)
    x = torch.randn(3, 96, generator=g)
    compiled = torch.compile(lambda t: layer(t * 2) + 1, fullgraph=True)
    torch.testing.assert_close(compiled(x), layer(x * 2) + 1)
