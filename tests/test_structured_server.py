"""Structured outputs and tool calling end to end: the real server through the official openai client.

Most tests run on the embedded SmolLM2 (a real model: its answers must validate, not just parse); the
preemption and "auto" cases run on the tiny random-weight model, whose server starts in a second.
"""
from __future__ import annotations

import asyncio
import json
import pickle
import random
from typing import Literal

import jsonschema
import openai
import pytest
import torch
from pydantic import BaseModel, Field

from kvflow.config import EngineConfig
from kvflow.runner.sampler import Sampler
from kvflow.runner.step import ModelStep, SamplingRow, StepBatch
from kvflow.sampling_params import SamplingParams
from kvflow.server.testing import ServerThread
from kvflow.structured_output import GrammarCompiler, StructuredSpec
from test_structured_output import gen_object_schema
from test_tool_calls import TOOLS, WEATHER
from tiny_models import make_tiny_hf_model

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 16},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}
PARAMS = {t["function"]["name"]: t["function"].get("parameters", {"type": "object", "additionalProperties": False})
          for t in TOOLS}


@pytest.fixture(scope="module")
def smol_server():
    config = EngineConfig(dtype="float32", max_model_len=1024, kv_cache_memory="256MiB", max_num_seqs=64,
                          served_model_name="smol")
    with ServerThread(config) as s:
        yield s


@pytest.fixture
def client(smol_server):
    return openai.OpenAI(base_url=smol_server.base_url, api_key="x", max_retries=0, timeout=300)


def ask(client, content="Describe a person as JSON.", **kw):
    kw.setdefault("max_tokens", 200)
    return client.chat.completions.create(model="smol", messages=[{"role": "user", "content": content}], **kw)


def bad_request(call) -> dict:
    with pytest.raises(openai.BadRequestError) as e:
        call()
    return e.value.body


# ---------------------------------------------------------------------------------------------- the goals
@pytest.mark.slow
def test_fifty_generated_schemas_at_temperature_1_all_validate(smol_server):
    """50 generated schemas (nested objects, arrays, enums, bounded numbers, optional fields) at once."""
    rng = random.Random(16)
    schemas = [gen_object_schema(rng) for _ in range(50)]
    client = openai.AsyncOpenAI(base_url=smol_server.base_url, api_key="x", max_retries=0, timeout=600)

    # seeded: JSON numbers have no length limit, and at temperature 1 a small model can write digits for a
    # long time; seeds make the run the same every time on a machine (room: 900 tokens)
    async def one(i, schema):
        return await client.chat.completions.create(
            model="smol", messages=[{"role": "user", "content": "Fill in this JSON object."}], temperature=1.0,
            max_tokens=900, seed=i,
            response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": schema}})

    async def all_of_them():
        try:
            return await asyncio.gather(*(one(i, s) for i, s in enumerate(schemas)))
        finally:
            await client.close()

    for schema, r in zip(schemas, asyncio.run(all_of_them())):
        choice = r.choices[0]
        assert choice.finish_reason == "stop", (schema, choice.message.content)
        jsonschema.validate(json.loads(choice.message.content), schema)


@pytest.mark.slow
def test_parse_returns_a_pydantic_object(client):
    class Pet(BaseModel):
        name: str = Field(max_length=12)
        kind: Literal["cat", "dog", "bird"]
        legs: int = Field(ge=0, le=4)

    r = client.chat.completions.parse(model="smol", messages=[{"role": "user", "content": "Invent a pet."}],
                                      response_format=Pet, max_tokens=100, temperature=1.0)
    assert isinstance(r.choices[0].message.parsed, Pet)


@pytest.mark.slow
@pytest.mark.parametrize("stream", [False, True])
def test_required_tool_choice_arguments_validate(client, stream):
    kw = dict(tools=TOOLS, tool_choice="required", temperature=1.0, max_tokens=200)
    content = "What is the weather in Paris?"
    if not stream:
        choice = ask(client, content, **kw).choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        calls = [(c.id, c.function.name, c.function.arguments) for c in choice.message.tool_calls]
    else:
        calls, finish = {}, None
        for chunk in ask(client, content, stream=True, **kw):
            delta = chunk.choices[0].delta
            assert not delta.content
            for tc in delta.tool_calls or []:
                if tc.id:
                    calls[tc.index] = [tc.id, tc.function.name, ""]
                calls[tc.index][2] += tc.function.arguments or ""
            finish = chunk.choices[0].finish_reason or finish
        assert finish == "tool_calls"
        calls = [calls[i] for i in range(len(calls))]
    assert calls
    for call_id, name, arguments in calls:
        assert call_id.startswith("call_")
        jsonschema.validate(json.loads(arguments), PARAMS[name])


@pytest.mark.slow
def test_named_tool_then_the_conversation_goes_on_with_a_tool_message(client):
    choice = ask(client, "Weather in Oslo?", tools=TOOLS, temperature=1.0,
                 tool_choice={"type": "function", "function": {"name": "get_weather"}}).choices[0]
    (call,) = choice.message.tool_calls
    assert choice.finish_reason == "tool_calls" and call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER)
    follow = client.chat.completions.create(model="smol", max_tokens=8, tools=TOOLS, tool_choice="none", messages=[
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 3}'}])
    assert follow.choices[0].message.content is not None and follow.choices[0].message.tool_calls is None


@pytest.mark.slow
def test_n_choices_and_a_stop_string_with_a_schema(client):
    r = ask(client, n=3, temperature=1.0, extra_body={"guided_json": PERSON})
    assert len(r.choices) == 3
    for c in r.choices:
        assert c.finish_reason == "stop"
        jsonschema.validate(json.loads(c.message.content), PERSON)
    # the grammar writes "name" before "age": a stop string ends the JSON there, as the client asked
    r = ask(client, n=2, temperature=1.0, stop=['"age"'], extra_body={"guided_json": PERSON})
    for c in r.choices:
        assert c.finish_reason == "stop" and c.message.content.startswith('{"name": ')
        assert '"age"' not in c.message.content


@pytest.mark.slow
def test_json_object_and_vllm_extras_on_chat_and_completions(client):
    # seeded: an unseeded draw at temperature 1 may write one string until max_tokens (then it is no JSON)
    answer = ask(client, temperature=1.0, seed=0, response_format={"type": "json_object"}).choices[0]
    assert answer.finish_reason == "stop", answer.message.content
    obj = json.loads(answer.message.content)
    assert isinstance(obj, dict)
    choice = ask(client, "Capital of France?", extra_body={"structured_outputs": {"choice": ["Paris", "Rome"]}})
    assert choice.choices[0].message.content in ("Paris", "Rome")
    text = client.completions.create(model="smol", prompt="Phone:", max_tokens=30, temperature=1.0,
                                     extra_body={"guided_regex": r"\d{3}-\d{4}"}).choices[0].text
    assert len(text) == 8 and text[3] == "-"
    text = client.completions.create(model="smol", prompt="Answer:", max_tokens=10,
                                     extra_body={"guided_grammar": 'root ::= "yes" | "no"'}).choices[0].text
    assert text in ("yes", "no")
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model="smol", prompt="Person:", max_tokens=200, stream=True, extra_body={"guided_json": PERSON}) if c.choices)
    jsonschema.validate(json.loads(streamed), PERSON)


