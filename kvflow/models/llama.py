"""Llama-family decoder (Llama 2/3, SmolLM2, SmolLM3 with its NoPE layers, Mistral) and its Qwen2 (QKV bias) /
Qwen3 (Q/K norm) / Phi-3 (fused qkv and gate_up in the checkpoint, split at load; partial rotary; sliding window on
every layer) variants; Gemma 3 builds on it (gemma3.py).

Q, K and V are one fused projection, and so are gate and up: one matmul each instead of three or two.
`forward(input_ids, positions, meta)` takes the flat batch of every scheduled token and the step's
attention metadata.

Tensor parallelism (`tp`, one rank of N): every layer keeps plain `nn.Linear`s of this rank's size, so
quantization swaps them as usual. Attention is split by KV-head groups (a rank gets whole KV heads and
their query heads), the MLP by intermediate columns, the embedding and LM head by vocabulary rows, each
contiguous and as even as possible. Q/K/V and gate/up compute their own columns (column-parallel); o_proj
and down_proj sum partial products over the ranks (row-parallel: one all-reduce each). Everything else
(norms, rotary, the residual stream) is replicated. `load_weights` takes each rank's slice of the full
checkpoint tensors.
"""
from __future__ import annotations

from typing import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from kvflow.distributed.parallel_state import TensorParallel
from kvflow.kernels.group_quant import CODES, GroupQuantized
from kvflow.kernels.plan import KernelPlan
from kvflow.layers.attention import PagedAttention
from kvflow.layers.attention_metadata import AttentionMetadata
from kvflow.layers.lora import LoRAStack
from kvflow.layers.native_layers import NativeAttention, NativeDecoder, NativeLayer, NotNative
from kvflow.layers.norm import RMSNorm
from kvflow.layers.rotary import RotaryEmbedding
from kvflow.models.lora_modules import lora_modules
from kvflow.models.model_config import ModelConfig


def check_tensor_parallel(cfg: ModelConfig, size: int) -> None:
    """Every rank needs at least one whole KV head (and its group of query heads)."""
    if size > cfg.num_key_value_heads:
        raise ValueError(
            f"tensor_parallel_size={size} cannot split this model: it has {cfg.num_attention_heads} attention "
            f"heads and {cfg.num_key_value_heads} KV heads, and each rank needs at least one KV head; "
            f"use tensor_parallel_size <= {cfg.num_key_value_heads}")
    if cfg.num_attention_heads % cfg.num_key_value_heads:
        raise ValueError(f"{cfg.num_attention_heads} attention heads do not form groups over "
                         f"{cfg.num_key_value_heads} KV heads")


class TensorParallelSizes:
    """This rank's share of each split dimension: its sizes, and its [start, end) in checkpoint units (rows or
    columns of the full tensors) for load_weights."""

    def __init__(self, cfg: ModelConfig, tp: TensorParallel):
        check_tensor_parallel(cfg, tp.size)
        group = cfg.num_attention_heads // cfg.num_key_value_heads
        kv_start, kv_end = tp.shard(cfg.num_key_value_heads)
        self.num_kv_heads = kv_end - kv_start
        self.num_heads = self.num_kv_heads * group
        d = cfg.head_dim
        self.q_rows = (kv_start * group * d, kv_end * group * d)
        self.kv_rows = (kv_start * d, kv_end * d)
        self.intermediate = tp.shard(cfg.intermediate_size)
        self.intermediate_size = self.intermediate[1] - self.intermediate[0]
        self.vocab = tp.shard(cfg.vocab_size)
        self.vocab_size = self.vocab[1] - self.vocab[0]
        # checkpoint name piece -> (dim to slice, this rank's range): output rows of the column-parallel
        # layers, input columns of the row-parallel ones, vocabulary rows of the embedding and head
        self.slices = {
            "q_proj": (0, self.q_rows), "k_proj": (0, self.kv_rows), "v_proj": (0, self.kv_rows),
            "o_proj": (1, self.q_rows),
            "gate_proj": (0, self.intermediate), "up_proj": (0, self.intermediate),
            "down_proj": (1, self.intermediate),
            "embed_tokens": (0, self.vocab), "lm_head": (0, self.vocab),
        }


