"""A random-weight mixture-of-experts GGUF, written as llama.cpp's converter writes one (stacked `ffn_*_exps` experts,
the `ffn_gate_inp` router, the family's metadata), for speed runs against llama-server on the same file.

    python benchmarks/make_moe_gguf.py OUT.gguf [--shape granite-1b-a400m | olmoe-1b-7b | tiny]
                                       [--family granitemoe | qwen3_moe | olmoe | mixtral] [--ftype f16] [--seed 0]

`--shape granite-1b-a400m` (the default) is Granite 3.1 1B-A400M's: 24 layers, hidden 1024, 16 heads / 8 KV heads,
32 experts of 512, 8 per token, Granite's four scalings, tied embeddings (~1.3B parameters, ~400M read per token);
`olmoe-1b-7b` is OLMoE-1B-7B's (16 layers, hidden 2048, 64 experts of 1024, 8 per token: ~7B parameters);
`tiny` is a test-sized one. The vocabulary is SmolLM2's 49,152 tokens (the embedded model's tokenizer, written into
the file), not the real model's: the weights are random anyway. `--ftype`: f32 f16 bf16 q8_0 q4_0 q4_1 q5_0 q5_1
q4_k q5_k q6_k q4_k_m (tests/tiny_models.py's writer: round to nearest, not llama-quantize's search; for the speed
table quantize an f16 file with `llama-quantize OUT-f16.gguf OUT-q4_k_m.gguf Q4_K_M`). Tensors are drawn and
written one at a time, so a model bigger than memory in float32 still fits.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))       # the GGUF writer the tests use (tiny_models.write_gguf_from_hf)

SHAPES = {
    "granite-1b-a400m": dict(num_hidden_layers=24, hidden_size=1024, num_attention_heads=16, num_key_value_heads=8,
                             num_experts=32, num_experts_per_tok=8, moe_intermediate_size=512,
                             max_position_embeddings=131072, rope_theta=10000.0, tie_word_embeddings=True),
    "olmoe-1b-7b": dict(num_hidden_layers=16, hidden_size=2048, num_attention_heads=16, num_key_value_heads=16,
                        num_experts=64, num_experts_per_tok=8, moe_intermediate_size=1024,
                        max_position_embeddings=4096, rope_theta=10000.0, tie_word_embeddings=False),
    "tiny": dict(num_hidden_layers=2, hidden_size=256, num_attention_heads=4, num_key_value_heads=2, num_experts=8,
                 num_experts_per_tok=2, moe_intermediate_size=256, max_position_embeddings=2048, rope_theta=10000.0,
                 tie_word_embeddings=True),
}
ARCHITECTURES = {"granitemoe": "GraniteMoeForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
                 "olmoe": "OlmoeForCausalLM", "mixtral": "MixtralForCausalLM"}
VOCAB = 49152


def model_config(shape: str, family: str) -> dict:
    """The config.json the file stands for."""
    s = dict(SHAPES[shape])
    experts, inter = s.pop("num_experts"), s.pop("moe_intermediate_size")
    cfg = {**s, "architectures": [ARCHITECTURES[family]], "vocab_size": VOCAB, "rms_norm_eps": 1e-6,
           "num_experts_per_tok": s["num_experts_per_tok"], "bos_token_id": 1, "eos_token_id": 2}
    if family in ("qwen3_moe", "olmoe"):
        cfg.update(num_experts=experts, moe_intermediate_size=inter, intermediate_size=inter, norm_topk_prob=True)
    else:
        cfg.update(num_local_experts=experts, intermediate_size=inter)
    if family == "granitemoe":        # Granite 3.1 1B-A400M's scalings
        cfg.update(embedding_multiplier=12.0, residual_multiplier=0.22, attention_multiplier=0.015625,
                   logits_scaling=6.0)
    if family == "olmoe":
        cfg["norm_topk_prob"] = False
    return cfg


def random_tensors(cfg: dict, family: str, seed: int):
    """(HF name, float32 array) one at a time, experts stacked [experts, rows, columns] as the writer takes them."""
    rng = np.random.default_rng(seed)
    h, layers = cfg["hidden_size"], cfg["num_hidden_layers"]
    heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    d = h // heads
    experts = cfg.get("num_experts") or cfg["num_local_experts"]
    inter = cfg.get("moe_intermediate_size") or cfg["intermediate_size"]

    def rand(*shape, std=0.02):
        return (rng.standard_normal(shape, dtype=np.float32) * std).astype(np.float32)

    def norm(n):
        return (1.0 + 0.1 * rng.standard_normal(n, dtype=np.float32)).astype(np.float32)

    yield "model.embed_tokens.weight", rand(VOCAB, h)
    for i in range(layers):
        p = f"model.layers.{i}."
        yield p + "input_layernorm.weight", norm(h)
        yield p + "post_attention_layernorm.weight", norm(h)
        yield p + "self_attn.q_proj.weight", rand(heads * d, h)
        yield p + "self_attn.k_proj.weight", rand(kv * d, h)
        yield p + "self_attn.v_proj.weight", rand(kv * d, h)
        yield p + "self_attn.o_proj.weight", rand(h, heads * d)
        if family == "qwen3_moe":
            yield p + "self_attn.q_norm.weight", norm(d)
            yield p + "self_attn.k_norm.weight", norm(d)
        if family == "olmoe":
            yield p + "self_attn.q_norm.weight", norm(heads * d)
            yield p + "self_attn.k_norm.weight", norm(kv * d)
        yield p + "mlp.gate.weight", rand(experts, h, std=0.5)
        yield p + "mlp.experts.gate_proj.weight", rand(experts, inter, h)
        yield p + "mlp.experts.up_proj.weight", rand(experts, inter, h)
        yield p + "mlp.experts.down_proj.weight", rand(experts, h, inter)
    yield "model.norm.weight", norm(h)
    if not cfg["tie_word_embeddings"]:
        yield "lm_head.weight", rand(VOCAB, h)


def write(out: Path, shape: str = "granite-1b-a400m", family: str = "granitemoe", ftype: str = "f16",
          seed: int = 0) -> Path:
    from tiny_models import write_gguf_from_hf

    from kvflow.models.loader import default_model_path
    from kvflow.tokenizer import Tokenizer

    cfg = model_config(shape, family)
    with tempfile.TemporaryDirectory() as folder:     # config.json and the tokenizer: what the writer reads
        Tokenizer.from_model(default_model_path()).hf.save_pretrained(folder)
        (Path(folder) / "config.json").write_text(json.dumps(cfg))
        return write_gguf_from_hf(Path(folder), Path(out), ftype=ftype, tensors=random_tensors(cfg, family, seed))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="granite-1b-a400m")
    ap.add_argument("--family", choices=sorted(ARCHITECTURES), default="granitemoe")
    ap.add_argument("--ftype", default="f16")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    path = write(args.out, args.shape, args.family, args.ftype, args.seed)
    print(f"{path}: {path.stat().st_size / 2**20:.1f} MiB")


if __name__ == "__main__":
    main()
