"""The OpenAI Agents SDK (`openai-agents`) end to end against the real server: an Agent with two function tools
runs through kvflow's /v1/chat/completions (OpenAIChatCompletionsModel) and /v1/responses (OpenAIResponsesModel),
unchanged, over HTTP: the model's call reaches the tool with arguments that follow its schema, the tool's result goes
back to the model, and the run ends with the model's text.

The tiny random model cannot choose a tool by itself, so each run forces one: ModelSettings(tool_choice=<tool name>)
makes kvflow's grammar write that call. The SDK then resets tool_choice (Agent.reset_tool_choice), and the second
turn runs under "auto", which the server reads with --tool-call-parser hermes (a random model writes no
<tool_call>, so that turn is the run's final text). A random model seldom ends a reply by itself, and the SDK takes a
Responses reply cut at max_output_tokens ("incomplete") for a failure: a logit_bias on the EOS (vLLM's field, sent
through ModelSettings.extra_body) ends each reply as soon as the grammar lets it, so that turn's text is empty."""
from __future__ import annotations

import asyncio
from typing import Annotated

import pytest

agents = pytest.importorskip("agents")      # the test extra pins it (pyproject.toml)

from agents import (Agent, ModelSettings, OpenAIChatCompletionsModel, OpenAIResponsesModel, RunConfig,  # noqa: E402
                    Runner, function_tool, set_tracing_disabled)
from agents.items import ToolCallItem, ToolCallOutputItem  # noqa: E402
from openai import AsyncOpenAI  # noqa: E402
from pydantic import Field  # noqa: E402

from kvflow.config import EngineConfig  # noqa: E402
from kvflow.server.testing import ServerThread  # noqa: E402
from tiny_models import make_tiny_hf_model  # noqa: E402

set_tracing_disabled(True)       # the SDK would export traces to OpenAI's platform


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = make_tiny_hf_model(tmp_path_factory.mktemp("tiny-agents"), family="llama", seed=3,
                              max_position_embeddings=2048)      # room for the tools' prompt and a second turn
    config = EngineConfig(model=str(path), dtype="float32", max_model_len=2048, kv_cache_memory="16MiB",
                          served_model_name="tiny", enforce_eager=True)
    with ServerThread(config, enable_auto_tool_choice=True, tool_call_parser="hermes") as s:
        yield s


CALLS: list[tuple[str, dict]] = []


# bounded arguments (the grammar follows the schema's bounds): a random model's call fits max_tokens
Small = Annotated[int, Field(ge=0, le=99)]


@function_tool
def add(a: Small, b: Small) -> int:
    """Add two integers."""
    CALLS.append(("add", {"a": a, "b": b}))
    return a + b


@function_tool
def get_weather(city: Annotated[str, Field(max_length=12)]) -> str:
    """The weather in a city now."""
    CALLS.append(("get_weather", {"city": city}))
    return f"sunny in {city}"


def run_agent(server, model_class, tool: str):
    eos = server.engine.tokenizer.eos_token_id
    client = AsyncOpenAI(base_url=server.base_url, api_key="x", max_retries=0, timeout=120)
    agent = Agent(name="assistant", instructions="Use the tools.", tools=[add, get_weather],
                  model=model_class(model="tiny", openai_client=client),
                  model_settings=ModelSettings(tool_choice=tool, temperature=0, max_tokens=64,
                                               extra_body={"logit_bias": {str(eos): 100}}))
    CALLS.clear()
    return asyncio.run(Runner.run(agent, "What is 2 + 3, and the weather in Oslo?", max_turns=4,
                                  run_config=RunConfig(tracing_disabled=True)))


@pytest.mark.slow
@pytest.mark.parametrize("model_class", [OpenAIChatCompletionsModel, OpenAIResponsesModel],
                         ids=["chat_completions", "responses"])
@pytest.mark.parametrize("tool", ["add", "get_weather"])
def test_an_agent_calls_a_tool_gets_its_result_and_answers(server, model_class, tool):
    result = run_agent(server, model_class, tool)
    assert [name for name, _ in CALLS] == [tool]         # the SDK ran the forced call's tool, once
    args = CALLS[0][1]
    if tool == "add":
        assert all(isinstance(args[k], int) and 0 <= args[k] <= 99 for k in ("a", "b"))
    else:
        assert isinstance(args["city"], str) and len(args["city"]) <= 12
    calls = [i for i in result.new_items if isinstance(i, ToolCallItem)]
    outputs = [i for i in result.new_items if isinstance(i, ToolCallOutputItem)]
    assert len(calls) == 1 and calls[0].raw_item.name == tool
    expected = args["a"] + args["b"] if tool == "add" else f"sunny in {args['city']}"
    assert len(outputs) == 1 and outputs[0].output == expected
    assert len(result.raw_responses) == 2                 # the call, then the answer after the tool's result
    assert isinstance(result.final_output, str)
    usage = result.context_wrapper.usage
    assert usage.requests == 2 and usage.input_tokens > 0 and usage.output_tokens > 0
