"""GGUF K-quants and the other block formats served from their own codes: Q4_K as group-32 4-bit codes with the
file's own scales and minimums (bit for bit gguf's float32 values), Q5_0 as 8-bit codes (Q8_0's format), and
what is still re-rounded (Q5_K, Q6_K, ...) rounded in slices of rows."""
from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T

from kvflow.layers.group_quant import GroupQuantized
from kvflow.models.gguf_reader import dequantize, group_quantized
from kvflow.models.loader import iter_weights, resolve_model_files
from tiny_models import make_tiny_hf_model, quantize_q4_k, quantize_q5_k, quantize_q6_k, write_gguf_from_hf


def matrix(rows: int, cols: int, scale: float, seed: int = 0) -> np.ndarray:
    """Random rows with an offset on part of them (so minimums are not all zero) and a few outliers."""
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((rows, cols)) * scale).astype(np.float32)
    x[:, : cols // 3] += scale
    x[::7, 5] = 20 * scale
    return x


@pytest.mark.parametrize("scale", [0.05, 1e-4, 40.0])
@pytest.mark.parametrize("qtype", ["Q4_K", "Q5_0", "Q4_0", "Q4_1", "Q8_0"])
def test_codes_dequantize_to_ggufs_values_bit_for_bit(qtype, scale):
    x = matrix(48, 768, scale)
    raw = quantize_q4_k(x) if qtype == "Q4_K" else gguf.quants.quantize(x, T[qtype])
    gq = group_quantized(raw, T[qtype], x.shape)
    assert gq.exact and gq.group == 32 and gq.bits == (4 if qtype in ("Q4_K", "Q4_0", "Q4_1") else 8)
    want = torch.from_numpy(dequantize(raw, T[qtype], x.shape))
    assert torch.equal(gq.dequantize(), want)
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


def test_q4_k_file_kept_as_its_own_codes(wide_hf, tmp_path):
    path = write_gguf_from_hf(wide_hf, tmp_path / "m-q4_k.gguf", ftype="q4_k")
    files = resolve_model_files(path)
    assert {files.gguf.tensors[n].qtype for n in files.gguf.tensors if len(files.gguf.tensors[n].shape) == 2} == {T.Q4_K}
    floats = dict(iter_weights(files))
    codes = {n: w for n, w in iter_weights(files, keep_quantized=True) if isinstance(w, GroupQuantized)}
    assert "model.layers.0.self_attn.q_proj.weight" in codes and "model.embed_tokens.weight" in codes
    for name, gq in codes.items():
        assert gq.exact and gq.bits == 4 and gq.offset == 0, name
        assert torch.equal(gq.dequantize(), floats[name]), name       # Q/K rows un-permuted alike
