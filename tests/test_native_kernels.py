"""kvflow's CPU kernels (layers/kernels/csrc): 4-, 6- and 8-bit weights against a torch reference of the same
arithmetic (int8 activations per group of 32), every row-count remainder, on each instruction set this CPU runs
(AVX2, AVX-512 VNNI); paged attention and RMSNorm against float64; the LoRA term against torch's; each
kernel's batch invariance (a row's bits depend on that row alone), inside a compiled graph, and greedy output of the
default engine alone against batched; the AVX2 kernels against the AVX-512 ones, bit for bit."""
from __future__ import annotations

import pytest
import torch

from kvflow.layers import kv_int8
from kvflow.kernels import build, layout, ops
from kvflow.kernels.formats import FORMATS
from kvflow.kernels.group_quant import GroupQuantized
from kvflow.layers.int4 import Int4Linear


def _linear(bits: int):
    """x @ W.T through kvflow's operator, W in weight format FORMATS[bits] (minimum: a 4-bit matrix's only)."""
    return lambda x, codes, scale, minimum=torch.empty(0): ops.x16_linear(x, codes, scale, minimum, bits)


q4_linear, q5_linear, q6_linear, q8_linear = (_linear(bits) for bits in (4, 5, 6, 8))

pytestmark = pytest.mark.skipif(
    not build.usable(),
    reason="kvflow's kernels cannot run on this machine (no AVX2/FMA or no C compiler): torch's kernels serve")

# each instruction set whose kernels this CPU runs (AVX2's run on AVX-512 machines too)
ISAS = ["avx2"] + (["avx512"] if build.has_avx512_vnni() else [])


@pytest.fixture(params=ISAS)
def isa(request):
    """The x16 matmul kernels on this instruction set for the test, then the process's own again."""
    lib = build.library()
    lib.kvflow_x16_use_avx512(int(request.param == "avx512"))
    yield request.param
    lib.kvflow_x16_use_avx512(int(build.isa() == "avx512"))


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