@pytest.mark.parametrize("kw, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "if": {}}}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
     "response_format.json_schema.schema"),
    ({"extra_body": {"guided_regex": "(unclosed"}}, "guided_regex"),
    ({"extra_body": {"structured_outputs": {"grammar": "root ::= ??"}}}, "structured_outputs.grammar"),
    ({"extra_body": {"guided_json": "{not json"}}, "guided_json"),
    ({"extra_body": {"guided_regex": "a", "guided_choice": ["b"]}}, "guided_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "auto"}, "tool_choice"),       # this server has no --tool-call-parser
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format"),
])
def test_invalid_constraints_are_400_naming_the_field(client, kw, param):
    body = bad_request(lambda: ask(client, max_tokens=5, **kw))
    assert body["param"] == param and body["type"] == "invalid_request_error", body


@pytest.mark.slow
def test_one_compiler_per_server_caches_each_schema(client, smol_server):
    schema = {"type": "object", "properties": {"cached": {"type": "boolean"}}, "required": ["cached"]}
    serving, sizes = smol_server.app.state.serving, []
    for _ in range(2):
        ask(client, max_tokens=20, extra_body={"guided_json": schema})
        sizes.append(serving.preparer._grammar_compiler.cache_info()["size"])
    assert sizes[0] == sizes[1] and StructuredSpec("json_schema", json.dumps(schema)) in serving.preparer._grammar_compiler._cache


# ---------------------------------------------------------------------------------------------- tiny model
@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return make_tiny_hf_model(tmp_path_factory.mktemp("tiny-structured"), family="llama", seed=0)


def tiny_config(path, **kw) -> EngineConfig:
    return EngineConfig(**{**dict(model=str(path), dtype="float32", max_model_len=512, kv_cache_memory="32MiB",
                                  served_model_name="tiny"), **kw})


