"""Qwen3.5 (dense: 0.8B, 2B, 4B, 9B), as transformers' Qwen3_5ForCausalLM computes it: three Gated DeltaNet layers
(a recurrent state per request: layers/recurrent_state.py) before each gated full-attention layer, on the Llama
decoder's pieces (llama.py: fused projections, MLP, rotary tables, loading).

- Gated DeltaNet (`GatedDeltaNet`): q/k/v, z, b and a projections (two matmuls: [qkv; z] and [b; a], fused at
  load), a causal depthwise convolution over the q/k/v channels with SiLU, then the delta rule per value head
  (kernels/recurrent.py: token after token, the state float32), a gated RMSNorm per value head and out_proj.
- Gated attention (`GatedAttention`): q_proj gives, per head, the query then a gate on the attention's output
  (`o_proj(attention * sigmoid(gate))`); per-head q/k RMSNorm; RoPE on the first quarter of each head (the
  checkpoints' interleaved M-RoPE sections rotate a text position alike in every section: plain partial RoPE).
- RMSNorm x̂ (1 + w), the checkpoint holding w: 1 is added once at load in float32 (as gemma3.py does; the loader
  turns a GGUF's stored 1 + w back into w). The Gated DeltaNet's own norm multiplies by w as it is.

- LoRA: adapters adapt the gated attention's q_proj (its B rows in the checkpoint's query-then-gate order per head,
  the rows qkv_proj keeps) / k_proj / v_proj / o_proj and the MLPs' gate/up/down_proj (llama.py's `LORA_TARGETS`);
  the Gated DeltaNet's projections take none (refused: models/lora_modules.py).

The released checkpoints are Qwen3_5ForConditionalGeneration (a vision tower beside the text model): the text model
is served, the tower's weights (`model.visual.*`) skipped, and so are the multi-token-prediction block's (`mtp.*`)
unless speculative decoding drafts with it (`MultiTokenPredictor`, `enable_mtp`: the "mtp" method).
"""
from __future__ import annotations

import dataclasses
import logging
from typing import Iterable

import torch
from torch import nn

from kvflow.distributed.parallel_state import TensorParallel
from kvflow.kernels.group_quant import CODES
from kvflow.kernels.plan import KernelPlan
from kvflow.kernels.recurrent import (causal_conv1d, gated_delta_rule, gated_rms_norm, gdn_gates,
                                      sigmoid_mul)
from kvflow.layers.attention_metadata import AttentionMetadata
from kvflow.layers.native_layers import NativeAttention, NativeGatedDeltaNet, NativeLayer
from kvflow.layers.norm import RMSNorm
from kvflow.layers.recurrent_state import RecurrentLayer
from kvflow.layers.rotary import RotaryEmbedding
from kvflow.models.hybrid import HybridForCausalLM
from kvflow.models.llama import MLP, Attention, LlamaForCausalLM, TensorParallelSizes, _lora_on
from kvflow.models.model_config import GATED_DELTA_NET, ModelConfig, qwen3_5_zero_centred

logger = logging.getLogger(__name__)


