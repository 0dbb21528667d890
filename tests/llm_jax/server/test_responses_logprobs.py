"""Log-probabilities on /v1/responses (``include: ["message.output_text.logprobs"]`` with ``top_logprobs``)
as the official ``openai`` client sees them: the message's ``output_text`` part lists every token of the
answer, as chat completions' ``logprobs`` does for the same greedy request (held to ``generate`` and
``transformers`` elsewhere); streamed, the ``output_text.delta`` events carry the same entries in order;
bad values are refused by name."""

from __future__ import annotations

import pytest
from server_process import MODEL_NAME

QUESTION = "Where did the little dog go?"
INCLUDE = ["message.output_text.logprobs"]
ATOL = 1e-5


def _chat(client, max_tokens: int, top: int):
    response = client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": QUESTION}],
                                              max_tokens=max_tokens, temperature=0, logprobs=True, top_logprobs=top)
    return response.choices[0].logprobs.content


def _streamed(client, **kwargs):
    with client.responses.stream(**kwargs) as stream:
        events = list(stream)
    final = events[-1].response
    assert events[-1].type in ("response.completed", "response.incomplete")
    return events, final


def _same(entries, expected, *, top: int) -> None:
    """Entries (the Responses API's) equal chat's ``expected`` ones: tokens, log-probabilities, alternatives."""
    assert [e.token for e in entries] == [e.token for e in expected]
    for mine, theirs in zip(entries, expected):
        assert mine.logprob == pytest.approx(theirs.logprob, abs=ATOL)
        assert len(mine.top_logprobs) == top
        assert [t.token for t in mine.top_logprobs] == [t.token for t in theirs.top_logprobs]
        assert [t.logprob for t in mine.top_logprobs] == pytest.approx([t.logprob for t in theirs.top_logprobs],
                                                                        abs=ATOL)


@pytest.mark.parametrize("top", [0, 3])
def test_output_text_logprobs_are_chats(client, top):
    expected = _chat(client, 12, top)
    kwargs = dict(model=MODEL_NAME, input=QUESTION, max_output_tokens=12, temperature=0, top_logprobs=top,
                  include=INCLUDE)
    response = client.responses.create(**kwargs)
    assert response.top_logprobs == top
    (message,) = response.output
    (part,) = message.content
    assert len(part.logprobs) == response.usage.output_tokens
    _same(part.logprobs, expected, top=top)
    for entry in part.logprobs:
        assert entry.bytes == list(entry.token.encode())
        assert all(t.bytes == list(t.token.encode()) for t in entry.top_logprobs)

    events, final = _streamed(client, **kwargs)
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    _same([entry for e in deltas for entry in e.logprobs], expected, top=top)
    (done,) = [e for e in events if e.type == "response.output_text.done"]
    _same(done.logprobs, expected, top=top)
    _same(final.output[0].content[0].logprobs, expected, top=top)


def test_reasoning_tokens_go_with_the_message(client):
    """With the reasoning parser, the reasoning's tokens are listed with the message's (as vLLM lists
    them), whole and streamed alike."""
    pattern = r"<think>\nThe dog is [a-z]{1,8}\.\n</think>\n\nIt went [a-z]{1,8}\."
    kwargs = dict(model=MODEL_NAME, input=QUESTION, max_output_tokens=120, temperature=0, top_logprobs=1,
                  include=INCLUDE, extra_body={"structured_outputs": {"regex": pattern}})
    response = client.responses.create(**kwargs)
    reasoning, message = response.output
    assert reasoning.type == "reasoning" and message.type == "message"
    entries = message.content[0].logprobs
    assert len(entries) == response.usage.output_tokens and "think" in "".join(e.token for e in entries)
    events, final = _streamed(client, **kwargs)
    streamed = [entry for e in events if e.type == "response.output_text.delta" for entry in e.logprobs]
    assert [e.token for e in streamed] == [e.token for e in entries]
    assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in entries], abs=ATOL)
    assert not any(getattr(e, "logprobs", None) for e in events if e.type == "response.reasoning_text.delta")


def test_none_unless_included(client, http):
    """top_logprobs alone asks for nothing (as vLLM's): the part's logprobs stay empty."""
    response = client.responses.create(model=MODEL_NAME, input=QUESTION, max_output_tokens=6, temperature=0,
                                       top_logprobs=2)
    assert response.output[0].content[0].logprobs == [] and response.top_logprobs == 2
    plain = http.post("/v1/responses", json={"model": MODEL_NAME, "input": QUESTION, "max_output_tokens": 6,
                                             "stream": True})
    assert plain.status_code == 200 and '"logprobs":[{' not in plain.text


@pytest.mark.parametrize("change, param", [
    ({"top_logprobs": -1}, "top_logprobs"),
    ({"top_logprobs": 21}, "top_logprobs"),
    ({"top_logprobs": "3"}, "top_logprobs"),
    ({"top_logprobs": 1.5}, "top_logprobs"),
    ({"include": "message.output_text.logprobs"}, "include"),
    ({"include": ["reasoning.encrypted_content"]}, "include[0]"),
    ({"include": [INCLUDE[0], 7]}, "include[1]"),
])
def test_bad_fields_are_refused_by_name(http, change, param):
    response = http.post("/v1/responses", json={"model": MODEL_NAME, "input": "Hi", **change})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param, response.text
