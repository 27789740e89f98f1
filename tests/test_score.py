"""/score, /v1/score, /rerank and /v1/rerank, as vLLM serves them: a random-weight tiny cross-encoder
(BertForSequenceClassification) against transformers (the pair as its tokenizer joins it, token types included; the
logit through a sigmoid, as vLLM and sentence-transformers' CrossEncoder for one label); an embedding model scoring
by cosine similarity; the request shapes (1:1, 1:N, N:N; documents as strings or objects; top_n;
return_documents; use_activation) and the refusals; a decoder reranker (Qwen3-Reranker's recipe: vLLM's
hf_overrides with classifier_from_token ["no", "yes"]) against transformers' causal LM: the softmax over the two
tokens' logits at the pair's last position, P(yes).
"""
from __future__ import annotations

import httpx
import numpy as np
import pytest
import torch

from kvflow.config import EngineConfig
from kvflow.server.serving.request_fields import REFUSED, VLLM_FIELDS
from kvflow.server.score.protocol import RerankRequest, ScoreRequest
from kvflow.server.testing import ServerThread
from tiny_models import make_tiny_bert, make_tiny_hf_model

QUERY = "what is the capital of france?"
DOCS = ["paris is the capital of france.", "cats are small animals", "berlin is the capital of germany",
        "the quick brown fox jumps over the lazy dog. " * 3]


@pytest.fixture(scope="module")
def cross_encoder_path(tmp_path_factory):
    return make_tiny_bert(tmp_path_factory.mktemp("cross-encoder"), "BertForSequenceClassification", seed=7,
                          pooling=None)


@pytest.fixture(scope="module")
def cross_encoder(cross_encoder_path):
    with ServerThread(EngineConfig(model=str(cross_encoder_path), dtype="float32", served_model_name="ce",
                                   kv_cache_memory="8MiB")) as server:
        yield server


def hf_logits(path, firsts: list[str], seconds: list[str], **tokenize) -> list[float]:
    from transformers import AutoTokenizer, BertForSequenceClassification

    tok = AutoTokenizer.from_pretrained(str(path))
    model = BertForSequenceClassification.from_pretrained(str(path), dtype=torch.float32).eval()
    out = []
    for a, b in zip(firsts, seconds):
        with torch.no_grad():
            out.append(float(model(**tok(a, b, return_tensors="pt", **tokenize)).logits[0, 0]))
    return out


def sigmoid(x):
    return 1 / (1 + np.exp(-np.asarray(x, dtype=np.float64)))


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=60)


def test_every_vllm_field_is_implemented_or_refused():
    for route, model in (("score", ScoreRequest), ("rerank", RerankRequest)):
        implemented, refused = set(model.model_fields), set(REFUSED[route])
        missing = [f for f in VLLM_FIELDS[route] if f not in implemented | refused]
        assert not missing and not implemented & refused, (route, missing)


def test_score_of_a_cross_encoder_matches_transformers(cross_encoder, cross_encoder_path):
    r = post(cross_encoder, "/score", {"model": "ce", "text_1": QUERY, "text_2": DOCS})     # 1:N
    assert r.status_code == 200, r.text
    body = r.json()
    expected = sigmoid(hf_logits(cross_encoder_path, [QUERY] * len(DOCS), DOCS))
    assert [d["index"] for d in body["data"]] == list(range(len(DOCS)))
    assert {d["object"] for d in body["data"]} == {"score"} and body["object"] == "list"
    np.testing.assert_allclose([d["score"] for d in body["data"]], expected, atol=1e-4)
    assert len(set(np.round(expected, 4))) == len(DOCS)            # the pairs' scores differ: an order to get right
    tok = cross_encoder.engine.tokenizer
    assert body["usage"]["prompt_tokens"] == sum(len(tok.encode_pair(QUERY, d)[0]) for d in DOCS)
    assert body["usage"]["total_tokens"] == body["usage"]["prompt_tokens"] and body["id"].startswith("score-")
    # N:N pairs in order, on /v1/score; the raw logit without the activation
    firsts = [DOCS[1], QUERY]
    r = post(cross_encoder, "/v1/score", {"text_1": firsts, "text_2": DOCS[:2], "use_activation": False})
    np.testing.assert_allclose([d["score"] for d in r.json()["data"]],
                               hf_logits(cross_encoder_path, firsts, DOCS[:2]), atol=1e-4)
    # 1:1 as two strings
    r = post(cross_encoder, "/score", {"text_1": QUERY, "text_2": DOCS[0]})
    np.testing.assert_allclose(r.json()["data"][0]["score"], expected[0], atol=1e-4)


