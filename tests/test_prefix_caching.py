"""Prefix caching: identical outputs with the cache on and off (shared prefixes while running, after
evictions), fewer prefill tokens computed for a shared system prompt, and cached_tokens over the API."""
from __future__ import annotations

import openai
import pytest

from kvflow.config import EngineConfig
from kvflow.core.engine_core import EngineCore
from kvflow.core.messages import AddRequest
from kvflow.sampling_params import SamplingParams
from tiny_models import make_tiny_hf_model

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_tiny_hf_model(tmp_path_factory.mktemp("tiny-prefix"), family="llama", seed=3)


def core(path, prefix: bool, kv_tokens: int = 4096) -> EngineCore:
    # tiny llama: 512 bytes of KV per token in float32
    return EngineCore(EngineConfig(model=str(path), dtype="float32", max_model_len=256,
                                   kv_cache_memory=kv_tokens * 512, enable_prefix_caching=prefix))


def run_staggered(engine: EngineCore, prompts: list[list[int]], every: int = 2) -> dict[str, list[int]]:
    """Add a request every `every` steps, so later ones arrive while earlier ones with the same prefix run."""
    out: dict[str, list[int]] = {}
    pending = list(enumerate(prompts))
    step = 0
    while pending or engine.has_unfinished_requests():
        if pending and step % every == 0:
            i, p = pending.pop(0)
            engine.add_request(AddRequest(str(i), p, GREEDY))
        for o in engine.step():
            out.setdefault(o.request_id, []).extend(o.new_token_ids)
        step += 1
    engine.kv_cache_manager.check()
    return out


def shared_prefix_prompts(groups: int, per_group: int, prefix_len: int = 70) -> list[list[int]]:
    prompts = []
    for g in range(groups):
        prefix = [(g * 131 + j * 7) % 40000 + 100 for j in range(prefix_len)]
        for q in range(per_group):
            prompts.append(prefix + [(g + q * 13 + j) % 30000 + 50 for j in range(3 + q)])
    return prompts


def test_outputs_identical_with_prefix_caching_on_and_off_while_sharing(tiny_dir):
    prompts = shared_prefix_prompts(groups=2, per_group=4)
    with_cache = core(tiny_dir, prefix=True)
    on = run_staggered(with_cache, prompts)
    off = run_staggered(core(tiny_dir, prefix=False), prompts)
    assert on == off
    assert with_cache.kv_cache_manager.prefix_cache_hits > 0


def test_outputs_identical_after_evictions_under_a_small_cache(tiny_dir):
    # 20 blocks of 16 tokens: each group's ~75-token prompts need 5+ blocks, so groups evict each other
    prompts = shared_prefix_prompts(groups=5, per_group=3) + shared_prefix_prompts(groups=1, per_group=3)
    small = core(tiny_dir, prefix=True, kv_tokens=20 * 16)
    on = run_staggered(small, prompts, every=3)
    off = run_staggered(core(tiny_dir, prefix=False), prompts, every=3)
    assert on == off
    kv = small.kv_cache_manager
    assert kv.prefix_cache_hits > 0 and kv.num_evictions > 0


@pytest.mark.slow
def test_shared_system_prompt_is_computed_once(smol_llm):
    """~500-token system prompt x 32 questions: after the first request, prefill computes >= 90% fewer
    of the shared tokens."""
    tok = smol_llm.tokenizer
    system = "You are a meticulous assistant for a logistics company. " + " ".join(
        f"Rule {i}: always check shipment {i} against manifest {i * 7} before answering." for i in range(26))
    convs = [[{"role": "system", "content": system}, {"role": "user", "content": f"Question {i}: where is box {i}?"}]
             for i in range(32)]
    prompts = [tok.apply_chat_template(c) for c in convs]
    shared = min(next(j for j, (a, b) in enumerate(zip(prompts[0], p)) if a != b) for p in prompts[1:])
    assert 450 <= shared <= 650
    engine = smol_llm.engine
    engine.kv_cache_manager.reset_prefix_cache()
    params = SamplingParams(temperature=0.0, max_tokens=2)
    first = smol_llm.generate([{"prompt_token_ids": prompts[0]}], params)
    before = engine.num_prompt_tokens_computed
    rest = smol_llm.generate([{"prompt_token_ids": p} for p in prompts[1:]], params)
    computed = engine.num_prompt_tokens_computed - before
    total = sum(len(p) for p in prompts[1:])
    shared_total = 31 * shared
    saved = total - computed
    assert saved >= 0.9 * shared_total, f"saved {saved} of {shared_total} shared prompt tokens"
    assert all(o.num_cached_tokens >= shared - 16 for o in rest)
    assert first[0].num_cached_tokens == 0


@pytest.mark.slow
def test_cached_tokens_reported_through_the_api(tiny_dir):
    from kvflow.server.testing import ServerThread
    config = EngineConfig(model=str(tiny_dir), dtype="float32", max_model_len=256, kv_cache_memory="32MiB")
    with ServerThread(config) as server:
        client = openai.OpenAI(base_url=server.base_url, api_key="x")
        system = "Shared instructions. " * 30
        usages = []
        for i in range(3):
            r = client.chat.completions.create(
                model=client.models.list().data[0].id, max_tokens=4, temperature=0,
                messages=[{"role": "system", "content": system}, {"role": "user", "content": f"q{i}"}])
            usages.append(r.usage)
        assert usages[0].prompt_tokens_details.cached_tokens == 0
        for u in usages[1:]:
            assert u.prompt_tokens_details.cached_tokens >= u.prompt_tokens - 32
            assert u.prompt_tokens_details.cached_tokens % 16 == 0
        server.wait_idle()
        server.core("check")
