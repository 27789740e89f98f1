"""The server's seams without a model or HTTP: OpenAIServing's handlers over a fake engine, and the CLI
generated from the configs."""
from __future__ import annotations

import asyncio
import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvflow.async_engine import CompletionDelta, RequestFailedError
from kvflow.config import EngineConfig
from kvflow.core.request_validator import RequestValidator
from kvflow.errors import InvalidRequestError
from kvflow.server.common.errors import APIError
from kvflow.server.serving.protocol import ChatCompletionRequest, CompletionRequest, TokenizeRequest
from kvflow.server.serving.serving import OpenAIServing

REPO = Path(__file__).resolve().parents[1]


class FakeTokenizer:
    max_token_chars = 1          # a token per character
    chat_template = None

    def encode(self, text, add_special_tokens=True):
        return [ord(c) % 100 for c in text]

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(65 + i % 26) for i in ids)

    def id_to_piece(self, tid):
        return chr(65 + tid % 26)

    def apply_chat_template(self, messages, add_generation_prompt=True):
        return self.encode("".join(m["content"] for m in messages))


class FakeStream:
    """Emits token 1, then token 2 with finish_reason "length", per choice; or fails after the first."""

    def __init__(self, params, prompt, fail=False):
        self.params, self.num_prompt_tokens, self.fail = params, len(prompt), fail
        self.num_completion_tokens = self.num_cached_tokens = 0
        self.closed = False

    async def _deltas(self):
        for step, tid in enumerate((1, 2)):
            if self.fail and step == 1:
                raise RequestFailedError("the sampler failed on this request")
            for i in range(self.params.n):
                self.num_completion_tokens += 1
                yield CompletionDelta(i, chr(65 + tid), [tid], [{tid: -0.5, 3: -1.5}],
                                      "length" if step == 1 else None, None)

    def __aiter__(self):
        return self._deltas()

    def close(self):
        self.closed = True


class FakeEngine:
    tokenizer = FakeTokenizer()
    config = EngineConfig()
    model_path = Path("fake")
    served_model_name = "fake"
    max_model_len = 64
    vocab_size = 100
    is_accepting = True

    def __init__(self, refuse: Exception | None = None, fail=False):
        self.refuse, self.fail, self.streams = refuse, fail, []
        self.loras = {}

    def submit(self, request):
        if self.refuse:
            raise self.refuse
        RequestValidator(self.vocab_size, self.max_model_len).validate(   # the engine's check
            request.prompt_token_ids, request.params, request.pooling)
        self.streams.append(FakeStream(request.params, request.prompt_token_ids, self.fail))
        return self.streams[-1]


def run(coro):
    return asyncio.run(coro)


def sse(handler_call) -> list[str]:
    """The SSE events of a streamed response, read on the handler's own event loop."""
    async def go():
        response = await handler_call
        return [chunk async for chunk in response.body_iterator]
    return asyncio.run(go())


def test_chat_collected_response_is_the_pydantic_model():
    serving = OpenAIServing(FakeEngine())
    req = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], n=2, logprobs=True, top_logprobs=1)
    r = run(serving.chat(req)).model_dump()
    assert r["object"] == "chat.completion" and r["model"] == "fake"
    assert [c["message"]["content"] for c in r["choices"]] == ["BC", "BC"]
    assert r["choices"][0]["finish_reason"] == "length" and r["choices"][0]["stop_reason"] is None
    assert r["usage"] == {"prompt_tokens": 2, "completion_tokens": 4, "total_tokens": 6,
                          "prompt_tokens_details": {"cached_tokens": 0}}
    content = r["choices"][0]["logprobs"]["content"]
    assert [e["token"] for e in content] == ["B", "C"] and content[0]["top_logprobs"][0]["logprob"] == -0.5


def test_completions_stream_events_share_the_path_with_chat():
    engine = FakeEngine()
    serving = OpenAIServing(engine)
    req = CompletionRequest(prompt=["ab", "c"], stream=True, logprobs=1,
                            stream_options={"include_usage": True})
    events = sse(serving.completions(req))
    assert events[-1] == "data: [DONE]\n\n"
    chunks = [json.loads(e[6:]) for e in events[:-1]]
    assert sorted(c["choices"][0]["index"] for c in chunks if c["choices"]) == [0, 0, 1, 1]
    assert all("stop_reason" in c["choices"][0] for c in chunks if c["choices"] and c["choices"][0]["finish_reason"])
    assert all("stop_reason" not in c["choices"][0] for c in chunks
               if c["choices"] and not c["choices"][0]["finish_reason"])
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 4
    offsets = [c["choices"][0]["logprobs"]["text_offset"][0] for c in chunks if c["choices"]]
    assert sorted(offsets) == [0, 0, 1, 1]
    assert all(s.closed for s in engine.streams)