def test_rerank_sorts_the_documents_by_relevance(cross_encoder, cross_encoder_path):
    expected = sigmoid(hf_logits(cross_encoder_path, [QUERY] * len(DOCS), DOCS))
    order = list(np.argsort(-expected))
    documents = [DOCS[0], {"text": DOCS[1]}, DOCS[2], {"text": DOCS[3]}]      # strings or objects with text
    for path in ("/rerank", "/v1/rerank"):
        r = post(cross_encoder, path, {"model": "ce", "query": QUERY, "documents": documents})
        assert r.status_code == 200, r.text
        body = r.json()
        assert [x["index"] for x in body["results"]] == order
        np.testing.assert_allclose([x["relevance_score"] for x in body["results"]], expected[order], atol=1e-4)
        assert [x["document"]["text"] for x in body["results"]] == [DOCS[i] for i in order]
        assert body["usage"]["total_tokens"] > 0 and body["model"] == "ce" and body["id"].startswith("rerank-")
    r = post(cross_encoder, "/v1/rerank", {"query": QUERY, "documents": DOCS, "top_n": 2, "return_documents": False})
    assert [x["index"] for x in r.json()["results"]] == order[:2]
    assert all("document" not in x for x in r.json()["results"])


def test_a_long_pair_is_truncated_as_asked_or_refused(cross_encoder, cross_encoder_path):
    long_doc = "the quick brown fox jumps over the lazy dog. " * 12        # > 64 positions with the query
    r = post(cross_encoder, "/score", {"text_1": QUERY, "text_2": long_doc})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text
    r = post(cross_encoder, "/score", {"text_1": QUERY, "text_2": long_doc, "truncate_prompt_tokens": 40})
    assert r.status_code == 200, r.text
    expected = sigmoid(hf_logits(cross_encoder_path, [QUERY], [long_doc], truncation="longest_first", max_length=40))
    np.testing.assert_allclose(r.json()["data"][0]["score"], expected[0], atol=1e-4)


@pytest.mark.parametrize("path, body, param", [
    ("/score", {"text_1": ["a", "b"], "text_2": ["a", "b", "c"]}, "text_2"),
    ("/score", {"text_1": "a", "text_2": []}, "text_2"),
    ("/rerank", {"query": "a", "documents": []}, "documents"),
    ("/score", {"text_1": "a", "text_2": "b", "use_activation": True, "softmax": False}, "use_activation"),
    ("/rerank", {"query": "a", "documents": ["b"], "mm_processor_kwargs": {"x": 1}}, "mm_processor_kwargs"),
])
def test_bad_requests_are_400s_naming_the_field(cross_encoder, path, body, param):
    r = post(cross_encoder, path, body)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_llm_score_offline(cross_encoder_path, tmp_path):
    from kvflow import LLM

    with LLM(model=str(cross_encoder_path), dtype="float32", kv_cache_memory="8MiB") as llm:
        np.testing.assert_allclose(llm.score(QUERY, DOCS), sigmoid(hf_logits(cross_encoder_path, [QUERY] * 4, DOCS)),
                                   atol=1e-4)
        np.testing.assert_allclose(llm.score([QUERY, DOCS[1]], DOCS[:2], use_activation=False),
                                   hf_logits(cross_encoder_path, [QUERY, DOCS[1]], DOCS[:2]), atol=1e-4)
        with pytest.raises(ValueError, match="1:1, 1:N or N:N"):
            llm.score(["a", "b"], ["a", "b", "c"])
        with pytest.raises(ValueError, match="does not generate text"):
            llm.generate("a")
    with LLM(model=str(make_tiny_bert(tmp_path / "embedder", seed=3)), dtype="float32",
             kv_cache_memory="8MiB") as llm:
        vectors = np.asarray(llm.embed([QUERY] + DOCS[:2]))
        np.testing.assert_allclose(llm.score(QUERY, DOCS[:2]), vectors[1:] @ vectors[0], atol=1e-6)


def test_a_cross_encoder_neither_embeds_nor_generates(cross_encoder):
    r = post(cross_encoder, "/v1/embeddings", {"input": "a"})
    assert r.status_code == 400 and "does not make embeddings" in r.text
    r = post(cross_encoder, "/v1/completions", {"prompt": "a", "max_tokens": 1})
    assert r.status_code == 400 and "does not generate text" in r.text


