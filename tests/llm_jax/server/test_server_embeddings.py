"""/v1/embeddings as the official ``openai`` client sees it (it asks for base64 and decodes it): each
input's vector is ``llm_jax.embed_texts``'s on the same model (held to ``transformers`` in
tests/llm_jax/test_pooling.py), as floats or base64, truncated with ``dimensions``; bad fields are refused
by name."""

from __future__ import annotations

import base64

import numpy as np
import pytest
from server_process import MODEL_NAME

import llm_jax

TEXTS = ["Once upon a time", "The dog ran to the park and saw a big red ball.", "Hi"]


@pytest.fixture(scope="module")
def model(model_path):
    return llm_jax.load(model_path)


def test_embeddings_are_embed_texts(client, http, model):
    expected = llm_jax.embed_texts(model, TEXTS)
    response = client.embeddings.create(model=MODEL_NAME, input=TEXTS)
    got = np.array([d.embedding for d in response.data], np.float32)
    assert [d.index for d in response.data] == [0, 1, 2]
    np.testing.assert_allclose(got, expected, atol=1e-6)
    ids = [model.tokenizer.encode(t) for t in TEXTS]
    assert response.usage.prompt_tokens == sum(map(len, ids))
    floats = http.post("/v1/embeddings", json={"input": ids, "encoding_format": "float"}).json()
    np.testing.assert_allclose([d["embedding"] for d in floats["data"]], expected, atol=1e-6)
    raw = http.post("/v1/embeddings", json={"input": TEXTS[0], "encoding_format": "base64", "dimensions": 8}).json()
    (item,) = raw["data"]
    short = np.frombuffer(base64.b64decode(item["embedding"]), "<f4")
    np.testing.assert_allclose(short, expected[0, :8] / np.linalg.norm(expected[0, :8]), atol=1e-6)


def test_a_conversation_is_embedded_as_the_chat_template_renders_it(http, model):
    """vLLM's chat form of embeddings: ``messages`` rendered by the server's chat template (no generation
    prompt unless asked), embedded as those tokens are."""
    chat = [{"role": "user", "content": "Tell me a story."}, {"role": "assistant", "content": "A cat sat."}]
    for prompt in (False, True):
        ids = http.post("/tokenize", json={"messages": chat, "add_generation_prompt": prompt}).json()["tokens"]
        body = http.post("/v1/embeddings", json={"messages": chat, "add_generation_prompt": prompt}).json()
        np.testing.assert_allclose(body["data"][0]["embedding"], llm_jax.embed_texts(model, [ids])[0], atol=1e-6)
        assert body["usage"]["prompt_tokens"] == len(ids)


@pytest.mark.parametrize("body, param", [
    ({}, "input"),
    ({"input": "Hi", "messages": [{"role": "user", "content": "Hi"}]}, "input"),
    ({"messages": [{"role": "robot", "content": "Hi"}]}, "messages[0].role"),
    ({"input": "Hi", "continue_final_message": True}, "messages"),
    ({"input": []}, "input"),
    ({"input": [1, -1]}, "input"),
    ({"input": ["a", 1]}, "input"),
    ({"input": "Hi", "encoding_format": "bits"}, "encoding_format"),
    ({"input": "Hi", "dimensions": 0}, "dimensions"),
    ({"input": "Hi", "dimensions": 100000}, "dimensions"),
    ({"input": ["Hi", "x " * 400]}, "input[1]"),
    ({"input": "Hi", "model": "gpt-4"}, "model"),
    ({"input": "Hi", "pooling": "max"}, "pooling"),
])
def test_bad_fields_are_refused_by_name(http, body, param):
    response = http.post("/v1/embeddings", json=body)
    assert response.status_code in (400, 404), response.text
    assert response.json()["error"]["param"] == param, response.text
