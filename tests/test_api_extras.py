"""vLLM's completions and chat extras, end to end: the real server through the official client (vLLM's
extras go in `extra_body`, as a vLLM user sends them). Each test shows the field changing the output in the way
vLLM defines, so a field accepted and dropped fails here.

The embedded SmolLM2 answers the questions whose greedy answer is known (bad_words); the tiny random model, whose
weights transformers loads too, checks prompt logprobs number by number.
"""
from __future__ import annotations

import math

import httpx
import openai
import pytest
import torch

from kvflow.config import EngineConfig
from kvflow.runner.sampler import banned_by_bad_words
from kvflow.server.testing import ServerThread
from tiny_models import make_tiny_hf_model

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def smol_server():
    config = EngineConfig(dtype="float32", max_model_len=1024, kv_cache_memory="256MiB", served_model_name="smol")
    with ServerThread(config, trust_request_chat_template=True) as s:
        yield s


@pytest.fixture
def client(smol_server):
    return openai.OpenAI(base_url=smol_server.base_url, api_key="x", max_retries=0, timeout=300)


def complete(client, prompt=PROMPT, **kw):
    kw.setdefault("max_tokens", 6)
    return client.completions.create(model="smol", prompt=prompt, temperature=0, **kw)


def chat(client, messages, **kw):
    kw.setdefault("max_tokens", 6)
    return client.chat.completions.create(model="smol", messages=messages, temperature=0, **kw)


def bad_request(call) -> dict:
    with pytest.raises(openai.BadRequestError) as e:
        call()
    return e.value.body


def tokenize(server, text, add_special_tokens=True) -> list[int]:
    r = httpx.post(server.url + "/tokenize", json={"prompt": text, "add_special_tokens": add_special_tokens})
    return r.json()["tokens"]


# ---- sampling fields --------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_bad_words_keep_the_greedy_answer_out(client):
    assert "Paris" in complete(client).choices[0].text
    text = complete(client, extra_body={"bad_words": ["Paris"]}).choices[0].text
    assert "Paris" not in text and text.strip()


def test_a_multi_token_bad_word_bans_its_last_token_after_its_others():
    word = [5, 6, 7]
    assert banned_by_bad_words([word], [1, 2, 5, 6]) == {7}
    assert banned_by_bad_words([word], [1, 2, 5]) == set()
    assert banned_by_bad_words([word, [9]], []) == {9}


def test_allowed_token_ids_bound_the_output(client, smol_server):
    allowed = tokenize(smol_server, " London Berlin Rome", add_special_tokens=False)
    r = complete(client, max_tokens=8, extra_body={"allowed_token_ids": allowed, "return_token_ids": True})
    assert r.choices[0].token_ids and set(r.choices[0].token_ids) <= set(allowed)
    assert bad_request(lambda: complete(client, extra_body={"allowed_token_ids": [10**9]}))["param"] == \
        "allowed_token_ids"


@pytest.mark.slow
def test_truncate_prompt_tokens_keeps_the_last_tokens_and_counts_them(client, smol_server):
    ids = tokenize(smol_server, "One two three four. " + PROMPT)
    r = complete(client, prompt=ids, extra_body={"truncate_prompt_tokens": 6})
    assert r.usage.prompt_tokens == 6
    assert r.choices[0].text == complete(client, prompt=ids[-6:]).choices[0].text
    assert bad_request(lambda: complete(client, prompt=ids, extra_body={"truncate_prompt_tokens": 4096})
                       )["param"] == "truncate_prompt_tokens"
    r = chat(client, [{"role": "user", "content": "Hello there, how are you today?"}],
             extra_body={"truncate_prompt_tokens": 5})
    assert r.usage.prompt_tokens == 5


