"""What Qwen3.5's MTP drafting costs at batch 1, and the concurrency-1 speedup it would give at a given acceptance.

Times, on a Qwen3.5 folder with an MTP block (`--model`; `--add-mtp-from SRC` first writes one: SRC's files linked, a
random `mtp.*` block of the right shapes in `mtp.safetensors`, config.json's `mtp_num_hidden_layers` = 1):
- one decode step (the target's forward over one row, its logits) and one MTP draft pass (fc, the MTP layer, its norm,
  the LM head for one row, argmax), the 20th percentile of 25 calls each at position 128;
- the target over 1 + N decode rows (a verification) and the MTP pass over them, by parts;
- engine steps: a request's steps after its first, without speculation and with N MTP drafts (a random head: its
  drafts are rejected, every step verifies N), the 20th percentile of ~60 steps.
The speedup at acceptance a (each draft accepted with probability a once the ones before it were): a speculating step
gives E = (1 - a^(N+1)) / (1 - a) tokens, so speedup = E x decode step / speculating step.

Run alone on an idle machine (the figures are the 20th percentiles so that a short burst elsewhere does not move them,
but a busy machine moves everything).
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from kvflow import LLM, SamplingParams
from kvflow.request import AddRequest
from kvflow.runner.step import StepBatch

PROMPT_LEN = 128


def add_random_mtp(src: Path, dst: Path) -> None:
    """dst: src's files linked, config.json with mtp_num_hidden_layers = 1, a random MTP block (src's dtype; fc
    [hidden, 2 hidden], zero-centred norms, a decoder layer shaped as src's first full-attention layer)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.name != "config.json" and not (dst / f.name).exists():
            (dst / f.name).symlink_to(f.resolve())
    cfg = json.loads((src / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**cfg, "mtp_num_hidden_layers": 1}, indent=2))
    full, hidden = cfg["layer_types"].index("full_attention"), cfg["hidden_size"]
    shapes = {"mtp.fc.weight": [hidden, 2 * hidden], "mtp.pre_fc_norm_embedding.weight": [hidden],
              "mtp.pre_fc_norm_hidden.weight": [hidden], "mtp.norm.weight": [hidden]}
    dtype = torch.float32
    for file in sorted(src.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                if name.startswith(f"model.layers.{full}."):
                    shapes[name.replace(f"model.layers.{full}.", "mtp.layers.0.")] = f.get_slice(name).get_shape()
                    dtype = f.get_tensor(name).dtype
    g = torch.Generator().manual_seed(0)
    save_file({n: ((0.1 if n.endswith("norm.weight") else 0.02) * torch.randn(s, generator=g)).to(dtype)
               for n, s in shapes.items()}, str(dst / "mtp.safetensors"), metadata={"format": "pt"})


def percentile20(fn, reps: int = 25) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return sorted(times)[len(times) // 5]


def engine_step(llm: LLM, prompt: list[int], tokens: int = 60) -> float:
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    engine.add_request(AddRequest("m", prompt, params, max_tokens=tokens))
    times = []
    while engine.has_unfinished_requests():
        t = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t)
    steps = sorted(times[1:])
    print(f"  ({len(steps)} steps: min {steps[0] * 1e3:.1f}, 20th percentile {steps[len(steps) // 5] * 1e3:.1f}, "
          f"median {statistics.median(steps) * 1e3:.1f}, max {steps[-1] * 1e3:.1f} ms)")
    return steps[len(steps) // 5]


@torch.inference_mode()
def parts(llm: LLM, rows: int) -> tuple[float, float]:
    """The target's forward over `rows` decode rows of one request at position 128 (and their logits), and the MTP
    pass over them with one row's logits and argmax."""
    runner = llm.engine.runner
    model = runner.model
    table = list(range(PROMPT_LEN // runner.block_size + 2))
    common = dict(num_decodes=rows, token_ids=[5] * rows, num_computed_tokens=[PROMPT_LEN + j for j in range(rows)],
                  num_new_tokens=[1] * rows, block_tables=[table] * rows)
    target = percentile20(lambda: runner.forward(StepBatch(**common, samples=[True] * rows, state_slots=(0,) * rows)))
    ids, pos, meta, _ = runner.prepare_inputs(StepBatch(**common, samples=[False] * rows))
    hidden = torch.randn(rows, model.config.hidden_size, dtype=runner.dtype, device=runner.device)

    def mtp_pass():
        return model.compute_logits(model.mtp_forward(ids, pos, hidden, meta)[-1:]).argmax(-1).tolist()
    return target, percentile20(mtp_pass)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="/tmp/models/hf/qwen35-0.8b-shape-mtp")
    ap.add_argument("--add-mtp-from", type=Path, help="write --model first: this folder plus a random MTP block")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--drafts", type=int, nargs="+", default=[1, 3])
    args = ap.parse_args()
    if args.add_mtp_from:
        add_random_mtp(args.add_mtp_from, Path(args.model))

    def build(k: int | None = None) -> LLM:
        return LLM(args.model, dtype=args.dtype, max_model_len=1024, kv_cache_memory="1GiB",
                   enable_prefix_caching=False, max_num_seqs=4,
                   speculative_config={"method": "mtp", "num_speculative_tokens": k} if k else None)

    llm = build(1)
    runner = llm.engine.runner
    print(runner.plan.describe())
    print(f"dtype {runner.dtype}, weights {runner.weights_bytes / 2**20:.0f} MiB (with the MTP block)")
    prompt = torch.randint(10, min(40000, runner.model_config.vocab_size), (PROMPT_LEN,),
                           generator=torch.Generator().manual_seed(0)).tolist()
    decode, draft = parts(llm, 1)
    print(f"batch 1: a decode step {decode * 1e3:.1f} ms; an MTP draft pass {draft * 1e3:.1f} ms "
          f"({draft / decode:.2f} of a decode step)")
    for n in args.drafts:
        verify, mtp = parts(llm, 1 + n)
        print(f"N={n}: the target over {1 + n} rows {verify * 1e3:.1f} ms, the MTP pass over them {mtp * 1e3:.1f} ms, "
              f"{n - 1} more draft pass(es): ~{(verify + mtp + (n - 1) * draft) * 1e3:.1f} ms a step by parts")
    del llm
    base = engine_step(build(), prompt)
    print(f"engine: a decode step without speculation {base * 1e3:.1f} ms")
    step = {}
    for n in args.drafts:
        step[n] = engine_step(build(n), prompt)
        print(f"engine: a step verifying {n} MTP draft(s) and drafting the next {step[n] * 1e3:.1f} ms "
              f"({step[n] / base:.2f} x a decode step)")
    for n in args.drafts:
        cells = []
        for a in (0.3, 0.6, 0.9):
            tokens = (1 - a ** (n + 1)) / (1 - a)
            cells.append(f"a={a}: {tokens:.2f} tokens/step, {tokens * base / step[n]:.2f}x")
        print(f"c=1 speedup, N={n}: " + "; ".join(cells))


if __name__ == "__main__":
    main()
