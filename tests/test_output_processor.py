"""The output processor alone (the one path from core token ids to what LLM and the server return): stop strings
across token boundaries, `n` fan-out into seeded core requests, aborting a choice its stop string ended, and one
request's failure staying its own. Real tokenizer (the embedded SmolLM2's); the engine outputs are made by hand."""
from kvflow.core.messages import AddRequest
from kvflow.core.outputs import EngineOutput
from kvflow.output_processor import OutputProcessor
from kvflow.sampling_params import SamplingParams

TEXT = "Hello world. The end is near."     # tokens: Hello| world|.| The| end| is| near|.


def feed(processor, core_id, ids, t=1.0):
    """One engine output per token, as successive steps; the processed result of each."""
    return [processor.process([EngineOutput(core_id, [i])], t + k, t + k + 0.5) for k, i in enumerate(ids)]


def texts(results, request_id):
    return ["".join(d.text for d in r.deltas.get(request_id, [])) for r in results]


def test_a_stop_string_across_tokens_ends_the_choice_and_aborts_it_in_the_core(smollm2_tokenizer):
    ids = smollm2_tokenizer.encode(TEXT, add_special_tokens=False)
    p = OutputProcessor(smollm2_tokenizer)
    [core] = p.add_request(AddRequest("r", [1, 2], SamplingParams(stop=["d. Th"], max_tokens=50), arrival_time=0.0))
    assert core.request_id == "r"
    results = feed(p, "r", ids)
    # "world" ends in "d", the stop string's first character: held back until the string completes or cannot
    assert texts(results, "r")[:4] == ["Hello", " worl", "", ""]
    state = p.requests["r"]
    [choice] = state.choices
    assert (choice.text, choice.finish_reason, choice.stop_reason) == ("Hello worl", "stop", "d. Th")
    # the match came with " The" (step 4): that step aborts the core request, exactly once
    assert [r.to_abort for r in results[:4]] == [[], [], [], ["r"]]
    assert all(not r.deltas and not r.to_abort for r in results[4:])     # its later outputs are dropped
    last = results[3].deltas["r"][-1]
    assert (last.finish_reason, last.stop_reason) == ("stop", "d. Th")
    assert p.finish("r") == []                 # nothing left unfinished to abort


def test_a_stop_string_kept_in_the_output_when_asked(smollm2_tokenizer):
    ids = smollm2_tokenizer.encode(TEXT, add_special_tokens=False)
    p = OutputProcessor(smollm2_tokenizer)
    p.add_request(AddRequest("r", [1], SamplingParams(stop=["end"], include_stop_str_in_output=True), arrival_time=0.0))
    feed(p, "r", ids)
    assert p.requests["r"].choices[0].text == "Hello world. The end"


def test_a_held_back_prefix_that_does_not_complete_is_released(smollm2_tokenizer):
    ids = smollm2_tokenizer.encode(TEXT, add_special_tokens=False)
    p = OutputProcessor(smollm2_tokenizer)
    p.add_request(AddRequest("r", [1], SamplingParams(stop=[" world peace"]), arrival_time=0.0))
    results = feed(p, "r", ids[:3])
    assert texts(results, "r") == ["Hello", "", " world."]     # " world" waits until "." rules it out
    assert p.requests["r"].choices[0].finish_reason is None


def test_n_fans_out_into_seeded_core_requests_and_gathers_back(smollm2_tokenizer):
    p = OutputProcessor(smollm2_tokenizer, keep_logprobs=True)
    params = SamplingParams(n=3, seed=41, temperature=1.0, logprobs=0)
    cores = p.add_request(AddRequest("req", [5, 6], params, arrival_time=0.0))
    assert [c.request_id for c in cores] == ["req-0", "req-1", "req-2"]
    assert [(c.params.n, c.params.seed) for c in cores] == [(1, 41), (1, 42), (1, 43)]
    assert all(c.prompt_token_ids == [5, 6] for c in cores)
    hello, world = smollm2_tokenizer.encode("Hello world", add_special_tokens=False)
    out = p.process([EngineOutput("req-2", [world], [{world: -0.5}], finish_reason="length", num_cached_tokens=0),
                     EngineOutput("req-0", [hello], [{hello: -0.25}])])
    assert [(d.index, d.text, d.finish_reason) for d in out.deltas["req"]] == [(2, " world", "length"), (0, "Hello", None)]
    state = p.requests["req"]
    assert not state.finished and state.num_completion_tokens == 2
    assert state.choices[0].logprobs == [{hello: -0.25}] and state.choices[1].logprobs == []
    # the consumer goes away: the two unfinished choices are what the core must abort
    assert p.finish("req", "abort") == ["req-0", "req-1"]
    assert [c.finish_reason for c in state.choices] == ["abort", "abort", "length"]
    assert p.process([EngineOutput("req-1", [hello])]).deltas == {}      # forgotten


