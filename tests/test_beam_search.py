"""Beam search (vLLM's, kvflow/beam_search.py): offline `LLM.beam_search` against transformers' `generate(num_beams=…)`
on float32 models, against vLLM's definition written again here where the two definitions differ, the beams' shared
KV blocks, and the server's `use_beam_search` through the official `openai` client.

Where vLLM's and transformers' beam search coincide, and where not:
- With no EOS (ignore_eos; transformers with eos_token_id=None) every beam has max_tokens tokens. Both keep, each
  step, the best beam_width live continuations of the 2 * beam_width best per beam / over all beams (the same set),
  and return the best beam_width of the last step: the same sequences in the same order. Their scores differ by a
  constant factor: vLLM divides the cumulative logprob by (prompt + output tokens) ** length_penalty, transformers
  (`sequences_scores`) by (output tokens) ** length_penalty; at length_penalty 0 both are the cumulative logprob.
- With EOS they differ, whatever the length_penalty and early_stopping: vLLM keeps every EOS candidate of a beam's
  2 * beam_width as a finished beam and runs to max_tokens; transformers keeps one only if it ranks among the step's
  best beam_width candidates over all beams, counts EOS in the length and not the prompt, and may stop early. On the
  EOS model below, transformers misses a short finished beam that vLLM's rule returns first. So the EOS case is
  checked against `vllm_reference`, vLLM's `LLM.beam_search` written again over transformers' logits (no KV cache,
  no kvflow code), which is itself checked against transformers' generate in the fixed-length case.
"""
from __future__ import annotations

import openai
import pytest
import torch

from kvflow import LLM
from kvflow.beam_search import BeamSearchParams, beam_search_score
from kvflow.config import EngineConfig
from kvflow.server.testing import ServerThread
from tiny_models import make_tiny_hf_model

PROMPTS = [[5, 17, 300, 4000, 12], list(range(100, 130)), [42, 43]]
EOS_BOOST = 8.0      # the EOS row of the EOS model's LM head, scaled: EOS is often among a step's candidates


def make_llm(path, **kw) -> LLM:
    return LLM(str(path), dtype="float32", max_model_len=256, kv_cache_memory="16MiB", enforce_eager=True, **kw)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_tiny_hf_model(tmp_path_factory.mktemp("tiny-beam"), family="llama", seed=0)


@pytest.fixture(scope="module")
def eos_dir(tmp_path_factory):
    """A tiny model whose beams often end on EOS (untied LM head, EOS's row scaled up)."""
    from transformers import AutoModelForCausalLM
    path = make_tiny_hf_model(tmp_path_factory.mktemp("tiny-beam-eos"), family="llama", seed=3,
                              tie_word_embeddings=False)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        hf.lm_head.weight[2] *= EOS_BOOST
    hf.save_pretrained(path)
    return path


def hf_model(path):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def tiny_llm(tiny_dir):
    llm = make_llm(tiny_dir)
    yield llm
    llm.shutdown()


def hf_beam_search(hf, prompt: list[int], width: int, max_tokens: int, length_penalty: float):
    """transformers' beam search with no EOS: (output tokens, sequences_score) of the best `width`, best first."""
    ids = torch.tensor([prompt])
    out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens, num_beams=width,
                      num_return_sequences=width, do_sample=False, output_scores=True, return_dict_in_generate=True,
                      length_penalty=length_penalty, early_stopping="never", eos_token_id=None, pad_token_id=0)
    return [(seq[len(prompt):].tolist(), score) for seq, score in zip(out.sequences, out.sequences_scores.tolist())]


@torch.no_grad()
def vllm_reference(hf, prompt: list[int], width: int, max_tokens: int, length_penalty: float, eos: set[int],
                   ignore_eos: bool = False):
    """vLLM's LLM.beam_search over transformers' logits, written from vllm/entrypoints/llm.py and
    vllm/beam_search.py: [(tokens with the prompt, cum_logprob, finished on EOS)], best first."""
    def score(beam):
        tokens, cum, _ = beam
        return cum / ((len(tokens) - (tokens[-1] in eos)) ** length_penalty)

    beams, completed = [(list(prompt), 0.0, False)], []
    for _ in range(max_tokens):
        if not beams:
            break
        logprobs = torch.log_softmax(hf(torch.tensor([b[0] for b in beams])).logits[:, -1].float(), dim=-1)
        top, ids = logprobs.topk(2 * width, dim=-1)
        candidates = []
        for (tokens, cum, _), values, tokens_next in zip(beams, top.tolist(), ids.tolist()):
            for t, lp in zip(tokens_next, values):
                if t in eos and not ignore_eos:
                    completed.append((tokens + [t], cum + lp, True))
                else:
                    candidates.append((tokens + [t], cum + lp, False))
        beams = sorted(candidates, key=score, reverse=True)[:width]
    return sorted(completed + beams, key=score, reverse=True)[:width]


