"""Workloads: what the benchmark sends. Each yields RequestSpecs, seeded, so two runs send the same requests.

Token counting, kept simple on purpose: prompts of the `random` and `shared-prefix` workloads are built from
common short English words, each one token in the usual BPE vocabularies (Llama, Qwen, SmolLM2, GPT-2), so a
prompt of N words is about N tokens. The exact count each request really had is taken from the server's `usage`
field when it sends one (kvflow and vLLM do, with `stream_options.include_usage`); the word estimate is used only
when it does not.
"""
from __future__ import annotations

import itertools
import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

# short, common words: one token each (with their leading space) in the usual BPE vocabularies
WORDS = ("the of and to in is it you that he was for on are with as his they at be this from have or by one had "
         "not but what all were when we there can an your which their said if do will each about how up out them "
         "then she many some so these would other into has more her two like him see time could no make than first "
         "been its who now people my made over did down only way find use may water long little very after words "
         "called just where most know get through back much before go good new write our used me man too any day "
         "same right look think also around another came come work three word must because does part even place "
         "well such here take why things help put years different away again off went old number great tell men say "
         "small every found still between name should home big give air line set own under read last never us left "
         "end along while might next sound below saw something thought both few those always looked show large often "
         "together asked house world going want school important until form food keep children feet land side without "
         "boy once animals life enough took sometimes four head above kind began almost live page got earth need far "
         "hand high year mother light parts country father let night following picture being study second eyes soon "
         "times story boys since white days ever paper hard near sentence better best across during today others sure "
         "means knew its try told young miles sun ways thing whole hear example heard several change answer room sea "
         "against top turned learn point city play toward five using himself usually").split()


@dataclass
class RequestSpec:
    """One request to send: a prompt (completions) or a messages list (chat), and its max_tokens."""
    index: int
    prompt: str | None = None
    messages: list[dict] | None = None
    max_tokens: int | None = None
    prompt_tokens_est: int = 0          # word-count estimate, used when the server gives no usage
    group: str | None = None            # shared-prefix: which system prompt

    def as_messages(self) -> list[dict]:
        if self.messages is not None:
            return self.messages
        return [{"role": "user", "content": self.prompt or ""}]

    def as_prompt(self) -> str:
        if self.prompt is not None:
            return self.prompt
        return "\n".join(f"{m.get('role', 'user')}: {m.get('content', '')}" for m in self.messages or [])


@dataclass
class Workload:
    """A named, seeded, finite list of requests (cycled when a run asks for more)."""
    name: str
    specs: list[RequestSpec]
    params: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.specs:
            raise ValueError(f"workload {self.name!r} has no requests")

    def take(self, n: int | None) -> Iterator[RequestSpec]:
        """The first n requests (all of them cycled forever when n is None), re-indexed 0, 1, 2, ..."""
        cycled = itertools.cycle(self.specs)
        source = cycled if n is None else itertools.islice(cycled, n)
        for i, s in enumerate(source):
            yield RequestSpec(i, s.prompt, s.messages, s.max_tokens, s.prompt_tokens_est, s.group)

    def default_num_requests(self) -> int:
        return len(self.specs)


def _words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def _length(rng: random.Random, mean: int, range_ratio: float) -> int:
    lo, hi = max(1, round(mean * (1 - range_ratio))), max(1, round(mean * (1 + range_ratio)))
    return rng.randint(lo, hi)


def random_workload(num_requests: int, input_len: int, output_len: int, range_ratio: float = 0.0,
                    seed: int = 0) -> Workload:
    """Random word prompts of ~input_len tokens, max_tokens ~output_len, both uniform in len*(1±range_ratio)."""
    if input_len < 1 or output_len < 1:
        raise ValueError("--input-len and --output-len must be >= 1")
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"--range-ratio must be in [0, 1), got {range_ratio}")
    rng = random.Random(seed)
    specs = []
    for i in range(num_requests):
        n_in = _length(rng, input_len, range_ratio)
        n_out = _length(rng, output_len, range_ratio)
        specs.append(RequestSpec(i, prompt=_words(rng, n_in), max_tokens=n_out, prompt_tokens_est=n_in))
    return Workload("random", specs, dict(input_len=input_len, output_len=output_len, range_ratio=range_ratio,
                                          seed=seed, num_requests=num_requests))


