"""xgrammar vs llguidance on the embedded model's tokenizer, and kvflow's batched mask cost.

    python benchmarks/grammar_engines.py            # the engines that import (xgrammar is not a dependency:
                                                    # pip install --no-deps --target DIR xgrammar apache-tvm-ffi
                                                    # and put DIR on PYTHONPATH to compare)
Per engine: tokenizer-info build, compile time of 30 generated JSON schemas and of one 40-property schema,
and per-token mask fill time while decoding them from random logits at temperature 1 (one torch thread).
Then kvflow.structured_output.apply_structured_masks on a batch of 32 rows of the padded vocabulary.
"""
from __future__ import annotations

import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from test_structured_output import gen_object_schema  # noqa: E402  (the tests' schema generator)

from kvflow.models.model_files import locate_model  # noqa: E402
from kvflow.tokenizer import Tokenizer  # noqa: E402


def q(xs, p):
    return sorted(xs)[min(len(xs) - 1, int(len(xs) * p))] * 1e6


def xgrammar_engine(tok):
    import xgrammar as xgr
    info = xgr.TokenizerInfo.from_huggingface(tok.hf, vocab_size=tok.vocab_size, stop_token_ids=sorted(tok.eos_token_ids))
    comp = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    return (lambda s: xgr.GrammarMatcher(comp.compile_json_schema(json.dumps(s), any_whitespace=False)),
            lambda m, mask: m.fill_next_token_bitmask(mask, 0), lambda m, t: m.accept_token(t),
            lambda m: m.is_terminated())


def llguidance_engine(tok):
    from kvflow.structured_output import GrammarCompiler, StructuredSpec
    comp = GrammarCompiler(tok, cache_size=0)
    return (lambda s: comp.compile(StructuredSpec("json_schema", json.dumps(s))).matcher(),
            lambda m, mask: m.fill_mask(mask, 0), lambda m, t: m.accept(t), lambda m: m.is_terminated())


def run_engine(name, build, tok):
    t = time.perf_counter()
    compile_, fill, accept, done = build(tok)
    init = time.perf_counter() - t
    schemas = [gen_object_schema(random.Random(i)) for i in range(30)]
    big = {"type": "object", "properties": {f"p{i}": gen_object_schema(random.Random(100 + i)) for i in range(40)},
           "additionalProperties": False}
    vocab, words = tok.vocab_size, (tok.vocab_size + 31) // 32
    gen = torch.Generator().manual_seed(0)
    compile_s, first, fills, ok = [], [], [], 0
    for s in schemas:
        t = time.perf_counter()
        m = compile_(s)
        compile_s.append(time.perf_counter() - t)
        out = []
        for step in range(300):
            if done(m):
                break
            mask = torch.zeros(1, words, dtype=torch.int32)
            t = time.perf_counter()
            fill(m, mask)
            (first if step == 0 else fills).append(time.perf_counter() - t)
            allowed = ((mask.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1).view(1, -1)[:, :vocab].bool()
            logits = torch.randn(1, vocab, generator=gen).masked_fill(~allowed, float("-inf"))
            token = int(torch.multinomial(torch.softmax(logits, -1), 1, generator=gen))
            accept(m, token)
            out.append(token)
        try:
            json.loads(tok.decode(out))
            ok += done(m)
        except ValueError:
            pass
    t = time.perf_counter()
    compile_(big)
    big_s = time.perf_counter() - t
    print(f"{name}: tokenizer info {init * 1e3:.0f} ms | compile of 30 schemas median {statistics.median(compile_s) * 1e3:.1f} ms, "
          f"max {max(compile_s) * 1e3:.1f} ms | 40-property schema {big_s * 1e3:.0f} ms | first mask median "
          f"{statistics.median(first) * 1e6:.0f} us | mask fill over {len(fills)} tokens p50 {q(fills, .5):.0f} us, "
          f"p90 {q(fills, .9):.0f} us, p99 {q(fills, .99):.0f} us, max {max(fills) * 1e6:.0f} us | {ok}/30 finished and parsed")


def batch_cost(tok, rows=32, reps=20):
    from kvflow.structured_output import GrammarCompiler, StructuredSpec, allocate_bitmask, apply_structured_masks
    comp = GrammarCompiler(tok)
    matchers = [comp.compile(StructuredSpec("json_schema", json.dumps(gen_object_schema(random.Random(i))))).matcher()
                for i in range(rows)]
    logits = torch.randn(rows, tok.vocab_size + 128)
    bitmask = allocate_bitmask(rows, comp.vocab_size)
    for label, ms in (("none constrained", [None] * rows), ("all constrained", matchers),
                      ("half constrained", [m if i % 2 else None for i, m in enumerate(matchers)])):
        times = []
        for _ in range(reps):
            x = logits.clone()
            t = time.perf_counter()
            apply_structured_masks(x, ms, bitmask)
            times.append(time.perf_counter() - t)
        print(f"apply_structured_masks, batch {rows} x {logits.shape[1]}, {label}: median {statistics.median(times) * 1e3:.3f} ms")


if __name__ == "__main__":
    torch.set_num_threads(1)
    tok = Tokenizer.from_model(locate_model(None))
    print(f"vocab {tok.vocab_size}, eos {sorted(tok.eos_token_ids)}, torch {torch.__version__}, 1 torch thread")
    for name, build in (("xgrammar", xgrammar_engine), ("llguidance", llguidance_engine)):
        try:
            run_engine(name, build, tok)
        except ImportError as e:
            print(f"{name}: not installed ({e})")
    batch_cost(tok)
