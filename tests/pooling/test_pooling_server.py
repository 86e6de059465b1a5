"""The pooling endpoints on a real `pagedllm serve` (uvicorn on a loopback port): the official
`openai` client's embeddings (float and base64) equal the offline engine's, a batch of 256,
/rerank ordering and /score equal to the cross-encoder's scores, /classify, /pooling, /v1/models
naming the task, and bad inputs as 400s with OpenAI error bodies while the server serves on."""
from __future__ import annotations

import base64
import warnings

import httpx
import numpy as np
import openai
import pytest
import torch

from tests.entrypoints.test_openai_server import _serve

QUERY = "what is the water"
DOCS = ["the water is long", "people made words", "a little water", "time", "water water water"]


@pytest.fixture(scope="module")
def embed_url(pooling_models, tmp_path_factory):
    log_path = tmp_path_factory.mktemp("embed-server") / "server.log"
    yield from _serve(pooling_models["bert-mean"], log_path, ["--served-model-name", "emb", "--disable-log-stats",
                                                              "--dtype", "float32"], {"PAGEDLLM_API_KEY": ""})


@pytest.fixture(scope="module")
def rerank_url(pooling_models, tmp_path_factory):
    log_path = tmp_path_factory.mktemp("rerank-server") / "server.log"
    yield from _serve(pooling_models["bert-cross"], log_path, ["--served-model-name", "rr", "--disable-log-stats",
                                                               "--dtype", "float32"], {"PAGEDLLM_API_KEY": ""})


def _st(folder: str, texts: list[str]) -> np.ndarray:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from sentence_transformers import SentenceTransformer

        return SentenceTransformer(folder, device="cpu").encode(texts, batch_size=64)


def test_embeddings_with_the_official_client(embed_url, pooling_models):
    client = openai.OpenAI(base_url=f"{embed_url}/v1", api_key="unused", max_retries=0)
    texts = [f"the {w} is long and {v}" for w in ("water", "time", "people", "way") for v in ("little", "first")]
    ref = _st(pooling_models["bert-mean"], texts)
    res = client.embeddings.create(model="emb", input=texts)  # the client asks for base64 and decodes it
    got = np.array([d.embedding for d in res.data])
    np.testing.assert_allclose(got, ref, atol=1e-5)
    assert res.usage.prompt_tokens == res.usage.total_tokens > len(texts)
    flt = client.embeddings.create(model="emb", input=texts[:2], encoding_format="float")
    np.testing.assert_allclose(np.array([d.embedding for d in flt.data]), ref[:2], atol=1e-5)
    b64 = client.embeddings.create(model="emb", input=texts[:2], encoding_format="base64")  # returned as sent
    np.testing.assert_allclose(np.stack([np.frombuffer(base64.b64decode(d.embedding), dtype=np.float32)
                                         for d in b64.data]), ref[:2], atol=1e-5)
    raw = httpx.post(f"{embed_url}/v1/embeddings", json={"input": texts[0], "encoding_format": "base64"}).json()
    np.testing.assert_allclose(np.frombuffer(base64.b64decode(raw["data"][0]["embedding"]), dtype=np.float32), ref[0],
                               atol=1e-5)
    ids = client.embeddings.create(model="emb", input=[[5, 6, 7], [8, 9]])  # token-id inputs
    assert len(ids.data) == 2 and len(ids.data[0].embedding) == 32
    many = client.embeddings.create(model="emb", input=[f"{w} {i}" for i, w in enumerate(DOCS * 52)][:256])
    assert len(many.data) == 256 and [d.index for d in many.data] == list(range(256))
    models = httpx.get(f"{embed_url}/v1/models").json()["data"]
    assert models[0]["task"] == "embed"
    stats = httpx.get(f"{embed_url}/internal/stats").json()
    assert stats["num_free_blocks"] == stats["num_blocks"] and stats["num_unfinished_requests"] == 0
    metrics = httpx.get(f"{embed_url}/metrics").text  # pooling requests are counted as finished ones
    done = [line for line in metrics.splitlines()
            if line.startswith("pagedllm:request_success_total") and 'finished_reason="stop"' in line]
    assert done and float(done[0].rsplit(" ", 1)[1]) >= 256


