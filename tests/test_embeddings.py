"""/v1/embeddings and LLM.embed: pooled final hidden states, computed by prefill-only rows in the same continuous
batch as generation.

The scheduler's side with hand-made requests and no model (which positions pool, no sampling, the finish after the
last chunk, prefix hits, preemption); then the real engine against transformers' `AutoModel` last hidden state of
the same weights in float32 (cosine >= 0.999), through the official `openai` client, with prompts longer than
`max_num_batched_tokens` (chunked), beside streaming generation, offline and under tensor parallelism.
"""
from __future__ import annotations

import base64
import re
import threading
import time

import httpx
import numpy as np
import openai
import pytest

from kvflow import LLM, PoolingParams
from kvflow.config import EngineConfig
from kvflow.core.kv_cache_manager import KVCacheManager
from kvflow.core.scheduler import Scheduler
from kvflow.request import Request, RequestStatus
from kvflow.runner.step import SampledTokens
from kvflow.sampling_params import SamplingParams
from kvflow.server.embeddings.protocol import EmbeddingRequest
from kvflow.server.serving.request_fields import REFUSED, VLLM_FIELDS
from kvflow.server.testing import ServerThread
from tiny_models import make_tiny_hf_model

BUDGET = 32                  # max_num_batched_tokens of the engines below: LONG is prefilled in several chunks
SHORT = "The quick brown fox jumps over the lazy dog."
LONG = " ".join(f"item{i} is {i * 7 % 13} apples" for i in range(24))
OTHER = "Paged attention keeps the KV cache in blocks."


# ---- the scheduler, no model ------------------------------------------------------------------------------------
def make_scheduler(pooling: str, num_blocks=64, block_size=4, prefix_caching=False, **cfg):
    kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching=prefix_caching)
    return Scheduler(EngineConfig(pooling=pooling, **cfg), kv, max_model_len=256), kv


def embedding_request(rid: str, prompt: list[int]) -> Request:
    return Request(rid, prompt, SamplingParams(), 0, pooling=PoolingParams())


def generation_request(rid: str, prompt: list[int], max_tokens=4) -> Request:
    return Request(rid, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True), max_tokens)


def step(sched: Scheduler, token=7):
    """One step with a fake model: each sampling row samples `token`; each pooling row's "sum" is its span's absolute
    positions, so what the scheduler asked for is visible in the outputs."""
    out = sched.schedule()
    batch = out.step.batch
    pooled = [[float(p) for p in range(s.num_computed_tokens + off, s.num_computed_tokens + off + n)]
              for s, (off, n) in zip(out.rows, batch.pooling_spans) if n]
    rows = len(out.step.sampling)
    return out, sched.update(out, SampledTokens([token] * rows, [None] * rows, pooled=pooled))


def test_mean_pooling_rows_pool_every_position_once_and_finish_after_the_last_chunk():
    sched, kv = make_scheduler("mean", max_num_batched_tokens=8)
    r = embedding_request("e", list(range(1, 21)))
    sched.add_request(r)
    outputs, spans = [], []
    while sched.has_unfinished_requests():
        out, outs = step(sched)
        assert out.step.batch.samples == [False] and out.step.sampling == []     # prefill only: nothing sampled
        spans.append(out.step.batch.pooling_spans)
        outputs += outs
    assert spans == [((0, 8),), ((0, 8),), ((0, 4),)]
    assert [o.num_pooled for o in outputs] == [8, 8, 4]
    assert sum((o.pooled_sum for o in outputs), []) == [float(p) for p in range(20)]
    assert [o.finish_reason for o in outputs] == [None, None, "stop"] and outputs[-1].new_token_ids == []
    assert r.status == RequestStatus.FINISHED_STOPPED and r.num_output_tokens == 0
    assert "e" not in sched.requests and "e" not in kv.block_tables and kv.num_free_blocks == 64    # no KV held
    kv.check()


