"""The engine's features on the hybrid families (LFM2, Qwen3.5, Granite 4.0 H: recurrent state beside the KV blocks),
random-weight tiny models in float32, each against transformers' greedy tokens: alone and in a mixed batch; a prompt
prefilled in chunks of several sizes (the bits do not move with the split); after preemption (state freed and
recomputed); from prefix-cache hits that restore a state checkpoint (a repeated prompt, and a shared prefix's
junction); with n-gram speculation (rejected drafts rolled back from snapshots). The state cache's books balance after
each (`check()`)."""
from __future__ import annotations

import pytest
import torch

from kvflow import LLM, SamplingParams
from kvflow.runner.state_memory import plan_state_slots
from tiny_models import make_tiny_hf_model
from transformers_greedy import assert_greedy_matches

FAMILIES = ["lfm2", "qwen3_5", "granitemoehybrid"]
MAX_TOKENS = 16
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


def rand_prompts(seed: int = 11) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    rand = lambda n: torch.randint(10, 40000, (n,), generator=g).tolist()     # noqa: E731
    shared = rand(37)
    # a repeating pattern, so n-gram speculation finds drafts in the prompt
    pattern = rand(6) * 8
    return [rand(3), rand(21), rand(90), shared + rand(5), shared + rand(11), pattern, [42]]


@pytest.fixture(scope="module", params=FAMILIES)
def family_model(request, tmp_path_factory):
    from transformers import AutoModelForCausalLM

    path = make_tiny_hf_model(tmp_path_factory.mktemp(request.param), family=request.param, seed=3)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return request.param, path, hf


def llm(path, **engine) -> LLM:
    return LLM(str(path), dtype="float32", max_model_len=256, kv_cache_memory=engine.pop("kv_cache_memory", "64MiB"),
               **engine)


def generate(model: LLM, prompts) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in model.generate(prompts, GREEDY)]


def assert_matches(hf, prompts, got, what):
    for p, tokens in zip(prompts, got):
        assert_greedy_matches(hf, p, tokens, what, MAX_TOKENS)


def test_batched_chunked_and_cached_outputs_match_transformers(family_model):
    family, path, hf = family_model
    prompts = rand_prompts()
    model = llm(path, max_num_batched_tokens=32)
    batched = generate(model, prompts)
    assert_matches(hf, prompts, batched, f"{family}, batched: ")
    hits = model.engine.kv_cache_manager.prefix_cache_hits
    again = generate(model, prompts)         # every prompt of a whole block or more restores a checkpoint
    assert model.engine.kv_cache_manager.prefix_cache_hits > hits
    assert again == batched, "prefix-cache hits (restored state checkpoints) changed the output"
    model.engine.kv_cache_manager.check()
    # alone, and with other chunk sizes: the same bits
    for budget in (7, 1024):
        alone = [generate(llm(path, max_num_batched_tokens=budget, enable_prefix_caching=False), [p])[0]
                 for p in prompts[:3]]
        assert alone == batched[:3], f"{family}: budget {budget} alone differs from the batched run"


def test_a_shared_prefix_junction_gets_a_checkpoint(family_model):
    family, path, hf = family_model
    g = torch.Generator().manual_seed(5)
    system = torch.randint(10, 40000, (40,), generator=g).tolist()      # 2 whole blocks of 16, and 8 more
    asks = [torch.randint(10, 40000, (n,), generator=g).tolist() for n in (6, 9, 13)]
    model = llm(path)
    kv = model.engine.kv_cache_manager
    out = []
    for ask in asks:
        before = kv.prefix_cache_hits
        out.append(generate(model, [system + ask])[0])
        hit = kv.prefix_cache_hits - before
    # the first request checkpoints its own prompt's end, the second the junction (32 tokens), the third starts there
    assert hit == 32
    assert_matches(hf, [system + a for a in asks], out, f"{family}, shared prefix: ")
    kv.check()


def test_preemption_frees_the_state_and_recomputes(family_model):
    family, path, hf = family_model
    g = torch.Generator().manual_seed(9)
    prompts = [torch.randint(10, 40000, (n,), generator=g).tolist() for n in (60, 70, 80, 90, 100)]
    # the least budget that runs all five at once (a live state slot each) and leaves 10 blocks (8 hold one request
    # of max_model_len): they need ~35 blocks, so running requests are preempted and recomputed
    probe = llm(path, enable_prefix_caching=False).engine.runner
    per_block, slot = probe.kv_cache_bytes // probe.num_blocks, probe.state_slots.slot_bytes
    budget = 8 * per_block + slot
    while True:
        live = plan_state_slots(budget, slot, per_block, 8, 5, 0, False).live
        if live == 5 and (budget - live * slot) // per_block >= 10:
            break
        budget += per_block // 2
    model = LLM(str(path), dtype="float32", max_model_len=128, kv_cache_memory=budget, max_num_seqs=5,
                max_num_batched_tokens=64, enable_prefix_caching=False)
    got = generate(model, prompts)
    assert model.engine.scheduler.num_preemptions > 0
    assert_matches(hf, prompts, got, f"{family}, preempted: ")
    model.engine.kv_cache_manager.check()


class KnownContinuation:
    """A draft source that knows each prompt's greedy output: it proposes the right next tokens, except one wrong token
    at every third position it drafts — so steps accept some drafts and reject the rest, and the recurrent state must
    be rolled back to the last accepted token each time. (n-gram lookup finds no drafts in a random model's output.)"""

    def __init__(self, outputs: dict[tuple, list[int]]):
        self.outputs = outputs
        self.drafted = 0

    def propose(self, request_id: str, token_ids: list[int], k: int) -> list[int]:
        for prompt, out in self.outputs.items():
            n = len(prompt)
            if tuple(token_ids[:n]) == prompt:
                done = len(token_ids) - n
                drafts = []
                for j in range(done, min(done + k, len(out))):
                    self.drafted += 1
                    drafts.append(out[j] if self.drafted % 3 else 7)
                return drafts
        return []

    def finished(self, request_id, token_ids, num_prompt_tokens) -> None:
        pass


def test_speculation_rolls_the_state_back_to_the_last_accepted_token(family_model):
    family, path, hf = family_model
    prompts = rand_prompts()
    plain = generate(llm(path), prompts)
    spec = llm(path, speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    sched = spec.engine.scheduler
    sched.proposer = KnownContinuation({tuple(p): o for p, o in zip(prompts, plain)})
    got = generate(spec, prompts)
    assert sched.spec_num_draft_tokens > 0
    assert 0 < sched.spec_num_accepted_tokens < sched.spec_num_draft_tokens, "drafts all accepted or all rejected"
    assert got == plain, "speculation changed the greedy output"
    spec.engine.kv_cache_manager.check()
