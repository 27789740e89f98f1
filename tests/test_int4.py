"""Int4 weights: GGUF codes kept as stored, torch's int4 CPU kernel and its constraints, the dequantizing fallback,
and the default that serves a quantized GGUF quantized."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from kvflow import LLM, SamplingParams
from kvflow.kernels import build
from kvflow.layers import int4
from kvflow.kernels.group_quant import CODES, GroupQuantized
from kvflow.layers.int4 import Int4Linear, choose_kernel_rows, packed_layout
from kvflow.layers.quantization import (GGUFVocabulary, NativeQ8Linear, QuantizedEmbedding, QuantizedLinear,
                                       quantize_model)
from kvflow.models.gguf_reader import dequantize, read_gguf
from kvflow.models.loader import default_model_path, iter_weights, resolve_model_files, weight_quantization
from tiny_models import make_tiny_hf_model, write_gguf_from_hf

HAS_KERNEL = packed_layout() is not None
needs_kernel = pytest.mark.skipif(not HAS_KERNEL, reason="torch has no usable int4 CPU kernel here")


@pytest.fixture(scope="module")
def tiny_hf(tmp_path_factory):
    return make_tiny_hf_model(tmp_path_factory.mktemp("tiny_int4") / "hf", "llama", seed=3)


def bf16_rounded(gq: GroupQuantized) -> torch.Tensor:
    """The matrix as the kernel holds it: codes untouched, scale and zero (for codes - 8, torch's convention)
    rounded to bf16."""
    zero = gq.zero_for_offset(8)
    return GroupQuantized(gq.codes, gq.scale.bfloat16().float(), zero.bfloat16().float(), gq.group, 4).dequantize()


# --------------------------------------------------------------------------- the file's codes, untouched

@pytest.mark.slow
@pytest.mark.parametrize("ftype", ["q4_0", "q4_1", "q8_0"])
def test_gguf_codes_dequantize_to_the_files_values(tiny_hf, tmp_path, ftype):
    """keep_quantized yields codes whose float values are bit for bit what the float load gives (Q/K rows
    un-permuted alike), and Int4Linear holds the same codes with only the scales rounded to bf16."""
    path = write_gguf_from_hf(tiny_hf, tmp_path / f"m-{ftype}.gguf", ftype=ftype)
    files = resolve_model_files(path)
    floats = dict(iter_weights(files))
    codes = {n: w.resolve() for n, w in iter_weights(files, keep_quantized=True) if isinstance(w, CODES)}
    assert "model.layers.0.self_attn.q_proj.weight" in codes and "model.embed_tokens.weight" in codes
    for name, gq in codes.items():
        assert gq.exact and gq.bits == (8 if ftype == "q8_0" else 4), name
        assert torch.equal(gq.dequantize(), floats[name]), name
        if gq.bits == 4:
            layer = Int4Linear(gq)
            assert torch.equal(layer.dequantize(torch.float32), bf16_rounded(gq)), name


def test_embedded_model_codes_are_exact(smollm2_path):
    files = resolve_model_files(smollm2_path)
    wanted = {"model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight",
              "model.layers.0.self_attn.k_proj.weight", "model.layers.29.mlp.down_proj.weight"}
    floats = {n: w for n, w in iter_weights(files) if n in wanted}
    for name, gq in iter_weights(files, keep_quantized=True):
        if name in wanted:
            assert torch.equal(gq.dequantize(), floats[name]), name


def test_round_to_nearest_int4_is_close_and_checks_groups():
    w = torch.randn(64, 96)
    gq = GroupQuantized.round_to_nearest(w, bits=4, group=32)
    step = (w.view(64, 3, 32).amax(-1) - w.view(64, 3, 32).amin(-1)) / 15
    assert ((gq.dequantize() - w).abs().view(64, 3, 32) <= step[..., None] / 2 + 1e-6).all()
    with pytest.raises(ValueError, match="groups of 32"):
        GroupQuantized.round_to_nearest(torch.randn(8, 40))


# --------------------------------------------------------------------------- the kernel and its constraints

@needs_kernel
def test_packed_layout_round_trips_model_shapes():
    for n, k in ((960, 576), (3072, 576), (576, 1536), (128, 32)):
        codes = torch.randint(0, 16, (n, k), dtype=torch.uint8)
        assert torch.equal(int4._unpack(int4._pack(codes), n, k, packed_layout()), codes), (n, k)


@needs_kernel
@pytest.mark.parametrize("n,k", [(64, 64), (40, 96), (16, 32), (200, 256)])     # N need not be a multiple of 16
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int4_kernel_matches_dequantized_matmul(n, k, dtype):
    torch.manual_seed(0)
    layer = Int4Linear(GroupQuantized.round_to_nearest(torch.randn(n, k) * 0.05), bias=torch.randn(n, dtype=dtype))
    assert layer.uses_kernel and layer.kernel_rows == int4.ALWAYS
    for rows in (1, 3, 17, 64):
        x = torch.randn(rows + 1, k + 1, dtype=dtype)[1:, 1:]          # a strided view at an odd offset
        ref = x.float() @ layer.dequantize(torch.float32).T + layer.bias.float()
        y = layer(x)
        assert y.dtype == dtype and y.shape == (rows, n)
        err = ((y.float() - ref).norm() / ref.norm()).item()
        assert err < 1e-2, (rows, err)
    layer.kernel_rows = 0                                                  # the dequantizing path, same answer
    assert ((layer(x).float() - ref).norm() / ref.norm()).item() < 1e-2


def test_unsupported_shapes_take_the_fallback():
    """Group sizes the kernel rejects (16) keep plain nibbles and dequantize; K not a multiple of 32 under
    --quantization int4 becomes int8; nothing reaches the kernel with a shape it would reject."""
    torch.manual_seed(0)
    gq = GroupQuantized.round_to_nearest(torch.randn(24, 48), bits=4, group=16)
    layer = Int4Linear(gq)
    assert not layer.uses_kernel and layer.kernel_rows == 0
    x = torch.randn(5, 48)
    torch.testing.assert_close(layer(x), x @ bf16_rounded(gq).T)
    model = nn.Sequential(nn.Linear(40, 24), nn.Linear(64, 32))
    quantize_model(model, "int4", torch.float32)
    assert isinstance(model[0], QuantizedLinear) and isinstance(model[1], Int4Linear)
    with pytest.raises(ValueError, match="4-bit"):
        Int4Linear(GroupQuantized.round_to_nearest(torch.randn(8, 32), bits=8))


@needs_kernel
def test_kernel_rows_come_from_a_measurement():
    layers = [Int4Linear(GroupQuantized.round_to_nearest(torch.randn(256, 128))) for _ in range(2)]
    rows, table = choose_kernel_rows(layers, torch.float32)
    assert table and all(k > 0 and d > 0 for k, d in table.values())
    assert rows == int4.ALWAYS or rows in (0, *int4.MEASURED_ROWS)
    assert choose_kernel_rows([], torch.float32) == (0, {})


# --------------------------------------------------------------------------- what the engine does by default

def test_default_for_a_quantized_gguf_is_to_keep_it_quantized(smollm2_path):
    files = resolve_model_files(smollm2_path)
    assert weight_quantization(files, None, "auto") == "gguf"
    assert weight_quantization(files, None, "float32") is None          # bit-exact float32 stays reachable
    assert weight_quantization(files, None, "bfloat16") == "gguf"       # bf16: the activations' dtype (vLLM's GGUF)
    assert weight_quantization(files, None, "float16") is None
    assert weight_quantization(files, "none", "auto") is None
    assert weight_quantization(files, "int4", "float32") == "int4"
    assert weight_quantization(files, None, "auto", tp_size=2) is None
    assert weight_quantization(files, None, "auto", device_type="cuda") is None


@pytest.mark.slow
def test_embedded_model_serves_within_130_mib():
    llm = LLM(max_model_len=256, kv_cache_memory="16MiB")
    runner = llm.engine.runner
    assert runner.quantization == "gguf"
    assert runner.weights_bytes <= 130 * 2**20, runner.weights_bytes / 2**20
    kinds = {type(m) for m in runner.model.modules()}
    assert Int4Linear in kinds and GGUFVocabulary in kinds and nn.Linear not in kinds
    table = runner.model.embed_tokens
    if all(m.native for m in runner.model.modules() if isinstance(m, Int4Linear)):
        # kvflow's kernel multiplies the Q8_0 codes themselves (held in its layout; lookups read them back): one copy
        assert table.native_head and isinstance(table.head, NativeQ8Linear) and not hasattr(table, "codes")
        g = read_gguf(default_model_path())
        info = g.tensors["token_embd.weight"]
        rows = torch.tensor([0, 17, 49151])
        want = torch.from_numpy(dequantize(g.raw(info), info.qtype, info.shape))[rows]
        assert torch.equal(table(rows), want)                   # the file's own values, from the head's codes
    else:
        assert table.codes.dtype == torch.int8
        assert isinstance(table.head, QuantizedEmbedding)                                # Q8_0: head apart
    out = llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=4))
    assert "Paris" in out[0].outputs[0].text


@pytest.mark.slow
@pytest.mark.parametrize("ftype", ["q4_0", "q8_0"])
def test_tiny_quantized_gguf_runs_kept_quantized(tiny_hf, tmp_path, ftype):
    path = write_gguf_from_hf(tiny_hf, tmp_path / f"m-{ftype}.gguf", ftype=ftype)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    kept = LLM(str(path), max_model_len=128, kv_cache_memory="8MiB")
    exact = LLM(str(path), dtype="float32", max_model_len=128, kv_cache_memory="8MiB")
    kinds = {type(m) for m in kept.engine.runner.model.modules()}
    eight_bit = NativeQ8Linear if build.usable() else QuantizedLinear     # Q8_0: kvflow's kernel where it runs
    assert (Int4Linear if ftype == "q4_0" else eight_bit) in kinds and GGUFVocabulary in kinds
    assert kept.engine.runner.weights_bytes < 0.65 * exact.engine.runner.weights_bytes   # mostly the vocabulary
    assert len(kept.generate(["Hello there"], params)[0].outputs[0].token_ids) == 6