def test_last_pooling_pools_only_the_prompts_last_position():
    sched, kv = make_scheduler("last", max_num_batched_tokens=8)
    sched.add_request(embedding_request("e", list(range(1, 21))))
    spans, outputs = [], []
    while sched.has_unfinished_requests():
        out, outs = step(sched)
        spans.append(out.step.batch.pooling_spans)
        outputs += outs
    assert spans == [(), (), ((3, 1),)]          # the chunks before the last have nothing to pool
    [o] = outputs
    assert (o.pooled_sum, o.num_pooled, o.finish_reason) == ([19.0], 1, "stop")
    kv.check()


@pytest.mark.parametrize("pooling, hits", [("mean", False), ("last", True)])
def test_mean_pooling_takes_no_prefix_cache_hits_and_last_pooling_does(pooling, hits):
    """A hit skips positions: mean pooling needs every one of them, last pooling only the last (always computed)."""
    sched, kv = make_scheduler(pooling, prefix_caching=True, max_num_batched_tokens=64)
    prompt = list(range(1, 18))                  # 4 full blocks of 4 and one token
    sched.add_request(generation_request("g", prompt, max_tokens=1))
    while sched.has_unfinished_requests():
        step(sched)
    e = embedding_request("e", prompt)
    sched.add_request(e)
    out, outputs = step(sched)
    assert e.num_cached_tokens == (16 if hits else 0)
    assert out.step.batch.pooling_spans == (((0, 1),) if hits else ((0, 17),))
    assert outputs[-1].finish_reason == "stop"
    kv.check()


def test_a_preempted_embedding_request_pools_each_position_once():
    """Preemption throws the request's KV away and recomputes it; what was pooled already is not sent again."""
    sched, kv = make_scheduler("mean", num_blocks=5, block_size=4, max_num_batched_tokens=4)
    sched.add_request(generation_request("g", [1, 2, 3], max_tokens=14))
    sched.add_request(e := embedding_request("e", list(range(1, 15))))
    pooled = []
    for _ in range(80):
        if not sched.has_unfinished_requests():
            break
        _, outputs = step(sched)
        pooled += [p for o in outputs if o.request_id == "e" for p in (o.pooled_sum or [])]
    assert not sched.has_unfinished_requests()
    assert e.num_preemptions > 0, "the test needs the embedding request to be preempted mid-prompt"
    assert pooled == [float(p) for p in range(14)]
    assert e.status == RequestStatus.FINISHED_STOPPED
    kv.check()


def test_sampling_and_pooling_rows_share_a_step():
    sched, kv = make_scheduler("mean", max_num_batched_tokens=10)
    g = generation_request("g", [5, 6, 7], max_tokens=3)
    sched.add_request(g)
    step(sched)                                   # g prefilled, sampled its first token
    sched.add_request(embedding_request("e", list(range(1, 13))))
    out, outputs = step(sched, token=9)
    assert [s.request_id for s in out.rows] == ["g", "e"]
    assert out.step.batch.samples == [True, False] and len(out.step.sampling) == 1
    assert out.step.batch.pooling_spans == ((0, 0), (0, 9))
    assert [(o.request_id, o.new_token_ids, o.num_pooled) for o in outputs] == [("g", [9], 0), ("e", [], 9)]
    assert g.token_ids[-1] == 9


# ---- the request fields ------------------------------------------------------------------------------------------
def test_every_vllm_embeddings_field_is_implemented_or_refused():
    implemented = set(EmbeddingRequest.model_fields)
    refused = set(REFUSED["embeddings"])
    assert not implemented & refused, implemented & refused
    missing = [f for f in VLLM_FIELDS["embeddings"] if f not in implemented | refused]
    assert not missing, f"neither implemented nor refused: {missing}"


# ---- the real engine against transformers ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return make_tiny_hf_model(tmp_path_factory.mktemp("tiny-embed"), family="llama", seed=4)


@pytest.fixture(scope="module")
def hf_hidden(model_path):
    """transformers' last hidden state of the same weights in float32 (AutoModel: the decoder without the LM head,
    its final norm applied, which is also `output_hidden_states`' last entry)."""
    import torch
    from transformers import AutoModel

    model = AutoModel.from_pretrained(str(model_path), dtype=torch.float32).eval()

    def last_hidden_state(ids: list[int]) -> np.ndarray:
        with torch.no_grad():
            out = model(torch.tensor([ids]), output_hidden_states=True)
        assert torch.equal(out.hidden_states[-1], out.last_hidden_state)     # both name the normed state
        return out.last_hidden_state[0].double().numpy()
    return last_hidden_state


