"""The one request check (RequestValidator, with SamplingParams.validate): each bad field raises
InvalidRequestError naming that field (`param`) with a stable `code`, which the server maps to a 400."""
import pytest

from kvflow.core.request_validator import RequestValidator
from kvflow.errors import InvalidRequestError
from kvflow.sampling_params import SamplingParams

VALIDATOR = RequestValidator(vocab_size=100, max_model_len=64)

BAD_FIELDS = [
    ("n", 0), ("n", 1.5), ("temperature", -1.0), ("temperature", 0.001), ("temperature", float("nan")),
    ("top_p", 0.0), ("top_p", 1.5), ("top_k", -2), ("top_k", 2**31), ("min_p", 2.0), ("seed", 2**63),
    ("max_tokens", 0), ("min_tokens", -1), ("presence_penalty", 3.0), ("frequency_penalty", -3.0),
    ("repetition_penalty", 0.0), ("logprobs", 21), ("stop", [""]), ("stop", ["x"] * 65), ("stop", ["a" * 1025]),
    ("stop_token_ids", [-1]), ("stop_token_ids", [True]), ("logit_bias", {-1: 1.0}), ("logit_bias", {5: 101.0}),
    ("structured_outputs", "json"),
]


@pytest.mark.parametrize("field,value", BAD_FIELDS)
def test_each_bad_field_is_named_with_a_code(field, value):
    params = SamplingParams(max_tokens=8)
    object.__setattr__(params, field, value)     # as a request that skipped the constructor's own check (frozen)
    with pytest.raises(InvalidRequestError) as e:
        VALIDATOR.validate([1, 2, 3], params)
    assert (e.value.param, e.value.code) == (field, "invalid_value")
    with pytest.raises(InvalidRequestError) as e:     # the constructor runs the same check
        SamplingParams(**{"max_tokens": 8, field: value})
    assert e.value.param == field


def test_min_tokens_above_max_tokens():
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(max_tokens=2, min_tokens=3)
    assert (e.value.param, e.value.code) == ("min_tokens", "invalid_value")


@pytest.mark.parametrize("field,value", [("stop_token_ids", [100]), ("logit_bias", {100: 1.0})])
def test_token_ids_outside_the_vocabulary(field, value):
    with pytest.raises(InvalidRequestError) as e:
        VALIDATOR.validate([1], SamplingParams(**{field: value}))
    assert (e.value.param, e.value.code) == (field, "invalid_value")
    assert "100" in e.value.message and "[0, 100)" in e.value.message


@pytest.mark.parametrize("prompt,params,code", [
    ([], SamplingParams(), "invalid_value"),
    ([1, 100], SamplingParams(), "invalid_value"),                    # outside the vocabulary
    ([1, -1], SamplingParams(), "invalid_value"),
    ([1, "2"], SamplingParams(), "invalid_value"),
    ([1] * 64, SamplingParams(max_tokens=None), "context_length_exceeded"),   # no room to generate
    ([1] * 60, SamplingParams(max_tokens=5), "context_length_exceeded"),      # prompt + max_tokens > 64
])
def test_bad_prompts(prompt, params, code):
    with pytest.raises(InvalidRequestError) as e:
        VALIDATOR.validate(prompt, params)
    assert (e.value.param, e.value.code) == ("prompt", code)


def test_a_good_request_gets_its_max_tokens_resolved():
    assert VALIDATOR.validate([1] * 60, SamplingParams(max_tokens=4)) == 4
    assert VALIDATOR.validate([1] * 60, SamplingParams(max_tokens=None)) == 4     # what the context leaves


def test_structured_outputs_must_be_compiled_before_the_engine():
    with pytest.raises(InvalidRequestError) as e:
        VALIDATOR.validate([1], SamplingParams(structured_outputs={"json": {"type": "object"}}))
    assert e.value.param == "structured_outputs"
