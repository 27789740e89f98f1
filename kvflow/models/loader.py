"""Model files -> ModelConfig and Hugging Face-named weight tensors.

Two formats: a Hugging Face folder (config.json + *.safetensors, sharded or not) and a GGUF file
(`gguf_reader.py`). Which one a path is, and its parsed header or config, is decided once by
`model_files.resolve_model_files`; the functions here take that `ModelFiles` (`iter_weights` also a path).
GGUF weights come out dequantized to float32, with HF names and HF shapes ([out, in]), and with
llama.cpp's Q/K row permutation undone for the llama family, so a model sees one layout whatever the file.
With `keep_quantized`, 2-D quantized GGUF tensors come out as `GroupQuantized` codes instead (below).
"""
from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Iterator

import torch

from kvflow.layers.group_quant import GroupQuantized
from kvflow.models.gguf_reader import GGUFFile, GGUFTensorInfo, dequantize, group_quantized
from kvflow.models.model_config import ModelConfig
from kvflow.models.model_files import ModelFiles, default_model_path, resolve_model_files  # noqa: F401

logger = logging.getLogger(__name__)


# --------------------------------------------------------------------------- weights

_GGUF_TO_HF = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_GGUF_BLOCK_TO_HF = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_BLOCK_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


def gguf_name_to_hf(name: str) -> str | None:
    """'blk.3.attn_q.weight' -> 'model.layers.3.self_attn.q_proj.weight'; None for tensors we don't use."""
    if name in _GGUF_TO_HF:
        return _GGUF_TO_HF[name]
    m = _BLOCK_RE.fullmatch(name)
    if m and m.group(2) in _GGUF_BLOCK_TO_HF:
        return f"model.layers.{m.group(1)}.{_GGUF_BLOCK_TO_HF[m.group(2)]}.{m.group(3)}"
    return None


def unpermute_qk(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Invert llama.cpp's `reshape(n_head, 2, d/2, ...).swapaxes(1, 2)` on q/k rows (weights or biases)."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape).contiguous()


# GGUF types kept as codes with `keep_quantized`: Q4_0 / Q4_1 / Q8_0 exactly as stored; the K-quants re-rounded at
# load to the nearest format torch multiplies (4-bit group 32 for the 4-bit ones, 8-bit otherwise)
_FOUR_BITS_OR_FEWER = {"Q2_K", "Q3_K", "Q4_K", "IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S",
                       "IQ4_NL", "IQ4_XS"}
_FLOAT_TYPES = {"F32", "F16", "BF16", "F64"}                   # stay float


def _iter_gguf(g: GGUFFile, config: ModelConfig, keep_quantized: bool) -> Iterator[tuple[str, torch.Tensor]]:
    permuted = config.family == "llama"
    for info in g.tensors.values():
        name = gguf_name_to_hf(info.name)
        if name is None:
            logger.debug("%s: skipping tensor %s", g.path, info.name)
            continue
        w = _gguf_tensor(g, info, keep_quantized)
        heads = (config.num_attention_heads if ".self_attn.q_proj." in name
                 else config.num_key_value_heads if ".self_attn.k_proj." in name else 0)
        if permuted and heads:
            if isinstance(w, GroupQuantized):      # a row permutation: codes and scales move with their rows
                w = w.take_rows(unpermute_qk(torch.arange(w.shape[0]), heads))
            else:
                w = unpermute_qk(w, heads)
        yield name, w


def _gguf_tensor(g: GGUFFile, info: GGUFTensorInfo, keep_quantized: bool) -> torch.Tensor | GroupQuantized:
    from gguf import GGMLQuantizationType

    raw = g.raw(info)
    kind = GGMLQuantizationType(info.qtype).name
    quantized = keep_quantized and len(info.shape) == 2 and kind not in _FLOAT_TYPES
    codes = group_quantized(raw, info.qtype, info.shape) if quantized else None
    if codes is not None:
        return codes
    w = torch.from_numpy(dequantize(raw, info.qtype, info.shape))
    if quantized and info.shape[1] % 32 == 0:
        return GroupQuantized.round_to_nearest(w, bits=4 if kind in _FOUR_BITS_OR_FEWER else 8)
    return w


def _iter_safetensors(folder: Path) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{folder} has no *.safetensors weight files")
    for file in files:
        try:
            f = safe_open(str(file), framework="pt")
        except Exception as e:  # safetensors raises its own SafetensorError
            raise ValueError(f"cannot read {file}: {e}") from None
        with f:
            for key in f.keys():
                yield key, f.get_tensor(key)


def iter_weights(files: ModelFiles | Path, keep_quantized: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, tensor) for every weight. Safetensors: stored dtype. GGUF: float32, llama Q/K un-permuted; with
    `keep_quantized`, each quantized matrix as `GroupQuantized` (its float values: `.dequantize()`)."""
    if not isinstance(files, ModelFiles):
        path = Path(files)
        if path.is_dir():
            return _iter_safetensors(path)
        files = resolve_model_files(path)   # reads the header now: a corrupt file fails here, not on next()
    if files.format == "hf":
        return _iter_safetensors(files.path)
    return _iter_gguf(files.gguf, files.config, keep_quantized)


def weight_quantization(files: ModelFiles, quantization: str | None, dtype_setting: str, tp_size: int = 1,
                        device_type: str = "cpu") -> str | None:
    """What `quantize_model` is asked to do with these files (None: nothing, the weights stay float).

    An explicit `quantization` wins ("none": float). Unset, a GGUF whose matrices are quantized stays quantized
    ("gguf": the file's own codes, 4-8x fewer bytes per step than floats; `dtype=bfloat16` then sets the
    activations' dtype, as vLLM's GGUF support does) unless the user asked for float32 or float16
    (`dtype=float32` stays bit-exact with transformers' float load of the same file), the model is split
    over tensor-parallel ranks, or it runs on a GPU (the int4 kernel used here is torch's CPU one)."""
    if quantization is not None:
        return None if quantization == "none" else quantization
    if files.format != "gguf" or dtype_setting not in ("auto", "bfloat16") or tp_size > 1 or device_type != "cpu":
        return None
    from gguf import GGMLQuantizationType

    quantized = any(len(t.shape) == 2 and GGMLQuantizationType(t.qtype).name not in _FLOAT_TYPES
                    for t in files.gguf.tensors.values())
    return "gguf" if quantized else None