def reference(hf_hidden, ids: list[int], pooling: str, normalize: bool = True) -> np.ndarray:
    h = hf_hidden(ids)
    v = h[-1] if pooling == "last" else h.mean(0)
    return v / np.linalg.norm(v) if normalize else v


def cosine(a, b) -> float:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


def engine_args(path, pooling: str, **kw) -> dict:
    return dict(model=str(path), dtype="float32", max_model_len=256, kv_cache_memory="8MiB", enforce_eager=True,
                max_num_batched_tokens=BUDGET, pooling=pooling, **kw)


@pytest.fixture(scope="module")
def servers(model_path):
    with ServerThread(EngineConfig(**engine_args(model_path, "last", served_model_name="tiny"))) as last, \
            ServerThread(EngineConfig(**engine_args(model_path, "mean", served_model_name="tiny"))) as mean:
        yield {"last": last, "mean": mean}


def client_of(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0)


def token_ids(server, text: str) -> list[int]:
    r = httpx.post(server.url + "/tokenize", json={"prompt": text}, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()["tokens"]


@pytest.mark.slow
@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_embeddings_match_transformers_float_and_base64(servers, hf_hidden, pooling):
    server = servers[pooling]
    client = client_of(server)
    texts = [SHORT, LONG, OTHER]
    ids = [token_ids(server, t) for t in texts]
    assert len(ids[1]) > 3 * BUDGET                       # LONG runs in several chunks
    expected = [reference(hf_hidden, i, pooling) for i in ids]
    other = reference(hf_hidden, ids[1], "mean" if pooling == "last" else "last")
    assert cosine(expected[1], other) < 0.99              # the comparison tells the pooling types apart

    as_floats = client.embeddings.create(model="tiny", input=texts, encoding_format="float")
    decoded = client.embeddings.create(model="tiny", input=texts)     # the client asks for base64 and decodes it
    raw = client.embeddings.create(model="tiny", input=texts, encoding_format="base64")
    for response in (as_floats, decoded, raw):
        assert [d.index for d in response.data] == [0, 1, 2] and response.model == "tiny"
    from_base64 = [np.frombuffer(base64.b64decode(d.embedding), dtype="<f4") for d in raw.data]
    for i, want in enumerate(expected):
        for got in (as_floats.data[i].embedding, decoded.data[i].embedding, from_base64[i]):
            assert len(got) == 64
            assert cosine(got, want) >= 0.999, (pooling, i)
            assert abs(np.linalg.norm(got) - 1.0) < 1e-4              # normalised, as vLLM's embedding runners
        for j in range(len(expected)):
            if j != i:
                assert cosine(as_floats.data[i].embedding, expected[j]) < 0.999     # each input its own vector
    np.testing.assert_allclose(from_base64[1], as_floats.data[1].embedding, atol=1e-6)


@pytest.mark.slow
def test_every_input_form_gives_the_same_vectors(servers):
    server = servers["mean"]
    client = client_of(server)
    ids = [token_ids(server, t) for t in (SHORT, OTHER)]
    one_text = client.embeddings.create(model="tiny", input=SHORT, encoding_format="float").data
    texts = client.embeddings.create(model="tiny", input=[SHORT, OTHER], encoding_format="float").data
    one_ids = client.embeddings.create(model="tiny", input=ids[0], encoding_format="float").data
    many_ids = client.embeddings.create(model="tiny", input=ids, encoding_format="float").data
    assert len(one_text) == len(one_ids) == 1 and len(texts) == len(many_ids) == 2
    for got in (texts[0], one_ids[0], many_ids[0]):
        np.testing.assert_allclose(got.embedding, one_text[0].embedding, atol=1e-5)
    np.testing.assert_allclose(many_ids[1].embedding, texts[1].embedding, atol=1e-5)
    assert cosine(texts[0].embedding, texts[1].embedding) < 0.999


@pytest.mark.slow
@pytest.mark.parametrize("switch", ["normalize", "use_activation"])
def test_normalize_false_gives_the_pooled_state_itself(servers, hf_hidden, switch):
    server = servers["mean"]
    ids = token_ids(server, LONG)
    got = client_of(server).embeddings.create(model="tiny", input=ids, encoding_format="float",
                                              extra_body={switch: False}).data[0].embedding
    want = reference(hf_hidden, ids, "mean", normalize=False)
    assert cosine(got, want) >= 0.999
    assert abs(np.linalg.norm(got) / np.linalg.norm(want) - 1) < 1e-3 and abs(np.linalg.norm(want) - 1) > 0.05
    r = httpx.post(server.base_url + "/embeddings", timeout=30,
                   json={"input": "x", "normalize": False, "use_activation": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "use_activation", r.text


def prompt_tokens_counter(server) -> float:
    text = httpx.get(server.url + "/metrics", timeout=30).text
    return float(re.search(r'^vllm:prompt_tokens_total\{model_name="tiny"\} (\S+)$', text, re.M).group(1))


@pytest.mark.slow
def test_usage_counts_every_input_and_truncate_prompt_tokens_keeps_the_last_tokens(servers, hf_hidden):
    server = servers["last"]
    client = client_of(server)
    ids = [token_ids(server, t) for t in (SHORT, LONG)]
    before = prompt_tokens_counter(server)
    response = client.embeddings.create(model="tiny", input=[SHORT, LONG])
    n = len(ids[0]) + len(ids[1])
    assert (response.usage.prompt_tokens, response.usage.total_tokens) == (n, n)
    assert prompt_tokens_counter(server) - before == n          # the metrics count these requests too
    truncated = client.embeddings.create(model="tiny", input=[LONG], encoding_format="float",
                                         extra_body={"truncate_prompt_tokens": 5})
    assert truncated.usage.prompt_tokens == 5
    assert cosine(truncated.data[0].embedding, reference(hf_hidden, ids[1][-5:], "last")) >= 0.999
    # last pooling depends on the context: the truncated prompt's last state is not the whole prompt's
    assert cosine(truncated.data[0].embedding, reference(hf_hidden, ids[1], "last")) < 0.999



@pytest.mark.slow
def test_truncation_side_right_keeps_the_first_tokens(servers, hf_hidden):
    server = servers["last"]
    ids = token_ids(server, LONG)
    for side, kept in (("right", ids[:5]), ("left", ids[-5:])):
        r = client_of(server).embeddings.create(model="tiny", input=[LONG], encoding_format="float",
                                                extra_body={"truncate_prompt_tokens": 5, "truncation_side": side})
        assert r.usage.prompt_tokens == 5
        assert cosine(r.data[0].embedding, reference(hf_hidden, kept, "last")) >= 0.999, side

@pytest.mark.slow
def test_dimensions_is_a_400_naming_it(servers):
    with pytest.raises(openai.BadRequestError) as e:
        client_of(servers["last"]).embeddings.create(model="tiny", input=SHORT, dimensions=8)
    assert e.value.status_code == 400 and e.value.body["param"] == "dimensions", e.value.body


def a_value_other_than(default):
    if isinstance(default, (int, float)) and not isinstance(default, bool):
        return default + 1
    return "bfloat16" if default == "float32" else [1, 2]


@pytest.mark.slow
@pytest.mark.parametrize("field", sorted(REFUSED["embeddings"]))
def test_a_refused_field_is_a_400_naming_it_and_its_default_is_accepted(servers, field):
    url = servers["last"].base_url + "/embeddings"
    r = httpx.post(url, json={"input": SHORT, field: a_value_other_than(REFUSED["embeddings"][field])}, timeout=30)
    assert r.status_code == 400, (field, r.text)
    assert r.json()["error"]["param"] == field and "not supported" in r.json()["error"]["message"]
    r = httpx.post(url, json={"input": SHORT, field: REFUSED["embeddings"][field]}, timeout=30)
    assert r.status_code == 200, (field, r.text)


@pytest.mark.slow
@pytest.mark.parametrize("body, param", [
    ({"input": []}, "input"),
    ({"input": ""}, "input"),                                        # no tokens
    ({"input": [1, 49152]}, "input"),                                # not in the vocabulary
    ({"input": [[1] * 300]}, "input"),                               # longer than max_model_len (256)
    ({"input": "x", "encoding_format": "bytes"}, "encoding_format"),
    ({"input": "x", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    ({"input": "x", "model": "nope"}, "model"),
])
def test_bad_requests_are_errors_in_openais_shape_naming_the_field(servers, body, param):
    r = httpx.post(servers["last"].base_url + "/embeddings", json=body, timeout=30)
    assert r.status_code in (400, 404), r.text
    error = r.json()["error"]
    assert error["param"] == param and error["message"] and error["type"], error


@pytest.mark.slow
def test_embeddings_share_the_batch_with_streaming_generation(servers, hf_hidden):
    """Embedding requests (one of them chunked) sent while greedy streams generate in the same server: the vectors
    match transformers, they come back before the streams end (they did not wait for them), and every stream's
    tokens are the ones it generates without them."""
    server = servers["mean"]
    client = client_of(server)
    prompts = [token_ids(server, t) for t in ("Once upon a time", "def main():", "The capital of France is")]

    def generate_all(during=None) -> tuple[list[str], list[float]]:
        texts, ends = [""] * len(prompts), [0.0] * len(prompts)
        started = threading.Barrier(len(prompts) + 1)

        def one(i):
            stream = client.completions.create(model="tiny", prompt=prompts[i], max_tokens=160, temperature=0,
                                               stream=True, extra_body={"ignore_eos": True})
            for k, chunk in enumerate(stream):
                texts[i] += chunk.choices[0].text
                if k == 0:
                    started.wait(timeout=60)
            ends[i] = time.monotonic()
        threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        started.wait(timeout=60)                          # every stream is generating
        if during is not None:
            during()
        for t in threads:
            t.join(timeout=120)
        return texts, ends

    alone, _ = generate_all()
    ids = [token_ids(server, t) for t in (LONG, SHORT)]
    result = {}

    def embed():
        result["response"] = client.embeddings.create(model="tiny", input=ids, encoding_format="float")
        result["done"] = time.monotonic()
    beside, ends = generate_all(during=embed)
    assert beside == alone                                # generation's greedy output unchanged
    assert result["done"] < min(ends)                     # answered while every stream was still generating
    for got, i in zip(result["response"].data, ids):
        assert cosine(got.embedding, reference(hf_hidden, i, "mean")) >= 0.999
    server.wait_idle()
    server.core("check")


# ---- offline ------------------------------------------------------------------------------------------------------
def test_llm_embed_matches_transformers(model_path, hf_hidden):
    with LLM(**engine_args(model_path, "mean")) as llm:
        ids = [llm.tokenizer.encode(t) for t in (SHORT, LONG)]
        vectors = llm.embed([SHORT, {"prompt_token_ids": ids[1]}])
        raw = llm.embed(ids[1], pooling_params=PoolingParams(normalize=False))
        llm.engine.check()
    assert len(vectors) == 2 and len(raw) == 1
    for got, i in zip(vectors, ids):
        assert cosine(got, reference(hf_hidden, i, "mean")) >= 0.999
    want = reference(hf_hidden, ids[1], "mean", normalize=False)
    assert cosine(raw[0], want) >= 0.999 and abs(np.linalg.norm(raw[0]) / np.linalg.norm(want) - 1) < 1e-3


@pytest.mark.slow
def test_llm_embed_under_tensor_parallelism_pools_rank_0s_hidden_states(model_path, hf_hidden):
    """Every rank holds the whole hidden state after the last all-reduce and the replicated norm: rank 0's is the
    model's."""
    args = {**engine_args(model_path, "last"), "tensor_parallel_size": 2, "device": "cpu", "kv_cache_memory": "16MiB"}
    with LLM(**args) as llm:
        ids = [llm.tokenizer.encode(t) for t in (SHORT, LONG)]
        vectors = llm.embed(ids)
    for got, i in zip(vectors, ids):
        assert cosine(got, reference(hf_hidden, i, "last")) >= 0.999
