"""LoRA adapters over HTTP, as vLLM serves them: ``--lora-modules`` names adapters requests choose with
"model"; ``/v1/models`` lists them with the base model as parent; ``--allow-runtime-lora-updating`` loads
and unloads them while serving. Through the official ``openai`` client, an adapter's greedy completions
are ``generate``'s on the adapter merged into the weights (itself held to PEFT in ``tests/llm_jax/test_lora.py``),
alongside the base model's in the same steps; bad loads are 4xx naming the field."""

from __future__ import annotations

import concurrent.futures

import httpx
import openai
import pytest
from server_process import API_KEY, CHAT_TEMPLATE, MODEL_NAME, metric, start_server, wait_until_idle

import llm_jax

PROMPTS = ["Once upon a time", "The little dog", "Lily and Ben went to the park"]


@pytest.fixture(scope="module")
def adapters(story_adapters):
    """The shared adapters (tests/llm_jax/conftest.py), as a folder name → path map."""
    return story_adapters


@pytest.fixture(scope="module")
def lora_server(model_path, compile_cache, adapters, tmp_path_factory):
    folder = tmp_path_factory.mktemp("lora_server")
    (folder / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    process = start_server(model_path, folder, compile_cache, "--api-key", API_KEY, "--chat-template",
                           str(folder / "chat_template.jinja"), "--lora-modules", f"tales={adapters['tales']}",
                           "--max-loras", "2", "--max-lora-rank", "8", "--allow-runtime-lora-updating")
    yield process
    process.terminate()


@pytest.fixture(scope="module")
def client(lora_server):
    return openai.OpenAI(base_url=f"{lora_server.url}/v1", api_key=API_KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def http(lora_server):
    with httpx.Client(base_url=lora_server.url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=120) as c:
        yield c


def expected(model: llm_jax.Model, prompt: str, n: int = 16) -> str:
    return llm_jax.generate(model, [prompt], max_new_tokens=n, ignore_eos=True)[0].text


def test_models_lists_the_adapters_with_their_parent(client, adapters):
    cards = {m.id: m for m in client.models.list().data}
    assert set(cards) == {MODEL_NAME, "tales"}
    assert cards["tales"].model_extra["parent"] == MODEL_NAME
    assert cards["tales"].model_extra["root"] == str(adapters["tales"])
    assert client.models.retrieve("tales").id == "tales"


def test_adapters_and_the_base_model_answer_side_by_side(client, stories, adapters):
    tales = stories.with_lora(adapters["tales"])

    def complete(model, prompt, stream):
        kwargs = dict(model=model, prompt=prompt, max_tokens=16, temperature=0, extra_body={"ignore_eos": True})
        if not stream:
            return client.completions.create(**kwargs).choices[0].text
        return "".join(c.choices[0].text for c in client.completions.create(stream=True, **kwargs) if c.choices)

    jobs = [(model, prompt, i % 2 == 1) for i, (model, prompt) in
            enumerate((m, p) for p in PROMPTS for m in (MODEL_NAME, "tales"))]
    with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
        texts = list(pool.map(lambda job: complete(*job), jobs))
    for (model, prompt, _), text in zip(jobs, texts):
        assert text == expected(tales if model == "tales" else stories, prompt), (model, prompt)
    assert expected(tales, PROMPTS[0]) != expected(stories, PROMPTS[0])


def test_adapters_load_and_unload_at_run_time(client, http, stories, adapters):
    response = http.post("/v1/load_lora_adapter", json={"lora_name": "poems", "lora_path": str(adapters["poems"])})
    assert response.status_code == 200 and response.text == "Success: LoRA adapter 'poems' added successfully."
    text = client.completions.create(model="poems", prompt=PROMPTS[1], max_tokens=16, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    assert text == expected(stories.with_lora(adapters["poems"]), PROMPTS[1])
    chat = client.chat.completions.create(model="poems", messages=[{"role": "user", "content": "Hi"}], max_tokens=4)
    assert chat.model == MODEL_NAME and chat.choices[0].message.content is not None

    bad = [({"lora_name": "more", "lora_path": str(adapters["tales"])}, 400, "lora_path", "all 2 LoRA slots"),
           ({"lora_name": "tales", "lora_path": str(adapters["tales"])}, 400, "lora_name", "is taken"),
           ({"lora_name": MODEL_NAME, "lora_path": str(adapters["tales"])}, 400, "lora_name", "is taken"),
           ({"lora_name": "x"}, 400, "lora_path", "lora_path is required"),
           ({"lora_name": "x", "lora_path": 3}, 400, "lora_path", "must be a string")]
    for body, status, param, message in bad:
        response = http.post("/v1/load_lora_adapter", json=body)
        assert response.status_code == status and response.json()["error"]["param"] == param, body
        assert message in response.json()["error"]["message"], response.json()

    response = http.post("/v1/unload_lora_adapter", json={"lora_name": "poems"})
    assert response.status_code == 200 and response.text == "Success: LoRA adapter 'poems' removed successfully."
    with pytest.raises(openai.NotFoundError, match="The model `poems` does not exist"):
        client.completions.create(model="poems", prompt="x", max_tokens=2)
    response = http.post("/v1/unload_lora_adapter", json={"lora_name": "poems"})
    assert response.status_code == 404 and response.json()["error"]["param"] == "lora_name"
    missing = adapters["tales"].parent / "missing"
    for body, message in (({"lora_name": "wide", "lora_path": str(adapters["wide"])}, "rank 16, above the largest"),
                          ({"lora_name": "none", "lora_path": str(missing)}, "not a PEFT adapter")):
        response = http.post("/v1/load_lora_adapter", json=body)
        assert response.status_code == 400 and message in response.json()["error"]["message"], response.json()
    assert {m.id for m in client.models.list().data} == {MODEL_NAME, "tales"}
    assert http.get("/health").status_code == 200


def test_embeddings_of_an_adapter_are_its_merged_models(client, http, stories, adapters):
    """An adapter's embeddings (and scores) are those of the adapter merged into the weights."""
    import numpy as np

    texts = ["Once upon a time", "The little dog ran to the park."]
    merged = stories.with_lora(adapters["tales"])
    response = client.embeddings.create(model="tales", input=texts)
    np.testing.assert_allclose([d.embedding for d in response.data], llm_jax.embed_texts(merged, texts), atol=1e-5)
    base = client.embeddings.create(model=MODEL_NAME, input=texts)
    np.testing.assert_allclose([d.embedding for d in base.data], llm_jax.embed_texts(stories, texts), atol=1e-5)
    score = http.post("/v1/score", json={"model": "tales", "text_1": texts[0], "text_2": texts[1]}).json()
    expected = llm_jax.embed_texts(merged, texts)
    np.testing.assert_allclose(score["data"][0]["score"], expected[0] @ expected[1], atol=1e-5)


def test_runtime_loading_is_off_unless_asked(http, server):
    """The shared server runs without the flag: the routes are not there."""
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60) as plain:
        assert plain.post("/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": "/tmp"}).status_code == 404


def test_metrics_name_the_adapters_of_running_requests(client, http):
    """vLLM's lora_requests_info: the adapters of running requests while one streams, none once idle."""
    stream = client.completions.create(model="tales", prompt="Once upon a time", max_tokens=200, stream=True,
                                       extra_body={"ignore_eos": True})
    next(iter(stream))  # running now
    assert metric(http, "llm_jax:lora_requests_info", max_lora="2", running_lora_adapters="tales") > 0
    stream.close()
    wait_until_idle(http)
    assert metric(http, "llm_jax:lora_requests_info", max_lora="2", running_lora_adapters="",
                  waiting_lora_adapters="") > 0