def test_n_equal_one_keeps_the_request_id_and_its_params(smollm2_tokenizer):
    p = OutputProcessor(smollm2_tokenizer)
    params = SamplingParams(seed=7)
    [core] = p.add_request(AddRequest("solo", [1], params, arrival_time=0.0))
    assert core.request_id == "solo" and core.params is params


def test_one_requests_bad_output_fails_it_alone(smollm2_tokenizer):
    p = OutputProcessor(smollm2_tokenizer)
    p.add_request(AddRequest("bad", [1], SamplingParams(), arrival_time=0.0))
    p.add_request(AddRequest("good", [1], SamplingParams(), arrival_time=0.0))
    hello = smollm2_tokenizer.encode("Hello", add_special_tokens=False)[0]
    out = p.process([EngineOutput("bad", ["not a token id"]), EngineOutput("good", [hello])], 0.0, 1.0)
    [failed] = out.deltas["bad"]
    assert failed.finish_reason == "error" and "TypeError" in str(failed.stop_reason)
    assert out.to_abort == ["bad"]          # unfinished in the core: stop it there
    assert [d.text for d in out.deltas["good"]] == ["Hello"]
    assert p.requests["bad"].finished and not p.requests["good"].finished


def test_an_engine_error_and_timings(smollm2_tokenizer):
    p = OutputProcessor(smollm2_tokenizer)
    p.add_request(AddRequest("r", [1], SamplingParams(), arrival_time=10.0))
    hello = smollm2_tokenizer.encode("Hello", add_special_tokens=False)[0]
    p.process([EngineOutput("r", [hello], first_scheduled_time=10.5)], 11.0, 12.0)
    out = p.process([EngineOutput("r", [], finish_reason="error", stop_reason="sampling failed")], 12.0, 13.0)
    assert [(d.finish_reason, d.stop_reason) for d in out.deltas["r"]] == [("error", "sampling failed")]
    t = p.requests["r"].choices[0].timings
    assert (t.scheduled, t.first_token, t.last_token, t.finished) == (10.5, 12.0, 12.0, 13.0)
    assert (t.queue_time, t.ttft) == (0.5, 2.0)


def run(processor, request_id, params, outputs):
    """One request fed `outputs` (EngineOutputs for it, one step each); its choice's text and the deltas' texts."""
    processor.add_request(AddRequest(request_id, [1], params, arrival_time=0.0))
    deltas = [d for out in outputs for d in processor.process([out]).deltas.get(request_id, [])]
    return processor.requests[request_id].choices[0].text, [d.text for d in deltas]


def test_the_token_that_ended_a_request_is_no_part_of_its_text(smollm2_tokenizer):
    """As vLLM: with skip_special_tokens=False the EOS (or the stop token id) that ended the output would end every
    answer with its text (<|im_end|>); it is left out, unless include_stop_str_in_output. Its id and logprob stay."""
    hello, world = smollm2_tokenizer.encode("Hello world", add_special_tokens=False)
    eos = smollm2_tokenizer.eos_token_id
    im_start = smollm2_tokenizer.encode("<|im_start|>", add_special_tokens=False)[0]
    assert smollm2_tokenizer.decode([eos], skip_special_tokens=False) == "<|im_end|>"
    keep = SamplingParams(skip_special_tokens=False)
    p = OutputProcessor(smollm2_tokenizer)
    # EOS in a step of its own, and in the same step as text
    assert run(p, "a", keep, [EngineOutput("a", [hello]), EngineOutput("a", [world]),
                              EngineOutput("a", [eos], [{eos: -0.1}], finish_reason="stop")]) == (
        "Hello world", ["Hello", " world", ""])
    assert p.requests["a"].choices[0].token_ids == [hello, world, eos]
    assert run(p, "b", keep, [EngineOutput("b", [hello, world, eos], finish_reason="stop")])[0] == "Hello world"
    # a stop token id (a special token here): the same; other special tokens stay
    params = SamplingParams(skip_special_tokens=False, stop_token_ids=[im_start])
    assert run(p, "c", params, [EngineOutput("c", [eos, hello, im_start], finish_reason="stop",
                                              stop_reason=im_start)])[0] == "<|im_end|>Hello"
    # kept when asked
    params = SamplingParams(skip_special_tokens=False, include_stop_str_in_output=True)
    assert run(p, "d", params, [EngineOutput("d", [hello, eos], finish_reason="stop")])[0] == "Hello<|im_end|>"
    # a constrained request the core stopped after its grammar's last token (no EOS): that token is text
    assert run(p, "e", keep, [EngineOutput("e", [hello, world], finish_reason="stop")])[0] == "Hello world"
    # max_tokens on an EOS that did not stop the request (ignore_eos): its text is text
    assert run(p, "f", keep, [EngineOutput("f", [hello, eos], finish_reason="length")])[0] == "Hello<|im_end|>"
