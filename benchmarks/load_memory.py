"""Peak and steady memory of loading a GGUF: RSS and PSS of a process tree sampled every 0.1 s.

    python benchmarks/load_memory.py FILE.gguf [--serve] [--make qwen2.5-0.5b]

Without `--serve` a child process builds `LLM(FILE)` (the engine in that process), then idles 3 s; with it,
`kvflow serve FILE` runs until /health answers, then idles 3 s. Peak: the largest sample; steady: the last one.
PSS (from /proc/PID/smaps_rollup) charges each process its share of pages it shares with others (the file's page
cache mapped by several, the frontend and the engine's common libraries), so a tree's PSS sums to what it costs.

`--make qwen2.5-0.5b` (or `small`) first writes FILE: random weights with Qwen2.5-0.5B-Instruct's shapes
(vocabulary 151,936, hidden 896, 24 layers, 14 heads / 2 KV heads, MLP 4864, untied head) and the type mix of its
Q4_K_M download as llama-quantize writes it: Q4_K / Q6_K where the rows are a multiple of 256 wide (ffn_down), else
llama.cpp's fallbacks, Q5_0 (133 tensors: the embedding, q/k/o/gate/up and most attn_v) and Q8_0 (the head, the
more-bits attn_v). The tokenizer is SmolLM2's (the embedded model's): the weights are random anyway.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))       # the GGUF writer the tests use (tiny_models.write_gguf_from_hf)

SHAPES = {
    "qwen2.5-0.5b": dict(architectures=["Qwen2ForCausalLM"], vocab_size=151936, hidden_size=896,
                         num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                         intermediate_size=4864, max_position_embeddings=32768, rope_theta=1_000_000.0,
                         rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2),
    # the same mix in a test's size (tests/test_gguf_load_memory.py): 640 columns (not a multiple of 256) take the
    # Q5_0 / Q8_0 fallbacks, ffn_down's 1536 Q4_K (layer 0) and Q6_K (layer 1)
    "small": dict(architectures=["Qwen2ForCausalLM"], vocab_size=49152, hidden_size=640, num_hidden_layers=2,
                  num_attention_heads=10, num_key_value_heads=2, intermediate_size=1536, max_position_embeddings=2048,
                  rope_theta=1_000_000.0, rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=1,
                  eos_token_id=2),
}


def random_tensors(cfg: dict, seed: int):
    """(HF name, float32 array) one at a time, in the converter's order."""
    rng = np.random.default_rng(seed)
    h, layers, inter = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["intermediate_size"]
    d = h // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d

    def rand(*shape, std=0.02):
        return (rng.standard_normal(shape, dtype=np.float32) * std).astype(np.float32)

    def norm(n):
        return (1.0 + 0.1 * rng.standard_normal(n, dtype=np.float32)).astype(np.float32)

    yield "model.embed_tokens.weight", rand(cfg["vocab_size"], h)
    for i in range(layers):
        p = f"model.layers.{i}."
        yield p + "input_layernorm.weight", norm(h)
        yield p + "post_attention_layernorm.weight", norm(h)
        for proj, rows in (("q_proj", q), ("k_proj", kv), ("v_proj", kv)):
            yield p + f"self_attn.{proj}.weight", rand(rows, h)
            yield p + f"self_attn.{proj}.bias", rand(rows)
        yield p + "self_attn.o_proj.weight", rand(h, q)
        yield p + "mlp.gate_proj.weight", rand(inter, h)
        yield p + "mlp.up_proj.weight", rand(inter, h)
        yield p + "mlp.down_proj.weight", rand(h, inter)
    yield "model.norm.weight", norm(h)
    if not cfg["tie_word_embeddings"]:
        yield "lm_head.weight", rand(cfg["vocab_size"], h)