# ---- offline, against transformers -------------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("width, max_tokens", [(2, 7), (4, 6)])
@pytest.mark.parametrize("length_penalty", [0.0, 1.0, 2.0])
def test_fixed_length_beams_match_transformers(tiny_llm, tiny_dir, width, max_tokens, length_penalty):
    """ignore_eos: the same top sequences as transformers, best first; the same scores at length_penalty 0, and
    in general once each side's length convention is applied (vLLM's counts the prompt, transformers' does not)."""
    hf = hf_model(tiny_dir)
    outs = tiny_llm.beam_search(PROMPTS, BeamSearchParams(beam_width=width, max_tokens=max_tokens, ignore_eos=True,
                                                          length_penalty=length_penalty))
    eos = tiny_llm.tokenizer.eos_token_ids
    for prompt, out in zip(PROMPTS, outs):
        ref = hf_beam_search(hf, prompt, width, max_tokens, length_penalty)
        assert len(out.sequences) == width
        assert [s.tokens[len(prompt):] for s in out.sequences] == [tokens for tokens, _ in ref]
        for seq, (_, hf_score) in zip(out.sequences, ref):
            assert seq.tokens[:len(prompt)] == prompt and seq.finish_reason == "length"
            assert len(seq.logprobs) == max_tokens and all(len(lp) >= 2 * width for lp in seq.logprobs)
            assert seq.cum_logprob == pytest.approx(sum(lp[t] for lp, t in zip(seq.logprobs,
                                                                                 seq.tokens[len(prompt):])))
            # transformers: cum / output_len ** lp; vLLM (kvflow): cum / (prompt + output) ** lp
            assert seq.cum_logprob / max_tokens ** length_penalty == pytest.approx(hf_score, rel=1e-5, abs=1e-5)
            assert beam_search_score(seq.tokens, seq.cum_logprob, eos, length_penalty) == pytest.approx(
                seq.cum_logprob / (len(prompt) + max_tokens) ** length_penalty)
        # the reference written from vLLM's code agrees with transformers here, so it can stand in where EOS differs
        vllm = vllm_reference(hf, prompt, width, max_tokens, length_penalty, eos, ignore_eos=True)
        assert [t[len(prompt):] for t, _, _ in vllm] == [tokens for tokens, _ in ref]
        assert out.sequences[0].text == tiny_llm.tokenizer.decode(out.sequences[0].tokens)
    tiny_llm.engine.kv_cache_manager.check()


@pytest.mark.slow
@pytest.mark.parametrize("length_penalty", [0.0, 1.0])
def test_beams_that_end_on_eos_follow_vllms_definition(eos_dir, length_penalty):
    """Beams end on EOS here (finish_reason "stop", EOS the stop_reason, scored without it); vLLM's rule and
    transformers' differ on them (module docstring), so the oracle is vLLM's definition, computed independently."""
    hf = hf_model(eos_dir)
    with make_llm(eos_dir) as llm:
        eos = llm.tokenizer.eos_token_ids
        width, max_tokens = 4, 8
        outs = llm.beam_search(PROMPTS, BeamSearchParams(beam_width=width, max_tokens=max_tokens,
                                                         length_penalty=length_penalty))
        reasons = []
        for prompt, out in zip(PROMPTS, outs):
            ref = vllm_reference(hf, prompt, width, max_tokens, length_penalty, eos)
            assert [s.tokens for s in out.sequences] == [tokens for tokens, _, _ in ref]
            for seq, (tokens, cum, finished) in zip(out.sequences, ref):
                assert seq.cum_logprob == pytest.approx(cum, rel=1e-5, abs=1e-5)
                assert seq.finish_reason == ("stop" if finished else "length")
                assert seq.stop_reason == (tokens[-1] if finished else None)
                reasons.append(seq.finish_reason)
            scores = [beam_search_score(s.tokens, s.cum_logprob, eos, length_penalty) for s in out.sequences]
            assert scores == sorted(scores, reverse=True)
        assert "stop" in reasons and "length" in reasons           # both kinds of beam, ranked together
        # transformers' own beam search on one prompt, to show the difference the docstring describes: a finished
        # beam vLLM's rule returns that transformers' does not keep
        ids = torch.tensor([PROMPTS[0]])
        hf_out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens, num_beams=width,
                             num_return_sequences=width, do_sample=False, length_penalty=length_penalty,
                             early_stopping="never", eos_token_id=2, pad_token_id=2)
        hf_best = hf_out[0, len(PROMPTS[0]):].tolist()
        ours = outs[0].sequences[0].tokens[len(PROMPTS[0]):]
        assert hf_best[:len(ours)] != ours
        llm.engine.kv_cache_manager.check()


