"""LFM2 (Liquid AI's LFM2-350M / 700M / 1.2B / 2.6B): short gated convolutions between attention layers, as
transformers' Lfm2ForCausalLM computes it.

Every layer is pre-norm: `operator_norm`, then its mixer (a short convolution or attention), a residual add,
`ffn_norm`, a SwiGLU MLP (`w1` gate, `w3` up, `w2` down, its width already the adjusted one: ModelConfig), a residual
add. The final norm (`embedding_norm`, despite its name) comes after the last layer; the embeddings are tied.

- A convolution layer (`ShortConv`, a RecurrentLayer): in_proj gives B, C and x (in that order, each `hidden` wide);
  B * x goes through a causal depthwise convolution of width `conv_L_cache` (3), no bias, no activation, whose state
  per request is the last `conv_L_cache - 1` values of B * x per channel (kept in the compute dtype: see
  kernels/recurrent.py); C times the result, then out_proj. The convolution runs token after token in
  kernels/recurrent.causal_conv1d for prefill and decode alike, so a prompt's tokens do not depend on how the
  scheduler chunked it or on what shares the step.
- An attention layer: llama.py's Attention (fused q/k/v, per-head RMSNorm on q and k before RoPE, its
  `out_proj` as o_proj) on the paged KV cache.

Modules carry llama.py's names (input_layernorm, self_attn.o_proj, mlp.gate_up_proj, ...); `load_weights` maps the
checkpoint's LFM2 names onto them (a GGUF comes out with the same LFM2 names: loader.py). LoRA adapters adapt the
attention and MLP projections under LFM2's names (self_attn.q_proj / k_proj / v_proj / out_proj, feed_forward.w1 /
w3 / w2: `LORA_TARGETS`); the convolutions' in_proj / out_proj take none (refused: models/lora_modules.py). The
native decoder step computes every layer (`native_layer`). Not here: tensor parallelism and compiled decode steps
(refused or off, with the reason).
"""
from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

from kvflow.distributed.parallel_state import TensorParallel
from kvflow.kernels.group_quant import CODES
from kvflow.kernels.plan import KernelPlan
from kvflow.kernels.recurrent import causal_conv1d
from kvflow.layers.attention_metadata import AttentionMetadata
from kvflow.layers.native_layers import NativeLayer, NativeShortConv, NotNative
from kvflow.layers.norm import RMSNorm
from kvflow.layers.recurrent_state import RecurrentLayer
from kvflow.layers.rotary import RotaryEmbedding
from kvflow.models.llama import MLP, Attention, LlamaForCausalLM, TensorParallelSizes
from kvflow.models.hybrid import HybridForCausalLM
from kvflow.models.model_config import SHORT_CONV, ModelConfig


