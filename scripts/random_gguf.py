"""Write a random-weight GGUF of a given shape, for checks and benchmarks on models kvflow does not ship (speed does
not depend on the weights' values; the tokenizer and chat template are the embedded SmolLM2's).

    python scripts/random_gguf.py OUT.gguf [--family qwen2] [--ftype q4_0|q4_1|q4_k|q8_0|f16]
        [--hidden 1024 --intermediate 2816 --layers 8 --heads 16 --kv-heads 2 --head-dim 64]

The defaults are Qwen2-shaped (QKV biases, grouped-query attention, untied LM head). q4_k writes real Q4_K blocks
(tests/tiny_models.quantize_q4_k) for matrices whose rows are a multiple of 256 wide and Q8_0 for the rest.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from tiny_models import make_tiny_hf_model, write_gguf_from_hf  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=Path)
    ap.add_argument("--family", default="qwen2", choices=["llama", "qwen2", "qwen3"])
    ap.add_argument("--ftype", default="q4_0")
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--intermediate", type=int, default=2816)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=64)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        hf = make_tiny_hf_model(Path(tmp) / "hf", args.family, hidden_size=args.hidden,
                                intermediate_size=args.intermediate, num_hidden_layers=args.layers,
                                num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
                                head_dim=args.head_dim, tie_word_embeddings=False, max_position_embeddings=4096)
        write_gguf_from_hf(hf, args.out, ftype=args.ftype)
    print(args.out)


if __name__ == "__main__":
    main()
