"""Speculative decoding (n-gram prompt lookup and suffix decoding): the proposers, the verification rule, and the
engine's output with speculation on against off — greedy token for token (alone, 32 at once, with prefix caching
and preemption), seeded sampling equal, unseeded sampling's distribution equal (chi-square)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from kvflow import LLM, SamplingParams
from kvflow.config import EngineConfig
from kvflow.core.kv_cache_manager import KVCacheManager
from kvflow.core.scheduler import Scheduler
from kvflow.request import Request, RequestStatus
from kvflow.runner.step import SampledTokens
from kvflow.spec_decode.ngram import ngram_lookup
from kvflow.spec_decode.suffix import SuffixProposer
from tiny_models import make_tiny_hf_model

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 1}
SUFFIX = {"method": "suffix", "num_speculative_tokens": 4}

CODE = ("def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\n"
        "def mul(a, b):\n    return a * b\n\ndef div(a, b):\n    return a / b\n")


# ---- proposers -------------------------------------------------------------------------------------------------
def test_ngram_lookup_proposes_what_followed_the_latest_earlier_occurrence():
    seq = np.array([1, 2, 3, 4, 5, 9, 1, 2, 3, 7, 1, 2, 3])
    assert ngram_lookup(seq, 3, 1, 4) == [7, 1, 2]            # the latest earlier "1 2 3" was followed by 7
    assert ngram_lookup(seq, 2, 4, 4) == []                   # "3 1 2 3" never came before
    assert ngram_lookup(np.array([5, 6, 7]), 3, 1, 3) == []   # nothing recurs
    assert ngram_lookup(np.array([8, 8]), 4, 1, 2) == [8, 8, 8, 8]          # a loop of period 1 goes on
    assert ngram_lookup(np.array([5, 1, 2, 1, 2]), 5, 2, 2) == [1, 2, 1, 2, 1]   # period 2


def test_suffix_proposer_follows_the_most_frequent_continuation_of_recent_outputs():
    s = SuffixProposer(k=8, max_depth=24, max_cached_requests=2, min_token_prob=0.3, spec_factor=4.0)
    for out in ([7, 8, 9, 10, 11], [7, 8, 9, 10, 12], [7, 8, 9, 13, 14]):
        s.finished("r", [0] + out, 1)
    # the last two outputs are cached (the bound): after "7 8", 9 twice, then 10 once and 13 once (1/2 each)
    assert s.propose("q", [3, 7, 8], 8) == [9, 10, 12]
    assert len(s._outputs) == 2 and s.num_cached_tokens == 10
    assert SuffixProposer(8, 24, 2, 0.6, 4.0).propose("q", [3, 7, 8], 8) == []   # nothing cached, no repeat
    own = SuffixProposer(8, 24, 0, 0.1, 1.0)                                       # its own tokens only
    assert own.propose("q", [4, 5, 6, 1, 4, 5], 8) == [6, 1]                       # spec factor: 1 x match (2)


@pytest.mark.parametrize("bad, field", [
    ({"method": "eagle"}, "method"), ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 17}, "num_speculative_tokens"),
    ({"method": "ngram", "prompt_lookup_min": 5, "prompt_lookup_max": 2}, "prompt_lookup_min"),
    ({"method": "suffix", "speculative_model": "x"}, "speculative_model"), ({"num_speculative_tokens": 2}, "method"),
    ("{not json", "JSON"),
])
def test_bad_speculative_configs_are_refused_at_start_naming_the_field(bad, field):
    with pytest.raises(ValueError, match=field):
        EngineConfig(speculative_config=bad)


# ---- the verification rule, in the scheduler ---------------------------------------------------------------------
def test_a_speculating_request_is_decode_rows_and_keeps_the_targets_up_to_the_first_mismatch():
    kv = KVCacheManager(64, 4, enable_prefix_caching=True)
    sched = Scheduler(EngineConfig(speculative_config=NGRAM), kv, max_model_len=256)
    req = Request("a", [1, 2, 3, 4, 1, 2], SamplingParams(max_tokens=20, ignore_eos=True), 20)
    sched.add_request(req)
    out = sched.schedule()                                     # the prefill
    sched.update(out, SampledTokens([3], [None]))              # 1 2 3 4 1 2 | 3: "1 2 3" came first at 0
    out = sched.schedule()
    (s,) = out.scheduled
    assert s.draft_token_ids == (4, 1, 2, 3) and s.num_new_tokens == 5   # what followed it there
    batch = out.step.batch
    assert batch.num_decodes == 5 and batch.num_new_tokens == [1] * 5
    assert batch.token_ids == [3, 4, 1, 2, 3] and batch.num_computed_tokens == [6, 7, 8, 9, 10]
    assert [len(r.token_ids) for r in out.step.sampling] == [7, 8, 9, 10, 11]   # each target sees the drafts before
    # the targets: 4 and 1 accepted, then 9 instead of 2
    (o,) = sched.update(out, SampledTokens([4, 1, 9, 5, 6], [None] * 5))
    assert o.new_token_ids == [4, 1, 9]
    assert req.token_ids == [1, 2, 3, 4, 1, 2, 3, 4, 1, 9] and req.num_computed_tokens == 9
    assert (sched.spec_num_drafts, sched.spec_num_draft_tokens, sched.spec_num_accepted_tokens) == (1, 4, 2)
    assert sched.spec_accepted_per_pos == [1, 1, 0, 0]
    sched.abort(["a"])
    kv.check()


def test_a_stop_among_the_accepted_tokens_ends_the_request_there():
    kv = KVCacheManager(64, 4, enable_prefix_caching=False)
    sched = Scheduler(EngineConfig(speculative_config=NGRAM), kv, max_model_len=256)
    req = Request("a", [1, 2, 3, 1, 2], SamplingParams(max_tokens=20, stop_token_ids=[1]), 20)
    sched.add_request(req)
    sched.update(sched.schedule(), SampledTokens([3], [None]))
    out = sched.schedule()
    assert out.scheduled[0].draft_token_ids == (1, 2, 3, 1)      # "1 2 3" repeats: so does the proposal
    (o,) = sched.update(out, SampledTokens([1, 2, 3, 4, 5], [None] * 5))
    assert o.new_token_ids == [1] and o.finish_reason == "stop" and o.stop_reason == 1
    assert req.status == RequestStatus.FINISHED_STOPPED
    kv.check()


def test_drafts_never_exceed_max_tokens():
    kv = KVCacheManager(64, 4, enable_prefix_caching=False)
    sched = Scheduler(EngineConfig(speculative_config=NGRAM), kv, max_model_len=256)
    req = Request("a", [1, 2, 3, 1, 2], SamplingParams(max_tokens=3, ignore_eos=True), 3)
    sched.add_request(req)
    sched.update(sched.schedule(), SampledTokens([3], [None]))
    out = sched.schedule()
    assert out.scheduled[0].draft_token_ids == (1,)           # 1 output so far: 1 draft + 1 target = 3
    (o,) = sched.update(out, SampledTokens([1, 2], [None] * 2))
    assert o.new_token_ids == [1, 2] and o.finish_reason == "length" and req.num_output_tokens == 3
    kv.check()


def test_a_reasoning_request_drafts_up_to_its_end_marker_and_the_grammar_masks_the_row_after(smollm2_tokenizer):
    """A draft that ends the reasoning is the last one verified: the rows before it reason freely (no matcher), the
    row after it is the grammar's (a fresh matcher), and the accepted marker opens the grammar to the next token."""
    from kvflow.structured_output import GrammarCompiler, spec_from_request
    from kvflow.structured_output.thinking import ThinkingSpec

    compiler = GrammarCompiler(smollm2_tokenizer)
    try:
        compiled = compiler.compile(spec_from_request({"structured_outputs": {"regex": "a+"}}))
    finally:
        compiler.close()
    a = smollm2_tokenizer.encode("a", add_special_tokens=False)[0]
    kv = KVCacheManager(64, 4, enable_prefix_caching=False)
    sched = Scheduler(EngineConfig(speculative_config=NGRAM), kv, max_model_len=256)
    params = SamplingParams(max_tokens=20, ignore_eos=True, structured=compiled, thinking=ThinkingSpec((5, 6)))
    req = Request("a", [1, 2, 5, 6, 9, 8, 1], params, 20)
    sched.add_request(req)
    out = sched.schedule()
    assert out.step.sampling[0].matcher is None                      # the first token is the reasoning's
    sched.update(out, SampledTokens([2], [None]))                    # "1 2" came first at 0: 5 6 9 8 follow it
    out = sched.schedule()
    assert out.scheduled[0].draft_token_ids == (5, 6)                # up to the end marker, that one included
    assert [r.matcher is req.matcher for r in out.step.sampling] == [False, False, True]
    (o,) = sched.update(out, SampledTokens([5, 6, a], [None] * 3))
    assert o.new_token_ids == [5, 6, a] and not req.thinking.in_reasoning and req.matcher.is_complete()
    out = sched.schedule()
    assert out.scheduled[0].draft_token_ids == () and out.step.sampling[0].matcher is req.matcher
    sched.abort(["a"])
    kv.check()


