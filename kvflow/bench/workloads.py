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
    model: str | None = None            # this request's model (e.g. a LoRA adapter's name); None: the run's --model

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
    """One request per line: {"prompt": "..."} or {"messages": [...]}, optional "max_tokens" and "model" (that
    request's model, e.g. a LoRA adapter's name; else the run's); a bare JSON string is a prompt."""
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
        if obj.get("model") is not None:
            if not isinstance(obj["model"], str):
                raise ValueError(f"{path}:{lineno}: 'model' must be a string")
            spec.model = obj["model"]
        spec.prompt_tokens_est = len(spec.as_prompt().split())
        specs.append(spec)
    return Workload("jsonl", specs, dict(path=str(path), default_max_tokens=default_max_tokens))


# ---- quote: answers that copy from the prompt --------------------------------------------------------------------
# Passages are built here from templates and word lists (no files, no downloads), each from its own seeded
# generator, so a request's passage depends only on (seed, index). ~300 tokens each: passages grow until
# characters / 3.6 (code) or / 4.2 (prose) reach it, ratios measured with SmolLM2's tokenizer (the embedded
# model), where 200 passages of each kind came to 268-382 tokens (code, mean 318) and 284-329 (prose, mean 308),
# and 64 whole chat prompts to 329-440 (tests/test_bench_stats.py checks the character bounds).
QUOTE_PASSAGE_TOKENS = 300
_CODE_CHARS_PER_TOKEN = 3.6
_TEXT_CHARS_PER_TOKEN = 4.2

_NOUNS = ("order", "invoice", "sensor", "player", "ticket", "shipment", "account", "recipe", "booking", "package",
          "device", "student", "vehicle", "report", "message", "session", "record", "job", "task", "user")
_FIELDS = ("price", "weight", "count", "score", "level", "size", "age", "total", "rate", "amount", "width", "height",
           "speed", "limit", "value", "duration", "distance", "quantity")
_LABELS = ("name", "city", "status", "owner", "color", "region", "category", "title", "code", "group")
_NAMES = ("Alice", "Bruno", "Chen", "Dana", "Emeka", "Farah", "Goran", "Hana", "Ivan", "Jonas", "Keiko", "Lena",
          "Marco", "Nadia", "Omar", "Priya", "Quinn", "Rosa", "Sami", "Tara")
_PLACES = ("the north warehouse", "the harbour office", "the main library", "the old station", "the river depot",
           "the hill clinic", "the market hall", "the east workshop", "the city archive", "the school garden")
_THINGS = ("boxes of tiles", "spare wheels", "printed maps", "glass jars", "paper forms", "copper wires",
           "wooden chairs", "seed packets", "blue lamps", "water filters", "winter coats", "old radios")
_DAYS = ("Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday")


