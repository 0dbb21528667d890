"""vLLM's /v1/score and the rerank endpoints (Jina's and Cohere's API) on the served model's embeddings:
each score is the cosine similarity of the two texts' last-token hidden states as ``transformers``'
``AutoModel`` computes them on stories260K's Hugging Face copy (within 1e-5), in one-to-many and pairwise
form; rerank orders documents by it and keeps ``top_n``; bad fields are refused by name."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers
from server_process import MODEL_NAME

import llm_jax

QUERY = "Where did the dog go?"
DOCUMENTS = ["The dog ran to the park.", "Lily ate an apple.", "The cat slept on the mat.", "A dog went home."]


@pytest.fixture(scope="module")
def reference(stories260k_dir):
    """Unit last-token embeddings from transformers."""
    model = transformers.AutoModel.from_pretrained(stories260k_dir / "hf", dtype=torch.float32).eval()
    tokenizer = llm_jax.load(stories260k_dir / "stories260K.bin").tokenizer

    def embed(text: str) -> np.ndarray:
        with torch.no_grad():
            hidden = model(torch.tensor([tokenizer.encode(text)])).last_hidden_state[0, -1].double().numpy()
        return hidden / np.linalg.norm(hidden)

    return embed


def test_scores_are_cosine_similarities_of_transformers_embeddings(http, reference):
    one_to_many = http.post("/v1/score", json={"model": MODEL_NAME, "text_1": QUERY, "text_2": DOCUMENTS}).json()
    expected = [reference(QUERY) @ reference(d) for d in DOCUMENTS]
    assert [d["index"] for d in one_to_many["data"]] == [0, 1, 2, 3]
    np.testing.assert_allclose([d["score"] for d in one_to_many["data"]], expected, atol=1e-5, rtol=0)
    assert one_to_many["object"] == "list" and one_to_many["usage"]["prompt_tokens"] > 0
    pairs = http.post("/score", json={"text_1": DOCUMENTS[:2], "text_2": DOCUMENTS[2:]}).json()
    np.testing.assert_allclose([d["score"] for d in pairs["data"]],
                               [reference(a) @ reference(b) for a, b in zip(DOCUMENTS[:2], DOCUMENTS[2:])],
                               atol=1e-5, rtol=0)


@pytest.mark.parametrize("path", ["/v1/rerank", "/rerank", "/v2/rerank"])
def test_rerank_orders_documents_by_similarity(http, reference, path):
    response = http.post(path, json={"model": MODEL_NAME, "query": QUERY, "documents": DOCUMENTS, "top_n": 3}).json()
    expected = {i: reference(QUERY) @ reference(d) for i, d in enumerate(DOCUMENTS)}
    order = sorted(expected, key=lambda i: -expected[i])[:3]
    assert [r["index"] for r in response["results"]] == order
    for r in response["results"]:
        assert r["document"]["text"] == DOCUMENTS[r["index"]]
        np.testing.assert_allclose(r["relevance_score"], expected[r["index"]], atol=1e-5, rtol=0)
    bare = http.post(path, json={"query": QUERY, "documents": DOCUMENTS, "return_documents": False}).json()
    assert len(bare["results"]) == 4 and "document" not in bare["results"][0]


@pytest.mark.parametrize("path, body, param", [
    ("/v1/score", {"text_2": "a"}, "text_1"),
    ("/v1/score", {"text_1": ["a", "b"], "text_2": ["c"]}, "text_2"),
    ("/v1/score", {"text_1": "a", "text_2": []}, "text_2"),
    ("/v1/score", {"text_1": "a", "text_2": ["b", 3]}, "text_2[1]"),
    ("/v1/score", {"text_1": "", "text_2": "b"}, "text_1"),
    ("/v1/score", {"text_1": "a", "text_2": "b", "model": "other"}, "model"),
    ("/v1/rerank", {"documents": ["a"]}, "query"),
    ("/v1/rerank", {"query": "a", "documents": "b"}, "documents"),
    ("/v1/rerank", {"query": "a", "documents": ["b"], "top_n": -1}, "top_n"),
    ("/v1/rerank", {"query": "a", "documents": ["b", "x " * 400]}, "documents[1]"),
    ("/v1/rerank", {"query": "a", "documents": ["b"], "rank_fields": ["x"]}, "rank_fields"),
])
def test_bad_fields_are_refused_by_name(http, path, body, param):
    response = http.post(path, json=body)
    assert response.status_code in (400, 404), response.text
    assert response.json()["error"]["param"] == param, response.text