def test_a_spent_thinking_budget_stops_the_drafts_and_forces_the_marker():
    from kvflow.structured_output.thinking import ThinkingSpec

    kv = KVCacheManager(64, 4, enable_prefix_caching=False)
    sched = Scheduler(EngineConfig(speculative_config=NGRAM), kv, max_model_len=256)
    spec = ThinkingSpec((5, 6), budget=3, forced_token_ids=(4, 5, 6))
    req = Request("a", [1, 2, 9, 8, 7, 1], SamplingParams(max_tokens=20, ignore_eos=True, thinking=spec), 20)
    sched.add_request(req)
    sched.update(sched.schedule(), SampledTokens([2], [None]))        # one reasoning token
    out = sched.schedule()
    assert out.scheduled[0].draft_token_ids == (9, 8)                # the budget is spent after the second
    assert [r.forced_token_id for r in out.step.sampling] == [None, None, 4]
    (o,) = sched.update(out, SampledTokens([9, 8, 4], [None] * 3))
    assert o.new_token_ids == [9, 8, 4]
    for forced in (5, 6):                                            # no drafts while tokens are forced
        out = sched.schedule()
        assert out.scheduled[0].draft_token_ids == () and out.step.sampling[0].forced_token_id == forced
        sched.update(out, SampledTokens([forced], [None]))
    assert not req.thinking.in_reasoning and req.thinking.thought == 3
    out = sched.schedule()
    assert out.step.sampling[-1].forced_token_id is None             # the answer: the model's, drafts again
    sched.abort(["a"])
    kv.check()


