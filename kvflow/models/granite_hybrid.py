"""Granite 4.0 H (350M, 1B, Micro; Tiny and Small with experts): Mamba2 layers with a few attention layers between
them, as transformers' GraniteMoeHybridForCausalLM computes it.

Every layer is pre-norm mixer then pre-norm MLP, each block's output times `residual_multiplier` before its residual
add. The mixer is a Mamba2 layer (`Mamba2Mixer`, a RecurrentLayer: its state per request lives in the slots the
runner binds) or llama.py's attention, which rotates nothing here (`position_embedding_type: "nope"`: the layers in
`ModelConfig.nope_layers` get no rotary table). The MLP is llama.py's (`shared_mlp.input_linear` is gate ‖ up, split
at load into llama's fused gate_up_proj; `output_linear` is its down_proj); with `num_local_experts` (Tiny, Small)
each layer also has experts (`block_sparse_moe`: layers/moe.py's SparseMoE with GraniteMoE's router, the top k
logits then their softmax), whose sum is added to the shared MLP's. Granite's other scalings: the embedding
times `embedding_multiplier`, `attention_multiplier` as the attention scale (llama.py's Attention reads it), the
logits divided by `logits_scaling`.

A Mamba2 layer, per token (transformers' GraniteMoeHybridMambaLayer, its torch path):
    in_proj(x) -> [z (d_inner) | xBC (d_inner + 2 G N) | dt (heads)]
    xBC = silu(causal depthwise conv(xBC) + bias)          the conv state: the last K - 1 xBC rows
    x, B, C = split(xBC);  dt = clamp(softplus(dt + dt_bias), time_step_limit);  A = -exp(A_log)
    y = ssm_scan(x, dt, A, B, C, D)                         the SSM state [heads, head_dim, N], float32
    y = group_rmsnorm(y * silu(z)) * norm.weight             gate before the norm, groups of d_inner / G
    out_proj(y)
Both recurrences are kernels/recurrent.py's sequential definitions, for prefill chunks and decodes alike, so a
token's arithmetic does not depend on how the scheduler split its prompt or what shares its step.

LoRA adapters adapt the attention layers' q/k/v/o_proj and the shared MLP's input_linear / output_linear
(`LORA_TARGETS`); the Mamba2 layers' in_proj / out_proj take none (refused: models/lora_modules.py). The native
decoder step computes every layer (`native_layer`). Not here: tensor parallelism and compiled decode graphs (refused
or off, saying why).
"""
from __future__ import annotations

from typing import Iterable, Iterator

import torch
from torch import nn

from kvflow.distributed.parallel_state import TensorParallel
from kvflow.kernels.group_quant import CODES
from kvflow.kernels.plan import KernelPlan
from kvflow.kernels.recurrent import causal_conv1d, gated_group_rms_norm, mamba2_gates, ssm_scan
from kvflow.layers.attention_metadata import AttentionMetadata
from kvflow.layers.moe import SparseMoE
from kvflow.layers.native_layers import NativeLayer, NativeMamba2
from kvflow.layers.norm import RMSNorm
from kvflow.layers.recurrent_state import RecurrentLayer
from kvflow.layers.rotary import RotaryEmbedding
from kvflow.models.llama import _ACTIVATIONS, MLP, Attention, LlamaForCausalLM, TensorParallelSizes
from kvflow.models.hybrid import HybridForCausalLM
from kvflow.models.model_config import MAMBA2, ModelConfig


class DepthwiseConv(nn.Module):
    """The Mamba2 layer's causal convolution weights: one K-tap filter per channel ([channels, K]; the checkpoint's
    Conv1d holds [channels, 1, K]) and its bias."""

    def __init__(self, channels: int, kernel: int, bias: bool):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(channels, kernel))
        self.bias = nn.Parameter(torch.empty(channels)) if bias else None