def test_logprobs_zero_is_the_sampled_token_alone(client):
    lp = complete(client, logprobs=0).choices[0].logprobs
    assert all(top == {tok: val} for tok, val, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs))
    lp = complete(client, logprobs=3).choices[0].logprobs
    assert all(tok in top and 3 <= len(top) <= 4 for tok, top in zip(lp.tokens, lp.top_logprobs))
    r = chat(client, [{"role": "user", "content": "Hi"}], logprobs=True, top_logprobs=20)
    assert all(len(t.top_logprobs) == 20 for t in r.choices[0].logprobs.content)
    assert bad_request(lambda: chat(client, [{"role": "user", "content": "Hi"}], logprobs=True, top_logprobs=21)
                       )["param"] == "top_logprobs"


# ---- echo, token ids --------------------------------------------------------------------------------------------
def test_completion_echo_prepends_the_prompt_and_its_logprobs(client, smol_server):
    plain = complete(client, logprobs=1).choices[0]
    r = complete(client, echo=True, logprobs=1).choices[0]
    assert r.text == PROMPT + plain.text
    n_prompt = len(tokenize(smol_server, PROMPT))
    lp = r.logprobs
    assert len(lp.tokens) == n_prompt + len(plain.logprobs.tokens)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(isinstance(x, float) for x in lp.token_logprobs[1:])
    assert lp.token_logprobs[n_prompt:] == pytest.approx(plain.logprobs.token_logprobs, abs=1e-5)
    assert lp.text_offset[0] == 0 and lp.text_offset[n_prompt] == len(PROMPT)
    streamed = complete(client, echo=True, logprobs=1, stream=True)
    chunks = list(streamed)
    assert "".join(c.choices[0].text for c in chunks) == r.text
    assert [t for c in chunks for t in c.choices[0].logprobs.tokens] == lp.tokens


@pytest.mark.slow
def test_return_token_ids_whole_and_streamed(client, smol_server):
    r = complete(client, extra_body={"return_token_ids": True}).choices[0]
    assert r.prompt_token_ids == tokenize(smol_server, PROMPT)
    detok = httpx.post(smol_server.url + "/detokenize", json={"tokens": r.token_ids}).json()["prompt"]
    assert detok == r.text
    chunks = list(complete(client, stream=True, extra_body={"return_token_ids": True}))
    assert chunks[0].choices[0].prompt_token_ids == r.prompt_token_ids
    assert [t for c in chunks for t in c.choices[0].token_ids] == r.token_ids
    messages = [{"role": "user", "content": "Hi"}]
    whole = chat(client, messages, extra_body={"return_token_ids": True})
    assert len(whole.prompt_token_ids) == whole.usage.prompt_tokens
    assert len(whole.choices[0].token_ids) == whole.usage.completion_tokens
    chunks = list(chat(client, messages, stream=True, extra_body={"return_token_ids": True}))
    assert chunks[0].prompt_token_ids == whole.prompt_token_ids
    # the role chunk opens the stream before any token
    assert [t for c in chunks for t in (c.choices[0].model_extra.get("token_ids") or [])] == \
        whole.choices[0].token_ids
    assert complete(client).choices[0].model_extra.get("token_ids") is None


def test_return_tokens_as_token_ids(client):
    r = complete(client, logprobs=1, extra_body={"return_tokens_as_token_ids": True, "return_token_ids": True})
    choice = r.choices[0]
    assert choice.logprobs.tokens == [f"token_id:{t}" for t in choice.token_ids]
    r = chat(client, [{"role": "user", "content": "Hi"}], logprobs=True, top_logprobs=2,
             extra_body={"return_tokens_as_token_ids": True})
    assert all(t.token.startswith("token_id:") and all(x.token.startswith("token_id:") for x in t.top_logprobs)
               for t in r.choices[0].logprobs.content)


def test_request_id_names_the_response(client):
    assert complete(client, extra_body={"request_id": "abc-1"}).id == "cmpl-abc-1"
    assert chat(client, [{"role": "user", "content": "Hi"}], extra_body={"request_id": "abc-2"}).id == \
        "chatcmpl-abc-2"