def test_params_are_checked_and_beam_search_is_deterministic_at_temperature_0(tiny_llm):
    from kvflow.errors import InvalidRequestError
    for bad, param in [(dict(beam_width=0), "beam_width"), (dict(beam_width=11), "beam_width"),
                       (dict(beam_width=2, max_tokens=0), "max_tokens"),
                       (dict(beam_width=2, length_penalty=float("nan")), "length_penalty"),
                       (dict(beam_width=2, temperature=-1), "temperature")]:
        with pytest.raises(InvalidRequestError) as e:
            BeamSearchParams(**bad)
        assert e.value.param == param
    with pytest.raises(InvalidRequestError) as e:       # the prompt and max_tokens do not fit the context
        tiny_llm.beam_search([list(range(1, 250))], BeamSearchParams(beam_width=2, max_tokens=16))
    assert e.value.param == "prompt"
    params = BeamSearchParams(beam_width=3, max_tokens=5, ignore_eos=True)
    a = tiny_llm.beam_search(["Hello there", {"prompt": "Hello there"}], params)
    b = tiny_llm.beam_search(["Hello there"], params, concurrency_limit=1)
    assert [s.tokens for s in a[0].sequences] == [s.tokens for s in a[1].sequences] == \
        [s.tokens for s in b[0].sequences]
    # temperature > 0: each beam's sampled token may join its candidates, as in vLLM; still width beams
    hot = tiny_llm.beam_search(["Hello there"], BeamSearchParams(beam_width=3, max_tokens=5, ignore_eos=True,
                                                                temperature=1.0))
    assert len(hot[0].sequences) == 3 and all(len(s.tokens) == len(a[0].sequences[0].tokens)
                                              for s in hot[0].sequences)
    tiny_llm.engine.kv_cache_manager.check()


# ---- memory: beams share their prompt's KV blocks ----------------------------------------------------------------

def test_beams_share_the_prompts_blocks_even_with_prefix_caching_off(tiny_dir):
    """A width-4 beam search over a 200-token prompt holds about one prompt's blocks plus each beam's tail, not 4
    prompts' worth, and computes the prompt once: its steps take the prefix cache (per request) while the engine's
    is off for everyone else."""
    width, max_tokens, prompt = 4, 8, list(range(1000, 1200))
    with make_llm(tiny_dir, enable_prefix_caching=False) as llm:
        kv, engine = llm.engine.kv_cache_manager, llm.engine
        prompt_blocks = kv.blocks_needed(len(prompt))          # 13 blocks of 16
        seen = []
        execute = engine.executor.execute

        def observed(step):          # the blocks held while the step runs: all of its requests' blocks
            held = [b for b, c in enumerate(kv.ref_cnt) if c]
            seen.append((len(held), max(kv.ref_cnt[b] for b in held)))
            return execute(step)

        engine.executor.execute = observed
        try:
            computed = engine.counters()["num_prompt_tokens_computed"]
            out = llm.beam_search([prompt], BeamSearchParams(beam_width=width, max_tokens=max_tokens, ignore_eos=True))
            computed = engine.counters()["num_prompt_tokens_computed"] - computed
        finally:
            engine.executor.execute = execute
        assert len(out[0].sequences) == width and len(seen) == max_tokens       # one engine step per beam step
        peak = max(held for held, _ in seen)
        # the prompt's blocks once, then per beam at most its own blocks since the beams parted, and its tail
        assert peak <= prompt_blocks + width * (kv.blocks_needed(max_tokens) + 1), seen
        assert peak < 2 * prompt_blocks, seen                  # not width copies of the prompt (52 blocks)
        assert max(shared for _, shared in seen) == width      # the prompt's blocks referenced by every beam
        # the prompt computed once; each later step computes at most a block per beam, not the prompt again
        assert computed <= len(prompt) + (max_tokens - 1) * width * kv.block_size, computed
        kv.check()
        # prefix caching stays off for other requests: the same prompt again computes it whole
        from kvflow import SamplingParams
        again = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1))
        assert again[0].num_cached_tokens == 0
        kv.check()


# ---- the server, with the official client ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def server(eos_dir):
    config = EngineConfig(model=str(eos_dir), dtype="float32", max_model_len=256, kv_cache_memory="16MiB",
                          served_model_name="tiny", enforce_eager=True, enable_prefix_caching=False)
    with ServerThread(config) as s:
        yield s


