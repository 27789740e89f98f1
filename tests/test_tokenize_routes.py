"""The tokenizer and housekeeping routes through the real server, with vLLM's shapes: /tokenize (token_strs, the
chat form with its template options and tools: the very ids /v1/chat/completions runs), the /render routes (vLLM's
GenerateRequest for a chat or completion body: the very prompt the route runs, the route's own 400s), /tokenizer_info
behind its flag, SageMaker's /ping and /invocations, and the /v1/models cards.

The tiny model's tokenizer is the embedded SmolLM2's with a post-processor that adds BOS, so that whether special
tokens are added shows in the ids."""
from __future__ import annotations

import json
import logging

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvflow.config import EngineConfig
from kvflow.server.serving.protocol import DetokenizeRequest, TokenizeRequest
from kvflow.server.serving.request_fields import REFUSED, VLLM_FIELDS
from kvflow.server.testing import ServerThread
from tiny_models import make_tiny_hf_model

BOS = 1          # <|im_start|>, which the post-processor below adds
API_KEY = "sekret"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
CHATS = {
    "plain": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello, who are you?"}],
    "tool turn": [{"role": "user", "content": "Weather in Paris?"},
                  {"role": "assistant", "content": None, "tool_calls": [
                      {"id": "call_1", "type": "function",
                       "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
                  {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}],
}


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    path = make_tiny_hf_model(tmp_path_factory.mktemp("tiny-tokenize"), family="llama", seed=3)
    spec = json.loads((path / "tokenizer.json").read_text())
    spec["post_processor"] = {   # BOS before every encoded text that asks for special tokens
        "type": "TemplateProcessing",
        "single": [{"SpecialToken": {"id": "<|im_start|>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [{"SpecialToken": {"id": "<|im_start|>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                 {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {"<|im_start|>": {"id": "<|im_start|>", "ids": [BOS], "tokens": ["<|im_start|>"]}}}
    (path / "tokenizer.json").write_text(json.dumps(spec))
    return path


@pytest.fixture(scope="module")
def hf_tokenizer(model_path):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(str(model_path), local_files_only=True)


def engine_config(model_path) -> EngineConfig:
    # no prefix caching: a repeated prompt is computed the same way, so greedy answers compare exactly
    return EngineConfig(model=str(model_path), dtype="float32", max_model_len=512, kv_cache_memory="16MiB",
                        served_model_name="tiny", enforce_eager=True, enable_prefix_caching=False)


@pytest.fixture(scope="module")
def server(model_path):
    """Every option on: /tokenizer_info, request chat templates, "auto" tool choice with the json parser."""
    with ServerThread(engine_config(model_path), enable_tokenizer_info_endpoint=True,
                      trust_request_chat_template=True, enable_auto_tool_choice=True, tool_call_parser="json") as s:
        yield s


@pytest.fixture(scope="module")
def plain_server(model_path):
    """The defaults, behind an API key."""
    with ServerThread(engine_config(model_path), api_key=API_KEY) as s:
        yield s


@pytest.fixture
def http(server):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


@pytest.fixture
def plain(plain_server):
    with httpx.Client(base_url=plain_server.url, timeout=60, headers={"Authorization": f"Bearer {API_KEY}"}) as c:
        yield c


def ok(r: httpx.Response) -> dict:
    assert r.status_code == 200, r.text
    return r.json()


def error_param(r: httpx.Response, status: int = 400) -> str | None:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    return err["param"]


def rendered_ids(hf_tokenizer, messages, **kw) -> list[int]:
    """What transformers renders, encoded without special tokens (the template writes them)."""
    text = hf_tokenizer.apply_chat_template(messages, tokenize=False, **kw)
    return hf_tokenizer.encode(text, add_special_tokens=False)


# ---- /tokenize: the chat form is the chat route's prompt --------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("chat, tool_choice", [("plain", None), ("tool turn", "required"), ("tool turn", None),
                                               ("tool turn", "none")])
def test_the_chat_form_is_the_prompt_the_chat_route_runs(http, chat, tool_choice):
    extra = {"tools": [WEATHER]} if chat == "tool turn" else {}
    if tool_choice is not None:
        extra["tool_choice"] = tool_choice
    counted = ok(http.post("/tokenize", json={"model": "tiny", "messages": CHATS[chat], **extra}))
    ran = ok(http.post("/v1/chat/completions", json={"model": "tiny", "messages": CHATS[chat], "max_tokens": 1,
                                                     **extra}))
    assert counted["count"] == len(counted["tokens"]) == ran["usage"]["prompt_tokens"]
    assert counted["max_model_len"] == 512 and counted["token_strs"] is None


def test_the_chat_form_without_tools_is_what_transformers_renders(http, hf_tokenizer):
    got = ok(http.post("/tokenize", json={"messages": CHATS["plain"]}))["tokens"]
    assert got == rendered_ids(hf_tokenizer, CHATS["plain"], add_generation_prompt=True)
    got = ok(http.post("/tokenize", json={"messages": CHATS["plain"], "add_generation_prompt": False}))["tokens"]
    assert got == rendered_ids(hf_tokenizer, CHATS["plain"], add_generation_prompt=False)


@pytest.mark.slow
def test_tools_reach_the_prompt_on_a_server_without_a_tool_parser(plain, http):
    """vLLM's /tokenize takes tools on any server; kvflow renders them as the chat route does under "auto" with
    the json parser (the other server's)."""
    bare = ok(plain.post("/tokenize", json={"messages": CHATS["tool turn"]}))["count"]
    with_tools = ok(plain.post("/tokenize", json={"messages": CHATS["tool turn"], "tools": [WEATHER]}))["count"]
    ran = ok(http.post("/v1/chat/completions", json={"messages": CHATS["tool turn"], "tools": [WEATHER],
                                                     "max_tokens": 1}))
    assert bare < with_tools == ran["usage"]["prompt_tokens"]
    assert error_param(plain.post("/tokenize", json={"messages": CHATS["tool turn"], "tools": [WEATHER],
                                                     "tool_choice": "auto"})) == "tool_choice"


def test_token_strs_are_the_tokenizers_pieces(http, hf_tokenizer):
    text = "Hello world, café! 12345"
    r = ok(http.post("/tokenize", json={"prompt": text, "return_token_strs": True}))
    assert r["tokens"] == hf_tokenizer.encode(text) and r["tokens"][0] == BOS
    assert r["token_strs"] == hf_tokenizer.convert_ids_to_tokens(r["tokens"])
    assert "Ġworld" in r["token_strs"]                        # the vocabulary's piece, not the decoded text
    chat = ok(http.post("/tokenize", json={"messages": CHATS["plain"], "return_token_strs": True}))
    assert chat["token_strs"] == hf_tokenizer.convert_ids_to_tokens(chat["tokens"])


def test_add_special_tokens_defaults_as_vllm(http, hf_tokenizer):
    prompt = ok(http.post("/tokenize", json={"prompt": "Hello"}))["tokens"]
    assert prompt[0] == BOS and ok(http.post("/tokenize", json={"prompt": "Hello", "add_special_tokens": False})
                                   )["tokens"] == prompt[1:]
    chat = ok(http.post("/tokenize", json={"messages": CHATS["plain"]}))["tokens"]            # default: false
    assert chat == rendered_ids(hf_tokenizer, CHATS["plain"], add_generation_prompt=True)
    assert ok(http.post("/tokenize", json={"messages": CHATS["plain"], "add_special_tokens": True})
              )["tokens"] == [BOS] + chat


def test_continue_final_message_leaves_the_last_message_open(http):
    prefill = CHATS["plain"] + [{"role": "assistant", "content": "I am a tiny"}]
    body = {"messages": prefill, "add_generation_prompt": False}
    closed = ok(http.post("/tokenize", json=body))["tokens"]
    opened = ok(http.post("/tokenize", json={**body, "continue_final_message": True}))["tokens"]
    text = ok(http.post("/detokenize", json={"tokens": opened}))["prompt"]
    assert text.endswith("I am a tiny") and closed[:len(opened)] == opened and len(closed) > len(opened)
    for both in ({"continue_final_message": True}, {"continue_final_message": True, "add_generation_prompt": True}):
        assert error_param(http.post("/tokenize", json={"messages": prefill, **both})) == "continue_final_message"


def test_a_request_chat_template_and_its_kwargs(http):
    template = ("{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}"
                "{% if tools %}<{{ tools | length }} tools>{% endif %}{% if greeting %}{{ greeting }}{% endif %}"
                "{% if add_generation_prompt %}[assistant]{% endif %}")
    body = {"messages": [{"role": "user", "content": "hi"}], "chat_template": template}

    def text(**extra) -> str:
        ids = ok(http.post("/tokenize", json={**body, **extra}))["tokens"]
        return ok(http.post("/detokenize", json={"tokens": ids}))["prompt"]

    assert text() == "[user]hi[assistant]"
    assert text(chat_template_kwargs={"greeting": "Hello!"}) == "[user]hiHello![assistant]"
    assert text(tools=[WEATHER], tool_choice="required") == "[user]hi<1 tools>[assistant]"   # a template with tools
    assert text(add_generation_prompt=False, chat_template_kwargs={"add_generation_prompt": False}) == "[user]hi"
    for kwargs, param in (({"tokenize": True}, "chat_template_kwargs.tokenize"),
                          ({"return_dict": True}, "chat_template_kwargs.return_dict"),
                          ({"add_generation_prompt": False}, "chat_template_kwargs.add_generation_prompt"),
                          ({"chat_template": template}, "chat_template_kwargs.chat_template")):
        assert error_param(http.post("/tokenize", json={**body, "chat_template_kwargs": kwargs})) == param
    assert error_param(http.post("/tokenize", json={**body, "chat_template": "{% for %}"})) == "chat_template"


def test_a_request_chat_template_needs_the_trust_flag(plain):
    body = {"messages": [{"role": "user", "content": "hi"}]}
    r = plain.post("/tokenize", json={**body, "chat_template": "{{ messages[0].content }}"})
    assert error_param(r) == "chat_template" and "--trust-request-chat-template" in r.json()["error"]["message"]
    assert error_param(plain.post("/tokenize", json={**body, "chat_template_kwargs": {"chat_template": "x"}})
                       ) == "chat_template_kwargs"


def test_chat_form_fields_beside_a_prompt_are_refused(http):
    for field, value in (("tools", [WEATHER]), ("add_generation_prompt", False), ("continue_final_message", True),
                         ("chat_template", "{{ 1 }}"), ("chat_template_kwargs", {"x": 1}), ("tool_choice", "none")):
        assert error_param(http.post("/tokenize", json={"prompt": "hi", field: value})) == field
    assert ok(http.post("/tokenize", json={"prompt": "hi", "add_generation_prompt": True, "tools": []}))["count"]
    assert error_param(http.post("/tokenize", json={"prompt": "hi", "messages": CHATS["plain"]})) == "prompt"
    assert error_param(http.post("/tokenize", json={"model": "other", "prompt": "hi"}), 404) == "model"


# ---- /v1/chat/completions/render and /v1/completions/render ------------------------------------------------------
GENERATE_REQUEST_FIELDS = {"request_id", "token_ids", "features", "sampling_params", "model", "stream",
                           "stream_options", "cache_salt", "priority", "kv_transfer_params"}     # vLLM's


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server.base_url, api_key="none", max_retries=0, timeout=60)


def render(client, route: str, body: dict):
    """A render route through the official client (it has no method for them): the JSON it answers."""
    return client.post(f"/{route}/render", body=body, cast_to=object)


def prompt_tokens_run(server) -> float:
    """vllm:prompt_tokens_total: the prompt tokens of every request the engine has run."""
    text = httpx.get(server.url + "/metrics").text
    family = next(f for f in text_string_to_metric_families(text) if f.name == "vllm:prompt_tokens")
    return sum(s.value for s in family.samples if s.name == "vllm:prompt_tokens_total")


def refusal(call) -> tuple[int, str | None]:
    with pytest.raises(openai.APIStatusError) as e:
        call()
    return e.value.status_code, e.value.body["param"]


@pytest.mark.parametrize("chat, tool_choice", [
    ("plain", None), ("tool turn", "auto"),
    pytest.param("tool turn", "required", marks=pytest.mark.slow),     # builds the grammar compiler
])
def test_chat_render_is_the_prompt_the_chat_route_runs(client, chat, tool_choice):
    body = {"model": "tiny", "messages": CHATS[chat], "max_tokens": 1}
    if chat == "tool turn":
        body.update(tools=[WEATHER], tool_choice=tool_choice)
    rendered = render(client, "chat/completions", body)
    assert set(rendered) == GENERATE_REQUEST_FIELDS and rendered["request_id"].startswith("chatcmpl-")
    ran = client.chat.completions.create(**body, extra_body={"return_token_ids": True})
    assert rendered["token_ids"] == ran.model_extra["prompt_token_ids"]
    assert len(rendered["token_ids"]) == ran.usage.prompt_tokens
    if tool_choice == "required":         # the forced call's grammar, as vLLM's structured_outputs
        schema = rendered["sampling_params"]["structured_outputs"]["json"]
        assert "get_weather" in json.dumps(schema)
        rendered = render(client, "chat/completions", {"messages": CHATS["plain"], "response_format": {
            "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}})
        assert rendered["sampling_params"]["structured_outputs"] == {"json": {"type": "object"}}


def test_completions_render_is_one_request_per_prompt_as_the_route_runs_them(client, http):
    prompts = ["The capital of France is", "Hello there, my good friend"]
    body = {"model": "tiny", "prompt": prompts, "max_tokens": 2, "truncate_prompt_tokens": 3,
            "truncation_side": "right", "request_id": "abc"}
    rendered = render(client, "completions", body)
    assert [r["request_id"] for r in rendered] == ["cmpl-abc-p0", "cmpl-abc-p1"]      # the engine's ids
    ran = client.completions.create(model="tiny", prompt=prompts, max_tokens=2, extra_body={
        "truncate_prompt_tokens": 3, "truncation_side": "right", "return_token_ids": True})
    assert [r["token_ids"] for r in rendered] == [c.model_extra["prompt_token_ids"] for c in ran.choices]
    for r, prompt in zip(rendered, prompts):        # truncated as the route truncates: the first 3 tokens
        assert r["token_ids"] == ok(http.post("/tokenize", json={"prompt": prompt}))["tokens"][:3]
    assert sum(len(r["token_ids"]) for r in rendered) == ran.usage.prompt_tokens == 6
    ids = render(client, "completions", {"prompt": [BOS, 400, 401]})       # token ids are the prompt as given
    assert [r["token_ids"] for r in ids] == [[BOS, 400, 401]] and ids[0]["request_id"].startswith("cmpl-")


def test_render_answers_vllms_sampling_params_and_runs_nothing(server, client):
    before = prompt_tokens_run(server)
    rendered = render(client, "chat/completions", {
        "messages": CHATS["plain"], "temperature": 0.123, "top_p": 0.456, "frequency_penalty": 1.1, "n": 2,
        "stop": ["\n"], "seed": 7, "bad_words": ["cat"], "logit_bias": {"5": -1.5}, "truncate_prompt_tokens": 500,
        "stream": True, "stream_options": {"include_usage": True}})
    params = rendered["sampling_params"]
    # vLLM's omit-defaults form: what the request set, max_tokens resolved (the rest of the context), nothing the
    # engine works out for itself (the bad words' ids) or already applied to token_ids (the truncation)
    assert params == {"temperature": 0.123, "top_p": 0.456, "frequency_penalty": 1.1, "n": 2, "stop": ["\n"],
                      "seed": 7, "bad_words": ["cat"], "logit_bias": {"5": -1.5},
                      "max_tokens": 512 - len(rendered["token_ids"])}
    assert rendered["stream"] is True and rendered["stream_options"]["include_usage"] is True
    assert rendered["model"] is None and rendered["priority"] == 0 and rendered["features"] is None
    plain = render(client, "chat/completions", {"model": "tiny", "messages": CHATS["plain"], "max_tokens": 9})
    assert plain["sampling_params"] == {"max_tokens": 9} and plain["stream"] is False
    assert plain["stream_options"] is None and plain["model"] == "tiny"
    assert plain["token_ids"] == rendered["token_ids"]
    assert prompt_tokens_run(server) == before


@pytest.mark.parametrize("route, body", [
    ("chat/completions", {"model": "other", "messages": CHATS["plain"]}),                          # 404 model
    ("chat/completions", {"messages": CHATS["plain"], "temperature": "hot"}),                      # its type
    ("chat/completions", {"messages": CHATS["plain"], "temperature": 500}),                        # its value
    ("chat/completions", {"messages": CHATS["plain"], "max_tokens": 600}),                         # the context
    ("chat/completions", {"messages": CHATS["plain"], "cache_salt": "s"}),                         # a refused field
    ("chat/completions", {"messages": CHATS["plain"], "priority": 3}),                             # no policy
    ("chat/completions", {"messages": CHATS["plain"], "n": 1000}),                                 # --max-n
    ("chat/completions", {"messages": CHATS["plain"], "stream_options": {"include_usage": True}}), # without stream
    ("chat/completions", {"messages": CHATS["plain"], "continue_final_message": True}),            # the template
    ("chat/completions", {"messages": CHATS["plain"], "tools": [WEATHER], "tool_choice": {
        "type": "function", "function": {"name": "nope"}}}),                                       # no such tool
    ("chat/completions", {"messages": CHATS["plain"], "response_format": {"type": "xml"}}),        # constraint
    ("completions", {"prompt": [], "max_tokens": 1}),
    ("completions", {"prompt": [[1, 2], [10**6]], "max_tokens": 1}),                               # vocabulary
    ("completions", {"prompt": "hi", "suffix": "x"}),
    ("completions", {"prompt": "hi", "truncate_prompt_tokens": 513}),
])
def test_render_refuses_what_the_route_refuses(client, route, body):
    run = client.chat.completions.create if route == "chat/completions" else client.completions.create
    body = {"model": "tiny", **body}
    expected = refusal(lambda: run(**{k: v for k, v in body.items() if k in ("model", "messages", "prompt")},
                                   extra_body={k: v for k, v in body.items()
                                               if k not in ("model", "messages", "prompt")}))
    assert expected[0] in (400, 404) and expected[1] is not None
    assert refusal(lambda: render(client, route, body)) == expected


def test_render_refuses_beam_search_which_runs_as_many_requests(client):
    """A beam search runs one one-token request per beam and step: there is no one request to render; the route
    itself serves it."""
    for route, body in (("chat/completions", {"messages": CHATS["plain"]}), ("completions", {"prompt": "hi"})):
        body = {"model": "tiny", "n": 2, "use_beam_search": True, "temperature": 0, "max_tokens": 2, **body}
        assert refusal(lambda: render(client, route, body)) == (400, "use_beam_search")


def test_render_is_behind_the_api_key(plain_server):
    body = {"messages": CHATS["plain"]}
    assert httpx.post(plain_server.base_url + "/chat/completions/render", json=body).status_code == 401
    keyed = openai.OpenAI(base_url=plain_server.base_url, api_key=API_KEY, max_retries=0, timeout=60)
    assert render(keyed, "chat/completions", body)["token_ids"]
    assert render(keyed, "completions", {"prompt": "hi"})[0]["token_ids"] == [BOS, 6004]


def test_the_render_routes_are_in_the_openapi_document(http):
    paths = http.get("/openapi.json").json()["paths"]
    for route, request in (("/v1/chat/completions/render", "ChatCompletionRequest"),
                           ("/v1/completions/render", "CompletionRequest")):
        op = paths[route]["post"]
        assert op["requestBody"]["content"]["application/json"]["schema"]["$ref"].endswith("/" + request)
        assert {"400", "401", "404"} <= set(op["responses"])
    answers = {route: paths[route]["post"]["responses"]["200"]["content"]["application/json"]["schema"]
               for route in ("/v1/chat/completions/render", "/v1/completions/render")}
    assert answers["/v1/chat/completions/render"]["$ref"].endswith("/RenderedRequest")     # one, as vLLM's
    assert answers["/v1/completions/render"]["type"] == "array"                            # one per prompt
    assert answers["/v1/completions/render"]["items"]["$ref"].endswith("/RenderedRequest")


# ---- the field rule on the tokenizer routes -------------------------------------------------------------------
@pytest.mark.parametrize("route, model", [("tokenize", TokenizeRequest), ("detokenize", DetokenizeRequest)])
def test_every_vllm_field_of_the_tokenizer_routes_is_implemented_or_refused(route, model):
    implemented, refused = set(model.model_fields), set(REFUSED[route])
    assert not implemented & refused
    assert not [f for f in VLLM_FIELDS[route] if f not in implemented | refused]


def test_refused_tokenize_fields_are_400s_and_unknown_ones_are_logged_once(http, caplog):
    for field in sorted(REFUSED["tokenize"]):
        r = http.post("/tokenize", json={"messages": CHATS["plain"], field: {"image": {"size": 1}}})
        assert error_param(r) == field and "not supported" in r.json()["error"]["message"]
        assert ok(http.post("/tokenize", json={"messages": CHATS["plain"], field: {}}))["count"]   # the default
    with caplog.at_level(logging.WARNING, logger="kvflow.server"):
        for _ in range(2):
            ok(http.post("/tokenize", json={"prompt": "hi", "a_tokenize_field_nobody_defines": 1}))
            ok(http.post("/detokenize", json={"tokens": [1], "a_detokenize_field_nobody_defines": 1}))
    for name in ("a_tokenize_field_nobody_defines", "a_detokenize_field_nobody_defines"):
        assert len([rec for rec in caplog.records if name in rec.getMessage()]) == 1


# ---- /tokenizer_info --------------------------------------------------------------------------------------------
def test_tokenizer_info_is_the_tokenizers_config_behind_its_flag(http, plain, model_path):
    info = ok(http.get("/tokenizer_info"))
    on_disk = json.loads((model_path / "tokenizer_config.json").read_text())
    assert on_disk and {k: info.get(k) for k in on_disk} == on_disk
    assert info["tokenizer_class"] == on_disk["tokenizer_class"]
    assert info["chat_template"] == (model_path / "chat_template.jinja").read_text()
    assert "vocab_file" not in info and info["bos_token"] == "<|im_start|>"
    assert error_param(plain.get("/tokenizer_info"), 404) is None                    # off by default, as vLLM


# ---- SageMaker's routes -----------------------------------------------------------------------------------------
@pytest.mark.slow
def test_ping_answers_as_health_without_a_key(plain_server):
    for method in ("GET", "POST"):
        r = httpx.request(method, plain_server.url + "/ping")
        assert r.status_code == 200 and r.content == b""
    assert httpx.post(plain_server.url + "/invocations", json={"prompt": "hi"}).status_code == 401


def test_invocations_answers_as_the_route_the_body_is_for(http):
    chat = {"model": "tiny", "messages": CHATS["plain"], "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    direct, invoked = (ok(http.post(route, json=chat)) for route in ("/v1/chat/completions", "/invocations"))
    assert invoked["object"] == "chat.completion" and invoked["usage"] == direct["usage"]
    assert invoked["choices"][0]["message"] == direct["choices"][0]["message"]
    completion = {"model": "tiny", "prompt": "The capital of France is", "max_tokens": 8, "temperature": 0,
                  "ignore_eos": True}
    direct, invoked = (ok(http.post(route, json=completion)) for route in ("/v1/completions", "/invocations"))
    assert invoked["object"] == "text_completion" and invoked["choices"][0]["text"] == direct["choices"][0]["text"]
    streamed = http.post("/invocations", json={**completion, "stream": True})
    assert streamed.status_code == 200 and streamed.text.rstrip().endswith("data: [DONE]")


def test_invocations_refuses_what_neither_route_takes(http):
    assert error_param(http.post("/invocations", json={"max_tokens": 3})) == "messages"
    assert error_param(http.post("/invocations", json=[1, 2])) is None
    assert error_param(http.post("/invocations", content=b"{not json", headers={"content-type": "application/json"})
                       ) is None
    bad = {"messages": CHATS["plain"], "temperature": "hot"}        # the chat route's own 400, naming the field
    assert error_param(http.post("/invocations", json=bad)) == "temperature"
    assert error_param(http.post("/invocations", json={"prompt": "hi", "best_of": 3, "n": 1})) == "best_of"


# ---- /v1/models -------------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_model_cards_have_vllms_parent_and_permission(server, model_path):
    client = openai.OpenAI(base_url=server.base_url, api_key="none", max_retries=0, timeout=60)
    (card,) = client.models.list().data
    card = card.model_dump()
    assert card["id"] == "tiny" and card["parent"] is None and card["root"] and card["max_model_len"] == 512
    (perm,) = card["permission"]
    assert perm["id"].startswith("modelperm-") and perm["object"] == "model_permission"
    assert {k: perm[k] for k in ("allow_create_engine", "allow_sampling", "allow_logprobs", "allow_search_indices",
                                 "allow_view", "allow_fine_tuning", "organization", "group", "is_blocking")} == {
        "allow_create_engine": False, "allow_sampling": True, "allow_logprobs": True, "allow_search_indices": False,
        "allow_view": True, "allow_fine_tuning": False, "organization": "*", "group": None, "is_blocking": False}
