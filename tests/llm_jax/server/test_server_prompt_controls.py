"""vLLM's ``truncate_prompt_tokens`` (the prompt's last k tokens; -1 as many as the context holds) on
completions, chat and embeddings, and ``cache_salt`` (prefix-cache sharing only within one salt), through
the ``openai`` client: outputs equal ``generate``'s and ``embed_texts``' on the truncated prompts; the
engine shares cached blocks within a salt and never across."""

from __future__ import annotations

import numpy as np
import pytest
from server_process import MODEL_NAME

import llm_jax
from llm_jax.serving.engine import Engine

TEXT = "Once upon a time, there was a little girl named Lily. She loved to play outside in the park."


def test_completions_read_the_prompts_last_tokens(client, stories):
    ids = stories.tokenizer.encode(TEXT)
    response = client.completions.create(model=MODEL_NAME, prompt=TEXT, max_tokens=12, temperature=0, echo=True,
                                         extra_body={"truncate_prompt_tokens": 7, "ignore_eos": True})
    expected = llm_jax.generate(stories, [ids[-7:]], max_new_tokens=12, ignore_eos=True)[0].text
    echo = stories.tokenizer.decode(ids[-7:])
    assert response.choices[0].text == echo + expected
    assert response.usage.prompt_tokens == 7
    whole = client.completions.create(model=MODEL_NAME, prompt=TEXT, max_tokens=4, temperature=0,
                                      extra_body={"truncate_prompt_tokens": -1})
    assert whole.usage.prompt_tokens == len(ids)  # the context holds it all
    chat = client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": TEXT}],
                                          max_tokens=2, extra_body={"truncate_prompt_tokens": 5})
    assert chat.usage.prompt_tokens == 5


def test_embeddings_read_the_inputs_last_tokens(client, stories):
    ids = stories.tokenizer.encode(TEXT)
    response = client.embeddings.create(model=MODEL_NAME, input=[TEXT, "Hi"],
                                        extra_body={"truncate_prompt_tokens": 6})
    expected = llm_jax.embed_texts(stories, [ids[-6:], stories.tokenizer.encode("Hi")[-6:]])
    np.testing.assert_allclose([d.embedding for d in response.data], expected, atol=1e-6)


@pytest.mark.parametrize("extra, param", [
    ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    ({"truncate_prompt_tokens": -2}, "truncate_prompt_tokens"),
    ({"truncate_prompt_tokens": 10_000}, "truncate_prompt_tokens"),
    ({"truncate_prompt_tokens": "5"}, "truncate_prompt_tokens"),
    ({"cache_salt": ""}, "cache_salt"),
    ({"cache_salt": 7}, "cache_salt"),
])
def test_bad_values_are_refused_by_name(http, extra, param):
    response = http.post("/v1/completions", json={"prompt": "x", "max_tokens": 2, **extra})
    assert response.status_code == 400 and response.json()["error"]["param"] == param, response.text


def test_a_salted_request_answers_as_any(client, stories):
    response = client.completions.create(model=MODEL_NAME, prompt=TEXT, max_tokens=8, temperature=0,
                                         extra_body={"cache_salt": "tenant-1", "ignore_eos": True})
    assert response.choices[0].text == llm_jax.generate(stories, [TEXT], max_new_tokens=8, ignore_eos=True)[0].text


def test_cached_prefixes_are_shared_within_a_salt_only(stories):
    engine = Engine(stories, max_num_seqs=2, max_num_batched_tokens=64, block_size=8, max_model_len=128)
    prompt = [1] + list(range(40, 80))
    hits = []
    for rid, salt in (("first", "a"), ("other salt", "b"), ("no salt", None), ("same salt", "a")):
        before = engine.stats().prefix_hit_tokens
        engine.add_request(rid, prompt, max_new_tokens=2, cache_salt=salt)
        while engine.has_unfinished:
            engine.step()
        hits.append(engine.stats().prefix_hit_tokens - before)
    assert hits == [0, 0, 0, 40]
