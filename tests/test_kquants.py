"""GGUF K-quants and the other block formats served from their own codes: Q4_K as group-32 4-bit codes with the
file's own scales and minimums, Q6_K as 6-bit codes with its int8 multipliers per 16 and d per 256 (both bit for bit
gguf's float32 values), Q5_0 as 8-bit codes (Q8_0's format), and what is still re-rounded (Q5_K, ...) rounded in
slices of rows."""
from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T

from kvflow.kernels.group_quant import CODES, GroupQuantized
from kvflow.models.gguf_codes import group_quantized
from kvflow.models.gguf_reader import dequantize
from kvflow.models.loader import iter_weights, resolve_model_files
from tiny_models import make_tiny_hf_model, quantize_q4_k, quantize_q5_k, quantize_q6_k, write_gguf_from_hf


def _run(bits: int, x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor,
         minimum: torch.Tensor = torch.empty(0)) -> torch.Tensor:
    """x @ W.T by kvflow's linear kernel for weight format `bits` (formats.run_linear: its layout checks included)."""
    from kvflow.kernels import build, formats, ops
    return formats.run_linear(build.library(), bits, x, codes, scale, minimum, ops.threads())


def matrix(rows: int, cols: int, scale: float, seed: int = 0) -> np.ndarray:
    """Random rows with an offset on part of them (so minimums are not all zero) and a few outliers."""
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((rows, cols)) * scale).astype(np.float32)
    x[:, : cols // 3] += scale
    x[::7, 5] = 20 * scale
    return x


@pytest.mark.parametrize("scale", [0.05, 1e-4, 40.0])
@pytest.mark.parametrize("qtype", ["Q4_K", "Q6_K", "Q5_0", "Q4_0", "Q4_1", "Q8_0"])
def test_codes_dequantize_to_ggufs_values_bit_for_bit(qtype, scale):
    x = matrix(48, 768, scale)
    raw = {"Q4_K": quantize_q4_k, "Q6_K": quantize_q6_k}.get(qtype, lambda x: gguf.quants.quantize(x, T[qtype]))(x)
    gq = group_quantized(raw, T[qtype], x.shape)
    want = torch.from_numpy(dequantize(raw, T[qtype], x.shape))
    assert torch.equal(gq.dequantize(), want)
    if qtype == "Q6_K":
        # what the 6-bit kernel takes, (code - 32) * multiplier * d (the file's two levels), is exact too
        d, multipliers = gq.scale_parts
        assert gq.exact and (gq.group, gq.bits, gq.offset) == (16, 6, 32) and int(gq.codes.max()) <= 63
        scale = d.repeat_interleave(16, 1) * multipliers.float()
        w = (gq.codes.view(48, -1, 16).float() - 32) * scale[..., None]
        assert torch.equal(w.view(48, 768), want)
        return
    assert gq.exact and gq.group == 32 and gq.bits == (4 if qtype in ("Q4_K", "Q4_0", "Q4_1") else 8)
    # what kvflow's kernels take (value = code * scale + minimum) is exact too
    q = gq.codes.view(48, -1, 32).float() - (gq.offset if gq.bits == 8 else 0)
    w = q * gq.scale[..., None] + (gq.minimum()[..., None] if gq.bits == 4 else 0)
    assert torch.equal(w.view(48, 768), want)


def test_q4_k_codes_are_the_files_nibbles_and_scales_the_files_6_bit_ones():
    x = matrix(4, 256, 0.05)
    raw = quantize_q4_k(x)
    gq = group_quantized(raw, T.Q4_K, x.shape)
    blocks = raw.reshape(4, 144)
    low, high = blocks[:, 16:48] & 15, blocks[:, 16:48] >> 4
    assert np.array_equal(gq.codes[:, :32].numpy(), low) and np.array_equal(gq.codes[:, 32:64].numpy(), high)
    d = blocks[:, :2].copy().view(np.float16).astype(np.float32)[:, 0]
    sc0 = (blocks[:, 4] & 63).astype(np.float32)
    assert np.array_equal(gq.scale[:, 0].numpy(), d * sc0)


# --------------------------------------------------------------------------- whole files

@pytest.fixture(scope="module")
def wide_hf(tmp_path_factory):
    """A tiny llama whose matrices are all a multiple of 256 wide, so every one can be a K-quant."""
    return make_tiny_hf_model(tmp_path_factory.mktemp("kquants") / "hf", "llama", seed=5, hidden_size=256,
                              intermediate_size=512, num_attention_heads=4, num_key_value_heads=2)


@pytest.mark.slow
def test_q4_k_file_kept_as_its_own_codes(wide_hf, tmp_path):
    path = write_gguf_from_hf(wide_hf, tmp_path / "m-q4_k.gguf", ftype="q4_k")
    files = resolve_model_files(path)
    assert {files.gguf.tensors[n].qtype for n in files.gguf.tensors if len(files.gguf.tensors[n].shape) == 2} == {T.Q4_K}
    floats = dict(iter_weights(files))
    codes = {n: w.resolve() for n, w in iter_weights(files, keep_quantized=True) if isinstance(w, CODES)}
    assert "model.layers.0.self_attn.q_proj.weight" in codes and "model.embed_tokens.weight" in codes
    for name, gq in codes.items():
        assert gq.exact and gq.bits == 4 and gq.offset == 0, name
        assert torch.equal(gq.dequantize(), floats[name]), name       # Q/K rows un-permuted alike


# --------------------------------------------------------------------------- re-rounded formats, slice by slice

@pytest.mark.parametrize("qtype,writer", [("Q5_K", quantize_q5_k)])
def test_other_k_quants_are_rerounded_to_8_bits_in_slices(qtype, writer, monkeypatch):
    from kvflow.models import loader
    from kvflow.models.gguf_reader import GGUFTensorInfo

    x = matrix(300, 512, 0.05)
    raw = writer(x)
    values = torch.from_numpy(dequantize(raw, T[qtype], x.shape))
    whole = GroupQuantized.round_to_nearest(values, bits=8)
    seen = []
    real = loader.dequantize
    monkeypatch.setattr(loader, "dequantize", lambda r, t, shape: (seen.append(shape), real(r, t, shape))[1])
    monkeypatch.setattr(loader, "REROUND_VALUES", 64 * 512)
    info = GGUFTensorInfo("w", x.shape, T[qtype], 0, raw.nbytes)
    gq = loader._rerounded(lambda rows: raw[rows[0]:rows[1]], info, bits=8)
    assert seen == [(64, 512)] * 4 + [(44, 512)]                      # never the whole tensor as floats
    assert not gq.exact and gq.bits == 8 and gq.zero is None
    assert torch.equal(gq.codes, whole.codes) and torch.equal(gq.scale, whole.scale)
    step = values.abs().view(300, -1, 32).amax(-1) / 127
    assert ((gq.dequantize() - values).abs().view(300, -1, 32) <= step[..., None] / 2 * 1.001).all()


def test_mixed_stacks_keep_8_bit_pieces_as_the_files_codes():
    from kvflow.layers.quantization import _gguf_codes

    x = matrix(64, 256, 0.05)
    q8 = group_quantized(gguf.quants.quantize(x, T.Q8_0), T.Q8_0, x.shape)
    q5 = group_quantized(gguf.quants.quantize(x, T.Q5_0), T.Q5_0, x.shape)
    q40 = group_quantized(gguf.quants.quantize(x, T.Q4_0), T.Q4_0, x.shape)
    q4k = group_quantized(quantize_q4_k(x), T.Q4_K, x.shape)
    q6k = group_quantized(quantize_q6_k(x), T.Q6_K, x.shape)
    layer = torch.nn.Linear(256, 320)
    layer.gguf_pieces = [q4k, q8, q5, q40, q6k]
    stacked = _gguf_codes(layer)
    assert stacked.bits == 8 and stacked.zero is None and stacked.group == 32
    for i, piece in enumerate((q8, q5, q40)):                            # exactly their own values
        assert torch.equal(stacked.take_rows(torch.arange(64 * (i + 1), 64 * (i + 2))).dequantize(), piece.dequantize())
    for rows, piece in ((torch.arange(64), q4k), (torch.arange(256, 320), q6k)):     # rounded to 8 bits, group 32
        got = stacked.take_rows(rows).dequantize()
        assert (got - piece.dequantize()).abs().max() <= piece.dequantize().abs().max() / 254 * 1.001


@pytest.mark.slow
def test_q4_k_m_file_serves_from_its_codes(wide_hf, tmp_path):
    from kvflow import LLM, SamplingParams
    from kvflow.kernels import build
    from kvflow.layers.int4 import Int4Linear
    from kvflow.layers.quantization import NativeQ8Linear

    path = write_gguf_from_hf(wide_hf, tmp_path / "m-q4_k_m.gguf", ftype="q4_k_m")
    kinds = {t.qtype for t in resolve_model_files(path).gguf.tensors.values()}
    assert {T.Q4_K, T.Q6_K} <= kinds
    llm = LLM(str(path), max_model_len=128, kv_cache_memory="8MiB", enforce_eager=True)
    model = llm.engine.runner.model
    assert isinstance(model.layers[0].self_attn.qkv_proj, Int4Linear)            # Q4_K
    if build.usable():
        assert isinstance(model.layers[1].self_attn.qkv_proj, NativeQ8Linear)    # Q4_K q/k + Q6_K v: 8-bit
        assert model.layers[1].self_attn.qkv_proj.code_bits == 8
        assert model.layers[1].mlp.down_proj.code_bits == 6                        # Q6_K: its own 6-bit codes
    out = llm.generate(["Hello there"], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 6


@pytest.mark.slow
@pytest.mark.parametrize("ftype", ["q8_0", "q5_0", "q6_k"])
def test_untied_8_bit_head_multiplies_the_files_codes(tmp_path, ftype):
    from kvflow import LLM
    from kvflow.kernels import build
    from kvflow.layers.quantization import NativeQ8Linear

    if not build.usable():
        pytest.skip("kvflow's kernels do not run here")
    wide = dict(hidden_size=256, intermediate_size=512) if ftype == "q6_k" else {}     # Q6_K: rows of 256
    hf = make_tiny_hf_model(tmp_path / "hf", "qwen2", seed=2, **wide)
    path = write_gguf_from_hf(hf, tmp_path / f"m-{ftype}.gguf", ftype=ftype)
    llm = LLM(str(path), max_model_len=64, kv_cache_memory="4MiB", enforce_eager=True)
    head = llm.engine.runner.model.lm_head
    assert isinstance(head, NativeQ8Linear)
    files = resolve_model_files(path)
    want = dict(iter_weights(files, keep_quantized=True))["lm_head.weight"].resolve()
    assert head.code_bits == {"q5_0": 5, "q6_k": 6}.get(ftype, 8)                # Q5_0: held in 5 bits
    assert torch.equal(head.int8_codes(torch.arange(want.shape[0])), (want.codes.to(torch.int16) - want.offset).to(torch.int8))


# --------------------------------------------------------------------------- a tied table held once

@pytest.mark.slow
@pytest.mark.parametrize("ftype", ["q4_k", "q4_0", "q4_1", "q8_0", "q4_k_m", "q6_k"])
def test_tied_table_is_held_once_and_looks_up_the_files_values(wide_hf, tmp_path, ftype):
    from kvflow import LLM, SamplingParams
    from kvflow.kernels import build
    from kvflow.layers.quantization import GGUFVocabulary

    if not build.usable():
        pytest.skip("kvflow's kernels do not run here")
    path = write_gguf_from_hf(wide_hf, tmp_path / f"m-{ftype}.gguf", ftype=ftype)
    llm = LLM(str(path), max_model_len=64, kv_cache_memory="4MiB", enforce_eager=True)
    model = llm.engine.runner.model
    table = model.embed_tokens
    assert model.lm_head is None and isinstance(table, GGUFVocabulary) and table.native_head
    assert not hasattr(table, "codes")            # one copy: the head's, in its kernel's layout
    vocab, hidden = table.num_rows, model.config.hidden_size
    held = sum(t.numel() * t.element_size() for t in [*table.parameters(), *table.buffers()])
    # codes + a scale (and a minimum) per 32 values as the file stores them: fp16 (Q4_0, Q4_1, Q8_0), Q4_K's
    # 6-bit multiplier (a byte) per 32 and fp16 super-scale per 256; Q6_K (q6_k, and q4_k_m's table) its 6-bit
    # codes, an int8 multiplier per 16 and fp16 d per 256: the file's 6.5625 bits a value
    per_value = {"q8_0": 1 + 2 / 32, "q4_0": 0.5 + 4 / 32, "q4_1": 0.5 + 4 / 32, "q4_k": 0.5 + 2 * 1.25 / 32,
                 "q4_k_m": 210 / 256, "q6_k": 210 / 256}[ftype]
    assert held <= vocab * hidden * per_value * 1.001
    if ftype in ("q8_0", "q4_0", "q4_1"):
        assert {t.dtype for t in table.buffers() if t.is_floating_point()} == {torch.float16}
    files = resolve_model_files(path)
    gq = dict(iter_weights(files, keep_quantized=True))["model.embed_tokens.weight"].resolve()
    ids = torch.tensor([[0, 5, vocab - 1], [3, 3, 1000]])
    want = gq.dequantize()[ids]
    assert gq.exact and torch.equal(table(ids), want)
    hidden_states = torch.randn(5, hidden)
    logits = table.project(hidden_states)
    assert logits.shape == (5, vocab)
    ref = hidden_states @ gq.dequantize().T
    assert ((logits - ref).norm() / ref.norm()).item() < 0.02       # int8 activations
    assert len(llm.generate(["Hi"], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))[0]
               .outputs[0].token_ids) == 3


# --------------------------------------------------------------------------- scales as the file stores them

def test_fp16_scales_give_the_kernels_the_same_bits_as_float32():
    from kvflow.kernels import build, layout
    from kvflow.kernels.formats import FORMATS

    if not build.usable():
        pytest.skip("kvflow's kernels do not run here")
    g = torch.Generator().manual_seed(1)
    n, k = 45, 128
    c4 = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    c8 = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8)
    d = (torch.rand(n, k // 32, generator=g) * 0.02).half().float()
    m = (-torch.rand(n, k // 32, generator=g) * 0.1).half().float()
    q4, q8 = 4, 8
    half = [layout.pack_scales(t, compact=True) for t in (d, m)]
    assert all(t.dtype == torch.float16 for t in half)
    assert layout.pack_scales(d + 1e-7, compact=True).dtype == torch.float32      # not fp16 values: kept
    for rows in (1, 7, 70):
        x = torch.randn(rows, k, generator=g)
        for mixed in ((half[0], layout.pack_scales(m)), (layout.pack_scales(d), half[1]), half):
            assert torch.equal(_run(q4, x, FORMATS[4].pack_codes(c4), *mixed),
                               _run(q4, x, FORMATS[4].pack_codes(c4), layout.pack_scales(d),
                                       layout.pack_scales(m)))
        assert torch.equal(_run(q8, x, FORMATS[8].pack_codes(c8), half[0]),
                           _run(q8, x, FORMATS[8].pack_codes(c8), layout.pack_scales(d)))


@pytest.mark.slow
def test_untied_4_bit_embedding_is_held_packed_and_looks_up_the_files_values(tmp_path):
    from kvflow import LLM
    from kvflow.kernels import build
    from kvflow.layers.quantization import GGUFVocabulary

    if not build.usable():
        pytest.skip("kvflow's kernels do not run here")
    hf = make_tiny_hf_model(tmp_path / "hf", "qwen2", seed=4)
    path = write_gguf_from_hf(hf, tmp_path / "m-q4_1.gguf", ftype="q4_1")
    llm = LLM(str(path), max_model_len=64, kv_cache_memory="4MiB", enforce_eager=True)
    model = llm.engine.runner.model
    table = model.embed_tokens
    assert model.lm_head is not None and isinstance(table, GGUFVocabulary) and not hasattr(table, "codes")
    assert table.head.packed.numel() * 2 == table.num_rows * model.config.hidden_size      # two codes a byte
    gq = dict(iter_weights(resolve_model_files(path), keep_quantized=True))["model.embed_tokens.weight"]
    ids = torch.tensor([1, 2, 49151, 7])
    assert torch.equal(table(ids), gq.dequantize()[ids])


def test_q4_k_scales_held_as_two_levels_give_the_same_bits():
    """Q4_K's scales and minimums held as the file stores them (a uint8 multiplier per 32 values, an fp16
    super-scale per 256): the kernels multiply them out to the float32 values the file defines."""
    from kvflow.kernels import build, layout
    from kvflow.kernels.formats import FORMATS
    from kvflow.layers.int4 import Int4Linear

    if not build.usable():
        pytest.skip("kvflow's kernels do not run here")
    x = matrix(45, 512, 0.05)
    gq = group_quantized(quantize_q4_k(x), T.Q4_K, x.shape)
    fn = 4
    two = [layout.pack_scales(gq.scale, True, gq.scale_parts), layout.pack_scales(gq.minimum(), True, gq.zero_parts)]
    plain = [layout.pack_scales(gq.scale), layout.pack_scales(gq.minimum())]
    assert all(t.dtype == torch.uint8 and t.numel() * 4 == p.numel() * 5 for t, p in zip(two, plain))
    for t, p in zip(two, plain):
        assert torch.equal(layout.widen_scales(t, 45, 16), p)
    g = torch.Generator().manual_seed(3)
    for rows in (1, 6, 70):
        a = torch.randn(rows, 512, generator=g)
        assert torch.equal(_run(fn, a, FORMATS[4].pack_codes(gq.codes), *two),
                           _run(fn, a, FORMATS[4].pack_codes(gq.codes), *plain))
    with pytest.raises(ValueError, match="one layout"):
        _run(fn, torch.randn(1, 512), FORMATS[4].pack_codes(gq.codes), two[0][:-2], two[1])
    layer = Int4Linear(gq, native=True)
    assert layer.scale.dtype == torch.uint8
    assert torch.equal(layer.dequantize(torch.float32), gq.dequantize())
    assert torch.equal(layer.rows(torch.tensor([0, 44, 17])), gq.dequantize()[[0, 44, 17]])


# --------------------------------------------------------------------------- Q5_0 in 5 bits

def test_5_bit_kernel_gives_the_8_bit_kernels_bits_from_5_8_of_the_bytes():
    from kvflow.kernels import build, layout
    from kvflow.kernels.formats import FORMATS

    if not build.usable():
        pytest.skip("kvflow's kernels do not run here")
    g = torch.Generator().manual_seed(7)
    for n, k in ((45, 96), (16, 576), (3, 32)):
        codes = torch.randint(-16, 16, (n, k), generator=g, dtype=torch.int8)
        codes[0, :32] = torch.tensor([-16, 15] * 16, dtype=torch.int8)                  # both ends of the range
        packed = FORMATS[5].pack_codes(codes)
        assert packed.numel() * 8 == layout.padded_rows(n) * k * 5
        assert torch.equal(FORMATS[5].int8_rows(packed, torch.arange(n)), codes)
        pick = torch.tensor([[n - 1, 0]])
        assert torch.equal(FORMATS[5].int8_rows(packed, pick), codes[pick])
        scale = layout.pack_scales((torch.rand(n, k // 32, generator=g) * 0.05).half().float(), compact=True)
        for rows in (1, 5, 70):
            x = torch.randn(rows, k, generator=g)
            eight = _run(8, x, FORMATS[8].pack_codes(codes), scale)
            five = _run(5, x, packed, scale)
            assert torch.equal(five, eight), (n, k, rows)
    assert not FORMATS[5].fits(torch.tensor([[16, 0]], dtype=torch.int8))
    assert not FORMATS[5].fits(torch.tensor([[-17, 0]], dtype=torch.int8))


@pytest.mark.slow
def test_q5_0_matrix_held_in_5_bits_same_bits_eager_and_compiled():
    from kvflow.kernels import build, layout
    from kvflow.kernels.formats import FORMATS
    from kvflow.layers.quantization import NativeQ8Linear

    if not build.usable():
        pytest.skip("kvflow's kernels do not run here")
    x = matrix(96, 256, 0.05)
    gq = group_quantized(gguf.quants.quantize(x, T.Q5_0), T.Q5_0, x.shape)
    five = NativeQ8Linear(gq, None)
    eight = NativeQ8Linear(GroupQuantized(gq.codes.clone(), gq.scale, None, 32, 8), None)
    eight.format = FORMATS[8]
    eight.codes = FORMATS[8].pack_codes(gq.codes)
    assert five.code_bits == 5 and five.codes.numel() * 8 == layout.padded_rows(96) * 256 * 5
    a = torch.randn(9, 256)
    assert torch.equal(five(a), eight(a))
    assert torch.equal(five.rows(torch.arange(96)), gq.dequantize())
    compiled = torch.compile(five, fullgraph=True)
    assert torch.equal(compiled(a), five(a))


def test_packing_a_large_matrix_by_row_chunks_gives_the_whole_matrix_bytes(monkeypatch):
    """Formats whose packing builds int32 temporaries pack PACK_VALUES values at a time (a 248,320-row Q6_K vocabulary
    peaked at ~4 GiB otherwise): the bytes are those of packing the whole matrix at once, padding rows included."""
    from kvflow.kernels import formats

    g = torch.Generator().manual_seed(3)
    n, k = 3 * 64 + 21, 256
    six = torch.randint(-32, 32, (n, k), generator=g, dtype=torch.int8)
    multipliers = torch.randint(-128, 128, (n, k // 16), generator=g, dtype=torch.int8)
    five = torch.randint(-16, 16, (n, k), generator=g, dtype=torch.int8)
    monkeypatch.setattr(formats, "PACK_VALUES", 64 * 256)
    chunked = formats.FORMATS[6].pack_codes(six, multipliers), formats.FORMATS[5].pack_codes(five)
    monkeypatch.setattr(formats, "PACK_VALUES", 1 << 40)
    whole = formats.FORMATS[6].pack_codes(six, multipliers), formats.FORMATS[5].pack_codes(five)
    assert all(torch.equal(a, b) for a, b in zip(chunked, whole))