class GatedRMSNorm(nn.Module):
    """RMSNorm over each value head's dv values, times w (as it is), times silu(gate): norm before gate, in float32,
    as transformers' Qwen3_5RMSNormGated (kernels/recurrent.gated_rms_norm)."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        return gated_rms_norm(x, gate, self.weight, self.eps)


class CausalConv1d(nn.Module):
    """The depthwise causal convolution's taps, [channels, kernel] (a checkpoint's [channels, 1, kernel] squeezed at
    load); no bias."""

    def __init__(self, channels: int, kernel: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(channels, kernel))


class GatedDeltaNet(RecurrentLayer):
    """One Gated DeltaNet mixer over the step's flat rows; `meta.state` says which state slot each run of rows
    continues. States per slot: the convolution's last K - 1 inputs [K - 1, 2 Hk dk + Hv dv] (compute dtype) and
    the delta rule's matrices [Hv, dk, dv] (float32)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        rc = cfg.recurrent
        self.num_k_heads, self.num_v_heads = rc.num_key_heads, rc.num_value_heads
        self.head_k_dim, self.head_v_dim = rc.key_head_dim, rc.value_head_dim
        if self.num_v_heads % self.num_k_heads:
            raise ValueError(f"Gated DeltaNet: {self.num_v_heads} value heads do not form groups over "
                             f"{self.num_k_heads} key heads")
        self.key_dim = self.num_k_heads * self.head_k_dim
        self.value_dim = self.num_v_heads * self.head_v_dim
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.conv_kernel = rc.conv_kernel
        # [q; k; v; z] and [b; a]: the checkpoint's four projections in two matmuls (b and a, Hv rows each, apart:
        # a GGUF may keep them in another format than the big ones)
        self.in_proj_qkvz = nn.Linear(cfg.hidden_size, self.conv_dim + self.value_dim, bias=False)
        self.in_proj_ba = nn.Linear(cfg.hidden_size, 2 * self.num_v_heads, bias=False)
        self.conv1d = CausalConv1d(self.conv_dim, self.conv_kernel)
        self.dt_bias = nn.Parameter(torch.empty(self.num_v_heads))
        self.A_log = nn.Parameter(torch.empty(self.num_v_heads))
        self.norm = GatedRMSNorm(self.head_v_dim, cfg.rms_norm_eps)
        self.out_proj = nn.Linear(self.value_dim, cfg.hidden_size, bias=False)
        # which columns of the value heads' output out_proj takes, in its order: None, the checkpoint's; a GGUF's
        # codes of a model with fewer key than value heads keep llama.cpp's order (models/loader.py)
        self.register_buffer("out_proj_input_order", None)

    def state_shapes(self, dtype: torch.dtype) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        return {"conv": ((self.conv_kernel - 1, self.conv_dim), dtype),
                "recurrent": ((self.num_v_heads, self.head_k_dim, self.head_v_dim), torch.float32)}

    def forward(self, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        if meta.state is None:
            raise RuntimeError("a Gated DeltaNet layer needs the step's state runs (AttentionMetadata.state)")
        T = x.shape[0]
        qkv, z = self.in_proj_qkvz(x).split([self.conv_dim, self.value_dim], dim=-1)
        qkv = causal_conv1d(qkv.contiguous(), self.conv1d.weight, None, self.states["conv"], meta.state, silu=True)
        q, k, v = qkv.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        beta, g = gdn_gates(self.in_proj_ba(x), self.A_log, self.dt_bias)     # g: the log decay per value head
        o = gated_delta_rule(q.reshape(T, self.num_k_heads, self.head_k_dim),
                             k.reshape(T, self.num_k_heads, self.head_k_dim),
                             v.reshape(T, self.num_v_heads, self.head_v_dim), g, beta, self.states["recurrent"],
                             meta.state)
        o = self.norm(o, z.reshape(T, self.num_v_heads, self.head_v_dim)).reshape(T, self.value_dim)
        if self.out_proj_input_order is not None:
            o = o.index_select(1, self.out_proj_input_order)
        return self.out_proj(o)

    def native(self) -> NativeGatedDeltaNet:
        """This mixer as the native step computes it (the same kernels: kernels/recurrent.py's C ones)."""
        states = self.bound_states()
        return NativeGatedDeltaNet(self.in_proj_qkvz, self.in_proj_ba, self.out_proj, self.conv1d.weight,
                                   states["conv"], states["recurrent"], self.A_log, self.dt_bias,
                                   self.norm.weight, self.norm.eps, self.num_k_heads, self.num_v_heads,
                                   self.head_k_dim, self.head_v_dim, self.out_proj_input_order)


class GatedAttention(Attention):
    """Llama's attention with q_proj twice as wide: per head, head_dim query values then head_dim gate values (the
    checkpoint's row order, transformers' view(..., heads, 2 * head_dim).chunk(2)), kept in that order in the fused
    qkv_proj; the output is o_proj(attention * sigmoid(gate))."""

    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding, tp: TensorParallel, sizes: TensorParallelSizes,
                 layer: int = 0, kernels: KernelPlan | None = None):
        super().__init__(cfg, rotary, tp, sizes, layer, kernels)
        self.qkv_proj = nn.Linear(cfg.hidden_size, 2 * self.q_size + 2 * self.kv_size, bias=cfg.attention_bias)

    def forward(self, rope: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        T, H, Hkv, D = x.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        qkv = self.qkv_proj(x)
        if _lora_on(self.qkv_lora, meta):
            # q_proj's LoRA rows are the checkpoint's (query then gate per head), which qkv_proj keeps as they are
            qkv = self.qkv_lora.add_to(qkv, x, meta.lora_mask)
        qg, k, v = qkv.split([2 * self.q_size, self.kv_size, self.kv_size], dim=-1)
        qg = qg.view(T, H, 2, D)
        qk = torch.cat([self.q_norm(qg[:, :, 0].contiguous()), self.k_norm(k.reshape(T, Hkv, D))], dim=1)
        q, k = self.rotary.rotate(qk, rope).split([H, Hkv], dim=1)
        gated = sigmoid_mul(self.attn(q, k, v.reshape(T, Hkv, D), meta), qg[:, :, 1])
        out = self.o_proj(gated)
        if _lora_on(self.o_lora, meta):
            out = self.o_lora.add_to(out, gated, meta.lora_mask)
        return out

    def native(self, rotary: RotaryEmbedding) -> NativeAttention:
        return dataclasses.replace(super().native(rotary), output_gate=True)


class Qwen3_5DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding, tp: TensorParallel, sizes: TensorParallelSizes,
                 layer: int = 0, kernels: KernelPlan | None = None):
        super().__init__()
        self.recurrent = cfg.is_recurrent(layer)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, kernels)
        if self.recurrent:
            self.linear_attn = GatedDeltaNet(cfg)
        else:
            self.self_attn = GatedAttention(cfg, rotary, tp, sizes, layer, kernels)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, kernels)
        self.mlp = MLP(cfg, tp, sizes)

    def forward(self, rope: tuple[torch.Tensor, torch.Tensor], h: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        x = self.input_layernorm(h)
        h = h + (self.linear_attn(x, meta) if self.recurrent else self.self_attn(rope, x, meta))
        return h + self.mlp(self.post_attention_layernorm(h), meta)

    def native_layer(self, model: LlamaForCausalLM) -> NativeLayer:
        """This layer as the native step computes it: the Gated DeltaNet or gated attention, then the MLP."""
        if self.recurrent:
            return NativeLayer(None, self.input_layernorm, self.post_attention_layernorm,
                               recurrent=self.linear_attn.native(), **self.mlp.native())
        return NativeLayer(self.self_attn.native(model.rotary), self.input_layernorm, self.post_attention_layernorm,
                           **self.mlp.native())


class MultiTokenPredictor(nn.Module):
    """Qwen3.5's multi-token-prediction block (the checkpoint's `mtp.*`; vLLM's Qwen3_5MultiTokenPredictor). At
    position p it reads the token at p + 1 and the target's final hidden state at p (after the model's final norm)
    and gives the hidden state whose logits (the model's LM head) predict the token at p + 2:

        x = fc([pre_fc_norm_embedding(embed(t[p + 1])); pre_fc_norm_hidden(h[p])])      (2 hidden -> hidden)
        x = layers[0](x)      a full-attention Qwen3.5 decoder layer at position p, over its own KV cache
        out = norm(x)

    `out` is also the h of the next draft's step (vLLM feeds the tensor it takes the logits of). Its norms are
    zero-centred like the model's (1 + w, added at load)."""

    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding, tp: TensorParallel, sizes: TensorParallelSizes,
                 kernels: KernelPlan | None = None):
        super().__init__()
        hidden = cfg.hidden_size
        self.fc = nn.Linear(2 * hidden, hidden, bias=False)
        self.pre_fc_norm_embedding = RMSNorm(hidden, cfg.rms_norm_eps, kernels)
        self.pre_fc_norm_hidden = RMSNorm(hidden, cfg.rms_norm_eps, kernels)
        # numbered after the trunk's layers (a GGUF's block index): a full-attention layer there
        self.layers = nn.ModuleList([Qwen3_5DecoderLayer(cfg, rotary, tp, sizes, cfg.num_hidden_layers, kernels)])
        self.norm = RMSNorm(hidden, cfg.rms_norm_eps, kernels)

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                meta: AttentionMetadata) -> torch.Tensor:
        x = self.fc(torch.cat([self.pre_fc_norm_embedding(embeds), self.pre_fc_norm_hidden(hidden)], dim=-1))
        return self.norm(self.layers[0](rope, x, meta))