def test_completion_add_special_tokens(client, smol_server):
    without = tokenize(smol_server, PROMPT, add_special_tokens=False)
    assert complete(client, extra_body={"add_special_tokens": False}).usage.prompt_tokens == len(without)


# ---- the chat template ------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_continue_final_message_and_chat_echo(client):
    messages = [{"role": "user", "content": "Name the capital of France."},
                {"role": "assistant", "content": "The capital of France is"}]
    cont = {"continue_final_message": True, "add_generation_prompt": False}
    r = chat(client, messages, extra_body=cont)
    assert "Paris" in r.choices[0].message.content
    fresh = chat(client, messages)        # a new assistant turn: a different prompt
    assert fresh.usage.prompt_tokens > r.usage.prompt_tokens
    echoed = chat(client, messages, extra_body={**cont, "echo": True})
    assert echoed.choices[0].message.content == messages[-1]["content"] + r.choices[0].message.content
    streamed = chat(client, messages, stream=True, extra_body={**cont, "echo": True})
    assert "".join(c.choices[0].delta.content or "" for c in streamed) == echoed.choices[0].message.content
    # echo only repeats an assistant's message
    user_last = messages[:1]
    assert chat(client, user_last, extra_body={"echo": True}).choices[0].message.content == \
        chat(client, user_last).choices[0].message.content
    assert bad_request(lambda: chat(client, messages, extra_body={"continue_final_message": True})
                       )["param"] == "continue_final_message"


def test_request_chat_template_and_its_kwargs(client, smol_server):
    template = "{{ greeting }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    messages = [{"role": "narrator", "content": PROMPT}]          # any role reaches the template
    r = chat(client, messages, extra_body={"chat_template": template,
                                           "chat_template_kwargs": {"greeting": "Hello. "}})
    assert r.usage.prompt_tokens == len(tokenize(smol_server, "Hello. narrator: " + PROMPT + "\n",
                                                 add_special_tokens=False))
    with_docs = "{% for d in documents %}{{ d['text'] }} {% endfor %}" + template
    r = chat(client, messages, extra_body={"chat_template": with_docs, "documents": [{"title": "t", "text": "Doc."}],
                                           "chat_template_kwargs": {"greeting": ""}})
    assert r.usage.prompt_tokens == len(tokenize(smol_server, "Doc. narrator: " + PROMPT + "\n",
                                                 add_special_tokens=False))
    # the model's own template reads neither documents nor reasoning_effort: they would change nothing
    for field, value in (("documents", [{"title": "t", "text": "x"}]), ("reasoning_effort", "low")):
        assert bad_request(lambda: chat(client, messages[:1], extra_body={field: value}))["param"] == field


def test_chat_add_special_tokens(client):
    messages = [{"role": "user", "content": "Hi"}]
    plain = chat(client, messages, extra_body={"return_token_ids": True})
    added = chat(client, messages, extra_body={"return_token_ids": True, "add_special_tokens": True})
    assert added.prompt_token_ids[-len(plain.prompt_token_ids):] == plain.prompt_token_ids
    assert len(added.prompt_token_ids) >= len(plain.prompt_token_ids)


# ---- prompt logprobs, against transformers ---------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = make_tiny_hf_model(tmp_path_factory.mktemp("tiny-extras"), family="llama", seed=3)
    # chunks of 16 tokens: a prompt's logprobs come from several steps
    config = EngineConfig(model=str(path), dtype="float32", max_model_len=256, kv_cache_memory="8MiB",
                          served_model_name="tiny", enforce_eager=True, max_num_batched_tokens=16)
    with ServerThread(config) as s:
        yield path, s


