"""SmolLM3 (SmolLM3ForCausalLM, GGUF `smollm3`): a Llama whose every 4th layer has no position embedding (NoPE), on a
random-weight model with SmolLM3-3B's layout, small (4 layers, layer 3 NoPE; tiny_models). Its config (config.json's
`no_rope_layers` list or `no_rope_layer_interval`, the GGUF's llama keys with llama.cpp's fixed interval of 4, the
sliding window transformers puts on the NoPE layers); greedy tokens equal to transformers' in float32 — batched and
alone, prompts prefilled in chunks, prefix-cache hits — from the folder and from its GGUF twin; the NoPE layer makes
a difference; `kvflow run-batch` on the folder and on a Q8_0 GGUF; and SmolLM3's chat format through the server: the
/think and /no_think system flags and `enable_thinking`, tools (its `xml_tools` argument, or the request's `tools`
through kvflow's tool prompt), the deepseek_r1 reasoning parser and hermes tool calls."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import openai
import pytest
import torch

from kvflow import LLM, SamplingParams
from kvflow.config import EngineConfig
from kvflow.models.model_config import FULL, SLIDING, ModelConfig
from kvflow.models.model_files import resolve_model_files
from kvflow.server.testing import ServerThread
from test_model_families import MAX_TOKENS, check_family, prompts_for
from tiny_models import make_tiny_hf_model, write_gguf_from_hf
from transformers_greedy import assert_greedy_matches

REPO = Path(__file__).resolve().parent.parent
TEMPLATE = Path(__file__).parent / "chat_templates" / "smollm3_format.jinja"
BASE = dict(architectures=["SmolLM3ForCausalLM"], vocab_size=10, hidden_size=8, intermediate_size=16,
            num_hidden_layers=8, num_attention_heads=2)


@pytest.fixture(scope="module")
def smollm3_dir(tmp_path_factory):
    return make_tiny_hf_model(tmp_path_factory.mktemp("smollm3"), family="smollm3", seed=2)


def test_config_reads_the_nope_layers_from_the_list_the_interval_and_a_gguf(smollm3_dir, tmp_path):
    assert ModelConfig.from_hf_dict(BASE).nope_layers == (3, 7)           # transformers' default interval: 4
    assert ModelConfig.from_hf_dict({**BASE, "no_rope_layer_interval": 2}).nope_layers == (1, 3, 5, 7)
    flags = [0, 1, 1, 0, 1, 1, 1, 1]                                      # 1: the layer rotates
    assert ModelConfig.from_hf_dict({**BASE, "no_rope_layers": flags}).nope_layers == (0, 3)
    assert ModelConfig.from_hf_dict(BASE).rope_theta == 2_000_000.0       # SmolLM3Config's default_theta
    with pytest.raises(ValueError, match="no_rope_layers has 4 entries for 8 layers"):
        ModelConfig.from_hf_dict({**BASE, "no_rope_layers": [1, 1, 1, 0]})
    for key in ("mlp_bias", "attention_bias"):
        with pytest.raises(ValueError, match=key):
            ModelConfig.from_hf_dict({**BASE, key: True})
    # use_sliding_window: transformers makes the NoPE layers the sliding ones; without it, no window anywhere
    cfg = ModelConfig.from_hf_dict({**BASE, "use_sliding_window": True, "sliding_window": 16})
    assert cfg.sliding_window == 16 and cfg.layer_types == tuple(SLIDING if i in (3, 7) else FULL for i in range(8))
    assert ModelConfig.from_hf_dict({**BASE, "sliding_window": 16}).sliding_window is None
    # the folder (transformers writes the list) and its GGUF twin (llama's keys; llama.cpp's interval of 4)
    hf = resolve_model_files(smollm3_dir).config
    gguf = resolve_model_files(write_gguf_from_hf(smollm3_dir, tmp_path / "s.gguf")).config
    fields = ("family", "nope_layers", "rope_theta", "tie_word_embeddings", "head_dim", "layer_types",
              "num_key_value_heads")
    assert [getattr(hf, f) for f in fields] == [getattr(gguf, f) for f in fields]
    assert hf.family == "smollm3" and hf.nope_layers == (3,) and hf.tie_word_embeddings


@pytest.mark.slow
def test_greedy_tokens_match_transformers_batched_alone_chunked_and_from_the_prefix_cache(tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM

    path = check_family(tmp_path / "default", monkeypatch, "smollm3")       # batched, chunked, prefix-cache hits
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    llm = LLM(str(path), dtype="float32", max_model_len=256, kv_cache_memory="32MiB")
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    for prompt in prompts_for(16)[:3]:                                        # each alone
        assert_greedy_matches(hf, prompt, llm.generate([prompt], params)[0].outputs[0].token_ids, "alone: ",
                              MAX_TOKENS)
    # no_rope_layers as a list other than the interval's: NoPE at 0 and 2
    check_family(tmp_path / "list", monkeypatch, "smollm3", no_rope_layers=[0, 1, 0, 1])


@pytest.mark.slow
def test_use_sliding_window_windows_the_nope_layers_as_transformers_does(tmp_path, monkeypatch):
    """transformers' SmolLM3Config makes the NoPE layers the sliding ones: the same tokens through kvflow's attention
    kernel and the pure-PyTorch paths, with prompts past the 16-token window, chunked and from the prefix cache."""
    path = check_family(tmp_path, monkeypatch, "smollm3", window=16, use_sliding_window=True, sliding_window=16)
    cfg = resolve_model_files(path).config
    assert cfg.sliding_window == 16 and cfg.layer_types == (FULL, FULL, FULL, SLIDING)


@pytest.mark.slow
def test_the_nope_layer_changes_the_output(smollm3_dir):
    """The same weights with every layer rotating give other tokens on the long prompts, so the matches above check
    the NoPE layer and not a model on which it does not show."""
    from transformers import AutoConfig, AutoModelForCausalLM

    prompts = prompts_for(16)[1:4]
    llm = LLM(str(smollm3_dir), dtype="float32", max_model_len=256, kv_cache_memory="32MiB")
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, SamplingParams(
        temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True))]
    config = AutoConfig.from_pretrained(smollm3_dir)
    config.no_rope_layers = [1] * config.num_hidden_layers
    rotating = AutoModelForCausalLM.from_pretrained(smollm3_dir, config=config, dtype=torch.float32).eval()
    from transformers_greedy import greedy_choices
    assert any(greedy_choices(rotating, p, a) != a for p, a in zip(prompts, got))


@pytest.mark.slow
def test_gguf_twin_gives_the_safetensors_tokens(smollm3_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    gguf_path = write_gguf_from_hf(smollm3_dir, tmp_path / "smollm3.gguf")
    hf = AutoModelForCausalLM.from_pretrained(smollm3_dir, dtype=torch.float32).eval()
    prompts = prompts_for(16)[1:4]
    llm = LLM(str(gguf_path), dtype="float32", max_model_len=256, kv_cache_memory="32MiB")
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, SamplingParams(
        temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True))]
    for p, a in zip(prompts, got):
        assert_greedy_matches(hf, p, a, "GGUF: ", MAX_TOKENS)


@pytest.mark.slow
@pytest.mark.parametrize("form", ["folder", "q8_0"])
def test_run_batch_answers_a_file(smollm3_dir, tmp_path, form):
    path = smollm3_dir if form == "folder" else write_gguf_from_hf(smollm3_dir, tmp_path / "s.gguf", ftype=form)
    lines = [{"custom_id": f"c{i}", "method": "POST", "url": "/v1/chat/completions",
              "body": {"model": str(path), "messages": [{"role": "user", "content": f"Question {i}: the sea?"}],
                       "max_tokens": 6, "temperature": 0}} for i in range(3)]
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text("".join(json.dumps(x) + "\n" for x in lines))
    run = subprocess.run([sys.executable, "-m", "kvflow.cli", "run-batch", "-i", str(inp), "-o", str(out),
                          str(path), "--dtype", "float32", "--max-model-len", "512", "--kv-cache-memory", "64MiB"],
                         capture_output=True, text=True, timeout=600, cwd=REPO,
                         env={**os.environ, "PYTHONPATH": str(REPO)})
    assert run.returncode == 0, run.stderr[-3000:]
    records = {r["custom_id"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert set(records) == {f"c{i}" for i in range(3)}
    for r in records.values():
        assert r["error"] is None and r["response"]["status_code"] == 200
        assert r["response"]["body"]["usage"]["completion_tokens"] == 6


# ---- SmolLM3's chat format through the server ----------------------------------------------------------------------
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}
NO_THINK_START = "<|im_start|>assistant\n<think>\n\n</think>\n"


@pytest.fixture(scope="module")
def server(smollm3_dir):
    config = EngineConfig(model=str(smollm3_dir), dtype="float32", max_model_len=512, kv_cache_memory="32MiB",
                          served_model_name="smol3", enforce_eager=True)
    with ServerThread(config, chat_template=str(TEMPLATE), reasoning_parser="deepseek_r1",
                      enable_auto_tool_choice=True, tool_call_parser="hermes") as s:
        yield s


def rendered(server, messages: list[dict], **body) -> str:
    """The prompt the chat route renders (through /tokenize and /detokenize), as text."""
    r = httpx.post(server.url + "/tokenize", json={"model": "smol3", "messages": messages, **body}, timeout=60)
    assert r.status_code == 200, r.text
    return httpx.post(server.url + "/detokenize", json={"model": "smol3", "tokens": r.json()["tokens"]},
                      timeout=60).json()["prompt"]


def test_the_think_flags_and_enable_thinking_choose_the_reasoning_mode(server):
    user = [{"role": "user", "content": "Hi"}]
    thinking = rendered(server, user)
    assert "Reasoning Mode: /think" in thinking and thinking.endswith("<|im_start|>assistant\n")
    off = rendered(server, user, chat_template_kwargs={"enable_thinking": False})
    assert "Reasoning Mode: /no_think" in off and off.endswith(NO_THINK_START)
    flagged = rendered(server, [{"role": "system", "content": "Be brief. /no_think"}, *user])
    assert "Reasoning Mode: /no_think" in flagged and "Be brief.\n" in flagged and "Be brief. /no_think" not in flagged
    assert flagged.endswith(NO_THINK_START)
    assert "Reasoning Mode: /think" in rendered(server, [{"role": "system", "content": "/think"}, *user],
                                                chat_template_kwargs={"enable_thinking": False})


def test_tools_reach_the_prompt_from_xml_tools_or_the_requests_tools(server):
    user = [{"role": "user", "content": "Weather in Paris?"}]
    listed = rendered(server, user, chat_template_kwargs={"xml_tools": [WEATHER["function"]]})
    assert "<tools>\n" + json.dumps(WEATHER["function"]) in listed and "<tool_call>" in listed
    # the template reads no `tools`: kvflow's tool prompt carries the request's, in the parser's syntax
    prompt = rendered(server, user, tools=[WEATHER])
    assert '"name": "get_weather"' in prompt and "<tool_call>{" in prompt


@pytest.mark.slow
def test_answers_split_by_the_reasoning_parser_and_hermes_calls(server):
    client = openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0, timeout=300)
    user = [{"role": "user", "content": "Weather in Paris?"}]
    call = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
    # /no_think: the prompt closes the reasoning, so the output is all answer, and the call is read from it
    r = client.chat.completions.create(model="smol3", messages=user, tools=[WEATHER], temperature=0, max_tokens=60,
                                       extra_body={"chat_template_kwargs": {"enable_thinking": False},
                                                   "structured_outputs": {"choice": [call]}})
    message = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls" and (message.model_extra or {}).get("reasoning") is None
    assert [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls] == [
        ("get_weather", {"city": "Paris"})]
    # /think: what the model writes up to </think> is reasoning (a random model's text never closes it here)
    r = client.chat.completions.create(model="smol3", messages=user, temperature=0, max_tokens=8)
    assert r.choices[0].message.content is None and r.choices[0].message.model_extra.get("reasoning")
