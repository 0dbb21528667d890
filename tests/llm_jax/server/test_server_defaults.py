"""The model's ``generation_config.json`` as request defaults (vLLM's ``--generation-config auto``): which
values count is ``transformers``' own rule (``GenerationConfig.to_diff_dict``), and a server on a folder
that recommends settings samples as ``generate`` does with them, for requests that leave them out."""

from __future__ import annotations

import json
import shutil

import pytest
import transformers
from server_process import API_KEY, CHAT_TEMPLATE, MODEL_NAME, start_server

import llm_jax
from llm_jax.server import defaults
from llm_jax.server.fields import Fields
from llm_jax.server.protocol import Limits, parse_chat, parse_completion, read_sampling

RECOMMENDED = {"do_sample": True, "temperature": 0.6, "top_p": 0.9, "top_k": 20, "repetition_penalty": 1.1,
               "max_new_tokens": 12, "bos_token_id": 1, "eos_token_id": 2}


@pytest.mark.parametrize("config", [
    RECOMMENDED,
    {"temperature": 1.0, "top_k": 50, "top_p": 0.95},
    {"min_p": 0.05, "max_new_tokens": 100, "repetition_penalty": 1.0},
    {"bos_token_id": 1, "do_sample": False},
])
def test_the_values_that_count_are_transformers_diff(tmp_path, config):
    (tmp_path / "generation_config.json").write_text(json.dumps(config))
    diff = transformers.GenerationConfig(**config).to_diff_dict()
    expected = {k: diff[k] for k in defaults.FIELDS if diff.get(k) is not None}
    if "max_new_tokens" in expected:
        expected["max_tokens"] = expected.pop("max_new_tokens")
    assert defaults.sampling_defaults("auto", tmp_path) == expected
    assert defaults.sampling_defaults("vllm", tmp_path) == {}
    assert defaults.sampling_defaults("vllm", tmp_path, {"temperature": 1.0}) == {"temperature": 1.0}
    assert defaults.sampling_defaults("auto", tmp_path / "missing") == {}


def test_requests_keep_their_own_values():
    limits = Limits(vocab_size=512, max_logprobs=5, defaults={"temperature": 0.6, "top_k": 20, "max_tokens": 12})
    plain = parse_completion({"prompt": "x"}, limits)
    assert plain.generation.max_tokens == 12
    assert (plain.generation.sampling.temperature, plain.generation.sampling.top_k) == (0.6, 20)
    own = parse_completion({"prompt": "x", "temperature": 0, "top_k": 3, "max_tokens": 40}, limits)
    assert (own.generation.sampling.temperature, own.generation.sampling.top_k, own.generation.max_tokens) == (0, 3, 40)
    assert parse_chat({"messages": [{"role": "user", "content": "a"}]}, limits).generation.max_tokens == 12
    neutral = read_sampling(Fields({}), Limits(vocab_size=512, max_logprobs=5))
    assert (neutral.temperature, neutral.top_k, neutral.top_p) == (1.0, 0, 1.0)


@pytest.fixture(scope="module")
def recommending(stories260k_dir, compile_cache, tmp_path_factory):
    """A server on stories260K's Hugging Face copy whose generation_config.json recommends settings."""
    folder = tmp_path_factory.mktemp("recommending")
    model = folder / "model"
    shutil.copytree(stories260k_dir / "hf", model)
    (model / "generation_config.json").write_text(json.dumps(RECOMMENDED))
    (folder / "template.jinja").write_text(CHAT_TEMPLATE)
    process = start_server(model, folder, compile_cache, "--api-key", API_KEY, "--chat-template",
                           str(folder / "template.jinja"))
    yield process, model
    process.terminate()


def test_a_server_samples_with_the_models_recommended_settings(recommending):
    import openai

    process, path = recommending
    assert "default sampling settings from the generation config" in process.log()
    client = openai.OpenAI(base_url=f"{process.url}/v1", api_key=API_KEY, max_retries=0, timeout=120)
    model = llm_jax.load(path)
    prompt = "Once upon a time"
    text = client.completions.create(model=MODEL_NAME, prompt=prompt, seed=5,
                                     extra_body={"ignore_eos": True}).choices[0].text
    recommended = llm_jax.Sampling(temperature=0.6, top_p=0.9, top_k=20, repetition_penalty=1.1, seed=5)
    assert text == llm_jax.generate(model, [prompt], max_new_tokens=12, ignore_eos=True, sampling=recommended)[0].text
    greedy = client.completions.create(model=MODEL_NAME, prompt=prompt, temperature=0, max_tokens=20,
                                       extra_body={"ignore_eos": True, "repetition_penalty": 1.0})
    assert greedy.choices[0].text == llm_jax.generate(model, [prompt], max_new_tokens=20, ignore_eos=True)[0].text
    chat = client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "Hi"}],
                                          extra_body={"ignore_eos": True})
    assert chat.usage.completion_tokens == 12
