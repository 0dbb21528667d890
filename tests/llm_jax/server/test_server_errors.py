"""Bad requests: each gets a 4xx in OpenAI's error format naming the field, never a 5xx; generated bodies
(``hypothesis``) leave the server healthy and answering."""

from __future__ import annotations

import json

import httpx
import pytest
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st
from server_process import API_KEY, MAX_MODEL_LEN, MODEL_NAME

COMPLETION = {"prompt": "Once upon a time", "max_tokens": 4}
CHAT = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
VOCAB = 512  # stories260K


def _error(response: httpx.Response, status: int, param: str | None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["param"] == param, error
    return error


CASES = [
    # (path, body, status, param)
    ("/v1/completions", {"max_tokens": 4}, 400, "prompt"),
    ("/v1/completions", {**COMPLETION, "max_tokens": "4"}, 400, "max_tokens"),
    ("/v1/completions", {**COMPLETION, "max_tokens": 4.5}, 400, "max_tokens"),
    ("/v1/completions", {**COMPLETION, "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {**COMPLETION, "max_tokens": MAX_MODEL_LEN}, 400, "max_tokens"),  # prompt + max > context
    ("/v1/completions", {**COMPLETION, "temperature": True}, 400, "temperature"),
    ("/v1/completions", {**COMPLETION, "temperature": -0.5}, 400, "temperature"),
    ("/v1/completions", {**COMPLETION, "top_p": 0}, 400, "top_p"),
    ("/v1/completions", {**COMPLETION, "n": 0}, 400, "n"),
    ("/v1/completions", {**COMPLETION, "n": 129}, 400, "n"),
    ("/v1/completions", {**COMPLETION, "n": 100}, 400, "n"),  # more than the server ever holds at once
    ("/v1/completions", {**COMPLETION, "prompt": []}, 400, "prompt"),
    ("/v1/completions", {**COMPLETION, "prompt": [[]]}, 400, "prompt[0]"),
    ("/v1/completions", {**COMPLETION, "prompt": [1, VOCAB]}, 400, "prompt"),
    ("/v1/completions", {**COMPLETION, "prompt": [1, -3]}, 400, "prompt"),
    ("/v1/completions", {**COMPLETION, "prompt": ["a", 1]}, 400, "prompt"),
    ("/v1/completions", {**COMPLETION, "prompt": [1] * MAX_MODEL_LEN}, 400, "max_tokens"),
    ("/v1/completions", {**COMPLETION, "logprobs": 21}, 400, "logprobs"),
    ("/v1/completions", {**COMPLETION, "logprobs": True}, 400, "logprobs"),
    ("/v1/completions", {**COMPLETION, "stop": [""]}, 400, "stop"),
    ("/v1/completions", {**COMPLETION, "stop": [1]}, 400, "stop[0]"),
    ("/v1/completions", {**COMPLETION, "stop_token_ids": [VOCAB]}, 400, "stop_token_ids"),
    ("/v1/completions", {**COMPLETION, "logit_bias": {"x": 1}}, 400, "logit_bias"),
    ("/v1/completions", {**COMPLETION, "logit_bias": {"5": 101}}, 400, "logit_bias"),
    ("/v1/completions", {**COMPLETION, "presence_penalty": 3}, 400, "presence_penalty"),
    ("/v1/completions", {**COMPLETION, "seed": 2**64}, 400, "seed"),
    ("/v1/completions", {**COMPLETION, "min_tokens": 5}, 400, "min_tokens"),
    ("/v1/completions", {**COMPLETION, "stream_options": {"include_usage": True}}, 400, "stream_options"),
    ("/v1/completions", {**COMPLETION, "typical_p": 0}, 400, "typical_p"),
    ("/v1/completions", {**COMPLETION, "bad_words": [1]}, 400, "bad_words[0]"),
    ("/v1/completions", {**COMPLETION, "bad_words": [" "]}, 400, "bad_words"),
    ("/v1/completions", {**COMPLETION, "bad_words": ["a" * 200]}, 400, "bad_words"),
    ("/v1/completions", {**COMPLETION, "best_of": 3}, 400, "best_of"),
    ("/v1/completions", {**COMPLETION, "skip_special_tokens": "no"}, 400, "skip_special_tokens"),
    ("/v1/completions", {**COMPLETION, "priority": 1}, 400, "priority"),  # the server schedules first come first
    ("/v1/completions", {**COMPLETION, "priority": 1.5}, 400, "priority"),
    ("/v1/completions", {**COMPLETION, "suffix": "end"}, 400, "suffix"),
    ("/v1/completions", {**COMPLETION, "temprature": 0.5}, 400, "temprature"),
    ("/v1/completions", {**COMPLETION, "model": "gpt-4"}, 404, "model"),
    ("/v1/chat/completions", {"max_tokens": 4}, 400, "messages"),
    ("/v1/chat/completions", {**CHAT, "messages": []}, 400, "messages"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "wizard", "content": "x"}]}, 400, "messages[0].role"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400,
     "messages[0].content[0]"),
    ("/v1/chat/completions", {**CHAT, "top_logprobs": 2}, 400, "top_logprobs"),
    ("/v1/chat/completions", {**CHAT, "tools": [{"type": "function"}]}, 400, "tools[0].function"),
    ("/v1/chat/completions", {**CHAT, "tool_choice": "required"}, 400, "tool_choice"),
    ("/v1/chat/completions", {**CHAT, "tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"type": 7}}}}}], "tool_choice": "required"}, 400, "tools"),
    ("/v1/chat/completions", {**CHAT, "max_completion_tokens": -1}, 400, "max_completion_tokens"),
    ("/v1/completions", {**COMPLETION, "guided_regex": "a(b"}, 400, "guided_regex"),
    ("/v1/completions", {**COMPLETION, "guided_choice": []}, 400, "guided_choice"),
    ("/v1/completions", {**COMPLETION, "guided_choice": ["a", 1]}, 400, "guided_choice[1]"),
    ("/v1/completions", {**COMPLETION, "guided_json": "{not json"}, 400, "guided_json"),
    ("/v1/completions", {**COMPLETION, "guided_grammar": "start: nowhere"}, 400, "guided_grammar"),
    ("/v1/completions", {**COMPLETION, "guided_regex": "a", "guided_choice": ["a"]}, 400, "guided_choice"),
    ("/v1/completions", {**COMPLETION, "structured_outputs": {"regex": "a", "choice": ["b"]}}, 400,
     "structured_outputs"),
    ("/v1/completions", {**COMPLETION, "structured_outputs": {"xml": "a"}}, 400, "structured_outputs"),
    ("/v1/completions", {**COMPLETION, "structured_outputs": {"json": {"type": "object", "minProperties": "x"}}},
     400, "structured_outputs"),
    ("/v1/chat/completions", {**CHAT, "response_format": {"type": "xml"}}, 400, "response_format.type"),
    ("/v1/chat/completions", {**CHAT, "response_format": {"type": "json_schema"}}, 400,
     "response_format.json_schema"),
    ("/v1/chat/completions", {**CHAT, "response_format": {"type": "json_schema", "json_schema": {"schema": {}}}},
     400, "response_format"),
    ("/v1/chat/completions", {**CHAT, "response_format": {"type": "json_object"}, "guided_regex": "a"}, 400,
     "guided_regex"),
    ("/tokenize", {}, 400, "prompt"),
    ("/detokenize", {"tokens": []}, 400, "tokens"),
    ("/detokenize", {"tokens": [VOCAB]}, 400, "tokens"),
]


@pytest.mark.parametrize("path, body, status, param", CASES, ids=[f"{c[0]} {json.dumps(c[1])[:60]}" for c in CASES])
def test_bad_fields_are_named(http, path, body, status, param):
    _error(http.post(path, json=body), status, param)


@pytest.mark.parametrize("raw", [b"", b"{", b"[1, 2]", b'{"prompt": NaN}', b'{"prompt": "a", "max_tokens": 1e400}',
                                 b"\xff\xfe", b'"\\ud800"', b"[" * 100_000])
def test_malformed_json_is_refused(http, raw):
    error = _error(http.post("/v1/completions", content=raw), 400, None)
    assert error["type"] == "invalid_request_error"


def test_api_key(server, http):
    body = {**COMPLETION, "model": MODEL_NAME}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
        error = _error(httpx.post(f"{server.url}/v1/completions", json=body, headers=headers), 401, None)
        assert error["code"] == "invalid_api_key"
    assert http.post("/v1/completions", json=body).status_code == 200
    for path in ("/health", "/metrics", "/version"):  # probes and scrapers need no key
        assert httpx.get(f"{server.url}{path}").status_code == 200


def test_unknown_routes_and_methods(http):
    assert _error(http.get("/v2/nothing"), 404, None)["type"] == "not_found_error"
    _error(http.get("/v1/completions"), 405, None)


# Values that probe edges: types, signs, bounds, empties.
EDGES = st.sampled_from([None, True, False, 0, 1, -1, 3, 0.5, 1.5, 2.5, 100, 2**31, 2**63, -2**63, 1e30, "", "x",
                         [], [0], [1, 2], [[1]], [[]], {}, {"include_usage": True}, {"1": 5}, {"x": 1}, [-1], [VOCAB],
                         ["a"], [{"role": "user", "content": "Hi"}], [{"role": "user"}], [{"content": 1}]])
SCALARS = (st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=False, allow_infinity=False)
           | st.text(max_size=12))
JSON = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=3)
                    | st.dictionaries(st.text(max_size=8), inner, max_size=3), max_leaves=8)