def make(out: Path, shape: str = "qwen2.5-0.5b", seed: int = 0) -> Path:
    from tiny_models import write_gguf_from_hf

    from kvflow.models.loader import default_model_path
    from kvflow.tokenizer import Tokenizer

    cfg = SHAPES[shape]
    with tempfile.TemporaryDirectory() as folder:     # config.json and the tokenizer: what the writer reads
        Tokenizer.from_model(default_model_path()).hf.save_pretrained(folder)
        (Path(folder) / "config.json").write_text(json.dumps(cfg))
        # llama-quantize's Q4_K_M leaves an untied model's embedding at the mix's default type, Q4_K (-> Q5_0 at 896
        # columns); the writer's simplified table gives it the head's Q6_K
        return write_gguf_from_hf(Path(folder), Path(out), ftype="q4_k_m", tensors=random_tensors(cfg, seed),
                                  types={"token_embd.weight": "Q4_K"})


def _tree(pid: int) -> list[int]:
    """pid and its descendants."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        try:
            with open(f"/proc/{p}/task/{p}/children") as f:
                todo.extend(int(c) for c in f.read().split())
        except OSError:
            pass
    return out


def tree_memory(pid: int) -> tuple[int, int]:
    """(RSS, PSS) in bytes summed over the tree."""
    rss = pss = 0
    for p in _tree(pid):
        try:
            with open(f"/proc/{p}/smaps_rollup") as f:
                for line in f:
                    if line.startswith("Rss:"):
                        rss += int(line.split()[1]) * 1024
                    elif line.startswith("Pss:"):
                        pss += int(line.split()[1]) * 1024
        except OSError:
            pass
    return rss, pss


def _ready(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=0.5) as r:
            return r.status == 200
    except OSError:
        return False


def measure(path: Path, serve: bool = False, port: int = 8771, idle: float = 3.0, extra: list[str] = ()) -> dict:
    """Peak and steady (last sample) RSS / PSS of the load, in GiB, and the load's seconds."""
    if serve:
        cmd = [sys.executable, "-m", "kvflow.cli", "serve", str(path), "--port", str(port), *extra]
    else:
        cmd = [sys.executable, "-c", f"import sys, time; from kvflow import LLM; llm = LLM({str(path)!r}); "
               f"print('loaded', flush=True); time.sleep({idle})"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE if not serve else subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, cwd=REPO)
    if not serve:
        os.set_blocking(proc.stdout.fileno(), False)
    t0, ready_at, peak, last = time.monotonic(), None, (0, 0), (0, 0)
    try:
        while proc.poll() is None:
            last = tree_memory(proc.pid)
            peak = (max(peak[0], last[0]), max(peak[1], last[1]))
            if ready_at is None and (_ready(port) if serve else b"loaded" in (proc.stdout.read() or b"")):
                ready_at = time.monotonic()
            if ready_at is not None and time.monotonic() - ready_at > idle:
                break
            time.sleep(0.1)
    finally:
        proc.terminate()
        proc.wait()
    if ready_at is None:
        raise RuntimeError(f"{' '.join(cmd)} exited ({proc.returncode}) before it was ready")
    gib = 2 ** 30
    return dict(peak_rss=peak[0] / gib, peak_pss=peak[1] / gib, steady_rss=last[0] / gib, steady_pss=last[1] / gib,
                load_s=ready_at - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("file", type=Path)
    ap.add_argument("--make", choices=sorted(SHAPES), help="write FILE first, random weights of this shape")
    ap.add_argument("--serve", action="store_true", help="measure `kvflow serve FILE` (else LLM(FILE))")
    ap.add_argument("--port", type=int, default=8771)
    args, extra = ap.parse_known_args()
    if args.make:
        make(args.file, args.make)
        print(f"{args.file}: {args.file.stat().st_size / 2**20:.1f} MiB")
    r = measure(args.file, args.serve, args.port, extra=extra)
    print(f"peak RSS {r['peak_rss']:.2f} GiB, PSS {r['peak_pss']:.2f} GiB; steady RSS {r['steady_rss']:.2f} GiB, "
          f"PSS {r['steady_pss']:.2f} GiB (file {args.file.stat().st_size / 2**30:.2f} GiB, ready after "
          f"{r['load_s']:.1f} s)")


if __name__ == "__main__":
    main()