def _code_functions(rng: random.Random) -> list[tuple[str, str]]:
    """(name, source) of small Python functions over one record type, names drawn from the word lists."""
    noun = rng.choice(_NOUNS)
    f1, f2 = rng.sample(_FIELDS, 2)
    label = rng.choice(_LABELS)
    n1, n2 = rng.randint(2, 99), rng.randint(2, 9)
    items = f"{noun}s"
    funcs = [
        (f"total_{f1}", f"def total_{f1}({items}):\n"
                        f"    total = 0\n"
                        f"    for {noun} in {items}:\n"
                        f"        total += {noun}[\"{f1}\"]\n"
                        f"    return total\n"),
        (f"find_{noun}", f"def find_{noun}({items}, {label}):\n"
                         f"    for {noun} in {items}:\n"
                         f"        if {noun}[\"{label}\"] == {label}:\n"
                         f"            return {noun}\n"
                         f"    return None\n"),
        (f"filter_by_{f2}", f"def filter_by_{f2}({items}, min_{f2}={n1}):\n"
                            f"    result = []\n"
                            f"    for {noun} in {items}:\n"
                            f"        if {noun}[\"{f2}\"] >= min_{f2}:\n"
                            f"            result.append({noun})\n"
                            f"    return result\n"),
        (f"group_by_{label}", f"def group_by_{label}({items}):\n"
                              f"    groups = {{}}\n"
                              f"    for {noun} in {items}:\n"
                              f"        key = {noun}[\"{label}\"]\n"
                              f"        groups.setdefault(key, []).append({noun})\n"
                              f"    return groups\n"),
        (f"average_{f1}", f"def average_{f1}({items}):\n"
                          f"    if not {items}:\n"
                          f"        return 0.0\n"
                          f"    return sum({noun}[\"{f1}\"] for {noun} in {items}) / len({items})\n"),
        (f"top_{items}", f"def top_{items}({items}, n={n2}):\n"
                         f"    ranked = sorted({items}, key=lambda {noun}: {noun}[\"{f2}\"], reverse=True)\n"
                         f"    return ranked[:n]\n"),
        (f"validate_{noun}", f"def validate_{noun}({noun}):\n"
                             f"    errors = []\n"
                             f"    if not {noun}.get(\"{label}\"):\n"
                             f"        errors.append(\"missing {label}\")\n"
                             f"    if {noun}.get(\"{f1}\", 0) < 0:\n"
                             f"        errors.append(\"negative {f1}\")\n"
                             f"    if {noun}.get(\"{f2}\", 0) > {n1 * 10}:\n"
                             f"        errors.append(\"{f2} too large\")\n"
                             f"    return errors\n"),
        (f"format_{noun}", f"def format_{noun}({noun}):\n"
                           f"    return f\"{{{noun}['{label}']}}: {f1}={{{noun}['{f1}']}}, "
                           f"{f2}={{{noun}['{f2}']}}\"\n"),
        (f"scale_{f1}", f"def scale_{f1}({items}, factor):\n"
                        f"    for {noun} in {items}:\n"
                        f"        {noun}[\"{f1}\"] = round({noun}[\"{f1}\"] * factor, {n2 % 4})\n"
                        f"    return {items}\n"),
    ]
    rng.shuffle(funcs)
    return funcs


def _code_passage(rng: random.Random, target_tokens: int) -> tuple[str, list[str]]:
    """Python source of ~target_tokens tokens, and the names of its functions (in order)."""
    funcs = _code_functions(rng)
    chosen, chars = [], 0
    for name, src in funcs:
        if chars / _CODE_CHARS_PER_TOKEN >= target_tokens:
            break
        chosen.append((name, src))
        chars += len(src) + 1
    return "\n".join(src for _, src in chosen).rstrip("\n"), [n for n, _ in chosen]


def _text_sentences(rng: random.Random) -> list[str]:
    name = rng.choice(_NAMES)
    others = rng.sample([n for n in _NAMES if n != name], 3)
    place, place2 = rng.sample(_PLACES, 2)
    templates = [
        "On {day} {who} moved {n} {thing} from {place} to {place2}.",
        "{who} counted the {thing} at {place} and found {n} of them.",
        "The {thing} that {who} ordered on {day} arrived at {place} in {m} crates.",
        "{who} asked {who2} to check the {thing} before {day}.",
        "By {day} there were {n} {thing} left at {place2}, and {who} wrote that down.",
        "{who} and {who2} spent {m} hours sorting the {thing} at {place}.",
        "A note from {who} says the {thing} at {place2} must be moved by {day}.",
        "{who2} repaired {m} of the {thing} and sent them back to {place}.",
    ]
    out = []
    for _ in range(40):
        t = rng.choice(templates)
        out.append(t.format(day=rng.choice(_DAYS), who=rng.choice([name, *others]), who2=rng.choice(others),
                            n=rng.randint(3, 400), m=rng.randint(2, 12), thing=rng.choice(_THINGS),
                            place=place, place2=place2))
    return out