def _lora_on(stack: LoRAStack | None, meta: AttentionMetadata | None) -> bool:
    """Whether a projection adds its LoRA term this step: it has one, the step has a mask (an eager step of base rows
    only has none), and some slot adapts it — a compiled graph always computes it (traced before any adapter)."""
    if stack is None or meta is None or meta.lora_mask is None:
        return False
    return torch.compiler.is_compiling() or stack._active


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding | None, tp: TensorParallel,
                 sizes: TensorParallelSizes, layer: int = 0, kernels: KernelPlan | None = None):
        super().__init__()
        self.tp = tp
        self.num_heads, self.num_kv_heads, self.head_dim = sizes.num_heads, sizes.num_kv_heads, cfg.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=False)
        # per head (Qwen3, Gemma 3), or over the whole q and k projections (OLMoE: `qk_norm_whole`)
        self.qk_norm_whole = cfg.qk_norm and cfg.arch.qk_norm_whole
        q_width, k_width = (self.q_size, self.kv_size) if self.qk_norm_whole else (self.head_dim, self.head_dim)
        self.q_norm = RMSNorm(q_width, cfg.rms_norm_eps, kernels) if cfg.qk_norm else None
        self.k_norm = RMSNorm(k_width, cfg.rms_norm_eps, kernels) if cfg.qk_norm else None
        self.clip_qkv = cfg.clip_qkv
        self.rotary = rotary
        scale = (cfg.attention_multiplier if cfg.attention_multiplier is not None
                 else cfg.query_pre_attn_scalar ** -0.5 if cfg.query_pre_attn_scalar else None)
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, self.head_dim, scale,
                                   cfg.sliding_window if cfg.is_sliding(layer) else None)
        # LoRA terms added to the projections' outputs (enable_lora: LlamaForCausalLM.enable_lora)
        self.qkv_lora: LoRAStack | None = None
        self.o_lora: LoRAStack | None = None

    def forward(self, rope: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        T = x.shape[0]
        qkv = self.qkv_proj(x)
        if _lora_on(self.qkv_lora, meta):
            qkv = self.qkv_lora.add_to(qkv, x, meta.lora_mask)
        if self.qk_norm_whole:
            q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
            qkv = torch.cat([self.q_norm(q.contiguous()), self.k_norm(k.contiguous()), v], dim=-1)
        if self.clip_qkv is not None:
            qkv = qkv.clamp(-self.clip_qkv, self.clip_qkv)
        # q and k heads sit side by side in qkv's rows: rotate them as one [T, Hq + Hkv, D] tensor
        qk = qkv[:, :self.q_size + self.kv_size].view(T, self.num_heads + self.num_kv_heads, self.head_dim)
        v = qkv[:, self.q_size + self.kv_size:].view(T, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and not self.qk_norm_whole:     # Qwen3, Gemma 3: per-head norms, with their own weights for q and k
            qk = torch.cat([self.q_norm(qk[:, :self.num_heads]), self.k_norm(qk[:, self.num_heads:])], dim=1)
        # rotary None: a layer without position embedding (NoPE: Granite 4.0 H's attention layers)
        qk = self.rotary.rotate(qk, rope) if self.rotary is not None else qk.contiguous()
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        attn = self.attn(q, k, v, meta)
        out = self.o_proj(attn)
        if _lora_on(self.o_lora, meta):
            out = self.o_lora.add_to(out, attn, meta.lora_mask)
        return self.tp.all_reduce(out)

    def native(self, rotary: RotaryEmbedding | None) -> NativeAttention:
        """This attention as the native step computes it, rotating with `rotary`'s tables (None: no rotation)."""
        if self.clip_qkv is not None or self.qkv_lora or self.o_lora:
            raise NotNative("QKV clipping or LoRA terms")
        return NativeAttention(self.qkv_proj, self.o_proj, self.q_norm, self.k_norm, self.qk_norm_whole,
                               self.num_heads, self.num_kv_heads, self.head_dim, self.attn, rotary)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TensorParallel, sizes: TensorParallelSizes):
        super().__init__()
        self.tp = tp
        self.intermediate_size = sizes.intermediate_size
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * self.intermediate_size, bias=False)
        self.down_proj = nn.Linear(self.intermediate_size, cfg.hidden_size, bias=False)
        if cfg.hidden_act not in _ACTIVATIONS:
            raise ValueError(f"hidden activation {cfg.hidden_act!r} is not supported ({', '.join(_ACTIVATIONS)})")
        self.act = _ACTIVATIONS[cfg.hidden_act]
        self.gate_up_lora: LoRAStack | None = None
        self.down_lora: LoRAStack | None = None

    def forward(self, x: torch.Tensor, meta: AttentionMetadata | None = None) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if _lora_on(self.gate_up_lora, meta):
            gate_up = self.gate_up_lora.add_to(gate_up, x, meta.lora_mask)
        gate, up = gate_up.split(self.intermediate_size, dim=-1)
        h = self.act(gate) * up
        out = self.down_proj(h)
        if _lora_on(self.down_lora, meta):
            out = self.down_lora.add_to(out, h, meta.lora_mask)
        return self.tp.all_reduce(out)

    def native(self) -> dict:
        """This MLP's fields of a NativeLayer."""
        if self.gate_up_lora or self.down_lora:
            raise NotNative("an MLP with LoRA terms")
        return dict(gate_up=self.gate_up_proj, down=self.down_proj, intermediate=self.intermediate_size)


