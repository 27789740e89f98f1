"""SamplingParams frozen once checked (a change is a new, checked object; n > 1's children are copies made without
checking again) and the one request record (AddRequest) the core builds its Request from."""
import dataclasses

import pytest

from kvflow.core.messages import AddRequest
from kvflow.errors import InvalidRequestError
from kvflow.lora_request import LoRARequest
from kvflow.request import Request
from kvflow.sampling_params import SamplingParams


def test_vllms_constructor_spelling_normalizes_and_checks():
    params = SamplingParams(temperature=0, max_tokens=32, stop="x", top_k=-1)
    assert (params.greedy, params.max_tokens, params.stop, params.top_k) == (True, 32, ["x"], 0)
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(temperature=0, max_tokens=0)
    assert e.value.param == "max_tokens"


def test_checked_params_are_frozen_and_a_change_is_checked_again():
    params = SamplingParams(max_tokens=8)
    with pytest.raises(dataclasses.FrozenInstanceError):
        params.max_tokens = 9
    assert dataclasses.replace(params, max_tokens=9).max_tokens == 9 and params.max_tokens == 8
    with pytest.raises(InvalidRequestError) as e:
        dataclasses.replace(params, top_p=0.0)
    assert e.value.param == "top_p"


def test_children_are_seeded_copies_not_checked_again(monkeypatch):
    params = SamplingParams(n=3, seed=2**63 - 2, prompt_logprobs=1, stop=["x"], max_tokens=4)
    monkeypatch.setattr(SamplingParams, "validate", lambda self: pytest.fail("a child was checked again"))
    children = [params.child(i) for i in range(3)]
    assert [(c.n, c.seed, c.prompt_logprobs) for c in children] == [
        (1, 2**63 - 2, 1), (1, 2**63 - 1, None), (1, -(2**63), None)]     # seed + i, wrapped into int64
    assert all(c.stop == ["x"] and c.max_tokens == 4 for c in children)
    assert (params.n, params.seed, params.prompt_logprobs) == (3, 2**63 - 2, 1)     # the parent is unchanged


def test_bad_words_resolve_into_new_params():
    params = SamplingParams(bad_words=["ab"])
    resolved = params.with_bad_words_resolved(lambda text, _special: [ord(c) for c in text])
    assert params.bad_words_token_ids is None
    assert resolved.bad_words_token_ids == [[97, 98]]     # " ab" is one token longer: only the bare word
    plain = SamplingParams()
    assert resolved.with_bad_words_resolved(None) is resolved and plain.with_bad_words_resolved(None) is plain


def test_the_core_builds_its_request_from_the_record():
    lora = LoRARequest("a", 1, "/adapters/a")
    add = AddRequest("r", [1, 2, 3], SamplingParams(max_tokens=5), 12.5, max_tokens=5, priority=3, lora=lora,
                     cache_prefix=True)
    req = Request.from_add_request(add, frozenset({2}))
    assert (req.request_id, req.prompt_token_ids, req.params, req.max_tokens, req.arrival_time, req.priority,
            req.lora, req.cache_prefix, req.pooling, req.eos_token_ids) == (
        "r", [1, 2, 3], add.params, 5, 12.5, 3, lora, True, None, frozenset({2}))
    with pytest.raises(ValueError, match="max_tokens"):     # not admitted: EngineCore checks it first
        Request.from_add_request(dataclasses.replace(add, max_tokens=None))