def q4_weights(n: int, k: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    scale = torch.rand(n, k // 32, generator=g) * 0.02
    minimum = -torch.rand(n, k // 32, generator=g) * 0.2
    packed = (FORMATS[4].pack_codes(codes), layout.pack_scales(scale),
              layout.pack_scales(minimum))
    return codes, scale, minimum, packed


@pytest.mark.parametrize("rows", [1, 3, 4, 5, 64, 65, 130])
@pytest.mark.parametrize("n,k", [(1, 32), (17, 96), (96, 576)])
def test_q4_kernel_matches_the_reference(isa, rows, n, k):
    codes, scale, minimum, packed = q4_weights(n, k, rows * 1000 + n + k)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)) * 3
    got = q4_linear(x, *packed)
    assert got.shape == (rows, layout.padded_rows(n))
    want = reference(x, codes, scale, minimum)
    torch.testing.assert_close(got[:, :n].double(), want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


@pytest.mark.parametrize("rows", [1, 4, 7, 70])
def test_q8_kernel_matches_the_reference_including_code_minus_128(isa, rows):
    g = torch.Generator().manual_seed(rows)
    n, k = 50, 128
    codes = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8)
    codes[0, :] = -128
    codes[1, :] = 127
    scale = torch.rand(n, k // 32, generator=g) * 0.01
    x = torch.randn(rows, k, generator=g)
    x[0, :32] = 0                                       # an all-zero group: scale 0, no division by it
    got = q8_linear(x, FORMATS[8].pack_codes(codes), layout.pack_scales(scale))
    want = reference(x, codes, scale)
    torch.testing.assert_close(got[:, :n].double(), want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


def q6_weights(n: int, k: int, seed: int = 0):
    """Q6_K's form: codes 0..63, an int8 multiplier per 16 columns, fp16 d per 256; value (code - 32) * mult * d.
    Codes and multipliers at both ends of their ranges in the first and last rows."""
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 64, (n, k), generator=g, dtype=torch.uint8)
    multipliers = torch.randint(-128, 128, (n, k // 16), generator=g, dtype=torch.int8)
    codes[0], codes[-1], multipliers[0], multipliers[-1] = 0, 63, -128, 127
    d = (torch.rand(n, k // 256, generator=g) * 1e-3).half()
    scale16 = d.float().repeat_interleave(16, 1) * multipliers.float()
    packed = (FORMATS[6].pack_codes(codes, multipliers), FORMATS[6].pack_d(d))
    return codes, scale16, packed


def reference_q6(x, codes, scale16):
    """The 6-bit kernel's arithmetic in float64: per group of 32, the integer dot of each half (codes - 32 times the
    activation codes) times its multiplier, summed, times d_w * d_x."""
    q, dx = quantized_activations(x)
    n = codes.shape[0]
    w = (codes.double() - 32).view(n, -1, 2, 16)
    halves = torch.einsum("mghk,nghk->mngh", q.view(q.shape[0], -1, 2, 16), w)
    mult = scale16.double().view(n, -1, 2)          # d * multiplier per half; d is one per group
    return (halves * mult[None]).sum(-1).mul(dx[:, None]).sum(-1)


@pytest.mark.parametrize("rows", [1, 3, 4, 5, 8, 70])
@pytest.mark.parametrize("n,k", [(1, 256), (40, 512)])
def test_q6_kernel_matches_the_reference_with_ggufs_q6_k_values(isa, rows, n, k):
    codes, scale16, packed = q6_weights(n, k, rows + n)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)) * 3
    x[0, :32] = 0                                       # an all-zero group
    got = q6_linear(x, *packed)
    assert got.shape == (rows, layout.padded_rows(n))
    want = reference_q6(x, codes, scale16)
    torch.testing.assert_close(got[:, :n].double(), want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
    w = ((codes.float() - 32).view(n, -1, 16) * scale16[..., None]).view(n, k)      # against float weights
    assert ((got[:, :n] - x @ w.T).norm() / (x @ w.T).norm()).item() < 0.02


def test_linear_kernels_give_a_row_the_same_bits_alone_as_in_any_batch(isa):
    """Row blocks of 4, their remainders, passes of 64 rows and the thread count must not change a row's sums."""
    n, k = 40, 96
    codes, scale, minimum, packed = q4_weights(n, k)
    codes8 = (codes.to(torch.int16) * 16 - 128).to(torch.int8)
    packed8 = (FORMATS[8].pack_codes(codes8), layout.pack_scales(scale))
    wide = torch.randn(131, 256, generator=torch.Generator().manual_seed(3))
    packed6 = q6_weights(n, 256)[2]
    for fn, weights in ((q4_linear, packed), (q8_linear, packed8),
                        (q6_linear, packed6)):
        x = wide[:, :weights[0].shape[1] * 32].contiguous()      # K: the weight's groups of 32
        batch = fn(x, *weights)
        for lo, hi in ((0, 1), (5, 6), (63, 66), (127, 131), (2, 9)):
            assert torch.equal(fn(x[lo:hi], *weights), batch[lo:hi])
        threads = torch.get_num_threads()
        try:
            torch.set_num_threads(1)
            assert torch.equal(fn(x, *weights), batch)
        finally:
            torch.set_num_threads(threads)


def test_the_layout_round_trips_and_lookups_read_the_codes_back():
    n, k = 37, 64
    codes, scale, _, (packed, packed_scale, _) = q4_weights(n, k)
    assert torch.equal(FORMATS[4].unpack_codes(packed, n, k), codes)
    assert torch.equal(layout.unpack_scales(packed_scale, n), scale)
    codes8 = torch.randint(-128, 128, (n, k), dtype=torch.int8)
    ids = torch.tensor([[0, 36], [17, 16]])
    assert torch.equal(FORMATS[8].int8_rows(FORMATS[8].pack_codes(codes8), ids), codes8[ids])
    codes6, _, (packed6, _) = q6_weights(n, 256)
    multipliers = torch.randint(-128, 128, (n, 16), dtype=torch.int8)
    got_codes, got_multipliers = FORMATS[6].rows_of(FORMATS[6].pack_codes(codes6, multipliers), ids)
    assert torch.equal(got_codes, (codes6.to(torch.int16) - 32).to(torch.int8)[ids])
    assert torch.equal(got_multipliers, multipliers[ids])


@pytest.mark.skipif(not build.has_avx512_vnni(), reason="no AVX-512 VNNI here: only the AVX2 kernels run")
@pytest.mark.parametrize("bits", [4, 5, 6, 8])
def test_x16_kernels_give_the_same_bits_on_avx2_as_on_avx512(bits):
    """Layout x16's two block kernels (kernels/csrc): every scale form (float32, fp16, Q4_K's two levels,
    Q4_0's minimums made from d, Q6_K's multipliers and d), pool and OpenMP sizes, each row-count remainder, codes
    at both ends."""
    lib = build.library()
    g = torch.Generator().manual_seed(bits)
    n, k = 40, 512
    scale = torch.rand(n, k // 32, generator=g) * 0.02
    sup, mult = (torch.rand(n, k // 256, generator=g) * 0.01).half(), torch.randint(0, 64, (n, k // 32), generator=g)
    two_level = sup.float().repeat_interleave(8, 1) * mult.float()
    forms = [layout.pack_scales(scale), layout.pack_scales(scale.half().float(), compact=True),
             layout.pack_scales(two_level, compact=True, parts=(sup, mult))]
    assert [f.dtype for f in forms] == [torch.float32, torch.float16, torch.uint8]
    if bits == 4:
        codes = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
        codes[0], codes[1] = 0, 15
        packed = FORMATS[4].pack_codes(codes)
        calls = [lambda x, d=d: q4_linear(x, packed, d, layout.minimums(-8 * d, d))
                 for d in forms[:2]]
        calls += [lambda x, d=d: q4_linear(x, packed, d, forms[0] * -0.5) for d in forms]
    elif bits == 6:
        packed6 = q6_weights(n, k, 6)[2]
        calls = [lambda x: q6_linear(x, *packed6)]
    else:
        low, high = (-16, 16) if bits == 5 else (-128, 128)
        codes = torch.randint(low, high, (n, k), generator=g, dtype=torch.int8)
        codes[0], codes[1] = low, high - 1
        packed, fn = ((FORMATS[5].pack_codes(codes), q5_linear) if bits == 5 else
                      (FORMATS[8].pack_codes(codes), q8_linear))
        calls = [lambda x, d=d: fn(x, packed, d) for d in forms]
    x = torch.randn(70, k, generator=g) * 3
    x[1] = 1e-3
    try:
        for call in calls:
            for rows in (1, 3, 4, 5, 8, 9, 70):
                lib.kvflow_x16_use_avx512(1)
                wide = call(x[:rows])
                lib.kvflow_x16_use_avx512(0)
                assert torch.equal(call(x[:rows]), wide), (rows, (call(x[:rows]) - wide).abs().max())
    finally:
        lib.kvflow_x16_use_avx512(int(build.isa() == "avx512"))


def test_weights_in_the_wrong_layout_are_refused_not_read_past():
    codes, scale, minimum, packed = q4_weights(48, 64)
    with pytest.raises(ValueError):
        q4_linear(torch.randn(2, 64), packed[0], scale[:1], minimum)
    _, _, (codes6, d) = q6_weights(48, 512)
    for bad in (d[:, :1].contiguous(), d.float()):     # d for one block of 256 of the two; float32 d
        with pytest.raises(ValueError):
            q6_linear(torch.randn(2, 512), codes6, bad)
    with pytest.raises(ValueError):                     # rows 256 wide, codes for 512
        q6_linear(torch.randn(2, 256), codes6, d)


@pytest.mark.parametrize("bits", sorted(FORMATS))
def test_every_weight_format_in_the_table_passes_its_own_check_on_each_isa(isa, bits):
    """The table (kernels/formats.py) is what the library multiplies: each row's kernel against torch here."""
    from kvflow.kernels import formats

    lib = build.library()

    def run(x, codes, scale, minimum, bits=bits):
        return formats.run_linear(lib, bits, x, codes, scale, minimum, ops.threads())

    assert FORMATS[bits].bits == bits and FORMATS[bits].self_check(run, torch.Generator().manual_seed(bits))


def test_a_code_width_no_format_registered_is_refused():
    """The C side knows a width only from the table: a call with another is an error, never a read of a layout."""
    codes, scale, minimum, packed = q4_weights(16, 64)
    lib, x, y = build.library(), torch.randn(1, 64), torch.empty(1, 16)
    assert lib.kvflow_x16_linear(3, x.data_ptr(), 1, 64, packed[0].data_ptr(), packed[1].data_ptr(), None, 16,
                                 y.data_ptr(), 1, 0, 1) == 2
    assert lib.kvflow_x16_set_format(9, 64) == 2


def q4_0_weights(n: int, k: int, seed: int = 0):
    """Packed 4-bit codes, fp16 d, and the minimums -8 d (GGUF Q4_0's) both stored and not (`minimums`)."""
    codes, scale, _, _ = q4_weights(n, k, seed)
    scale = layout.pack_scales(scale.half().float(), compact=True)
    stored = -8 * scale
    return FORMATS[4].pack_codes(codes), scale, stored, layout.minimums(stored, scale)


def test_q4_0_minimums_not_stored_give_the_stored_ones_bits(isa):
    """GGUF Q4_0's minimums are -8 d: held as nothing (layout.minimums) and made from d in the kernels,
    they give the bits of the same matrix with them stored, at pool and OpenMP sizes, and in the MoE op."""
    codes, scale, stored, none = q4_0_weights(40, 96)
    assert none.numel() == 0 and layout.minimums(-7 * scale, scale).numel() > 0    # others are kept
    x = torch.randn(70, 96, generator=torch.Generator().manual_seed(1)) * 3
    for rows in (1, 5, 70):
        assert torch.equal(q4_linear(x[:rows], codes, scale, none),
                           q4_linear(x[:rows], codes, scale, stored))
    # two experts of hidden 96 and intermediate 32: gate/up [64, 96], down [96, 32]
    gu, dn = q4_0_weights(64, 96, 2), q4_0_weights(96, 32, 3)
    ids, weights = torch.tensor([[0, 1], [1, 0], [1, 1]]), torch.tensor([[0.75, 0.25], [0.5, 0.5], [0.9, 0.1]])
    both = lambda t: torch.stack([t, t])
    results = [ops.moe_experts(x[:3], ids, weights, both(gu[0]), both(gu[1]), both(gu[m]), 4,
                                          both(dn[0]), both(dn[1]), both(dn[m]), 4, 32) for m in (2, 3)]
    assert torch.equal(results[0], results[1])


def test_native_int4_linear_holds_the_same_values_and_stays_close_to_float():
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(192, 256, generator=g) * 0.05
    gq = GroupQuantized.round_to_nearest(weight, bits=4, group=32)
    layer = Int4Linear(gq, bias=torch.randn(192, generator=g), native=True)
    assert layer.native
    torch.testing.assert_close(layer.dequantize(torch.float32), gq.dequantize(), rtol=0, atol=1e-6)
    for rows in (9, 300):
        x = torch.randn(rows, 256, generator=g)
        want = x @ gq.dequantize().T + layer.bias
        err = (layer(x) - want).norm() / want.norm()
        assert err < 0.01, err                           # int8 activations: well under 1% of the output
        assert torch.equal(layer(x[5:6]), layer(x)[5:6])     # the kernel at every size: a row alone, same bits


def paged(seed: int, heads=9, kv_heads=3, head_dim=64, block_size=16, blocks=64):
    g = torch.Generator().manual_seed(seed)
    k_cache = torch.randn(blocks, block_size, kv_heads, head_dim, generator=g)
    v_cache = torch.randn(blocks, block_size, kv_heads, head_dim, generator=g)
    tables = torch.randperm(blocks, generator=g)[:40].view(4, 10).contiguous()    # 4 sequences, 160 slots each
    positions = torch.tensor([0, 7, 159, 100])
    q = torch.randn(4, heads, head_dim, generator=g)
    return q, k_cache, v_cache, tables, positions


@pytest.mark.parametrize("heads,kv_heads,head_dim,window", [(9, 3, 64, 0), (4, 4, 32, 0), (8, 1, 128, 0),
                                                             (4, 2, 24, 0), (2, 1, 8, 0), (14, 2, 40, 0),
                                                             (4, 1, 256, 0), (4, 1, 256, 50), (9, 3, 64, 1)])
def test_paged_attention_matches_float64(heads, kv_heads, head_dim, window):
    """`window` > 0 (a sliding-window layer): the row attends to its last `window` keys only."""
    q, kc, vc, tables, pos = paged(heads, heads, kv_heads, head_dim)
    out = ops.paged_attention(q, kc, vc, tables, torch.arange(4), pos, head_dim ** -0.5, window)
    bs, group = kc.shape[1], heads // kv_heads
    for i in range(4):
        slots = (tables[i].repeat_interleave(bs) * bs + torch.arange(tables.shape[1] * bs) % bs)[:pos[i] + 1]
        if window:
            slots = slots[-window:]
        keys = kc.view(-1, kv_heads, head_dim)[slots].double().transpose(0, 1)       # [Hkv, L, D]
        values = vc.view(-1, kv_heads, head_dim)[slots].double().transpose(0, 1)
        scores = torch.softmax(q[i].double().view(kv_heads, group, head_dim) @ keys.transpose(1, 2) * head_dim ** -0.5, -1)
        want = (scores @ values).view(heads, head_dim)
        torch.testing.assert_close(out[i].double(), want, rtol=0, atol=1e-5)


def test_paged_attention_row_depends_on_its_own_inputs_only():
    q, kc, vc, tables, pos = paged(1)
    scale = 64 ** -0.5
    batch = ops.paged_attention(q, kc, vc, tables, torch.arange(4), pos, scale)
    alone = ops.paged_attention(q[2:3], kc, vc, tables[2:3], torch.zeros(1, dtype=torch.long), pos[2:3], scale)
    assert torch.equal(alone, batch[2:3])
    wider = torch.cat([tables, tables.flip(1)], 1).contiguous()       # longer tables: more padding, same bits
    assert torch.equal(ops.paged_attention(q, kc, vc, wider, torch.arange(4), pos, scale), batch)
    # a prefill chunk: rows of one sequence at consecutive positions, each as if it were decoded alone
    chunk = ops.paged_attention(torch.cat([q[:3], q[2:3]]), kc, vc, tables[2:3], torch.zeros(4, dtype=torch.long),
                                           torch.tensor([96, 97, 98, 159]), scale)
    assert torch.equal(chunk[3:], batch[2:3])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(ops.paged_attention(q, kc, vc, tables, torch.arange(4), pos, scale), batch)
    finally:
        torch.set_num_threads(threads)


def test_rms_norm_close_to_torch_and_the_same_bits_compiled_and_alone():
    g = torch.Generator().manual_seed(2)
    weight = torch.rand(576, generator=g) + 0.5
    x = torch.randn(32, 576, generator=g) * 3
    got = ops.rms_norm(x, weight, 1e-5)
    torch.testing.assert_close(got, weight * torch.nn.functional.rms_norm(x, (576,), None, 1e-5))
    assert torch.equal(ops.rms_norm(x[7:8], weight, 1e-5), got[7:8])
    compiled = torch.compile(lambda t: ops.rms_norm(t, weight, 1e-5), fullgraph=True, dynamic=False)
    assert torch.equal(compiled(x), got)


@pytest.mark.parametrize("rank", [16, 12])
def test_lora_term_matches_torch_reads_each_rows_slot_and_is_batch_invariant(rank):
    """layers/lora.py's term through kvflow's op against the same stack's torch path (every slot, masked): rows of
    three adapters and base rows mixed in one step; a base row keeps the base output's bits; a row alone, on one
    thread or two, and in a compiled graph gets the bits it gets in the mixed step. Slots of rank 12 leave their
    last 4 columns to the kernel's scalar loop; an adapter of rank 8 in them is zero-padded."""
    from kvflow.layers.lora import LoRAStack, lora_mask
    g = torch.Generator().manual_seed(3)
    stack = LoRAStack(96, [(0, 64), (80, 16)], max_loras=4, max_rank=rank)
    for slot, r in ((0, rank), (2, 8), (3, rank)):
        stack.set_slot(slot, [(torch.randn(r, 96, generator=g), torch.randn(64, r, generator=g)),
                              (torch.randn(r, 96, generator=g), torch.randn(16, r, generator=g))], 0.5)
    slots = torch.tensor([0, -1, 2, 3, 0, -1, 3, 2, 2, 0, -1])
    x, out = torch.randn(len(slots), 96, generator=g), torch.randn(len(slots), 96, generator=g)
    mask = lora_mask(slots, 4, rank, torch.float32)
    want = stack.add_to(out, x, mask)                                       # stack.native is False: torch's path
    stack.native = True
    got = stack.add_to(out, x, mask)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
    assert torch.equal(got[slots < 0], out[slots < 0])
    assert not torch.equal(got[slots >= 0], out[slots >= 0])
    threads = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            for row in range(len(slots)):
                assert torch.equal(stack.add_to(out[row:row + 1], x[row:row + 1], mask[row:row + 1]), got[row:row + 1])
    finally:
        torch.set_num_threads(threads)
    compiled = torch.compile(lambda o, t, m: stack.add_to(o, t, m), fullgraph=True, dynamic=False)
    assert torch.equal(compiled(out, x, mask), got)


def test_lora_pieces_outside_the_output_are_refused_not_read_past():
    from kvflow.layers.lora import LoRAStack, lora_mask
    stack = LoRAStack(32, [(0, 32)], max_loras=2, max_rank=8)
    mask = lora_mask(torch.tensor([0]), 2, 8, torch.float32)
    with pytest.raises(ValueError, match="outside"):
        ops.lora_add(torch.zeros(1, 16), torch.zeros(1, 32), stack.lora_a, stack.lora_b,
                                stack.lora_pieces, mask, 2)
    with pytest.raises(ValueError, match="layout"):
        ops.lora_add(torch.zeros(1, 32), torch.zeros(1, 32), stack.lora_a, stack.lora_b,
                                stack.lora_pieces, mask, 3)


@pytest.mark.slow
def test_default_engine_greedy_output_does_not_depend_on_what_shares_the_step():
    """The issue's bar: each prompt alone against all of them at once, token for token. Batched, the 12 prompts are
    prefilled together in one step (150 rows) and decoded 12 at a time; alone, each is prefilled alone and decoded
    one row a step. Where the whole decoder is one native call (runner/native_step.py) every step runs it; else
    decodes run eagerly or by the compiled bucket of 16 as its compile ends, and alone by the bucket of 1."""
    from kvflow import LLM, SamplingParams
    llm = LLM(max_model_len=512, kv_cache_memory="64MiB", enable_prefix_caching=False, enforce_eager=False,
              compile_batch_sizes=(1, 16))
    # where kvflow's kernels can run, the default engine runs them (on AVX-512 machines too: float32 compute)
    runner = llm.engine.runner
    assert runner.native_attention and runner.dtype == torch.float32
    # and its small steps' kernels on kvflow's pool with every thread, torch's own ops on one (KernelPlan.step_threads)
    assert runner.kernel_pool and runner.plan.step_threads(1) == (1, runner.threads)
    assert runner.plan.step_threads(150) == (runner.threads, runner.threads)
    prompts = [f"Q{i}: tell me about {topic}, in detail." for i, topic in
               enumerate(["the sea", "a city at night", "prime numbers", "an old clock", "coffee", "the moon"] * 2)]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    batched = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    path = runner.native_step or runner.compiled_decode
    if runner.native_step is None:
        assert path.wait() and not path.failed
    before = path.steps
    alone = [llm.generate([p], params)[0].outputs[0].token_ids for p in prompts]
    assert path.steps >= before + 12 * 23        # the alone runs decoded by the native step or the compiled graph
    assert alone == batched


def test_native_kernels_inside_a_compiled_graph():
    g = torch.Generator().manual_seed(1)
    layer = Int4Linear(GroupQuantized.round_to_nearest(torch.randn(64, 96, generator=g)), native=True)
    x = torch.randn(3, 96, generator=g)
    compiled = torch.compile(lambda t: layer(t * 2) + 1, fullgraph=True)
    torch.testing.assert_close(compiled(x), layer(x * 2) + 1)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float8_e4m3fn], ids=["bf16", "f16", "fp8"])
def test_paged_attention_reads_narrow_caches_as_the_floats_they_hold(dtype):
    """A 16- or 8-bit cache (bf16 compute, or the CPU's default 16-bit cache under float32 compute, or fp8): the
    kernel widens each value exactly and sums in float32, so it gives the bits of the float32 kernel over the same
    values, and a bf16 query gets them rounded once."""
    q, kc, vc, tables, pos = paged(4)
    kn, vn = kc.to(dtype), vc.to(dtype)
    rows, scale = torch.arange(4), 64 ** -0.5
    wide = ops.paged_attention(q, kn.float(), vn.float(), tables, rows, pos, scale)
    assert torch.equal(ops.paged_attention(q, kn, vn, tables, rows, pos, scale), wide)
    assert torch.equal(ops.paged_attention(q.bfloat16(), kn, vn, tables, rows, pos, scale),
                       ops.paged_attention(q.bfloat16().float(), kn.float(), vn.float(), tables, rows, pos,
                                                      scale).bfloat16())


def test_paged_attention_reads_int8_rows_as_their_codes_times_their_scale():
    """An int8 cache: rows of codes with their float32 scale (layers/kv_int8.py). The kernel applies each row's
    scale after its dot product: within float32 rounding of attention over the dequantized values, and each row's
    result its own (batch invariance)."""
    q, kc, vc, tables, pos = paged(5)
    k8, v8 = kv_int8.quantize_rows(kc), kv_int8.quantize_rows(vc)
    assert k8.shape == (*kc.shape[:-1], kv_int8.row_bytes(64)) and k8.dtype == torch.int8
    rows, scale = torch.arange(4), 64 ** -0.5
    got = ops.paged_attention(q, k8, v8, tables, rows, pos, scale)
    want = ops.paged_attention(q, kv_int8.dequantize_rows(k8, torch.float32),
                                          kv_int8.dequantize_rows(v8, torch.float32), tables, rows, pos, scale)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    assert (kv_int8.dequantize_rows(k8, torch.float32) - kc).abs().max() <= kc.abs().amax() / 254 * 1.0001
    alone = ops.paged_attention(q[2:3], k8, v8, tables[2:3], torch.zeros(1, dtype=torch.long), pos[2:3],
                                           scale)
    assert torch.equal(alone, got[2:3])


@pytest.mark.parametrize("stall_us", [0, 300])
def test_small_calls_on_the_thread_pool_give_one_threads_bits_even_when_workers_stall(isa, stall_us):
    """Calls of up to 8 rows run on kvflow's pool (thread_pool.c): on 1, 2 and 3 threads, and with workers that
    sleep before committing each chunk (a preempted thread: the caller takes their chunks back), every output is the
    one thread's bits; bigger calls (OpenMP) too."""
    lib = build.library()
    codes, scale, minimum, packed = q4_weights(1000, 576)
    codes8 = (codes.to(torch.int16) * 16 - 128).to(torch.int8)
    packed8 = (FORMATS[8].pack_codes(codes8), layout.pack_scales(scale))
    codes5 = (codes.to(torch.int16) * 2 - 16).to(torch.int8)
    packed5 = (FORMATS[5].pack_codes(codes5), layout.pack_scales(scale))
    x = torch.randn(9, 576, generator=torch.Generator().manual_seed(4))
    q, kc, vc, tables, pos = paged(1)
    calls = [(q4_linear, (x[:r], *packed)) for r in (1, 3, 8, 9)]
    calls += [(q8_linear, (x[:2], *packed8)), (q5_linear, (x[:5], *packed5))]
    calls += [(ops.paged_attention, (q[:r], kc, vc, tables[:r], torch.arange(r), pos[:r], 0.125))
              for r in (1, 4)]
    try:
        ops.set_threads(1)
        alone = [fn(*args) for fn, args in calls]
        lib.kvflow_pool_set_stall(stall_us)
        for threads in (2, 3):
            ops.set_threads(threads)
            for (fn, args), want in zip(calls, alone):
                assert torch.equal(fn(*args), want), (fn, threads)
    finally:
        lib.kvflow_pool_set_stall(0)
        ops.set_threads(None)
        ops.quiesce()
    assert lib.kvflow_pool_workers() >= 1