class GatedGroupRMSNorm(nn.Module):
    """transformers' GraniteMoeHybridRMSNormGated (norm_before_gate=False): y * silu(z), then RMS-normalised over
    each group of `group` channels, in float32, times the weight (in the activation dtype)."""

    def __init__(self, size: int, group: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.group = group
        self.eps = eps

    def forward(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        return gated_group_rms_norm(y, z, self.weight, self.group, self.eps)


class Mamba2Mixer(RecurrentLayer):
    """A Granite 4.0 H Mamba2 layer over the step's flat rows; `meta.state` says which slot each run of rows
    continues. States per slot: "conv" [K - 1, d_inner + 2 G N] in the compute dtype, "ssm" [heads, head_dim, N]
    float32."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        r = cfg.recurrent
        self.num_heads, self.head_dim, self.state_size, self.num_groups = (r.num_heads, r.head_dim, r.state_size,
                                                                           r.num_groups)
        if r.num_heads % r.num_groups:
            raise ValueError(f"Mamba2: {r.num_heads} heads do not form groups over {r.num_groups} B/C groups")
        self.d_inner = r.num_heads * r.head_dim
        self.conv_dim = self.d_inner + 2 * r.num_groups * r.state_size
        self.conv_kernel = r.conv_kernel
        self.time_step_limit = r.time_step_limit
        self.in_proj = nn.Linear(cfg.hidden_size, self.d_inner + self.conv_dim + r.num_heads, bias=r.proj_bias)
        self.conv1d = DepthwiseConv(self.conv_dim, r.conv_kernel, r.conv_bias)
        self.dt_bias = nn.Parameter(torch.empty(r.num_heads))
        self.A_log = nn.Parameter(torch.empty(r.num_heads))
        self.D = nn.Parameter(torch.empty(r.num_heads))
        self.norm = GatedGroupRMSNorm(self.d_inner, self.d_inner // r.num_groups, cfg.rms_norm_eps)
        self.out_proj = nn.Linear(self.d_inner, cfg.hidden_size, bias=r.proj_bias)

    def state_shapes(self, dtype: torch.dtype) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        return {"conv": ((self.conv_kernel - 1, self.conv_dim), dtype),
                "ssm": ((self.num_heads, self.head_dim, self.state_size), torch.float32)}

    def forward(self, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        T = x.shape[0]
        z, xBC, dt = self.in_proj(x).split([self.d_inner, self.conv_dim, self.num_heads], dim=-1)
        xBC = causal_conv1d(xBC.contiguous(), self.conv1d.weight, self.conv1d.bias, self.states["conv"], meta.state,
                            silu=True)
        xs, B, C = xBC.split([self.d_inner, self.num_groups * self.state_size, self.num_groups * self.state_size],
                             dim=-1)
        dt, A = mamba2_gates(dt, self.dt_bias, self.A_log, self.time_step_limit)
        y = ssm_scan(xs.reshape(T, self.num_heads, self.head_dim), dt.contiguous(), A,
                     B.reshape(T, self.num_groups, self.state_size), C.reshape(T, self.num_groups, self.state_size),
                     self.D, self.states["ssm"], meta.state)
        return self.out_proj(self.norm(y.reshape(T, self.d_inner), z))

    def native(self) -> NativeMamba2:
        """This mixer as the native step computes it (the same kernels: kernels/recurrent.py's C ones)."""
        states = self.bound_states()
        return NativeMamba2(self.in_proj, self.out_proj, self.conv1d.weight, self.conv1d.bias, states["conv"],
                            states["ssm"], self.A_log, self.dt_bias, self.D, self.norm.weight, self.norm.eps,
                            self.norm.group, self.num_heads, self.head_dim, self.num_groups, self.state_size,
                            self.time_step_limit)


class GraniteHybridDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding, tp: TensorParallel, sizes: TensorParallelSizes,
                 layer: int = 0, kernels: KernelPlan | None = None):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, kernels)
        recurrent = cfg.is_recurrent(layer)
        self.mamba = Mamba2Mixer(cfg) if recurrent else None
        self.self_attn = None if recurrent else Attention(cfg, None if layer in cfg.nope_layers else rotary, tp,
                                                           sizes, layer, kernels)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, kernels)
        self.mlp = MLP(cfg, tp, sizes)          # the shared MLP (shared_mlp)
        # Granite 4.0 H Tiny / Small: experts beside it, GraniteMoE's router (the top k logits, then their softmax)
        self.block_sparse_moe = (SparseMoE(cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts,
                                           cfg.num_experts_per_tok, "topk_softmax", True, _ACTIVATIONS[cfg.hidden_act])
                                 if cfg.is_moe_layer(layer) else None)
        self.residual_multiplier = cfg.residual_multiplier

    def forward(self, rope: tuple[torch.Tensor, torch.Tensor] | None, h: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        x = self.input_layernorm(h)
        out = self.mamba(x, meta) if self.mamba is not None else self.self_attn(rope, x, meta)
        h = h + (out if self.residual_multiplier is None else out * self.residual_multiplier)
        x = self.post_attention_layernorm(h)
        out = self.mlp(x, meta)
        if self.block_sparse_moe is not None:       # the experts' sum, then the shared MLP's (transformers' order)
            out = self.block_sparse_moe(x) + out
        return h + (out if self.residual_multiplier is None else out * self.residual_multiplier)

    def native_layer(self, model: LlamaForCausalLM) -> NativeLayer:
        """This layer as the native step computes it: Mamba2 or attention (NoPE where it is), then the MLP, each
        block's output times the residual multiplier."""
        scale = 1.0 if self.residual_multiplier is None else self.residual_multiplier
        mlp = dict(self.mlp.native(), moe=self.block_sparse_moe)        # experts (or None) beside the shared MLP
        if self.mamba is not None:
            return NativeLayer(None, self.input_layernorm, self.post_attention_layernorm, residual_scale=scale,
                               recurrent=self.mamba.native(), **mlp)
        return NativeLayer(self.self_attn.native(self.self_attn.rotary), self.input_layernorm,
                           self.post_attention_layernorm, residual_scale=scale, **mlp)


class GraniteHybridForCausalLM(HybridForCausalLM):
    decoder_layer = GraniteHybridDecoderLayer
    recurrent_kind = MAMBA2
    # LoRA on the attention layers' projections and the shared MLP's: input_linear's rows are gate then up, as
    # gate_up_proj's (one piece of both), output_linear is down_proj (the Mamba2 layers' take none:
    # models/lora_modules.py)
    LORA_TARGETS = {"self_attn": LlamaForCausalLM.LORA_TARGETS["self_attn"],
                    "mlp": (("gate_up_lora", "gate_up_proj", ("shared_mlp.input_linear",)),
                            ("down_lora", "down_proj", ("shared_mlp.output_linear",)))}

    def __init__(self, cfg: ModelConfig, max_positions: int, tp: TensorParallel | None = None,
                 kernels: KernelPlan | None = None):
        rotates = any(not cfg.is_recurrent(i) and i not in cfg.nope_layers for i in range(cfg.num_hidden_layers))
        # no layer rotates (NoPE, the released models): no table to hold or look up (a GGUF's context_length is
        # then 2^20, whose table would be a few hundred MiB)
        super().__init__(cfg, max_positions if rotates else 1, tp, kernels)
        if not rotates:
            self.rotary = None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        h = self.input_embeddings(input_ids)
        rope = self.rotary.lookup(positions) if self.rotary is not None else None
        for layer in self.layers:
            h = layer(rope, h, meta)
        return self.norm(h)

    def _shard_sizes(self, name: str) -> list[int]:
        if ".experts." in name and "gate_up_proj" in name:
            return [self.config.moe_intermediate_size] * 2
        return super()._shard_sizes(name)

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """HF checkpoints and GGUF files (loader.py's names) alike: the shared MLP's fused gate ‖ up split into
        llama's gate_proj / up_proj (fused again by llama.py), the Mamba2 tensors in this model's shapes."""
        super().load_weights(self._canonical(weights))

    def _canonical(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        params = dict(self.named_parameters())
        for name, w in weights:
            name = name.removeprefix("model.")
            if ".shared_mlp.input_linear." in name:          # [gate; up] rows, as transformers' chunk(2) reads them
                gate, up = w.chunk(2, dim=0)
                yield name.replace("shared_mlp.input_linear", "mlp.gate_proj"), gate
                yield name.replace("shared_mlp.input_linear", "mlp.up_proj"), up
                continue
            name = name.replace(".shared_mlp.output_linear.", ".mlp.down_proj.")
            # the experts and their router (loader.canonical_experts gave them models/moe.py's names under `mlp`)
            name = name.replace(".mlp.experts.", ".block_sparse_moe.experts.").replace(".mlp.gate.",
                                                                                      ".block_sparse_moe.gate.")
            if ".mamba." not in name:
                yield name, w
                continue
            if isinstance(w, CODES) and not name.endswith(("in_proj.weight", "out_proj.weight")):
                w = w.dequantize()        # only the projections are matrices a quantized module multiplies
            if name.endswith(".mamba.A"):     # a GGUF holds A = -exp(A_log); the model keeps A_log, as transformers
                name, w = name + "_log", torch.log(-w.float())
            param = params.get(name)
            if param is not None and not isinstance(w, CODES) and w.shape != param.shape \
                    and w.numel() == param.numel():
                # the Conv1d's [channels, 1, K]; a GGUF's A / D as (heads, 1), its norm as (groups, d_inner / groups)
                w = w.reshape(param.shape)
            yield name, w