class ShortConv(RecurrentLayer):
    """LFM2's gated short convolution: out_proj(C * conv(B * x)), the convolution causal and depthwise over time.
    State per request: `conv` [conv_L_cache - 1, hidden], the last inputs of the convolution (B * x)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        hidden, rec = cfg.hidden_size, cfg.recurrent
        self.hidden_size, self.kernel = hidden, rec.conv_kernel
        self.in_proj = nn.Linear(hidden, 3 * hidden, bias=rec.conv_bias)
        # the checkpoint's Conv1d weight [hidden, 1, L] as the kernel takes it: [hidden, L], tap j = 0..L-1 oldest first
        self.conv_weight = nn.Parameter(torch.empty(hidden, rec.conv_kernel))
        self.conv_bias = nn.Parameter(torch.empty(hidden)) if rec.conv_bias else None
        self.out_proj = nn.Linear(hidden, hidden, bias=rec.conv_bias)

    def state_shapes(self, dtype: torch.dtype) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        # the window in the step's dtype: what transformers' cache keeps, so the next token reads the same values
        return {"conv": ((self.kernel - 1, self.hidden_size), dtype)}

    def forward(self, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        if meta.state is None:
            raise RuntimeError("a short-convolution layer needs the step's state slots (AttentionMetadata.state)")
        b, c, v = self.in_proj(x).chunk(3, dim=-1)
        y = causal_conv1d(b * v, self.conv_weight, self.conv_bias, self.states["conv"], meta.state, silu=False)
        return self.out_proj(c * y)

    def native(self) -> NativeShortConv:
        """This convolution as the native step computes it (the same kernels, the products rounded alike)."""
        if self.conv_bias is not None:
            raise NotNative("a short convolution with biases")
        return NativeShortConv(self.in_proj, self.out_proj, self.conv_weight, self.bound_states()["conv"])


class Lfm2DecoderLayer(nn.Module):
    """operator_norm -> (ShortConv | attention) -> residual; ffn_norm -> SwiGLU MLP -> residual."""

    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding, tp: TensorParallel, sizes: TensorParallelSizes,
                 layer: int = 0, kernels: KernelPlan | None = None):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, kernels)         # operator_norm
        if cfg.is_recurrent(layer):
            self.conv = ShortConv(cfg)
        else:
            self.self_attn = Attention(cfg, rotary, tp, sizes, layer, kernels)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, kernels)   # ffn_norm
        self.mlp = MLP(cfg, tp, sizes)

    @property
    def is_recurrent(self) -> bool:
        return hasattr(self, "conv")

    def forward(self, rope: tuple[torch.Tensor, torch.Tensor], h: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        x = self.input_layernorm(h)
        h = h + (self.conv(x, meta) if self.is_recurrent else self.self_attn(rope, x, meta))
        return h + self.mlp(self.post_attention_layernorm(h), meta)

    def native_layer(self, model: LlamaForCausalLM) -> NativeLayer:
        """This layer as the native step computes it: the convolution or attention, then the MLP."""
        if self.is_recurrent:
            return NativeLayer(None, self.input_layernorm, self.post_attention_layernorm, recurrent=self.conv.native(),
                               **self.mlp.native())
        return NativeLayer(self.self_attn.native(model.rotary), self.input_layernorm, self.post_attention_layernorm,
                           **self.mlp.native())


# the checkpoint's LFM2 names -> the modules' (llama.py's) names, applied in order to the name after "model."
_RENAMES = (
    (".operator_norm.", ".input_layernorm."),
    (".ffn_norm.", ".post_attention_layernorm."),
    (".feed_forward.w1.", ".mlp.gate_proj."),
    (".feed_forward.w3.", ".mlp.up_proj."),
    (".feed_forward.w2.", ".mlp.down_proj."),
    (".self_attn.out_proj.", ".self_attn.o_proj."),
    (".self_attn.q_layernorm.", ".self_attn.q_norm."),
    (".self_attn.k_layernorm.", ".self_attn.k_norm."),
    (".conv.conv.weight", ".conv.conv_weight"),
    (".conv.conv.bias", ".conv.conv_bias"),
)


class Lfm2ForCausalLM(HybridForCausalLM):
    decoder_layer = Lfm2DecoderLayer
    recurrent_kind = SHORT_CONV
    # LoRA on the attention layers' and MLPs' projections under LFM2's names (the convolutions' take none:
    # models/lora_modules.py)
    LORA_TARGETS = {"self_attn": (LlamaForCausalLM.LORA_TARGETS["self_attn"][0],
                                  ("o_lora", "o_proj", ("self_attn.out_proj",))),
                    "mlp": (("gate_up_lora", "gate_up_proj", ("feed_forward.w1", "feed_forward.w3")),
                            ("down_lora", "down_proj", ("feed_forward.w2",)))}

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """The checkpoint's (or GGUF's, loader.py) LFM2 names as llama.py's; the convolution's [hidden, 1, L]
        (a GGUF: [hidden, L]) as [hidden, L]."""
        super().load_weights(self._renamed(weights))

    def _renamed(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterable[tuple[str, torch.Tensor]]:
        for name, tensor in weights:
            name = name.removeprefix("model.")
            if name.startswith("embedding_norm."):          # the final norm, after the last layer
                name = "norm." + name.removeprefix("embedding_norm.")
            for old, new in _RENAMES:
                name = name.replace(old, new)
            if name.endswith(".conv.conv_weight"):
                if isinstance(tensor, CODES):
                    tensor = tensor.dequantize()
                tensor = tensor.reshape(self.config.hidden_size, self.config.recurrent.conv_kernel)
            yield name, tensor
