"""vLLM's ``vllm_xargs`` on /v1/completions and /v1/chat/completions: each request's values of the
arguments its server's logits processors read (``--logits-processors`` naming an ``llm_jax.LogitsProcessor``),
through the ``openai`` client: completions equal ``generate``'s with the same arguments; names the
processors do not read and values that are not numbers are refused by name, on this server and on one
whose processors read none."""

from __future__ import annotations

import httpx
import openai
import pytest
from server_process import CHAT_TEMPLATE, MODEL_NAME, start_server

import llm_jax
from tests.llm_jax.test_custom_logits_processors import WATERMARK

PROMPT = "Once upon a time"


@pytest.fixture(scope="module")
def watermarked(model_path, compile_cache, tmp_path_factory):
    folder = tmp_path_factory.mktemp("processors")
    (folder / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    process = start_server(model_path, folder, compile_cache, "--logits-processors",
                           "tests.llm_jax.test_custom_logits_processors:WATERMARK", "--max-num-seqs", "2",
                           "--max-num-batched-tokens", "16", "--chat-template", str(folder / "chat_template.jinja"))
    yield process
    process.terminate()


def test_each_request_sets_the_processors_arguments(watermarked, stories):
    client = openai.OpenAI(base_url=f"{watermarked.url}/v1", api_key="none", max_retries=0, timeout=120)
    for args in ({"delta": 4.0}, {"delta": 0.0}, None):
        extra = {"ignore_eos": True} | ({} if args is None else {"vllm_xargs": args})
        response = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=12, temperature=0,
                                             extra_body=extra)
        expected = llm_jax.generate(stories, [PROMPT], max_new_tokens=12, ignore_eos=True,
                                    logits_processors=[WATERMARK], processor_args=args)[0]
        assert response.choices[0].text == expected.text, args
    marked, plain = (llm_jax.generate(stories, [PROMPT], max_new_tokens=12, ignore_eos=True,
                                      logits_processors=[WATERMARK], processor_args={"delta": d})[0].text
                     for d in (4.0, 0.0))
    assert marked != plain  # the argument matters
    chat = client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": PROMPT}],
                                          max_tokens=4, extra_body={"vllm_xargs": {"delta": 2.5}})
    assert chat.choices[0].finish_reason in ("length", "stop")


@pytest.mark.parametrize("xargs, param, message", [
    ({"strength": 1}, "vllm_xargs.strength", "they read ['delta']"),
    ({"delta": "4"}, "vllm_xargs.delta", "must be a finite number"),
    ({"delta": True}, "vllm_xargs.delta", "must be a finite number"),
    ([1, 2], "vllm_xargs", "object"),
])
def test_bad_arguments_are_refused_by_name(watermarked, xargs, param, message):
    response = httpx.post(f"{watermarked.url}/v1/completions", timeout=60,
                          json={"prompt": PROMPT, "max_tokens": 2, "vllm_xargs": xargs})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and message in error["message"], error


def test_a_server_without_such_processors_refuses_them(http):
    response = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2, "vllm_xargs": {"delta": 1}})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "vllm_xargs.delta" and "it has none that read arguments" in error["message"], error