def _text_passage(rng: random.Random, target_tokens: int) -> str:
    sentences, chosen, chars = _text_sentences(rng), [], 0
    for s in sentences:
        if chars / _TEXT_CHARS_PER_TOKEN >= target_tokens:
            break
        chosen.append(s)
        chars += len(s) + 1
    # paragraphs of 4 sentences
    return "\n\n".join(" ".join(chosen[i:i + 4]) for i in range(0, len(chosen), 4))


def quote_request(seed: int, index: int, target_tokens: int = QUOTE_PASSAGE_TOKENS) -> tuple[list[dict], str, int]:
    """(messages, kind, estimated prompt tokens) of one quote request: a passage (code or text) and an instruction
    to repeat it, edit it (rename / replace a word, everything else unchanged) or extract from it."""
    rng = random.Random(seed * 1_000_003 + index)
    code = rng.random() < 0.5
    task = rng.choice(("repeat", "repeat", "edit", "extract"))
    if code:
        passage, names = _code_passage(rng, target_tokens)
        block = f"```python\n{passage}\n```"
        if task == "repeat":
            text = f"Repeat the following code exactly as it is, with no changes and no comments.\n\n{block}"
        elif task == "edit":
            old = names[0]
            new = old + "_v2"
            text = (f"In the following code, rename the function `{old}` to `{new}`. Reply with the complete code, "
                    f"everything else unchanged.\n\n{block}")
        else:
            text = (f"Copy the functions `{names[1]}` and `{names[-1]}` from the following code, unchanged.\n\n"
                    f"{block}")
        est = len(passage) / _CODE_CHARS_PER_TOKEN
    else:
        passage = _text_passage(rng, target_tokens)
        if task == "repeat":
            text = f"Repeat the following text exactly, word for word.\n\n{passage}"
        elif task == "edit":
            thing = next(t for t in _THINGS if t in passage)
            text = (f"Rewrite the following text with every \"{thing}\" replaced by \"{thing.split()[-1]}\". Output "
                    f"the whole text and nothing else.\n\n{passage}")
        else:
            who = next(n for n in _NAMES if n in passage)
            text = (f"Copy, word for word and one per line, every sentence of the following text that mentions "
                    f"{who}.\n\n{passage}")
        est = len(passage) / _TEXT_CHARS_PER_TOKEN
    est += len(text.split(passage)[0].split()) * 1.3 + 30      # the instruction and the chat template
    return [{"role": "user", "content": text}], f"{'code' if code else 'text'}-{task}", round(est)


def quote_workload(num_requests: int = 32, output_len: int = 128, seed: int = 0) -> Workload:
    """Requests whose answer copies from the prompt (speculative decoding's case): a ~300-token passage of Python
    code or prose, each request its own (seeded by seed and its index), with an instruction to repeat it, edit
    it or extract from it; sent as a chat, max_tokens output_len."""
    if num_requests < 1 or output_len < 1:
        raise ValueError("--num-requests and --output-len must be >= 1")
    specs = []
    for i in range(num_requests):
        messages, kind, est = quote_request(seed, i)
        specs.append(RequestSpec(i, messages=messages, max_tokens=output_len, prompt_tokens_est=est, group=kind))
    return Workload("quote", specs, dict(num_requests=num_requests, output_len=output_len, seed=seed,
                                         passage_tokens=QUOTE_PASSAGE_TOKENS))


def write_jsonl(workload: Workload, path: str | Path, num_requests: int | None = None) -> int:
    """The workload's requests as a `--workload jsonl --dataset` file: one {"messages"|"prompt", "max_tokens"} per
    line. Returns the number of lines written."""
    path = Path(path)
    if path.parent != Path(""):
        path.parent.mkdir(parents=True, exist_ok=True)
    n = 0
    with path.open("w") as f:
        for spec in workload.take(num_requests or workload.default_num_requests()):
            line: dict = {"messages": spec.messages} if spec.messages is not None else {"prompt": spec.prompt}
            if spec.max_tokens is not None:
                line["max_tokens"] = spec.max_tokens
            f.write(json.dumps(line) + "\n")
            n += 1
    return n