def test_an_embedding_model_scores_by_cosine_similarity(tmp_path):
    path = make_tiny_bert(tmp_path / "embedder", seed=3, pooling="mean")
    with ServerThread(EngineConfig(model=str(path), dtype="float32", kv_cache_memory="8MiB")) as server:
        r = post(server, "/score", {"text_1": QUERY, "text_2": DOCS[:3]})
        assert r.status_code == 200, r.text
        vectors = post(server, "/v1/embeddings", {"input": [QUERY] + DOCS[:3]}).json()["data"]
        q = np.asarray(vectors[0]["embedding"])
        expected = [float(q @ np.asarray(v["embedding"])) for v in vectors[1:]]     # unit vectors: the cosine
        np.testing.assert_allclose([d["score"] for d in r.json()["data"]], expected, atol=1e-6)
        ranked = post(server, "/rerank", {"query": QUERY, "documents": DOCS[:3]}).json()["results"]
        assert [x["index"] for x in ranked] == list(np.argsort(expected)[::-1])


# ---- a decoder reranker: Qwen3 scored by its "no" / "yes" logits ---------------------------------------------------
QWEN3_RERANKER = {"architectures": ["Qwen3ForSequenceClassification"], "classifier_from_token": ["no", "yes"],
                  "is_original_qwen3_reranker": True}


@pytest.fixture(scope="module")
def qwen3_path(tmp_path_factory):
    return make_tiny_hf_model(tmp_path_factory.mktemp("tiny-qwen3-reranker"), family="qwen3", seed=2)


def hf_p_yes(path, firsts: list[str], seconds: list[str]) -> list[float]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(path))
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    no, yes = tok.convert_tokens_to_ids(["no", "yes"])
    out = []
    for a, b in zip(firsts, seconds):
        with torch.no_grad():
            logits = model(**tok(a, b, return_tensors="pt")).logits[0, -1]
        out.append(float(torch.softmax(logits[[no, yes]].double(), 0)[1]))
    return out


def test_a_decoder_reranker_scores_p_yes_as_transformers(qwen3_path):
    config = EngineConfig(model=str(qwen3_path), dtype="float32", kv_cache_memory="8MiB", enforce_eager=True,
                          max_num_batched_tokens=8, hf_overrides=QWEN3_RERANKER)    # pairs prefilled in chunks
    expected = hf_p_yes(qwen3_path, [QUERY] * len(DOCS), DOCS)
    assert max(expected) - min(expected) > 1e-3          # the pairs' scores differ
    with ServerThread(config) as server:
        r = post(server, "/score", {"text_1": QUERY, "text_2": DOCS})
        assert r.status_code == 200, r.text
        np.testing.assert_allclose([d["score"] for d in r.json()["data"]], expected, atol=1e-4)
        ranked = post(server, "/v1/rerank", {"query": QUERY, "documents": DOCS}).json()["results"]
        assert [x["index"] for x in ranked] == list(np.argsort(expected)[::-1])
        r = post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 400 and "does not generate text" in r.text


def test_a_generative_decoder_cannot_score(qwen3_path):
    with ServerThread(EngineConfig(model=str(qwen3_path), dtype="float32", kv_cache_memory="8MiB",
                                   enforce_eager=True)) as server:
        for path, body in (("/score", {"text_1": "a", "text_2": "b"}), ("/rerank", {"query": "a", "documents": ["b"]})):
            r = post(server, path, body)
            assert r.status_code == 400 and "does not score text pairs" in r.text, r.text
            assert r.json()["error"]["param"] == "model"


def test_classifier_from_token_needs_a_method_for_two_tokens(qwen3_path):
    from kvflow.models.model_files import resolve_model_files

    with pytest.raises(ValueError, match="from_2_way_softmax"):
        resolve_model_files(qwen3_path, hf_overrides={"architectures": ["Qwen3ForSequenceClassification"],
                                                      "classifier_from_token": ["no", "yes"]})
    with pytest.raises(ValueError, match="not tokens of the vocabulary"):
        resolve_model_files(qwen3_path, hf_overrides={**QWEN3_RERANKER, "classifier_from_token": ["no", "y€s☃"]})
    config = resolve_model_files(qwen3_path, hf_overrides=QWEN3_RERANKER).config
    assert config.tasks == ("score",) and config.pooling_for(None) == "last" and len(config.classifier_token_ids) == 2
