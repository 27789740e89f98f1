"""Write a random-weight GGUF of a given shape, for checks and benchmarks on models kvflow does not ship (speed does
not depend on the weights' values; the tokenizer and chat template are the embedded SmolLM2's).

    python scripts/random_gguf.py OUT.gguf [--preset qwen2.5-0.5b] [--family qwen2]
        [--ftype q4_0|q4_1|q4_k|q8_0|f16|bf16|f32]
        [--hidden 1024 --intermediate 2816 --layers 8 --heads 16 --kv-heads 2 --head-dim 64]
        [--vocab N] [--tie-embeddings] [--rope-theta 10000] [--rms-norm-eps 1e-5] [--seed 0]

The defaults are Qwen2-shaped (QKV biases, grouped-query attention, untied LM head). q4_k writes real Q4_K blocks
(tests/tiny_models.quantize_q4_k) for matrices whose rows are a multiple of 256 wide and Q8_0 for the rest.

`--vocab N` larger than the tokenizer's 49,152 tokens pads the GGUF token list with `[PAD<i>]` tokens up to N, as
llama.cpp's convert_hf_to_gguf.py pads a model whose embedding has more rows than its tokenizer has tokens
(llama.cpp refuses a file whose token list is shorter than the embedding). The tokenizer never produces those
ids, but a random model samples them (two thirds of 151,936): they are written as NORMAL tokens, not UNUSED as
the converter does, so that both kvflow and llama-server stream them as their text `[PAD<i>]` (llama.cpp
detokenizes an UNUSED token to nothing, kvflow to its name: the two servers' streams, and TTFT, would differ).

A 0.5B-class model: `--preset qwen2.5-0.5b` sets Qwen2.5-0.5B's shapes (24 layers, hidden 896, 14 heads / 2 KV
heads, head_dim 64, MLP 4864, vocab 151,936, tied embeddings, rope theta 1e6, RMS eps 1e-6, 32k positions);
explicit flags win over the preset. Written in f16 it is the input llama.cpp's `llama-quantize` expects; in q4_0
it is served as it is (about half a minute and 4.2 GB of RAM on the 2-core machine for either; the f16 file is
992 MB):

    python scripts/random_gguf.py /tmp/models/qwen05b-f16.gguf --preset qwen2.5-0.5b --ftype f16
    python scripts/random_gguf.py /tmp/models/qwen05b-q4_0-gguf-py.gguf --preset qwen2.5-0.5b --ftype q4_0
    # llama.cpp's own quantizations of it (a few seconds each; benchmarks/README.md builds llama-quantize):
    /tmp/llamacpp/build/bin/llama-quantize /tmp/models/qwen05b-f16.gguf /tmp/models/qwen05b-q4_0.gguf Q4_0
    /tmp/llamacpp/build/bin/llama-quantize /tmp/models/qwen05b-f16.gguf /tmp/models/qwen05b-q4_1.gguf Q4_1
    /tmp/llamacpp/build/bin/llama-quantize /tmp/models/qwen05b-f16.gguf /tmp/models/qwen05b-q4_k_m.gguf Q4_K_M

gguf-py's q4_0 writes every matrix, the tied embedding included, in Q4_0 (282 MB). llama-quantize keeps the tied
embedding in Q8_0 (350 MB for Q4_0, 373 MB Q4_1); and as hidden 896 is not a multiple of 256, its Q4_K_M
(396 MB) has K-quants only where the rows are 4864 wide (ffn_down: Q4_K and Q6_K); the other matrices fall back
to Q5_0 (attn_v half Q8_0), as they would for Qwen2.5-0.5B's real weights (the same shapes).
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import tiny_models  # noqa: E402
from tiny_models import SMOLLM2_VOCAB, make_tiny_hf_model, write_gguf_from_hf  # noqa: E402

PRESETS = {
    # https://huggingface.co/Qwen/Qwen2.5-0.5B-Instruct/blob/main/config.json
    "qwen2.5-0.5b": dict(family="qwen2", hidden=896, intermediate=4864, layers=24, heads=14, kv_heads=2,
                         head_dim=64, vocab=151936, tie_embeddings=True, rope_theta=1000000.0, rms_norm_eps=1e-6,
                         max_positions=32768),
}
DEFAULTS = dict(family="qwen2", hidden=1024, intermediate=2816, layers=8, heads=16, kv_heads=2, head_dim=64,
                vocab=SMOLLM2_VOCAB, tie_embeddings=False, rope_theta=10000.0, rms_norm_eps=1e-5, max_positions=4096)
NORMAL = 1   # gguf.TokenType.NORMAL (see the module docstring for why not UNUSED)


def pad_token_list(n_vocab: int) -> None:
    """Make tests/tiny_models write a token list of n_vocab entries: the tokenizer's, then [PAD<i>] (NORMAL)."""
    base = tiny_models._hf_tokenizer_metadata

    def metadata(hf_dir: Path) -> dict:
        tok = base(hf_dir)
        have = len(tok["tokens"])
        if have > n_vocab:
            raise ValueError(f"--vocab {n_vocab} is smaller than the tokenizer's {have} tokens")
        tok["tokens"] = tok["tokens"] + [f"[PAD{i}]" for i in range(have, n_vocab)]
        tok["types"] = tok["types"] + [NORMAL] * (n_vocab - have)
        return tok

    tiny_models._hf_tokenizer_metadata = metadata


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=Path)
    ap.add_argument("--preset", choices=sorted(PRESETS), default=None,
                    help="a real model's shapes (explicit flags win)")
    ap.add_argument("--family", choices=["llama", "qwen2", "qwen3"], default=None)
    ap.add_argument("--ftype", default="q4_0", choices=["q4_0", "q4_1", "q4_k", "q8_0", "f16", "bf16", "f32"])
    ap.add_argument("--hidden", type=int, default=None)
    ap.add_argument("--intermediate", type=int, default=None)
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--heads", type=int, default=None)
    ap.add_argument("--kv-heads", type=int, default=None)
    ap.add_argument("--head-dim", type=int, default=None)
    ap.add_argument("--vocab", type=int, default=None,
                    help=f"embedding rows (default {SMOLLM2_VOCAB}, the tokenizer's; more pads the token list)")
    ap.add_argument("--tie-embeddings", action=argparse.BooleanOptionalAction, default=None,
                    help="one matrix for the embedding and the LM head (no output.weight in the file)")
    ap.add_argument("--rope-theta", type=float, default=None)
    ap.add_argument("--rms-norm-eps", type=float, default=None)
    ap.add_argument("--max-positions", type=int, default=None, help="the context length the file declares")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    shape = {**DEFAULTS, **PRESETS.get(args.preset, {})}
    shape.update({k: v for k, v in vars(args).items() if k in shape and v is not None})

    if shape["vocab"] != SMOLLM2_VOCAB:
        pad_token_list(shape["vocab"])
    with tempfile.TemporaryDirectory() as tmp:
        hf = make_tiny_hf_model(Path(tmp) / "hf", shape["family"], seed=args.seed, vocab_size=shape["vocab"],
                                hidden_size=shape["hidden"], intermediate_size=shape["intermediate"],
                                num_hidden_layers=shape["layers"], num_attention_heads=shape["heads"],
                                num_key_value_heads=shape["kv_heads"], head_dim=shape["head_dim"],
                                tie_word_embeddings=shape["tie_embeddings"],
                                max_position_embeddings=shape["max_positions"], rope_theta=shape["rope_theta"],
                                rms_norm_eps=shape["rms_norm_eps"])
        write_gguf_from_hf(hf, args.out, ftype=args.ftype)
    print(args.out)


if __name__ == "__main__":
    main()