@pytest.mark.parametrize("path, body, param, match", [
    ("/v1/embeddings", {"input": ""}, "input", "empty"),
    ("/v1/embeddings", {"input": []}, "input", "empty"),
    ("/v1/embeddings", {"input": "a", "dimensions": 8}, None, "does not support matryoshka"),
    ("/v1/embeddings", {"input": [[5 + i % 100 for i in range(200)]]}, None, "more than max_model_len"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}, None, "does not generate"),
    ("/v1/completions", {"prompt": "hi"}, None, "does not generate"),
    ("/classify", {"input": "a"}, None, "does not apply"),
])
def test_bad_inputs_are_400s_and_the_server_serves_on(embed_url, path, body, param, match):
    r = httpx.post(f"{embed_url}{path}", json={"model": "emb", **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert match in err["message"] and err["code"] == 400
    if param:
        assert err["param"] == param
    ok = httpx.post(f"{embed_url}/v1/embeddings", json={"input": "the water"})
    assert ok.status_code == 200
    long = httpx.post(f"{embed_url}/v1/embeddings", json={"input": [[5 + i % 100 for i in range(200)]], "truncate_prompt_tokens": 50})
    assert long.status_code == 200 and long.json()["usage"]["prompt_tokens"] == 50


def test_chat_style_embeddings_and_pooling(embed_url):
    template = "[CLS] {% for m in messages %}{{ m.content }} {% endfor %}[SEP]"  # BERT's has none
    r = httpx.post(f"{embed_url}/v1/embeddings", json={"messages": [{"role": "user", "content": "the water"}],
                                                        "chat_template": template})
    assert r.status_code == 200, r.text
    plain = httpx.post(f"{embed_url}/v1/embeddings", json={"input": "the water"}).json()
    np.testing.assert_allclose(r.json()["data"][0]["embedding"], plain["data"][0]["embedding"], atol=1e-6)
    p = httpx.post(f"{embed_url}/pooling", json={"input": ["the water", "a"]}).json()
    assert len(p["data"]) == 2 and len(p["data"][0]["data"]) == 32


def test_rerank_and_score_match_the_cross_encoder(rerank_url, pooling_models):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from sentence_transformers import CrossEncoder

        ref = CrossEncoder(pooling_models["bert-cross"], device="cpu").predict([(QUERY, d) for d in DOCS])
    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
        r = httpx.post(f"{rerank_url}{path}", json={"model": "rr", "query": QUERY, "documents": DOCS, "top_n": 3})
        assert r.status_code == 200, r.text
        results = r.json()["results"]
        assert [x["index"] for x in results] == list(np.argsort(-ref)[:3])
        np.testing.assert_allclose([x["relevance_score"] for x in results], np.sort(ref)[::-1][:3], atol=1e-5)
        assert results[0]["document"]["text"] == DOCS[results[0]["index"]]
    for path in ("/score", "/v1/score"):
        s = httpx.post(f"{rerank_url}{path}", json={"text_1": QUERY, "text_2": DOCS}).json()
        np.testing.assert_allclose([d["score"] for d in s["data"]], ref, atol=1e-5)
    c = httpx.post(f"{rerank_url}/classify", json={"input": ["the water", "a"]}).json()
    assert c["data"][0]["num_classes"] == 1 and 0 < c["data"][0]["probs"][0] < 1
    bad = httpx.post(f"{rerank_url}/rerank", json={"query": QUERY, "documents": []})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "documents"
    assert httpx.get(f"{rerank_url}/v1/models").json()["data"][0]["task"] == "classify"
