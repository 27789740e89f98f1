"""Model files -> ModelConfig and Hugging Face-named weight tensors.

Two formats: a Hugging Face folder (config.json + *.safetensors, sharded or not) and a GGUF file
(`gguf_reader.py`). Which one a path is, and its parsed header or config, is decided once by
`model_files.resolve_model_files`; the functions here take that `ModelFiles` (`iter_weights` also a path).
GGUF weights come out dequantized to float32, with HF names and HF shapes ([out, in]), and with
llama.cpp's Q/K row permutation undone for the llama family, so a model sees one layout whatever the file.
With `keep_quantized`, 2-D quantized GGUF tensors come out as codes instead (`DeferredCodes`, below): the file's
own codes where the format maps exactly, else re-rounded slice by slice.
"""
from __future__ import annotations

import contextlib
import logging
import re
from dataclasses import replace
from pathlib import Path
from typing import Iterator

import torch

from kvflow.kernels.group_quant import CODES, DeferredCodes, GroupQuantized
from kvflow.models.gguf_codes import group_quantized_by_rows, keeps_codes
from kvflow.models.gguf_reader import GGUFFile, GGUFTensorInfo, dequantize
from kvflow.models.model_config import ModelConfig, qwen3_5_zero_centred
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
    "ffn_gate_inp": "mlp.gate",                   # a mixture of experts' router
    # its experts, stacked [experts, rows, columns]: split into one matrix per expert (`_iter_gguf`)
    "ffn_gate_exps": "mlp.experts.gate_proj",
    "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj",
}
# a piece may hold dots (LFM2's shortconv.conv); a tensor may have no suffix (Mamba2's ssm_a)
_BLOCK_RE = re.compile(r"blk\.(\d+)\.([\w.]+?)(?:\.(weight|bias))?")


def gguf_name_to_hf(name: str, renames: dict[str, str] | None = None) -> str | None:
    """'blk.3.attn_q.weight' -> 'model.layers.3.self_attn.q_proj.weight'; None for tensors we don't use.
    `renames`: the architecture's names that differ from the llama table (`Architecture.gguf_tensor_names`): block
    pieces; whole block tensors, their suffix included or a tensor without one (Mamba2's `ssm_dt.bias`, `ssm_a`);
    or whole names outside the blocks (LFM2's final norm, `token_embd_norm`)."""
    top, _, suffix = name.rpartition(".")
    if renames and top in renames and not name.startswith("blk."):
        return f"model.{renames[top]}.{suffix}"
    if name in _GGUF_TO_HF:
        return _GGUF_TO_HF[name]
    m = _BLOCK_RE.fullmatch(name)
    if m:
        layer, piece, suffix = m.groups()
        renames = renames or {}
        tensor = piece if suffix is None else f"{piece}.{suffix}"
        if tensor in renames:
            return f"model.layers.{layer}.{renames[tensor]}"
        piece = renames.get(piece) or _GGUF_BLOCK_TO_HF.get(piece)
        if piece and suffix:
            return f"model.layers.{layer}.{piece}.{suffix}"
    return None