@pytest.mark.slow
def test_preemption_keeps_the_matcher_in_step(tiny_path):
    """A KV cache of 10 blocks for 8 constrained requests of ~60 tokens: requests are preempted and
    recomputed mid-JSON; every answer still validates."""
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 999},
                                               "s": {"type": "string", "maxLength": 6},
                                               "t": {"type": "array", "items": {"enum": ["a", "bb", 3]},
                                                     "minItems": 1, "maxItems": 3}},
              "required": ["n", "s", "t"], "additionalProperties": False}
    with ServerThread(tiny_config(tiny_path, max_model_len=128, kv_cache_memory=10 * 16 * 512,
                                  max_num_batched_tokens=128)) as server:
        client = openai.AsyncOpenAI(base_url=server.base_url, api_key="x", max_retries=0, timeout=300)

        async def run():
            try:
                return await asyncio.gather(*(client.completions.create(
                    model="tiny", prompt=f"x{i}", max_tokens=100, temperature=1.0, seed=i,
                    extra_body={"guided_json": schema}) for i in range(8)))
            finally:
                await client.close()

        results = asyncio.run(run())
        assert server.core("counters")["num_preemptions"] > 0
    for r in results:
        assert r.choices[0].finish_reason == "stop", r.choices[0].text
        jsonschema.validate(json.loads(r.choices[0].text), schema)


@pytest.mark.slow
def test_auto_tool_choice_with_a_parser(tiny_path):
    with ServerThread(tiny_config(tiny_path), enable_auto_tool_choice=True, tool_call_parser="hermes") as server:
        client = openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0)
        r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                           tools=TOOLS, tool_choice="auto", max_tokens=8, temperature=0)
        # random weights write no <tool_call>: the text stays content
        assert r.choices[0].message.tool_calls is None and r.choices[0].finish_reason == "length"
        chunks = list(client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                                     tools=TOOLS, tool_choice="auto", max_tokens=8, temperature=0,
                                                     stream=True))
        assert "".join(c.choices[0].delta.content or "" for c in chunks) == r.choices[0].message.content


def test_offline_llm_compiles_structured_outputs(tiny_path):
    from kvflow import LLM
    from kvflow.core.messages import AddRequest
    from kvflow.errors import InvalidRequestError

    with LLM(str(tiny_path), dtype="float32", max_model_len=256, kv_cache_memory="8MiB") as llm:
        params = SamplingParams(n=3, temperature=1.0, seed=1, max_tokens=40,
                                structured_outputs={"regex": r"[a-c]{2}-\d{2}"})
        (out,) = llm.generate(["x"], params)
        assert [c.finish_reason for c in out.outputs] == ["stop"] * 3
        assert all(len(c.text) == 5 and c.text[2] == "-" for c in out.outputs), [c.text for c in out.outputs]
        with pytest.raises(InvalidRequestError) as e:     # the core never compiles: a frontend must
            llm.engine.add_request(AddRequest("raw", [1, 2], SamplingParams(structured_outputs={"regex": "a"})))
        assert e.value.param == "structured_outputs"


# ---------------------------------------------------------------------------------------------- pieces
def test_sampler_masks_constrained_rows_only(smollm2_tokenizer):
    compiler = GrammarCompiler(smollm2_tokenizer)
    compiled = compiler.compile(StructuredSpec("choice", '["yes", "no"]'))

    def allowed(token: int) -> bool:   # the first token of "yes" or "no", however it is split
        piece = smollm2_tokenizer.decode([token])
        return bool(piece) and ("yes".startswith(piece) or "no".startswith(piece))

    logits = torch.randn(3, smollm2_tokenizer.vocab_size + 64, generator=torch.Generator().manual_seed(0))
    greedy = SamplingParams(temperature=0.0)
    rows = [SamplingRow(greedy, [1], 1, (), None),
            SamplingRow(SamplingParams(temperature=1.0), [1], 1, (), None, compiled.matcher()),
            SamplingRow(greedy, [1], 1, (), None, compiled.matcher())]
    free = logits[0].argmax().item()
    tokens = Sampler(torch.device("cpu"))(logits.clone(), rows).token_ids
    assert tokens[0] == free and allowed(tokens[1]) and allowed(tokens[2])
    compiler.close()


def test_tensor_parallel_ranks_get_only_the_step_batch():
    """Matchers live on rank 0's SamplingRows; what is broadcast to the other ranks is the plain StepBatch."""
    from kvflow.executor.tensor_parallel import TensorParallelExecutor

    batch = StepBatch(1, [5], [3], [1], [[0]], [True])
    step = ModelStep(batch, [SamplingRow(SamplingParams(), [1, 2, 3, 5], 3, (), None, object())])
    sent = []
    executor = TensorParallelExecutor.__new__(TensorParallelExecutor)
    executor.failed, executor.workers = None, []
    executor.tp = type("TP", (), {"broadcast_from_first": lambda self, obj: sent.append(pickle.dumps(obj))})()
    executor.runner = type("Runner", (), {"execute": lambda self, s: "sampled"})()
    assert executor.execute(step) == "sampled"
    assert pickle.loads(sent[0])[1] == batch