def shared_prefix_workload(num_prefixes: int, questions_per_prefix: int, prefix_len: int, question_len: int,
                           output_len: int, seed: int = 0) -> Workload:
    """K system prompts of prefix_len tokens × M questions of question_len tokens, shuffled (seeded).

    Sent as a chat (system + user) or, for the completions API, as system prompt + newline + question, so the
    prompts of one group share their first prefix_len tokens: what a prefix cache can reuse."""
    if min(num_prefixes, questions_per_prefix, prefix_len, question_len, output_len) < 1:
        raise ValueError("shared-prefix sizes must all be >= 1")
    rng = random.Random(seed)
    prefixes = [f"System {k}: " + _words(rng, prefix_len - 2) if prefix_len > 2 else f"System {k}:"
                for k in range(num_prefixes)]
    specs = []
    for k, prefix in enumerate(prefixes):
        for m in range(questions_per_prefix):
            q = f"Question {m}: " + _words(rng, max(1, question_len - 2))
            specs.append(RequestSpec(0, messages=[{"role": "system", "content": prefix},
                                                  {"role": "user", "content": q}],
                                     max_tokens=output_len, prompt_tokens_est=prefix_len + question_len,
                                     group=f"prefix-{k}"))
    rng.shuffle(specs)
    for i, s in enumerate(specs):
        s.index = i
    return Workload("shared-prefix", specs, dict(num_prefixes=num_prefixes, questions_per_prefix=questions_per_prefix,
                                                 prefix_len=prefix_len, question_len=question_len,
                                                 output_len=output_len, seed=seed))


def haiku_workload(num_requests: int = 32, max_tokens: int = 64) -> Workload:
    """The seed scenario: "Q{i}: write a haiku" for i in 0..n-1, max_tokens 64 (sent all at once by default)."""
    specs = [RequestSpec(i, prompt=f"Q{i}: write a haiku", max_tokens=max_tokens, prompt_tokens_est=6)
             for i in range(num_requests)]
    return Workload("haiku", specs, dict(num_requests=num_requests, max_tokens=max_tokens))


def jsonl_workload(path: str | Path, default_max_tokens: int | None = None) -> Workload:
    """One request per line: {"prompt": "..."} or {"messages": [...]}, optional "max_tokens";
    a bare JSON string is a prompt."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no such workload file: {path}")
    specs = []
    for lineno, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{lineno}: not JSON: {e}") from None
        if isinstance(obj, str):
            obj = {"prompt": obj}
        if not isinstance(obj, dict) or ("prompt" in obj) == ("messages" in obj):
            raise ValueError(f"{path}:{lineno}: expected a string or an object with 'prompt' or 'messages'")
        max_tokens = obj.get("max_tokens", default_max_tokens)
        if max_tokens is not None and (not isinstance(max_tokens, int) or max_tokens < 1):
            raise ValueError(f"{path}:{lineno}: max_tokens must be a positive integer")
        if "prompt" in obj:
            if not isinstance(obj["prompt"], str):
                raise ValueError(f"{path}:{lineno}: 'prompt' must be a string")
            spec = RequestSpec(len(specs), prompt=obj["prompt"], max_tokens=max_tokens)
        else:
            msgs = obj["messages"]
            if not isinstance(msgs, list) or not all(isinstance(m, dict) and "content" in m for m in msgs):
                raise ValueError(f"{path}:{lineno}: 'messages' must be a list of {{role, content}} objects")
            spec = RequestSpec(len(specs), messages=msgs, max_tokens=max_tokens)
        spec.prompt_tokens_est = len(spec.as_prompt().split())
        specs.append(spec)
    return Workload("jsonl", specs, dict(path=str(path), default_max_tokens=default_max_tokens))