FIELDS = st.sampled_from(["model", "prompt", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p",
                          "n", "stop", "seed", "logprobs", "top_logprobs", "echo", "presence_penalty",
                          "frequency_penalty", "logit_bias", "stream", "stream_options", "top_k", "min_p",
                          "repetition_penalty", "min_tokens", "ignore_eos", "stop_token_ids", "best_of", "tokens",
                          "add_generation_prompt", "continue_final_message", "chat_template_kwargs", "typical_p",
                          "response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice",
                          "guided_grammar", "bad_words", "tools", "tool_choice", "parallel_tool_calls",
                          "skip_special_tokens", "input", "instructions", "max_output_tokens", "text", "reasoning",
                          "priority", "include_stop_str_in_output", "encoding_format", "dimensions",
                          "unknown"])
BASES = {"/v1/completions": COMPLETION, "/v1/chat/completions": CHAT, "/tokenize": {"prompt": "Hi"},
         "/detokenize": {"tokens": [1, 2]}, "/v1/responses": {"input": "Hi", "max_output_tokens": 8},
         "/v1/embeddings": {"input": "Hi"}}


def _bounded(path: str, body: dict) -> dict:
    """The body with its work kept small: at most 4 completions of at most 64 tokens (the limits themselves
    are tested above)."""

    def integer(value) -> bool:
        return isinstance(value, int) and not isinstance(value, bool)

    for key, most in (("max_tokens", 64), ("max_completion_tokens", 64), ("max_output_tokens", 64), ("n", 4)):
        if integer(body.get(key)) and body[key] > most:
            body[key] = most
    if path == "/v1/chat/completions" and body.get("max_tokens") is None and body.get("max_completion_tokens") is None:
        body["max_tokens"] = 8  # not the rest of the context
    return body