# the checkpoint's Gated DeltaNet projections in the fused ones, beside Llama's
_QWEN3_5_FUSED = {**LlamaForCausalLM.fused_pieces, "in_proj_qkv": ("in_proj_qkvz", 0), "in_proj_z": ("in_proj_qkvz", 1),
                  "in_proj_b": ("in_proj_ba", 0), "in_proj_a": ("in_proj_ba", 1)}
# checkpoint prefixes that are not the text model: Qwen3_5ForConditionalGeneration's vision tower, the
# multi-token-prediction block (loaded only when it drafts: `enable_mtp`)
MTP = "multi-token prediction"
_SKIPPED = {"model.visual.": "vision tower", "mtp.": MTP}


class Qwen3_5ForCausalLM(HybridForCausalLM):
    decoder_layer = Qwen3_5DecoderLayer
    fused_pieces = _QWEN3_5_FUSED
    recurrent_kind = GATED_DELTA_NET

    def __init__(self, cfg: ModelConfig, max_positions: int, tp: TensorParallel | None = None,
                 kernels: KernelPlan | None = None):
        if not cfg.attn_output_gate:
            raise ValueError("Qwen3.5 without attn_output_gate is not supported")
        super().__init__(cfg, max_positions, tp, kernels)
        self.mtp: MultiTokenPredictor | None = None

    def enable_mtp(self) -> None:
        """Build the multi-token-prediction block, before `load_weights` (which then loads its tensors instead of
        skipping them): speculative decoding's "mtp" method drafts with it (runner/mtp_drafter.py). Its attention layer
        joins `attention_layers`, so its KV cache comes from the same budget."""
        layers = self.config.mtp_layers
        if layers == 0:
            raise ValueError('speculative_config.method "mtp" drafts with the model\'s multi-token-prediction block, '
                             "and this Qwen3.5 checkpoint has none (config.json's mtp_num_hidden_layers, a GGUF's "
                             "nextn_predict_layers: absent or 0); use the ngram or suffix method")
        if layers != 1:
            raise ValueError(f'speculative_config.method "mtp": this checkpoint has {layers} multi-token-prediction '
                             "layers; kvflow drafts with one (the released Qwen3.5 checkpoints' count)")
        self.mtp = MultiTokenPredictor(self.config, self.rotary, self.tp, self.sizes, self.kernels)

    def mtp_forward(self, input_ids: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor,
                    meta: AttentionMetadata) -> torch.Tensor:
        """The MTP block's output hidden states (`MultiTokenPredictor`): row i reads `input_ids[i]`, the token after
        its position, and `hidden[i]`, the target's final hidden state at its position (or the previous draft step's
        output); `compute_logits` of the result predicts the token after `input_ids[i]`."""
        return self.mtp(self.embed(input_ids), hidden, self.rotary.lookup(positions), meta)

    def _shard_sizes(self, name: str) -> list[int]:
        cfg = self.config
        if "qkv_proj" in name:          # q_proj's rows are query and gate per head
            q, kv = self.sizes.num_heads * cfg.head_dim, self.sizes.num_kv_heads * cfg.head_dim
            return [2 * q, kv, kv]
        if "in_proj_qkvz" in name:
            rc = cfg.recurrent
            value = rc.num_value_heads * rc.value_head_dim
            return [2 * rc.num_key_heads * rc.key_head_dim + value, value]
        if "in_proj_ba" in name:
            return [cfg.recurrent.num_value_heads] * 2
        return super()._shard_sizes(name)

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """A Qwen3_5ForCausalLM checkpoint, or a Qwen3_5ForConditionalGeneration one (the text model under
        `model.language_model.`): the vision tower's tensors are skipped (logged), and so are the MTP block's unless
        it was built (`enable_mtp`: then a checkpoint without them is refused); norms get their 1 added in float32
        (not the Gated DeltaNet's gated norm), the convolution's taps are squeezed. A GGUF holds the MTP block as the
        block after the trunk's (loader.py names its own tensors model.layers.N.mtp.*, its decoder layer's as any
        layer's): moved under mtp."""
        skipped: dict[str, int] = {}
        layers = self.config.num_hidden_layers
        mtp_tensors = 0

        def text_model():
            nonlocal mtp_tensors
            for name, tensor in weights:
                name = name.replace("model.language_model.", "model.", 1)
                if name.startswith("model.mtp."):       # some exports keep the MTP block under model.
                    name = name.removeprefix("model.")
                if name.endswith(".linear_attn.out_proj.input_order"):    # a GGUF's out_proj codes (loader.py)
                    layer = self.layers[int(name.split(".")[2])].linear_attn
                    layer.out_proj_input_order = tensor.to(layer.out_proj.weight.device)
                    continue
                if name.startswith("model.layers.") and int(name.split(".")[2]) >= layers:
                    # a GGUF's MTP block: the blocks past the trunk's
                    _, _, index, rest = name.split(".", 3)
                    name = rest if rest.startswith("mtp.") else f"mtp.layers.{int(index) - layers}.{rest}"
                what = next((w for prefix, w in _SKIPPED.items() if name.startswith(prefix)), None)
                if what == MTP and self.mtp is not None:
                    what = None
                    mtp_tensors += 1
                if what is not None:
                    skipped[what] = skipped.get(what, 0) + 1
                    continue
                if qwen3_5_zero_centred(name):
                    tensor = tensor.float() + 1.0
                elif name.endswith("linear_attn.conv1d.weight"):
                    if isinstance(tensor, CODES):
                        tensor = tensor.dequantize()
                    tensor = tensor.reshape(tensor.shape[0], -1)
                yield name, tensor
            if self.mtp is not None and mtp_tensors == 0:
                raise ValueError('speculative_config.method "mtp" drafts with the model\'s multi-token-prediction '
                                 "block, and this checkpoint holds none of its tensors (mtp.*; a GGUF: the block "
                                 "after the trunk's, blk.N.nextn.*); use a checkpoint with them, or the ngram or "
                                 "suffix method")

        super().load_weights(text_model())
        for what, count in skipped.items():
            logger.info("Qwen3.5: serving the text model; skipped %d %s tensor(s)", count, what)
        if self.mtp is not None:
            logger.info("Qwen3.5: loaded the multi-token-prediction block (%d tensors) for speculative decoding",
                        mtp_tensors)