@pytest.fixture(scope="module")
def eos_llm(eos_dir):
    llm = make_llm(eos_dir)
    yield llm
    llm.shutdown()


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server.base_url, api_key="none", max_retries=0, timeout=120)


def expected_choices(llm: LLM, prompt_ids: list[int], params: BeamSearchParams):
    """LLM.beam_search's beams as the server answers them (vLLM's server): token ids without EOS unless
    include_stop_str_in_output, text without EOS, finish_reason "stop" on EOS (stop_reason its id) else "length"."""
    out = llm.beam_search([prompt_ids], params)[0]
    choices = []
    for s in out.sequences:
        generated = s.tokens[len(prompt_ids):]
        eos_end = s.finish_reason == "stop"
        ids = generated if (not eos_end or params.include_stop_str_in_output) else generated[:-1]
        text = llm.tokenizer.decode(generated[:-1] if eos_end else generated)
        choices.append((ids, text, s.finish_reason, s.stop_reason))
    return choices


def test_completions_beam_search_over_http_equals_llm_beam_search(server, client, eos_llm):
    prompts = ["The capital of France is", "Hello there"]
    r = client.completions.create(model="tiny", prompt=prompts, n=3, max_tokens=6, temperature=0,
                                  extra_body={"use_beam_search": True, "length_penalty": 0.5,
                                              "return_token_ids": True})
    assert len(r.choices) == 2 * 3
    stops, completion_tokens = 0, 0
    for k, prompt in enumerate(prompts):
        ids = eos_llm.tokenizer.encode(prompt)
        want = expected_choices(eos_llm, ids, BeamSearchParams(beam_width=3, max_tokens=6, length_penalty=0.5))
        got = r.choices[3 * k:3 * k + 3]
        assert [c.index for c in got] == [3 * k + i for i in range(3)]       # ranked best first, per prompt
        assert [(c.token_ids, c.text, c.finish_reason, c.model_extra.get("stop_reason")) for c in got] == want
        assert all(c.model_extra["prompt_token_ids"] == ids for c in got)
        stops += sum(c.finish_reason == "stop" for c in got)
        completion_tokens += sum(len(c.token_ids) for c in got)
    assert stops                                                      # some beams ended on EOS
    prompt_tokens = sum(len(eos_llm.tokenizer.encode(p)) for p in prompts)
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (prompt_tokens, completion_tokens)
    assert r.usage.total_tokens == prompt_tokens + completion_tokens
    server.wait_idle()
    server.core("check")


def test_completions_beam_search_fixed_length_echo_and_eos_in_token_ids(server, client, eos_llm):
    ids = eos_llm.tokenizer.encode("Once upon a time")
    r = client.completions.create(model="tiny", prompt="Once upon a time", n=4, max_tokens=5, temperature=0,
                                  echo=True, extra_body={"use_beam_search": True, "ignore_eos": True,
                                                         "length_penalty": 2.0, "return_token_ids": True})
    want = expected_choices(eos_llm, ids, BeamSearchParams(beam_width=4, max_tokens=5, ignore_eos=True,
                                                           length_penalty=2.0))
    assert [(c.token_ids, c.text) for c in r.choices] == [(i, "Once upon a time" + t) for i, t, _, _ in want]
    assert all(c.finish_reason == "length" and len(c.token_ids) == 5 for c in r.choices)
    assert r.usage.completion_tokens == 4 * 5
    # include_stop_str_in_output: a beam that ended on EOS keeps the EOS id in its token ids (not in its text)
    r = client.completions.create(model="tiny", prompt="Hello there", n=3, max_tokens=6, temperature=0,
                                  extra_body={"use_beam_search": True, "length_penalty": 0.5,
                                              "include_stop_str_in_output": True, "return_token_ids": True})
    want = expected_choices(eos_llm, eos_llm.tokenizer.encode("Hello there"),
                            BeamSearchParams(beam_width=3, max_tokens=6, length_penalty=0.5,
                                             include_stop_str_in_output=True))
    assert [(c.token_ids, c.text, c.finish_reason) for c in r.choices] == [w[:3] for w in want]
    assert any(c.finish_reason == "stop" and c.token_ids[-1] == 2 for c in r.choices)
    server.wait_idle()
    server.core("check")