# the MLP's gate activation by config name (GeGLU's tanh GELU: Gemma)
_ACTIVATIONS = {"silu": F.silu, "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh")}


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding, tp: TensorParallel, sizes: TensorParallelSizes,
                 layer: int = 0, kernels: KernelPlan | None = None):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, kernels)
        self.self_attn = Attention(cfg, rotary, tp, sizes, layer, kernels)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, kernels)
        self.mlp = MLP(cfg, tp, sizes)

    def forward(self, rope: tuple[torch.Tensor, torch.Tensor], h: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        h = h + self.self_attn(rope, self.input_layernorm(h), meta)
        return h + self.mlp(self.post_attention_layernorm(h), meta)

    def native_layer(self, model: LlamaForCausalLM) -> NativeLayer:
        """This layer as the native step computes it: pre-norm attention on the model's rotary tables (or none: a
        NoPE layer), pre-norm MLP."""
        rotary = self.self_attn.rotary
        if rotary is not None and rotary is not model.rotary:
            raise NotNative("a layer with its own rotary tables")
        return NativeLayer(self.self_attn.native(rotary), self.input_layernorm, self.post_attention_layernorm,
                           **self.mlp.native())


# checkpoint name piece -> (our fused parameter, shard index)
_FUSED = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
          "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, max_positions: int, tp: TensorParallel | None = None,
                 kernels: KernelPlan | None = None):
        super().__init__()
        self.config = cfg
        self.kernels = kernels          # the kernel plan its modules were built for (None: torch's kernels)
        self.tp = tp = tp or TensorParallel()
        self.sizes = sizes = TensorParallelSizes(cfg, tp)
        self.rotary = RotaryEmbedding(cfg.head_dim, max_positions, cfg.rope_theta, cfg.rope_scaling, cfg.rotary_dim)
        self.embed_tokens = nn.Embedding(sizes.vocab_size, cfg.hidden_size)
        # a NoPE layer (SmolLM3's every 4th) gets no rotary table
        self.layers = nn.ModuleList(self.decoder_layer(cfg, None if i in cfg.nope_layers else self.rotary, tp, sizes,
                                                       i, kernels)
                                    for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, kernels)
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, sizes.vocab_size, bias=False)

    decoder_layer = DecoderLayer
    # checkpoint name piece -> (fused parameter, shard index): a family with more fused projections extends it
    fused_pieces = _FUSED

    @property
    def attention_layers(self) -> list[PagedAttention]:
        return [layer.self_attn.attn for layer in self.layers]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """`meta`: the step's attention metadata, passed explicitly, so a compiled graph reads no module state
        and a background compile cannot see another thread's step."""
        h = self.input_embeddings(input_ids)
        rope = self.rotary.lookup(positions)
        for layer in self.layers:
            h = layer(rope, h, meta)
        return self.norm(h)

    def input_embeddings(self, input_ids: torch.Tensor) -> torch.Tensor:
        """What the first layer reads (the runner's native step starts here too): the embedding, times Granite's
        embedding multiplier (GraniteMoE, Granite 4.0 H; None for the other families)."""
        h = self.embed(input_ids)
        return h if self.config.embedding_multiplier is None else h * self.config.embedding_multiplier

    def native_decoder(self) -> NativeDecoder:
        """The model as kvflow's native decoder step computes it (layers/native_layers.py), each layer described by
        its own class (`native_layer`); NotNative says why not."""
        layers = []
        for layer in self.layers:
            if not hasattr(layer, "native_layer"):
                raise NotNative(f"a {type(layer).__name__}, which describes no native layer")
            layers.append(layer.native_layer(self))
        return NativeDecoder(layers, self.norm, self.config.hidden_act, self.input_embeddings)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return self.embed_tokens(input_ids)
        # this rank holds vocabulary rows [start, end): it looks up the ids in that range, gives zero rows
        # for the others, and the sum over ranks is the full lookup (works for the quantized table too)
        start, end = self.sizes.vocab
        local = input_ids - start
        outside = (local < 0) | (local >= end - start)
        rows = self.embed_tokens(local.masked_fill(outside, 0))
        return self.tp.all_reduce(rows.masked_fill(outside[:, None], 0))

    # ---- LoRA ----------------------------------------------------------------------------------------------
    # per block (the layer's attribute): (the attribute holding the LoRA term, the base layer, the checkpoint modules
    # under layers.{i} it fuses, in the order of its output rows: models/lora_modules.py names them and their shapes)
    LORA_TARGETS = {"self_attn": (("qkv_lora", "qkv_proj",
                                   ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
                                  ("o_lora", "o_proj", ("self_attn.o_proj",))),
                    "mlp": (("gate_up_lora", "gate_up_proj", ("mlp.gate_proj", "mlp.up_proj")),
                            ("down_lora", "down_proj", ("mlp.down_proj",)))}

    def enable_lora(self, max_loras: int, max_rank: int, dtype: torch.dtype = torch.float32,
                    targets: tuple[str, ...] | None = None) -> None:
        """Give every layer's projections among `targets` (the projections' checkpoint names, q_proj, w1, ...; None:
        every attention and MLP projection) a LoRA term of `max_loras` slots of rank `max_rank` (all zero: no adapter
        until `set_lora_slot`); a layer without the block (a recurrent layer has no self_attn) gets none. One rank
        only (config.validate refuses tensor parallelism with LoRA)."""
        modules = lora_modules(self.config)
        if targets is not None:
            missing = [t for t in targets if t not in modules.projections]
            if missing:
                recurrent = [m for t in missing for m in modules.matching(t, modules.recurrent)]
                why = modules.refusal(recurrent[0]) if recurrent else \
                    f"its projections are {', '.join(modules.projections)}"
                raise ValueError(f"lora_target_modules {missing}: {self.config.architecture} has no such adaptable "
                                 f"projection ({why})")
        device = self.norm.weight.device      # (the embedding may have been swapped for a quantized table)
        self.lora_pieces = {}                 # the LoRA term's attribute -> the modules it adapts, in order
        for block, terms in self.LORA_TARGETS.items():
            for attr, base, fused in terms:
                pieces, offset = [], 0
                for module in fused:
                    width = modules.shapes[module][1]
                    if targets is None or module.rsplit(".", 1)[1] in targets:
                        pieces.append((module, offset, width))
                    offset += width
                if not pieces:
                    continue
                self.lora_pieces[attr] = tuple(module for module, _, _ in pieces)
                for layer in self.layers:
                    owner = getattr(layer, block, None)
                    if owner is None:
                        continue
                    with torch.device(device):
                        stack = LoRAStack(modules.shapes[fused[0]][0], [(o, w) for _, o, w in pieces], max_loras,
                                          max_rank, self.kernels)
                    setattr(owner, attr, stack.to(dtype))

    @torch.no_grad()
    def set_lora_slot(self, slot: int, tensors: dict | None, scale: float = 1.0) -> None:
        """Write one adapter into `slot` of every LoRA term (`tensors`: "layers.{i}.{module}" -> (A [r, in],
        B [out, r]), models/lora_adapter.py); None clears the slot."""
        tensors = tensors or {}
        for i, layer in enumerate(self.layers):
            for block, terms in self.LORA_TARGETS.items():
                owner = getattr(layer, block, None)
                for attr, _, _ in terms:
                    stack = getattr(owner, attr, None)
                    if stack is None:
                        continue
                    pieces = [tensors.get(f"layers.{i}.{module}") for module in self.lora_pieces[attr]]
                    stack.set_slot(slot, [None if ab is None else (ab[0].to(stack.lora_a.dtype),
                                                                   ab[1].to(stack.lora_a.dtype)) for ab in pieces],
                                   scale)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Float32 logits over the whole vocabulary; under tensor parallelism every rank computes its vocabulary
        slice and rank 0 gets them all (the other ranks get None)."""
        head = self.embed_tokens if self.lm_head is None else self.lm_head
        if hasattr(head, "project"):          # quantized: dequantizes slice by slice
            logits = head.project(hidden).float()
        else:
            logits = F.linear(hidden, head.weight).float()
        logits = self.tp.gather_last_dim(logits, self.config.vocab_size)
        if self.config.logits_scaling is not None and logits is not None:     # Granite's: divided by it
            logits = logits / self.config.logits_scaling
        cap = self.config.final_logit_softcapping
        if cap and logits is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy Hugging Face-named tensors in (this rank's slice of each), fusing q/k/v and gate/up on the way.
        A `GroupQuantized` tensor (a GGUF loaded with keep_quantized, one rank only) is kept on the parameter's
        module, as `gguf_pieces[shard]` with its rows `gguf_rows[shard]`, for quantize_model; its float values are
        not written (`layers/quantization.fill_gguf_floats` writes them where a module keeps floats after all), so
        the float copy of a quantized model never becomes resident memory: the load has no float-model peak."""
        params = dict(self.named_parameters())
        loaded = set()
        for name, tensor in weights:
            name = name.removeprefix("model.")
            if name.startswith("lm_head") and self.lm_head is None:
                continue        # tied: the embedding serves as the head
            if "rotary_emb" in name:
                continue
            codes = None
            if isinstance(tensor, CODES):
                if self.tp.size > 1:
                    raise ValueError("quantized GGUF codes cannot be split over tensor-parallel ranks; load floats")
                codes = tensor
                if not name.endswith(".weight"):      # only matrices are kept as codes
                    codes, tensor = None, tensor.dequantize()
            else:
                tensor = self._rank_slice(name, tensor)
            target = name
            for piece, (fused, shard) in self.fused_pieces.items():
                if f".{piece}." in name:
                    target = name.replace(piece, fused)
                    param = params[target]
                    sizes = self._shard_sizes(target)
                    start = sum(sizes[:shard])
                    if codes is None:
                        param[start:start + sizes[shard]].copy_(tensor)
                    elif tuple(codes.shape) != (sizes[shard], *param.shape[1:]):
                        raise ValueError(f"checkpoint tensor {name!r} has shape {tuple(codes.shape)}, the model "
                                         f"expects {(sizes[shard], *param.shape[1:])}")
                    loaded.add((target, shard))
                    self._keep_codes(target, shard, len(sizes), codes, (start, start + sizes[shard]))
                    break
            else:
                if target not in params:
                    raise ValueError(f"checkpoint tensor {name!r} has no place in the model")
                param = params[target]
                if tuple(param.shape) != tuple(tensor.shape):
                    raise ValueError(f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, "
                                     f"the model expects {tuple(param.shape)}")
                if codes is None:
                    param.copy_(tensor)
                loaded.add((target, 0))
                self._keep_codes(target, 0, 1, codes, (0, param.shape[0]))
        expected = {(n, s) for n in params for s in range(len(self._shard_sizes(n)))}
        missing = sorted({n for n, _ in expected - loaded})
        if missing:
            raise ValueError(f"checkpoint lacks tensors for: {missing[:8]}")

    def _keep_codes(self, target: str, shard: int, shards: int, codes: GroupQuantized | None,
                    rows: tuple[int, int]) -> None:
        if codes is None:
            return
        module = self.get_submodule(target.removesuffix(".weight"))
        if not hasattr(module, "gguf_pieces"):
            module.gguf_pieces, module.gguf_rows = [None] * shards, [None] * shards
        module.gguf_pieces[shard], module.gguf_rows[shard] = codes, rows

    def _rank_slice(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's rows or columns of a checkpoint tensor (all of it at size 1; biases slice with their rows)."""
        if self.tp.size == 1:
            return tensor
        for piece in name.split("."):
            if piece in self.sizes.slices:
                dim, (start, end) = self.sizes.slices[piece]
                return tensor.narrow(dim, start, end - start) if dim < tensor.dim() else tensor
        return tensor      # norms (q_norm/k_norm are per head_dim): replicated

    def _shard_sizes(self, name: str) -> list[int]:
        """Row sizes of the pieces a (possibly fused) parameter is loaded from."""
        cfg, sizes = self.config, self.sizes
        if "qkv_proj" in name:
            kv = sizes.num_kv_heads * cfg.head_dim
            return [sizes.num_heads * cfg.head_dim, kv, kv]
        if "gate_up_proj" in name:
            return [sizes.intermediate_size, sizes.intermediate_size]
        return [0]
