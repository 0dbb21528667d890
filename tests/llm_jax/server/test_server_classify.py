"""A served sequence classifier (``python -m llm_jax.serve --model`` a ``*ForSequenceClassification`` folder):
vLLM's ``/classify`` against ``transformers``' logits (float32, ≤ 1e-4) for texts, token ids and a
conversation rendered by the chat template (the reference renders it with ``transformers``' own
``apply_chat_template``); the generating routes answer 404, and ``/classify`` on a language model too.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import httpx
import numpy as np
import pytest
import torch
import transformers
from server_process import API_KEY, CHAT_TEMPLATE, MODEL_NAME, REPO_ROOT, metric, start_server

from tests.llm_jax.test_classify import story_classifier

ATOL = 1e-4
LABELS = {0: "happy", 1: "sad", 2: "neutral"}
TEXTS = ["Once upon a time, there was a little dog.", "The cat was sad.", "Tom and Lily went to the park to play."]


@pytest.fixture(scope="module")
def classifier(stories260k_dir, compile_cache, tmp_path_factory):
    folder = tmp_path_factory.mktemp("story_classifier")
    torch_model = story_classifier(stories260k_dir, folder / "model", num_labels=3, id2label=LABELS,
                                   label2id={v: k for k, v in LABELS.items()})
    (folder / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    process = start_server(folder / "model", folder, compile_cache, "--chat-template",
                           str(folder / "chat_template.jinja"), "--api-key", API_KEY)
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder / "model")
    with httpx.Client(base_url=process.url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=120) as http:
        yield http, torch_model, tokenizer
    assert process.terminate() == 0


def logits(torch_model, ids) -> np.ndarray:
    with torch.no_grad():
        return torch_model(torch.tensor([list(ids)])).logits[0].numpy()


def test_classify_texts_and_token_ids(classifier):
    http, torch_model, tokenizer = classifier
    reference = np.stack([logits(torch_model, tokenizer(t)["input_ids"]) for t in TEXTS])
    body = http.post("/classify", json={"model": MODEL_NAME, "input": TEXTS}).json()
    assert body["object"] == "list" and body["model"] == MODEL_NAME and body["id"].startswith("classify-")
    probs = np.asarray([d["probs"] for d in body["data"]])
    np.testing.assert_allclose(probs, torch.softmax(torch.tensor(reference), -1).numpy(), atol=1e-5)
    assert [d["label"] for d in body["data"]] == [LABELS[i] for i in reference.argmax(-1)]
    assert [d["index"] for d in body["data"]] == [0, 1, 2] and {d["num_classes"] for d in body["data"]} == {3}
    tokens = sum(len(tokenizer(t)["input_ids"]) for t in TEXTS)
    assert body["usage"] == {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0,
                             "prompt_tokens_details": None}
    # Raw logits (a reward model's scores), token ids, the last tokens only, no BOS.
    ids = tokenizer(TEXTS[2])["input_ids"]
    raw = http.post("/v1/classify", json={"input": [ids, ids], "use_activation": False,
                                          "truncate_prompt_tokens": 5}).json()
    np.testing.assert_allclose(raw["data"][0]["probs"], logits(torch_model, ids[-5:]), atol=ATOL)
    bare = http.post("/classify", json={"input": TEXTS[1], "add_special_tokens": False, "activation": False}).json()
    np.testing.assert_allclose(bare["data"][0]["probs"],
                               logits(torch_model, tokenizer(TEXTS[1], add_special_tokens=False)["input_ids"]),
                               atol=ATOL)
    assert metric(http, "llm_jax:prompt_tokens_total", model_name=MODEL_NAME) >= tokens


def test_classify_a_conversation(classifier):
    """A reward model reads a whole conversation, rendered by the chat template (no generation prompt)."""
    http, torch_model, tokenizer = classifier
    chat = [{"role": "user", "content": "Tell me a story."}, {"role": "assistant", "content": "A cat sat."}]
    ids = tokenizer.apply_chat_template(chat, chat_template=CHAT_TEMPLATE, tokenize=True, add_generation_prompt=False,
                                        return_dict=False)
    body = http.post("/classify", json={"messages": chat, "use_activation": False}).json()
    np.testing.assert_allclose(body["data"][0]["probs"], logits(torch_model, ids), atol=ATOL)
    assert body["usage"]["prompt_tokens"] == len(ids)


@pytest.mark.parametrize("body,param", [
    ({}, "input"),
    ({"input": "a", "messages": [{"role": "user", "content": "a"}]}, "input"),
    ({"input": []}, "input"),
    ({"input": [[1, 10**6]]}, "input[0]"),
    ({"input": "a", "use_activation": "yes"}, "use_activation"),
    ({"input": "a", "use_activation": True, "activation": False}, "activation"),
    ({"input": "a", "add_generation_prompt": True}, "messages"),
    ({"input": "a", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    ({"input": "a", "temperature": 0.5}, "temperature"),
    ({"input": "a", "model": "other"}, "model"),
    ({"input": [1] * 600}, "input"),
    ({"input": [1] * 300}, "input"),  # beyond --max-model-len 256 (the model's context is 512)
])
def test_bad_requests_name_the_field(classifier, body, param):
    http = classifier[0]
    response = http.post("/classify", json=body)
    assert 400 <= response.status_code < 500, response.text
    assert response.json()["error"]["param"] == param, response.json()


def test_a_classifier_does_not_generate(classifier):
    http = classifier[0]
    for path in ("/v1/completions", "/v1/chat/completions", "/v1/responses"):
        response = http.post(path, json={"model": MODEL_NAME, "prompt": "Once"})
        assert response.status_code == 404, (path, response.text)
        assert "sequence classifier" in response.json()["error"]["message"]
    assert [m["id"] for m in http.get("/v1/models").json()["data"]] == [MODEL_NAME]
    assert http.get("/health").status_code == 200
    assert httpx.post(f"{http.base_url}/classify", json={"input": "Once"}).status_code == 401  # no key
    assert http.post("/tokenize", json={"prompt": "Once"}).json()["count"] > 0
    embedding = http.post("/v1/embeddings", json={"input": "Once upon a time"}).json()["data"][0]["embedding"]
    assert abs(np.linalg.norm(embedding) - 1) < 1e-5


def test_a_language_model_does_not_classify(http):
    response = http.post("/classify", json={"input": "Once"})
    assert response.status_code == 404
    assert "not a sequence classifier" in response.json()["error"]["message"]


# --- a reranker: a language model read as a classifier of two next tokens (--classifier-from-token) -------------


@pytest.fixture(scope="module")
def reranker(stories260k_dir, compile_cache, tmp_path_factory):
    folder = tmp_path_factory.mktemp("reranker")
    process = start_server(stories260k_dir / "hf", folder, compile_cache, "--classifier-from-token", "He", "She")
    torch_model = transformers.AutoModelForCausalLM.from_pretrained(stories260k_dir / "hf", dtype=torch.float32)
    tokenizer = transformers.AutoTokenizer.from_pretrained(stories260k_dir / "hf")
    with httpx.Client(base_url=process.url, timeout=120) as http:
        yield http, torch_model, tokenizer
    assert process.terminate() == 0


def pair_score(torch_model, tokenizer, query: str, document: str) -> float:
    """``transformers``' pair encoding of the texts, and the second token's share of the two at its end."""
    he, she = (tokenizer(t, add_special_tokens=False)["input_ids"][0] for t in ("He", "She"))
    with torch.no_grad():
        logits = torch_model(torch.tensor([tokenizer(query, document)["input_ids"]])).logits[0, -1]
    return float(torch.softmax(logits[[he, she]], -1)[1])


def test_score_and_rerank_with_a_cross_encoder(reranker):
    http, torch_model, tokenizer = reranker
    query, documents = "Lily went to the park.", ["Then", "The cat was happy. Then", "One day, Tom said hello and"]
    expected = [pair_score(torch_model, tokenizer, query, d) for d in documents]
    body = http.post("/v1/score", json={"text_1": query, "text_2": documents}).json()
    np.testing.assert_allclose([d["score"] for d in body["data"]], expected, atol=1e-5)
    pairs = http.post("/score", json={"text_1": documents[:2], "text_2": [query, query]}).json()
    np.testing.assert_allclose([d["score"] for d in pairs["data"]],
                               [pair_score(torch_model, tokenizer, d, query) for d in documents[:2]], atol=1e-5)
    ranked = http.post("/v1/rerank", json={"query": query, "documents": documents, "top_n": 2}).json()["results"]
    assert [r["index"] for r in ranked] == list(np.argsort(expected)[::-1][:2])
    np.testing.assert_allclose([r["relevance_score"] for r in ranked], sorted(expected, reverse=True)[:2], atol=1e-5)
    label = http.post("/classify", json={"input": query}).json()["data"][0]
    assert label["label"] == "She" and label["num_classes"] == 1


def test_score_needs_a_one_logit_classifier(classifier):
    response = classifier[0].post("/score", json={"text_1": "a", "text_2": "b"})
    assert response.status_code == 400 and response.json()["error"]["param"] == "model"


def test_a_batch_file_of_classifications(stories260k_dir, compile_cache, tmp_path):
    """``run_batch`` on a classifier: ``/v1/classify`` lines equal ``transformers``, generating lines are 404s."""
    torch_model = story_classifier(stories260k_dir, tmp_path / "model", num_labels=3, id2label=LABELS,
                                   label2id={v: k for k, v in LABELS.items()})
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "model")
    lines = [{"custom_id": "a", "method": "POST", "url": "/v1/classify", "body": {"input": TEXTS}},
             {"custom_id": "b", "method": "POST", "url": "/v1/completions", "body": {"prompt": "Once"}}]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    env = {**os.environ, "LLM_JAX_COMPILATION_CACHE": str(compile_cache),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, "-m", "llm_jax.run_batch", "--model", str(tmp_path / "model"), "-i",
                           str(tmp_path / "in.jsonl"), "-o", str(tmp_path / "out.jsonl")], capture_output=True,
                          text=True, timeout=900, cwd=REPO_ROOT, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    first, second = (json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines())
    reference = np.stack([logits(torch_model, tokenizer(t)["input_ids"]) for t in TEXTS])
    probs = [d["probs"] for d in first["response"]["body"]["data"]]
    np.testing.assert_allclose(probs, torch.softmax(torch.tensor(reference), -1).numpy(), atol=1e-5)
    assert second["response"]["status_code"] == 404