@settings(max_examples=120, deadline=None, database=None, suppress_health_check=list(HealthCheck))
@given(path=st.sampled_from(sorted(BASES)), changes=st.dictionaries(FIELDS, EDGES | JSON, max_size=4),
       dropped=st.sets(st.sampled_from(["prompt", "messages", "max_tokens", "tokens", "input"]), max_size=1))
@example(path="/v1/chat/completions", changes={"messages": [{"role": "user", "content": {"x": 1}}]}, dropped=set())
@example(path="/v1/chat/completions", changes={"chat_template_kwargs": {"messages": 1}}, dropped=set())
@example(path="/v1/completions", changes={"stream": True, "n": 3, "logprobs": 2}, dropped=set())
@example(path="/v1/completions", changes={"top_k": 1, "logprobs": 3}, dropped=set())  # -inf log-probabilities
def test_generated_bodies_never_fail_the_server(http, path, changes, dropped):
    body = _bounded(path, {k: v for k, v in {**BASES[path], **changes}.items() if k not in dropped})
    response = http.post(path, json=body)
    event(f"{path} {response.status_code}")
    assert response.status_code in (200, 400, 404), (response.status_code, response.text, body)
    if response.status_code != 200:
        _error(response, response.status_code, response.json()["error"]["param"])
    elif body.get("stream") is True:
        assert response.text.endswith("data: [DONE]\n\n")


def test_the_server_is_healthy_after_bad_input(server, http):
    for raw in (b"{", b'{"prompt": [1, 99999]}', json.dumps({"prompt": "x", "n": 10**6}).encode()):
        assert http.post("/v1/completions", content=raw).status_code == 400
    assert httpx.get(f"{server.url}/health").status_code == 200
    response = http.post("/v1/completions", json={**COMPLETION, "temperature": 0})
    assert response.status_code == 200 and response.json()["choices"][0]["text"]