def test_a_failed_stream_ends_with_an_error_event_then_done():
    serving = OpenAIServing(FakeEngine(fail=True))
    req = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], stream=True)
    events = sse(serving.chat(req))
    assert events[-1] == "data: [DONE]\n\n"
    assert json.loads(events[-2][6:])["error"]["type"] == "internal_error"
    with pytest.raises(APIError) as e:
        run(serving.chat(req.model_copy(update={"stream": False})))
    assert e.value.status_code == 500


def test_engine_invalid_request_maps_by_param_and_code_never_text():
    refuse = InvalidRequestError("words that mention messages and context length", param="prompt",
                                 code="context_length_exceeded")
    serving = OpenAIServing(FakeEngine(refuse=refuse))
    with pytest.raises(APIError) as e:
        run(serving.chat(ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}])))
    assert (e.value.status_code, e.value.param, e.value.code) == (400, "messages", "context_length_exceeded")
    with pytest.raises(APIError) as e:
        run(serving.completions(CompletionRequest(prompt="x")))
    assert (e.value.param, e.value.code) == ("prompt", "context_length_exceeded")
    serving = OpenAIServing(FakeEngine(refuse=ValueError("no param at all")))
    with pytest.raises(APIError) as e:
        run(serving.completions(CompletionRequest(prompt="x")))
    assert (e.value.status_code, e.value.param) == (400, None)


def test_max_n_at_the_edge_and_the_engines_vocabulary_check_by_param():
    serving = OpenAIServing(FakeEngine(), max_n=4)
    with pytest.raises(APIError) as e:
        run(serving.completions(CompletionRequest(prompt="x", n=5)))
    assert e.value.param == "n"
    with pytest.raises(APIError) as e:
        run(serving.completions(CompletionRequest(prompt=["a", "b", "c"], n=2)))
    assert e.value.param == "prompt"
    for field, value in (("stop_token_ids", [100]), ("logit_bias", {"100": 1.0}), ("prompt", [[5, 100]])):
        with pytest.raises(APIError) as e:
            run(serving.completions(CompletionRequest(**{"prompt": "x", field: value})))
        assert e.value.param == field


def test_tokenize_and_detokenize_handlers():
    serving = OpenAIServing(FakeEngine())
    r = run(serving.tokenize(TokenizeRequest(prompt="ab")))
    assert r.tokens == [97, 98] and r.count == 2 and r.max_model_len == 64
    with pytest.raises(APIError):
        run(serving.tokenize(TokenizeRequest()))


# ---- the CLI generated from the configs -------------------------------------------------------------------------
def serve_parser():
    from kvflow.cli import build_parser
    return build_parser()


def test_every_config_field_has_a_flag():
    from kvflow.config import EngineConfig
    from kvflow.server.common.config import ServerConfig

    sub = next(a for a in serve_parser()._actions if a.dest == "command").choices["serve"]
    flags = {s for a in sub._actions for s in a.option_strings}
    for cls in (EngineConfig, ServerConfig):
        for f in dataclasses.fields(cls):
            assert f"--{f.name.replace('_', '-')}" in flags, f.name
    assert {"-q", "-tp", "--no-enable-prefix-caching"} <= flags


def test_server_flags_reach_the_server_config():
    from kvflow.server.cli import configs_from_args

    args = serve_parser().parse_args(["serve", "m", "--max-n", "4", "--max-request-body-size", "1MiB",
                                      "--served-model-name", "a", "b", "-tp", "1", "-q", "none", "--seed", "7"])
    engine, server = configs_from_args(args)
    assert (server.max_n, server.max_request_body_size, server.served_model_name) == (4, 2 ** 20, ("a", "b"))
    # "-q none" stays "none": float weights asked for explicitly (unset keeps a GGUF quantized)
    assert (engine.model, engine.served_model_name, engine.quantization, engine.seed) == ("m", "a", "none", 7)
    with pytest.raises(ValueError, match="scheduling_policy"):
        configs_from_args(serve_parser().parse_args(["serve", "--scheduling-policy", "lifo"]))


def test_cli_help_and_bench_do_not_import_torch():
    code = ("import sys, kvflow, kvflow.bench.cli; from kvflow.cli import build_parser; build_parser().format_help(); "
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True)
    out = subprocess.run([sys.executable, "-m", "kvflow.cli", "serve", "--help"], cwd=REPO, check=True,
                         capture_output=True, text=True).stdout
    assert "--max-n" in out and "--max-num-seqs" in out and "--shutdown-grace-period" in out
