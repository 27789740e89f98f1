"""Prefix caching on a hybrid: the time to first token of a request whose ~1,000-token system prompt the server has
seen, against the same request cold.

    python benchmarks/hybrid_prefix_ttft.py MODEL.gguf [--reps 5] [--system-tokens 1000] [--question-tokens 30]

A hybrid's prefix-cache hit needs a state checkpoint where the cached blocks end (docs/architecture.md, "Recurrent
state"): the first request with a system prompt leaves one at its own prompt's end, the second (another question
after the same system prompt) at the junction, and from the third on the system prompt is not computed again.
So per repetition: a cold request (a fresh system prompt), two more with that system prompt to leave the junction's
checkpoint, then the warm request measured. TTFT is `kvflow serve`'s own: a streamed completion over HTTP with the
official `openai` client, time to the first content chunk. Medians over --reps; the ratio warm / cold.
Never run this while anything else loads the machine.
"""
from __future__ import annotations

import argparse
import random
import statistics
import time

import openai

from kvflow.config import EngineConfig
from kvflow.server.testing import ServerThread


def words(rng: random.Random, n: int) -> str:
    vocab = ["policy", "leave", "office", "employee", "Germany", "travel", "benefit", "contract", "manager", "team",
             "salary", "holiday", "parental", "request", "approval", "document", "section", "rule", "days", "notice"]
    return " ".join(rng.choice(vocab) for _ in range(n))


def ttft(client, model: str, system: str, question: str) -> float:
    t0 = time.perf_counter()
    stream = client.completions.create(model=model, prompt=system + "\n\nQuestion: " + question, max_tokens=2,
                                       temperature=0, stream=True)
    first = None
    for chunk in stream:
        if first is None and chunk.choices and chunk.choices[0].text is not None:
            first = time.perf_counter() - t0
    return first


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--system-tokens", type=int, default=1000, help="about this many tokens (words)")
    ap.add_argument("--question-tokens", type=int, default=30)
    args = ap.parse_args()
    rng = random.Random(0)
    config = EngineConfig(model=args.model, max_model_len=4096, kv_cache_memory="4GiB", served_model_name="m")
    cold, warm, hits = [], [], []
    with ServerThread(config) as server:
        client = openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0, timeout=600)
        ttft(client, "m", words(rng, 50), words(rng, 5))          # warm-up
        for _ in range(args.reps):
            system = words(rng, args.system_tokens)
            cold.append(ttft(client, "m", system, words(rng, args.question_tokens)))
            ttft(client, "m", system, words(rng, args.question_tokens))      # leaves the junction's checkpoint
            question = words(rng, args.question_tokens)
            warm.append(ttft(client, "m", system, question))
            usage = client.completions.create(model="m", prompt=system + "\n\nQuestion: " + question, max_tokens=1,
                                              temperature=0).usage
            hits.append((usage.prompt_tokens_details.cached_tokens, usage.prompt_tokens))
    c, w = statistics.median(cold), statistics.median(warm)
    print(f"model {args.model}")
    print(f"cold TTFT median {c * 1000:.0f} ms ({', '.join(f'{x * 1000:.0f}' for x in cold)})")
    print(f"warm TTFT median {w * 1000:.0f} ms ({', '.join(f'{x * 1000:.0f}' for x in warm)})")
    print(f"warm / cold = {w / c:.3f}; cached / prompt tokens of the warm requests: {hits}")


if __name__ == "__main__":
    main()
