"""Which projections of a model a LoRA adapter may adapt, by the names its checkpoint (and so PEFT) gives them under
`layers.{i}.`, with their shapes; and which projections of the hybrids' recurrent mixers kvflow refuses to adapt.

One table for the adapter checks (models/lora_adapter.py: torch-free, the frontend reads it) and the model's LoRA
terms (llama.py's `enable_lora`: each term's pieces and widths), so the two cannot disagree.

- Llama family (Llama, Mistral, Qwen2/3, Gemma 3): self_attn.q_proj / k_proj / v_proj / o_proj, mlp.gate_proj /
  up_proj / down_proj, in every layer.
- Qwen3.5: the same names; self_attn.q_proj gives per head the query then the output gate (`attn_output_gate`), so
  it is twice as wide; only the attention layers have self_attn.
- LFM2: self_attn.q_proj / k_proj / v_proj / out_proj in the attention layers, feed_forward.w1 (gate) / w3 (up) /
  w2 (down) in every layer.
- Granite 4.0 H: self_attn.q_proj / k_proj / v_proj / o_proj in the attention layers, shared_mlp.input_linear (gate
  and up in one matrix, gate rows first) / output_linear (down) in every layer.

The recurrent mixers' projections (LFM2's conv.in_proj / out_proj, Qwen3.5's Gated DeltaNet linear_attn.in_proj_qkv /
in_proj_z / in_proj_b / in_proj_a / out_proj, Granite 4.0 H's Mamba2 mamba.in_proj / out_proj) take no LoRA term in
kvflow: an adapter that adapts them is refused, naming the module.
"""
from __future__ import annotations

from dataclasses import dataclass

from kvflow.models.model_config import ModelConfig


@dataclass(frozen=True)
class LoRAModules:
    """One model's adaptable projections and the recurrent ones it refuses."""
    family: str
    # module under layers.{i} (the checkpoint's name, as PEFT writes it) -> (in features, out features), in the
    # family's order: attention, then MLP
    shapes: dict[str, tuple[int, int]]
    attention_only: frozenset[str]     # the modules only attention layers have (a recurrent layer has no self_attn)
    recurrent: dict[str, str]          # a recurrent mixer's projection -> the mixer, in words

    @property
    def projections(self) -> tuple[str, ...]:
        """The adaptable projections' own names (PEFT's target_modules, --lora-target-modules), in order."""
        return tuple(dict.fromkeys(_leaf(m) for m in self.shapes))

    def in_layer(self, module: str, layer: int, cfg: ModelConfig) -> bool:
        """Whether layer `layer` has adaptable `module`."""
        return module in self.shapes and not (module in self.attention_only and cfg.is_recurrent(layer))

    @staticmethod
    def matching(target: str, modules) -> list[str]:
        """The modules among `modules` that a PEFT target_modules entry names: the module, its dotted tail
        ("out_proj": self_attn.out_proj and conv.out_proj alike, as PEFT matches it) or a longer path ending in it."""
        return [m for m in modules if target == m or m.endswith("." + target) or target.endswith("." + m)]

    def refusal(self, module: str) -> str:
        """Why `module` takes no LoRA term, in words."""
        if module in self.recurrent:
            return (f"{module} is a projection of {self.recurrent[module]} (a recurrent layer), which kvflow gives no "
                    f"LoRA term; {self.family} adapters may adapt {', '.join(self.shapes)}")
        return f"kvflow adapts only {', '.join(self.shapes)} of {self.family}'s layers"


def _leaf(module: str) -> str:
    return module.rsplit(".", 1)[-1]


def lora_modules(cfg: ModelConfig) -> LoRAModules:
    """The adaptable projections of `cfg`'s family (full sizes: LoRA runs on one rank only)."""
    h, i = cfg.hidden_size, cfg.intermediate_size
    q = cfg.num_attention_heads * cfg.head_dim
    kv = cfg.num_key_value_heads * cfg.head_dim
    q_rows = 2 * q if cfg.attn_output_gate else q       # Qwen3.5: per head the query, then its output gate
    qkv = {"q_proj": (h, q_rows), "k_proj": (h, kv), "v_proj": (h, kv)}
    if cfg.family == "lfm2":
        attention = _under("self_attn", {**qkv, "out_proj": (q, h)})
        mlp = _under("feed_forward", {"w1": (h, i), "w3": (h, i), "w2": (i, h)})
        return LoRAModules("LFM2", {**attention, **mlp}, frozenset(attention),
                           _under("conv", dict.fromkeys(("in_proj", "out_proj"), "LFM2's short convolution")))
    attention = _under("self_attn", {**qkv, "o_proj": (q, h)})
    if cfg.family == "granitemoehybrid":
        mlp = _under("shared_mlp", {"input_linear": (h, 2 * i), "output_linear": (i, h)})
        return LoRAModules("Granite 4.0 H", {**attention, **mlp}, frozenset(attention),
                           _under("mamba", dict.fromkeys(("in_proj", "out_proj"), "Granite 4.0 H's Mamba2 mixer")))
    mlp = _under("mlp", {"gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)})
    if cfg.family == "qwen3_5":
        gated_deltanet = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj")
        return LoRAModules("Qwen3.5", {**attention, **mlp}, frozenset(attention),
                           _under("linear_attn", dict.fromkeys(gated_deltanet, "Qwen3.5's Gated DeltaNet")))
    return LoRAModules(cfg.family, {**attention, **mlp}, frozenset(), {})


def _under(block: str, by_projection: dict) -> dict:
    return {f"{block}.{proj}": value for proj, value in by_projection.items()}