# ---- the engine: speculation on against off ----------------------------------------------------------------------
def prompts(tokenizer) -> list[list[int]]:
    texts = [f"Repeat this code exactly:\n{CODE}\nThe code again:\n",
             f"Here is a list: apples, pears, plums, apples, pears, plums, apples,",
             f"Copy the text.\nText: {CODE[:60]}\nCopy:",
             "The capital of France is", "Why is the sky blue?", "1, 2, 3, 4, 5, 6, 7, 8,"]
    return [tokenizer.encode(texts[i % len(texts)] + " " * (i // len(texts))) for i in range(32)]


@pytest.fixture(scope="module")
def greedy_reference(smol_llm):
    ids = prompts(smol_llm.tokenizer)
    params = SamplingParams(temperature=0.0, max_tokens=24)
    return ids, params, [o.outputs[0].token_ids for o in smol_llm.generate(ids, params)]


@pytest.mark.slow
@pytest.mark.parametrize("spec", [NGRAM, SUFFIX], ids=["ngram", "suffix"])
def test_greedy_output_with_speculation_is_token_for_token_the_same(greedy_reference, spec):
    ids, params, reference = greedy_reference
    # a KV cache too small for 32 at once (preemption) with prefix caching on: ~900 tokens of float32 KV
    llm = LLM(dtype="float32", max_model_len=512, kv_cache_memory="40MiB", speculative_config=spec)
    alone = [llm.generate([p], params)[0].outputs[0].token_ids for p in ids[:6]]
    assert alone == reference[:6]
    together = [o.outputs[0].token_ids for o in llm.generate(ids, params)]
    sched = llm.engine.scheduler
    assert together == reference
    assert sched.num_preemptions > 0 and llm.engine.kv_cache_manager.prefix_cache_hits > 0
    assert sched.spec_num_accepted_tokens > 50, (sched.spec_num_drafts, sched.spec_num_accepted_tokens)
    llm.engine.kv_cache_manager.check()


@pytest.mark.slow
def test_seeded_sampling_with_speculation_gives_the_same_output_as_without(smol_llm):
    ids = prompts(smol_llm.tokenizer)[:4]
    params = [SamplingParams(temperature=0.8, top_k=50, max_tokens=16, seed=100 + i) for i in range(len(ids))]
    without = [o.outputs[0].token_ids for o in smol_llm.generate(ids, params)]
    llm = LLM(dtype="float32", max_model_len=1024, kv_cache_memory="128MiB", speculative_config=NGRAM)
    first = [o.outputs[0].token_ids for o in llm.generate(ids, params)]
    again = [o.outputs[0].token_ids for o in llm.generate(ids[::-1], params[::-1])][::-1]
    assert first == again == without            # each position's seed is its own, speculating or not
    assert llm.engine.scheduler.spec_num_accepted_tokens > 0


def chi_square_p(a: np.ndarray, b: np.ndarray) -> float:
    """The p-value of a chi-square test that two samples' category counts come from one distribution."""
    table = np.stack([a, b]).astype(np.float64)
    table = table[:, table.sum(0) > 0]
    expected = table.sum(1, keepdims=True) * table.sum(0, keepdims=True) / table.sum()
    stat = ((table - expected) ** 2 / expected).sum()
    df = table.shape[1] - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


@pytest.fixture(scope="module")
def tiny_llama_dir(tmp_path_factory):
    return make_tiny_hf_model(tmp_path_factory.mktemp("tiny-llama-spec"), family="llama", seed=0)


@pytest.mark.slow
def test_unseeded_sampling_has_the_same_distribution_with_speculation(tiny_llama_dir):
    # six tokens only; the prompt holds each of them with a continuation, so every step has drafts
    allowed = [300, 301, 302, 303, 304, 305]
    prompt = [1] + [allowed[j] for j in (0, 3, 1, 4, 2, 5, 0, 1, 2, 3, 4, 5, 5, 4, 3, 2, 1, 0)]
    params = SamplingParams(temperature=1.0, max_tokens=3, allowed_token_ids=allowed, ignore_eos=True)
    samples = {}
    for name, spec in (("off", None), ("ngram", NGRAM)):
        # 8 at a time: a step's draft rows stay within the largest compiled bucket (32), so at 128 running
        # requests nothing would speculate
        llm = LLM(str(tiny_llama_dir), dtype="float32", max_model_len=64, kv_cache_memory="16MiB", max_num_seqs=8,
                  speculative_config=spec, seed=1 if spec else 2, enable_prefix_caching=False)
        outs = llm.generate([prompt] * 2000, params)
        samples[name] = np.array([o.outputs[0].token_ids for o in outs])
        if spec:
            assert llm.engine.scheduler.spec_num_accepted_tokens > 200      # speculation did run
    for pos in range(3):         # each position's token, and the pair of the last two (its conditional)
        counts = [np.bincount(samples[n][:, pos] - 300, minlength=6) for n in ("off", "ngram")]
        assert chi_square_p(*counts) > 0.01, (pos, counts)
    pair = [np.bincount((samples[n][:, 1] - 300) * 6 + samples[n][:, 2] - 300, minlength=36) for n in ("off", "ngram")]
    assert chi_square_p(*pair) > 0.01, pair


@pytest.mark.slow
def test_the_server_speculates_and_reports_vllm_spec_decode_metrics():
    import httpx
    import openai

    from kvflow.server.testing import ServerThread

    config = EngineConfig(dtype="float32", max_model_len=512, kv_cache_memory="64MiB", served_model_name="smol",
                          speculative_config='{"method": "ngram", "num_speculative_tokens": 3}')
    with ServerThread(config) as server:
        client = openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0, timeout=300)
        r = client.completions.create(model="smol", prompt=f"Repeat this code exactly:\n{CODE}\nThe code again:\n",
                                      temperature=0, max_tokens=24)
        assert r.usage.completion_tokens == 24
        server.wait_idle()
        text = httpx.get(server.url + "/metrics").text
    values = {line.split("{")[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
              if line.startswith("vllm:spec_decode") and 'position="0"' not in line}
    assert values["vllm:spec_decode_num_drafts_total"] > 0
    assert 0 < values["vllm:spec_decode_num_accepted_tokens_total"] <= values["vllm:spec_decode_num_draft_tokens_total"]
    assert 'vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name="smol",position="2"}' in text


def test_draft_rows_keep_a_step_within_the_largest_compiled_bucket():
    kv = KVCacheManager(128, 4, enable_prefix_caching=False)
    sched = Scheduler(EngineConfig(speculative_config=NGRAM, compile_batch_sizes=(1, 2, 4, 8)), kv, max_model_len=256)
    for i in range(3):
        sched.add_request(Request(str(i), [1, 2, 3, 1, 2], SamplingParams(max_tokens=20, ignore_eos=True), 20))
    out = sched.schedule()
    sched.update(out, SampledTokens([3] * 3, [None] * 3))
    out = sched.schedule()
    assert [len(s.draft_token_ids) for s in out.scheduled] == [4, 1, 0]   # 3 rows + 5 drafts = 8
    assert len(out.step.batch.token_ids) == 8


@pytest.mark.slow
def test_speculation_across_the_end_of_the_reasoning_gives_the_same_output_as_without(smol_llm):
    """A few-shot prompt the model copies: n-gram drafts run through `</think>` into the answer the shots gave, which
    the grammar forbids. Greedy and seeded outputs are those without speculation, the answer valid JSON, and drafts
    were accepted; with a thinking budget too."""
    import json

    from kvflow.structured_output.thinking import ThinkingSpec

    tok = smol_llm.tokenizer
    shot = "<think>I add the numbers.</think>The answer is 4.\n"
    prompt = tok.encode(f"user: What is 2 + 2?\n{shot}{shot}{shot}user: What is 2 + 2?\n<think>")
    end = tuple(tok.encode("</think>", add_special_tokens=False))
    schema = {"type": "object", "properties": {"answer": {"enum": [3, 4, 5]}}, "required": ["answer"],
              "additionalProperties": False}
    params = []
    for budget in (None, 3):
        spec = ThinkingSpec(end, budget=budget, forced_token_ids=end if budget is not None else ())
        params += [SamplingParams(temperature=0.0, max_tokens=40, structured_outputs={"json": schema}, thinking=spec)]
        params += [SamplingParams(temperature=1.0, seed=7 + i, max_tokens=40, structured_outputs={"json": schema},
                                  thinking=spec) for i in range(2)]
    without = smol_llm.generate([prompt] * len(params), params)
    llm = LLM(dtype="float32", max_model_len=1024, kv_cache_memory="128MiB", speculative_config=NGRAM)
    with_spec = llm.generate([prompt] * len(params), params)
    assert [o.outputs[0].token_ids for o in with_spec] == [o.outputs[0].token_ids for o in without]
    for o, p in zip(with_spec, params):
        thought, marker, answer = o.outputs[0].text.partition("</think>")
        assert marker or (p.thinking.budget is None and p.temperature > 0)    # a free sample may reason to the end
        assert not marker or json.loads(answer)["answer"] in (3, 4, 5), o.outputs[0].text
        if p.thinking.budget is not None:
            assert len(tok.encode(thought, add_special_tokens=False)) <= p.thinking.budget + 1
    assert with_spec[0].outputs[0].text.startswith("I add the numbers.</think>")
    assert llm.engine.scheduler.spec_num_accepted_tokens > 3