def test_chat_beam_search_over_http_equals_llm_beam_search(server, client, eos_llm):
    messages = [{"role": "user", "content": "Name a color."}]
    r = client.chat.completions.create(model="tiny", messages=messages, n=2, max_completion_tokens=7,
                                       temperature=0, extra_body={"use_beam_search": True, "length_penalty": 0.0,
                                                                  "return_token_ids": True})
    ids = eos_llm.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    want = expected_choices(eos_llm, ids, BeamSearchParams(beam_width=2, max_tokens=7, length_penalty=0.0))
    assert [(c.index, c.message.role) for c in r.choices] == [(0, "assistant"), (1, "assistant")]
    assert [(c.token_ids, c.message.content, c.finish_reason) for c in r.choices] == [w[:3] for w in want]
    assert r.model_extra["prompt_token_ids"] == ids
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(ids), sum(len(w[0]) for w in want))
    server.wait_idle()
    server.core("check")


def test_streamed_chat_beam_search_sends_each_finished_beam_whole(server, client):
    """vLLM's chat streams a beam search: the roles first, then each beam's text in one chunk once the search is done
    (completions refuse stream, as vLLM's)."""
    kw = dict(model="tiny", messages=[{"role": "user", "content": "Name a color."}], n=3, max_tokens=6, temperature=0,
              extra_body={"use_beam_search": True, "length_penalty": 0.5})
    whole = client.chat.completions.create(**kw)
    texts, finishes, roles = ["", "", ""], [None] * 3, 0
    usage = None
    for chunk in client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}):
        usage = chunk.usage or usage
        for c in chunk.choices:
            roles += c.delta.role == "assistant"
            texts[c.index] += c.delta.content or ""
            finishes[c.index] = c.finish_reason or finishes[c.index]
    assert roles == 3
    assert texts == [c.message.content for c in whole.choices]
    assert finishes == [c.finish_reason for c in whole.choices]
    assert (usage.prompt_tokens, usage.completion_tokens) == (whole.usage.prompt_tokens, whole.usage.completion_tokens)
    server.wait_idle()
    server.core("check")


def test_beam_search_steps_share_the_prompt_on_the_server(server, client):
    """The server runs without --enable-prefix-caching; a width-3 search over a long prompt still computes the prompt
    once (its steps take the prefix cache), not once per beam and step."""
    prompt = " ".join(["word"] * 150)
    before = server.core("counters")["num_prompt_tokens_computed"]
    r = client.completions.create(model="tiny", prompt=prompt, n=3, max_tokens=6, temperature=0,
                                  extra_body={"use_beam_search": True, "ignore_eos": True})
    computed = server.core("counters")["num_prompt_tokens_computed"] - before
    assert len(r.choices) == 3 and r.usage.completion_tokens == 3 * 6
    assert r.usage.prompt_tokens <= computed <= r.usage.prompt_tokens + 5 * 3 * 16, computed
    server.wait_idle()
    server.core("check")


def test_a_client_that_goes_away_mid_search_frees_its_blocks(server):
    """The search is aborted between or during its steps: nothing is left running or holding blocks."""
    import httpx
    body = {"model": "tiny", "prompt": "Once upon a time", "n": 4, "max_tokens": 240, "ignore_eos": True,
            "temperature": 0, "use_beam_search": True}
    with pytest.raises(httpx.ReadTimeout):   # the whole search takes ~1 s on a 2-core Xeon: the client leaves early
        httpx.post(server.url + "/v1/completions", json=body, timeout=0.25)
    server.wait_idle()
    assert server.engine.last_stats.kv_cache_usage == 0 and not server.engine._beam_searches
    server.core("check")


@pytest.mark.parametrize("extra, param", [
    ({"stream": True}, "stream"),                  # vLLM refuses it too
    ({"n": 11}, "n"),                              # 2 * n logprobs per beam: at most 20
    ({"top_p": 0.5}, "top_p"),                     # a field vLLM's beam search drops
    ({"stop": ["x"]}, "stop"),
    ({"logprobs": 2}, "logprobs"),
    ({"early_stopping": True}, "early_stopping"),  # vLLM dropped it
    ({"use_beam_search": False, "length_penalty": 0.5}, "length_penalty"),   # nothing reads it without beam search
])
def test_bad_combinations_are_a_400_naming_the_param(server, client, extra, param):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny", prompt="hi", max_tokens=2,
                                  extra_body={"use_beam_search": True, **extra})
    assert e.value.status_code == 400 and e.value.body["param"] == param, e.value.body


def test_a_forced_tool_choice_is_a_400_with_beam_search(server, client):
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                       tools=[tool], tool_choice="required", extra_body={"use_beam_search": True})
    assert e.value.body["param"] == "tool_choice"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                       response_format={"type": "json_object"}, extra_body={"use_beam_search": True})
    assert e.value.body["param"] == "response_format"