@pytest.mark.slow
def test_prompt_logprobs_equal_transformers(tiny):
    from transformers import AutoModelForCausalLM

    path, server = tiny
    ids = [(7 * i + 3) % 500 + 2 for i in range(40)]
    client = openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0)
    r = client.completions.create(model="tiny", prompt=ids, max_tokens=2, temperature=0,
                                  extra_body={"prompt_logprobs": 3})
    got = r.choices[0].prompt_logprobs
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    with torch.no_grad():
        want = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)
    assert got[0] is None and len(got) == len(ids)
    for j in range(1, len(ids)):
        entry = {int(k): v for k, v in got[j].items()}
        assert entry[ids[j]]["logprob"] == pytest.approx(want[j - 1, ids[j]].item(), abs=1e-4)
        # the rank among ~49k near-flat logprobs of a random model: tokens within float rounding of the prompt
        # token's logprob (1e-5, 10x finer than the logprob check) may fall on either side of it
        target = want[j - 1, ids[j]]
        assert (int((want[j - 1] > target + 1e-5).sum()) + 1 <= entry[ids[j]]["rank"]
                <= int((want[j - 1] > target - 1e-5).sum()) + 1)
        top = want[j - 1].topk(3)
        assert {t for t in entry if entry[t]["rank"] <= 3} >= set(top.indices.tolist()) - {ids[j]}
        for t, lp in zip(top.indices.tolist(), top.values.tolist()):
            assert entry[t]["logprob"] == pytest.approx(lp, abs=1e-4)
    # not asked: the key is there, null; the request's own output does not change
    plain = client.completions.create(model="tiny", prompt=ids, max_tokens=2, temperature=0)
    assert plain.choices[0].prompt_logprobs is None and "prompt_logprobs" in plain.choices[0].model_dump()
    assert plain.choices[0].text == r.choices[0].text


@pytest.mark.slow
def test_prompt_logprobs_bad_values(tiny):
    _, server = tiny
    client = openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0)
    for body in ({"prompt_logprobs": -1}, {"prompt_logprobs": 21}):
        assert bad_request(lambda: client.completions.create(model="tiny", prompt="hi", max_tokens=2,
                                                             extra_body=body))["param"] == "prompt_logprobs"
    assert bad_request(lambda: client.completions.create(model="tiny", prompt="hi", max_tokens=2, stream=True,
                                                         extra_body={"prompt_logprobs": 1}))["param"] == \
        "prompt_logprobs"


@pytest.mark.slow
def test_chat_prompt_logprobs_on_the_response(tiny):
    _, server = tiny
    client = openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0)
    r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hello"}], max_tokens=2,
                                       extra_body={"prompt_logprobs": 0})
    got = r.model_extra["prompt_logprobs"]
    assert got[0] is None and len(got) == r.usage.prompt_tokens
    assert all(len(p) == 1 and math.isfinite(next(iter(p.values()))["logprob"]) for p in got[1:])


@pytest.mark.slow
def test_parallel_tool_calls_false_allows_one_call(client):
    from kvflow.errors import InvalidRequestError
    from kvflow.server.serving.tool_calls import parse_tool_request

    weather = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"]}}}
    messages = [{"role": "user", "content": "Weather in Oslo, in Paris and in Rome?"}]
    r = chat(client, messages, tools=[weather], tool_choice="required", parallel_tool_calls=False, max_tokens=120)
    assert len(r.choices[0].message.tool_calls) == 1
    assert parse_tool_request([weather], "required", parallel_tool_calls=False).spec() != \
        parse_tool_request([weather], "required").spec()
    with pytest.raises(InvalidRequestError) as e:      # "auto" leaves the model's syntax free: not promised
        parse_tool_request([weather], "auto", tool_parser="hermes", parallel_tool_calls=False)
    assert e.value.param == "parallel_tool_calls"


# ---- priority (vLLM's: honoured only under --scheduling-policy priority) -----------------------------------------
@pytest.mark.slow
def test_priority_without_the_priority_policy_is_a_400_naming_it(client):
    body = bad_request(lambda: complete(client, extra_body={"priority": 5}))
    assert body["param"] == "priority" and "--scheduling-policy priority" in body["message"]
    assert complete(client, extra_body={"priority": 0}).choices[0].text      # the default is no priority