def unpermute_qk(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Invert llama.cpp's `reshape(n_head, 2, d/2, ...).swapaxes(1, 2)` on q/k rows (weights or biases)."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape).contiguous()


# GGUF types kept as codes with `keep_quantized`: Q4_0 / Q4_1 / Q8_0 / Q5_0 / Q4_K / Q6_K exactly as stored
# (gguf_codes.group_quantized). The others are re-rounded at load to the nearest format kvflow multiplies, by
# round to nearest on the file's float values, slice by slice (`_rerounded`): 4-bit group 32 for the types of 4
# bits or fewer, 8-bit group 32 (symmetric, Q8_0's format) for the rest. None of those has an exact mapping to a
# kernel format: Q5_K / Q5_1 are 5-bit codes with a minimum (kvflow's 8-bit kernels have none), Q2_K / Q3_K have
# 16-wide groups, the IQ types are codebooks.
_FOUR_BITS_OR_FEWER = {"Q2_K", "Q3_K", "IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ4_NL",
                       "IQ4_XS"}
_FLOAT_TYPES = {"F32", "F16", "BF16", "F64"}                   # stay float
REROUND_VALUES = 1 << 22      # float32 values dequantized at once when re-rounding (16 MiB): never a whole tensor


def _iter_gguf(g: GGUFFile, config: ModelConfig, keep_quantized: bool) -> Iterator[tuple[str, torch.Tensor]]:
    arch = config.arch
    renames = dict(arch.gguf_tensor_names)
    for info in g.tensors.values():
        name = gguf_name_to_hf(info.name, renames)
        if name is None:
            logger.debug("%s: skipping tensor %s", g.path, info.name)
            continue
        if len(info.shape) == 3:       # stacked experts: one matrix per expert, each as a 2-D tensor would be
            prefix, proj = name.rsplit(".experts.", 1)
            for expert, w in enumerate(_gguf_experts(g, info, keep_quantized)):
                yield f"{prefix}.experts.{expert}.{proj}", w
            continue
        w = _gguf_tensor(g, info, keep_quantized)
        heads = (config.num_attention_heads if ".self_attn.q_proj." in name
                 else config.num_key_value_heads if ".self_attn.k_proj." in name else 0)
        if arch.permuted_qk and heads:
            if isinstance(w, CODES):      # a row permutation: codes and scales move with their rows
                w = w.take_rows(unpermute_qk(torch.arange(w.shape[0]), heads))
            else:
                w = unpermute_qk(w, heads)
        if config.family == "gemma3" and name.endswith("norm.weight"):
            w = w - 1       # llama.cpp stores Gemma's norms as 1 + w; the checkpoint's w (as transformers undoes it)
        if config.family == "qwen3_5":
            yield from _qwen3_5_from_gguf(name, w, config)
        else:
            yield name, w


def _qwen3_5_from_gguf(name: str, w, config: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """A Qwen3.5 GGUF tensor as the checkpoint holds it, undoing llama.cpp's converter (conversion/qwen.py; as
    transformers' GGUF load does): norms stored as 1 + w (all but the Gated DeltaNet's gated norm), ssm_a as
    -exp(A_log), the convolution's taps squeezed to [channels, kernel], and, with fewer key than value heads, the
    value heads in tiled order (value head m of key head g at m * Hk + g) instead of grouped (g * Hv / Hk + m) on
    every tensor with a row or column per value head. Row picks keep GGUF codes as they are. out_proj's columns cross
    the codes' blocks: kept as codes, it stays in the file's order and comes with `out_proj.input_order`, the
    columns of its input to take (models/qwen3_5.py applies it), as transformers' GGUF load does."""
    if qwen3_5_zero_centred(name):
        yield name, w - 1
        return
    if ".linear_attn." not in name:
        yield name, w
        return
    if name.endswith(".A_log"):
        w = torch.log(-w)
    elif name.endswith(".conv1d.weight"):
        w = w.unsqueeze(1)
    rc = config.recurrent
    if rc.num_key_heads == rc.num_value_heads:
        yield name, w
        return
    key_rows = 2 * rc.num_key_heads * rc.key_head_dim
    per_head = _grouped_from_tiled(rc.num_key_heads, rc.num_value_heads, 1)
    per_value = _grouped_from_tiled(rc.num_key_heads, rc.num_value_heads, rc.value_head_dim)
    qkv_rows = torch.cat([torch.arange(key_rows), key_rows + per_value])
    rows = {".in_proj_qkv.weight": qkv_rows, ".conv1d.weight": qkv_rows, ".in_proj_z.weight": per_value,
            ".in_proj_a.weight": per_head, ".in_proj_b.weight": per_head, ".A_log": per_head, ".dt_bias": per_head}
    index = next((r for suffix, r in rows.items() if name.endswith(suffix)), None)
    if index is not None:
        yield name, w.take_rows(index) if isinstance(w, CODES) else w[index]
    elif name.endswith(".out_proj.weight") and isinstance(w, CODES):
        yield name, w
        yield name.removesuffix(".weight") + ".input_order", torch.argsort(per_value)
    elif name.endswith(".out_proj.weight"):
        yield name, w[:, per_value]
    else:
        yield name, w


def _grouped_from_tiled(key_heads: int, value_heads: int, size: int) -> torch.Tensor:
    """For each row of the grouped order (key head g, its value head m, element d), its row in the tiled order."""
    return torch.arange(value_heads * size).view(value_heads // key_heads, key_heads, size).transpose(0, 1).reshape(-1)


# fused checkpoint tensors (Phi-3's) -> the pieces every other architecture's checkpoint has, so that one
# loading path (fusing, tensor-parallel slices, GGUF codes) serves all
_SPLIT = {"self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
          "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj")}


def split_fused(weights: Iterator[tuple[str, torch.Tensor]], config: ModelConfig
                ) -> Iterator[tuple[str, torch.Tensor]]:
    """Phi-3's qkv_proj ([q; k; v] rows) and gate_up_proj ([gate; up] rows) as separate q/k/v and gate/up tensors
    (float or GroupQuantized rows alike)."""
    q, kv = config.num_attention_heads * config.head_dim, config.num_key_value_heads * config.head_dim
    for name, w in weights:
        fused = next((f for f in _SPLIT if f".{f}." in name), None)
        if fused is None:
            yield name, w
            continue
        sizes = [q, kv, kv] if "qkv" in fused else [w.shape[0] // 2] * 2
        if w.shape[0] != sum(sizes):
            raise ValueError(f"checkpoint tensor {name!r} has {w.shape[0]} rows, expected {sum(sizes)}")
        start = 0
        for piece, size in zip(_SPLIT[fused], sizes):
            rows = torch.arange(start, start + size)
            part = w.take_rows(rows) if isinstance(w, CODES) else w[start:start + size]
            yield name.replace(fused, piece), part
            start += size


# a mixture of experts' checkpoint names -> models/moe.py's: `mlp.gate` (the router) and
# `mlp.experts.E.{gate,up,down}_proj` (Mixtral's block_sparse_moe.experts.E.w1 / w3 / w2)
_EXPERT_RENAMES = ((".block_sparse_moe.router.layer.", ".mlp.gate."), (".block_sparse_moe.", ".mlp."),
                   (".w1.", ".gate_proj."), (".w3.", ".up_proj."), (".w2.", ".down_proj."))
# stacked [experts, rows, columns] checkpoint tensors -> their pieces, split along the rows in order
_STACKED = {".mlp.input_linear.weight": ("gate_proj", "up_proj"),      # GraniteMoE: [gate; up] per expert
            ".mlp.output_linear.weight": ("down_proj",),
            ".mlp.experts.gate_up_proj": ("gate_proj", "up_proj"),      # transformers 5's in-memory layout
            ".mlp.experts.down_proj": ("down_proj",)}


def canonical_experts(weights: Iterator[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """Every family's expert and router names as models/moe.py's, stacked expert tensors split per expert."""
    for name, w in weights:
        if ".block_sparse_moe." in name or ".experts." in name:
            for old, new in _EXPERT_RENAMES:
                name = name.replace(old, new)
        stacked = next((s for s in _STACKED if name.endswith(s)), None)
        if stacked is None:
            yield name, w
            continue
        prefix = name[:-len(stacked)] + ".mlp.experts"
        pieces = _STACKED[stacked]
        rows = w.shape[1] // len(pieces)
        for e in range(w.shape[0]):
            for i, piece in enumerate(pieces):
                yield f"{prefix}.{e}.{piece}.weight", w[e, i * rows:(i + 1) * rows]


def _gguf_experts(g: GGUFFile, info: GGUFTensorInfo, keep_quantized: bool
                  ) -> Iterator[torch.Tensor | DeferredCodes]:
    """A stacked [experts, rows, columns] tensor (`ffn_*_exps`) as one 2-D matrix per expert: its rows are whole
    blocks of the file's format, so each expert's slice of the bytes is a matrix in that format (codes kept exactly
    where a 2-D matrix's would be), read from the file on its own."""
    experts, rows, cols = info.shape
    piece = replace(info, shape=(rows, cols), nbytes=info.nbytes // experts)
    for e in range(experts):
        def read(row_range=None, e=e):
            start, stop = row_range or (0, rows)
            return g.raw(info, (e * rows + start, e * rows + stop))
        yield _matrix(read, piece, keep_quantized)


def _gguf_tensor(g: GGUFFile, info: GGUFTensorInfo, keep_quantized: bool) -> torch.Tensor | DeferredCodes:
    return _matrix(lambda row_range=None: g.raw(info, row_range), info, keep_quantized)


def _matrix(read, info: GGUFTensorInfo, keep_quantized: bool) -> torch.Tensor | DeferredCodes:
    """`read()`: the matrix's bytes; `read((start, stop))`: those rows' only. A matrix kept as codes is read and
    decoded only when its module is built (`DeferredCodes`: so no more than one matrix's decoded codes is resident
    at a time), a slice of rows at a time (`group_quantized_by_rows`, `_rerounded`): neither its whole bytes nor a
    whole-matrix temporary of the decode is ever held."""
    from gguf import GGMLQuantizationType

    kind = GGMLQuantizationType(info.qtype).name
    quantized = keep_quantized and len(info.shape) == 2 and kind not in _FLOAT_TYPES
    if quantized and keeps_codes(info.qtype, info.shape):
        return DeferredCodes(lambda: group_quantized_by_rows(read, info.qtype, info.shape), info.shape)
    if quantized and info.shape[1] % 32 == 0:
        bits = 4 if kind in _FOUR_BITS_OR_FEWER else 8
        return DeferredCodes(lambda: _rerounded(read, info, bits), info.shape)
    return torch.from_numpy(dequantize(read(), info.qtype, info.shape))


def _rerounded(read, info: GGUFTensorInfo, bits: int) -> GroupQuantized:
    """Group-32 codes rounded to nearest from the tensor's float values, a slice of rows at a time (`read((start,
    stop))`: those rows' bytes): neither the float32 copy of the whole tensor (4-8x its bytes in the file) nor its
    whole bytes are ever held."""
    n, k = info.shape
    step = max(1, REROUND_VALUES // k)
    codes = torch.empty(n, k, dtype=torch.uint8 if bits == 4 else torch.int8)
    scale = torch.empty(n, k // 32)
    zero = torch.empty(n, k // 32) if bits == 4 else None
    for r in range(0, n, step):
        rows = min(step, n - r)
        part = GroupQuantized.round_to_nearest(
            torch.from_numpy(dequantize(read((r, r + rows)), info.qtype, (rows, k))), bits=bits)
        codes[r:r + rows], scale[r:r + rows] = part.codes, part.scale
        if zero is not None:
            zero[r:r + rows] = part.zero
    return GroupQuantized(codes, scale, zero, 32, bits, exact=False)


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


@contextlib.contextmanager
def without_weight_init():
    """Builds modules without initialising their parameters (as transformers' `no_init_weights`): every parameter
    is then written by `load_weights` (which refuses a checkpoint that lacks one) or, for GGUF codes kept as they
    are, never — so their pages are never touched and the float copy of a quantized model costs no memory. The
    random init also cost time: ~0.4 s of a 135M model's load on a 2-core CPU."""
    inits = {name: getattr(torch.nn.init, name) for name in
             ("uniform_", "normal_", "trunc_normal_", "kaiming_uniform_", "kaiming_normal_", "xavier_uniform_",
              "xavier_normal_", "zeros_", "ones_", "constant_")}
    for name in inits:
        setattr(torch.nn.init, name, lambda tensor, *args, **kwargs: tensor)
    try:
        yield
    finally:
        for name, fn in inits.items():
            setattr(torch.nn.init, name, fn)


def iter_weights(files: ModelFiles | Path, keep_quantized: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, tensor) for every weight. Safetensors: stored dtype. GGUF: float32, llama Q/K un-permuted; with
    `keep_quantized`, each quantized matrix as `DeferredCodes` (`.resolve()`: its `GroupQuantized`; its float
    values: `.dequantize()`)."""
    if not isinstance(files, ModelFiles):
        path = Path(files)
        if path.is_dir() and not (path / "config.json").is_file():
            return _iter_safetensors(path)
        files = resolve_model_files(path)   # reads the header now: a corrupt file fails here, not on next()
    weights = (_iter_safetensors(files.path) if files.format == "hf"
               else _iter_gguf(files.gguf, files.config, keep_quantized))
    if files.config.num_experts:
        return canonical_experts(weights)
    return split_fused(weights, files.config) if files.config.family == "phi3" else weights


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

    quantized = any(len(t.shape) >= 2 and GGMLQuantizationType(t.qtype).name not in _FLOAT_TYPES
                    for t in files.gguf.tensors.values())
    return "gguf" if quantized else None
