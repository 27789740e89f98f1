"""Structured outputs (kvflow.structured_output) on the embedded SmolLM2 tokenizer and real llguidance.

The decode loops stand in for the model with random logits sampled at temperature 1: whatever the
model would prefer, every masked sample must still parse and validate."""
import asyncio
import json
import random
import re
import threading

import jsonschema
import pytest
import torch

from kvflow.errors import InvalidRequestError
from kvflow.structured_output import (GrammarCompiler, StructuredSpec, allocate_bitmask, apply_structured_masks,
                                      fill_bitmask, spec_from_request, unpack_bitmask)

MAX_TOKENS = 400


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """Two shared cores: torch's second thread spin-waits on a busy machine and makes every op slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def compiler(smollm2_tokenizer):
    c = GrammarCompiler(smollm2_tokenizer)
    yield c
    c.close()


# ---------------------------------------------------------------------------------------------- specs
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
SCHEMA_TEXT = json.dumps(SCHEMA)


@pytest.mark.parametrize("body, kind, payload, param", [
    ({}, None, None, None),
    ({"response_format": {"type": "text"}}, None, None, None),
    ({"response_format": {"type": "json_object"}}, "json_object", "", "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA, "strict": True}}},
     "json_schema", SCHEMA_TEXT, "response_format.json_schema.schema"),
    ({"structured_outputs": {"json": SCHEMA}}, "json_schema", SCHEMA_TEXT, "structured_outputs.json"),
    ({"structured_outputs": {"json": SCHEMA_TEXT}}, "json_schema", SCHEMA_TEXT, "structured_outputs.json"),
    ({"structured_outputs": {"regex": "[0-9]+"}}, "regex", "[0-9]+", "structured_outputs.regex"),
    ({"structured_outputs": {"choice": ["yes", "no"]}}, "choice", '["yes", "no"]', "structured_outputs.choice"),
    ({"structured_outputs": {"grammar": 'start: "a"'}}, "grammar", 'start: "a"', "structured_outputs.grammar"),
    ({"structured_outputs": {"json_object": True}}, "json_object", "", "structured_outputs.json_object"),
    ({"structured_outputs": {"json": None, "regex": "a"}}, "regex", "a", "structured_outputs.regex"),
    ({"guided_json": SCHEMA}, "json_schema", SCHEMA_TEXT, "guided_json"),
    ({"guided_json": SCHEMA_TEXT}, "json_schema", SCHEMA_TEXT, "guided_json"),
    ({"guided_regex": "a|b"}, "regex", "a|b", "guided_regex"),
    ({"guided_choice": ["x"]}, "choice", '["x"]', "guided_choice"),
    ({"guided_grammar": 'root ::= "a"'}, "grammar", 'root ::= "a"', "guided_grammar"),
    ({"response_format": {"type": "text"}, "guided_regex": "a"}, "regex", "a", "guided_regex"),
])
def test_spec_from_every_request_form(body, kind, payload, param):
    spec = spec_from_request(body)
    if kind is None:
        assert spec is None
    else:
        assert (spec.kind, spec.payload, spec.param) == (kind, payload, param)


def test_spec_key_ignores_param_and_keeps_property_order():
    a = spec_from_request({"guided_json": SCHEMA})
    b = spec_from_request({"response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": SCHEMA}}})
    assert a == b and hash(a) == hash(b) and a.param != b.param
    reordered = spec_from_request({"guided_json": {"properties": {"z": {}, "a": {}}, "type": "object"}})
    assert reordered.payload.index('"z"') < reordered.payload.index('"a"')   # the grammar writes z first


@pytest.mark.parametrize("body, param", [
    ({"response_format": "json"}, "response_format"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": "{bad"}}},
     "response_format.json_schema.schema"),
    ({"structured_outputs": {"json": [1, 2]}}, "structured_outputs.json"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
    ({"guided_choice": ["a", 1]}, "guided_choice"),
    ({"guided_regex": ""}, "guided_regex"),
    ({"guided_json": "not json"}, "guided_json"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex"),
])
def test_malformed_requests_name_the_field(body, param):
    with pytest.raises(InvalidRequestError) as e:
        spec_from_request(body)
    assert e.value.param == param and e.value.message


@pytest.mark.parametrize("body, param, needle", [
    ({"guided_json": {"type": "foo"}}, "guided_json", "foo"),
    ({"guided_json": {"type": "object", "if": {}, "then": {}}}, "guided_json", "if"),   # unsupported keyword
    ({"guided_json": {"properties": {"a": {"$ref": "#/$defs/none"}}}}, "guided_json", "none"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"minimum": "x"}}}},
     "response_format.json_schema.schema", ""),
    ({"guided_regex": "[a-"}, "guided_regex", "regex"),
    ({"structured_outputs": {"regex": "(?<=a)b"}}, "structured_outputs.regex", "look"),
    ({"guided_grammar": "start: a b ::="}, "guided_grammar", ""),
    ({"structured_outputs": {"grammar": "root ::= undefined_rule"}}, "structured_outputs.grammar", ""),
])
def test_compile_errors_name_the_field(compiler, body, param, needle):
    spec = spec_from_request(body)
    for _ in range(2):   # the second time from the cache, same error and param
        with pytest.raises(InvalidRequestError) as e:
            compiler.compile(spec)
        assert e.value.param == param and needle in e.value.message


def test_cached_error_takes_the_asking_requests_param(compiler):
    with pytest.raises(InvalidRequestError):
        compiler.compile(spec_from_request({"guided_json": {"type": "nope"}}))
    with pytest.raises(InvalidRequestError) as e:
        compiler.compile(spec_from_request({"structured_outputs": {"json": {"type": "nope"}}}))
    assert e.value.param == "structured_outputs.json"


def test_compile_cache_lru_threads_and_async(smollm2_tokenizer, compiler):
    small = GrammarCompiler(smollm2_tokenizer, cache_size=2, ll_tokenizer=compiler.ll_tokenizer)
    specs = [StructuredSpec("regex", f"[0-9]{{{i}}}") for i in range(1, 4)]
    first = small.compile(specs[0])
    assert small.compile(StructuredSpec("regex", "[0-9]{1}", "other")) is first      # cache hit
    small.compile(specs[1]), small.compile(specs[0]), small.compile(specs[2])           # evicts specs[1]
    assert small.cache_info() == {"size": 2, "max_size": 2} and small.compile(specs[0]) is first
    # many threads asking for one new schema share a single compile
    spec = StructuredSpec("json_schema", json.dumps({"type": "array", "items": {"type": "integer"}}))
    results = [small.submit(spec) for _ in range(8)]
    assert len({id(f.result()) for f in results}) == 1
    assert asyncio.run(small.compile_async(spec)) is results[0].result()
    with pytest.raises(InvalidRequestError):
        asyncio.run(small.compile_async(StructuredSpec("regex", "(", "guided_regex")))
    small.close()


# ---------------------------------------------------------------------------------------------- decoding
def gen_schema(rng: random.Random, depth: int = 0) -> dict:
    """A random JSON schema with bounded size: nested objects, arrays, enums, bounded numbers, optionals."""
    kinds = ["string", "integer", "number", "boolean", "enum", "const"] + (["object", "array", "object"] if depth < 2 else [])
    kind = rng.choice(kinds)
    if kind == "string":
        s = {"type": "string", "maxLength": rng.randint(1, 10)}
        if rng.random() < 0.3:
            s = {"type": "string", "pattern": "^[a-z]{1,6}$"} if rng.random() < 0.5 else {**s, "minLength": 1}
        return s
    if kind == "integer":
        lo = rng.randint(-1000, 1000)
        return {"type": "integer", "minimum": lo, "maximum": lo + rng.randint(0, 5000)}
    if kind == "number":
        s = {"type": "number", "minimum": rng.choice([-1e3, -2.5, 0]), "maximum": rng.choice([0.5, 10, 1e6])}
        return {**s, "exclusiveMaximum": s.pop("maximum")} if rng.random() < 0.3 else s
    if kind == "boolean":
        return {"type": "boolean"}
    if kind == "enum":
        return {"enum": rng.sample(["red", "green", "blue", 7, 2.5, None, True, "naïve"], rng.randint(1, 4))}
    if kind == "const":
        return {"const": rng.choice(["v1", 42, False])}
    if kind == "array":
        return {"type": "array", "items": gen_schema(rng, depth + 1),
                "minItems": rng.randint(0, 1), "maxItems": rng.randint(1, 3)}
    props = {f"{rng.choice(['id', 'name', 'value', 'tags', 'x'])}_{i}": gen_schema(rng, depth + 1)
             for i in range(rng.randint(1, 4))}
    return {"type": "object", "properties": props, "additionalProperties": False,
            "required": sorted(rng.sample(sorted(props), rng.randint(0, len(props))))}


def gen_object_schema(rng: random.Random) -> dict:
    while (schema := gen_schema(rng)).get("type") != "object":
        pass
    return schema


def sample_constrained(tokenizer, matchers, seed, pad_vocab=128, extra_rows=0):
    """Decode all matchers in one batch (plus unconstrained rows) from random logits at temperature 1."""
    gen = torch.Generator().manual_seed(seed)
    outs = {id(m): [] for m in matchers}
    vocab = tokenizer.vocab_size + pad_vocab     # the model's padded vocabulary
    for _ in range(MAX_TOKENS):
        live = [m for m in matchers if not m.is_terminated()]
        if not live:
            break
        rows = live + [None] * extra_rows
        logits = torch.randn(len(rows), vocab, generator=gen)
        before = logits[len(live):].clone()
        apply_structured_masks(logits, rows)
        assert torch.equal(logits[len(live):], before)                          # unconstrained rows untouched
        assert torch.isinf(logits[: len(live), tokenizer.vocab_size:]).all()    # padded vocab never sampled
        tokens = torch.multinomial(torch.softmax(logits[: len(live)], -1), 1, generator=gen).flatten().tolist()
        for m, t in zip(live, tokens):
            assert m.accept(t), m.error
            outs[id(m)].append(t)
    return [outs[id(m)] for m in matchers]


@pytest.mark.slow
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_fifty_generated_schemas_always_validate(compiler, smollm2_tokenizer, seed):
    rng = random.Random(1234 + seed)
    schemas = [gen_object_schema(rng) for _ in range(50)]
    matchers = [compiler.compile(spec_from_request({"guided_json": s})).matcher() for s in schemas]
    outs = sample_constrained(smollm2_tokenizer, matchers, seed=seed, extra_rows=2)
    for schema, m, out in zip(schemas, matchers, outs):
        assert m.is_terminated(), (schema, smollm2_tokenizer.decode(out))
        text = smollm2_tokenizer.decode(out)
        jsonschema.validate(json.loads(text), schema)


@pytest.mark.parametrize("body, check", [
    ({"guided_regex": r"\d{3}-[a-z]{2,4}"}, lambda t: re.fullmatch(r"\d{3}-[a-z]{2,4}", t)),
    ({"guided_choice": ["Paris", "London", "New York"]}, lambda t: t in ("Paris", "London", "New York")),
    ({"guided_grammar": 'start: "(" NUM ("+" NUM)* ")"\nNUM: /[0-9]{1,3}/'},
     lambda t: re.fullmatch(r"\(\d{1,3}(\+\d{1,3})*\)", t)),
    ({"structured_outputs": {"grammar": 'root ::= "yes" | "no" | "maybe " [0-9]'}},
     lambda t: re.fullmatch(r"yes|no|maybe \d", t)),
])
def test_other_kinds_decode_to_their_language(compiler, smollm2_tokenizer, body, check):
    compiled = compiler.compile(spec_from_request(body))
    for seed in range(3):
        m = compiled.matcher()
        out, = sample_constrained(smollm2_tokenizer, [m], seed=seed)
        text = smollm2_tokenizer.decode(out)
        assert m.is_terminated() and check(text), text


def test_json_object_takes_any_object_and_only_objects(compiler, smollm2_tokenizer):
    """Free-form JSON runs long on random logits, so feed it text instead."""
    compiled = compiler.compile(spec_from_request({"response_format": {"type": "json_object"}}))
    m = compiled.matcher()
    assert m.accept_tokens(smollm2_tokenizer.encode('{"a": [1, {"b": null}], "c": "d"}', add_special_tokens=False))
    assert m.is_terminated()
    for text in ("[1]", '"x"', "{'a': 1}"):
        assert not compiled.matcher().accept_tokens(smollm2_tokenizer.encode(text, add_special_tokens=False))


def test_eos_only_when_complete_and_terminates(compiler, smollm2_tokenizer):
    eos = sorted(smollm2_tokenizer.eos_token_ids)
    assert compiler.ll_tokenizer.eos_tokens == eos
    m = compiler.compile(StructuredSpec("regex", "a+")).matcher()
    mask = allocate_bitmask(1, compiler.vocab_size)

    def allowed():
        m.fill_mask(mask, 0)
        return unpack_bitmask(mask, compiler.vocab_size)[0]

    assert not allowed()[eos].any() and not m.is_terminated()     # empty text does not match a+
    assert m.accept_tokens(smollm2_tokenizer.encode("aa", add_special_tokens=False))
    assert allowed()[eos].all() and m.is_complete() and not m.is_terminated()
    assert m.accept(eos[0]) and m.is_terminated()
    assert not m.accept(smollm2_tokenizer.encode("a", add_special_tokens=False)[0]) and m.error
    assert allowed().nonzero().flatten().tolist() == eos       # an errored matcher only lets the request end
    # a grammar that cannot go on allows only EOS and is terminated without it
    m = compiler.compile(StructuredSpec("choice", '["ok"]')).matcher()
    assert m.accept_tokens(smollm2_tokenizer.encode("ok", add_special_tokens=False)) and m.is_terminated()
    assert allowed().nonzero().flatten().tolist() == eos


def test_unconstrained_batch_is_untouched_and_mixed_rows_bit_identical(compiler):
    logits = torch.randn(4, compiler.vocab_size + 64, dtype=torch.bfloat16)
    ref, ptr = logits.clone(), logits.data_ptr()
    apply_structured_masks(logits, [None] * 4)
    assert torch.equal(logits.view(torch.int16), ref.view(torch.int16)) and logits.data_ptr() == ptr
    m = compiler.compile(StructuredSpec("regex", "[0-9]+")).matcher()
    apply_structured_masks(logits, [None, m, None, None])
    for row in (0, 2, 3):
        assert torch.equal(logits[row].view(torch.int16), ref[row].view(torch.int16))
    finite = torch.isfinite(logits[1]).nonzero().flatten()
    assert 0 < len(finite) < 1000 and torch.equal(logits[1, finite], ref[1, finite])


def test_matchers_fed_the_same_tokens_give_the_same_masks(compiler, smollm2_tokenizer):
    schema = gen_object_schema(random.Random(7))
    compiled = compiler.compile(spec_from_request({"guided_json": schema}))
    a = compiled.matcher()
    out, = sample_constrained(smollm2_tokenizer, [a], seed=3)
    cut = len(out) // 2
    masks = allocate_bitmask(4, compiler.vocab_size)

    b, c = compiled.matcher(), compiled.matcher()  # each sequence its own state, from one template
    assert b.accept_tokens(out[:cut]) and c.accept_tokens(out[:cut])
    fill_bitmask([b, c], masks)
    assert torch.equal(masks[0], masks[1])
    assert c.accept_tokens(out[cut:]) and c.is_terminated() and not b.is_terminated()   # c went on alone
    a.fill_mask(masks, 3)                          # a, terminated: only EOS is left
    compiled.matcher().fill_mask(masks, 2)          # a fresh one: the initial mask
    assert not torch.equal(masks[2], masks[3]) and torch.equal(masks[0], masks[1])


def test_compile_runs_beside_a_busy_thread(compiler):
    """A compile on the pool does not hold the GIL for its whole length: the 'step loop' keeps running."""
    ticks, stop = [0], threading.Event()

    def loop():
        while not stop.is_set():
            ticks[0] += 1

    t = threading.Thread(target=loop)
    t.start()
    big = {"type": "object", "properties": {f"p{i}": gen_object_schema(random.Random(i)) for i in range(30)}}
    compiler.submit(StructuredSpec("json_schema", json.dumps(big))).result()
    stop.set()
    t.join()
    assert ticks[0] > 0


def test_pydantic_schema_as_the_openai_client_sends_it(compiler, smollm2_tokenizer):
    """client.chat.completions.parse(response_format=Model) sends pydantic's schema made strict by the client:
    $defs, $ref, titles, anyOf for Optional, additionalProperties false, every property required."""
    from typing import Literal, Optional

    from openai.lib._pydantic import to_strict_json_schema
    from pydantic import BaseModel, Field

    class Step(BaseModel):
        explanation: str = Field(max_length=8)
        done: bool

    class Answer(BaseModel):
        kind: Literal["math", "other"]
        steps: list[Step] = Field(max_length=2)
        score: Optional[int] = Field(default=None, ge=0, le=10)

    schema = to_strict_json_schema(Answer)
    assert "$defs" in schema and schema["additionalProperties"] is False
    body = {"response_format": {"type": "json_schema",
                                "json_schema": {"name": "Answer", "schema": schema, "strict": True}}}
    compiled = compiler.compile(spec_from_request(body))
    matchers = [compiled.matcher() for _ in range(8)]
    for m, out in zip(matchers, sample_constrained(smollm2_tokenizer, matchers, seed=5)):
        assert m.is_terminated()
        Answer.model_validate_json(smollm2_tokenizer.decode(out))


def test_matchers_of_one_grammar_work_from_many_threads(compiler, smollm2_tokenizer):
    compiled = compiler.compile(StructuredSpec("regex", "[a-z]{2,5}[0-9]"))
    text_ids = smollm2_tokenizer.encode("abc7", add_special_tokens=False)
    errors = []

    def work():
        try:
            for _ in range(50):
                m = compiled.matcher()
                mask = allocate_bitmask(1, compiler.vocab_size)
                m.fill_mask(mask)
                assert m.accept_tokens(text_ids) and m.is_terminated()
        except Exception as e:   # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=work) for _ in range(4)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    assert not errors
