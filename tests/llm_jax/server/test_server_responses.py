"""OpenAI's Responses API as the official ``openai`` client sees it: ``responses.create`` and its stream
helper ``responses.stream`` (which checks every event against the items it has seen), ``responses.parse``
with a pydantic ``text_format``, function calls in and out, reasoning items; every answer is the one chat
completions gives for the same conversation (chat is held to ``generate`` elsewhere)."""

from __future__ import annotations

import json
import re

import httpx
import pydantic
import pytest
from server_process import MODEL_NAME

QUESTION = "Where did the little dog go?"
WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}},
                          "required": ["city"], "additionalProperties": False}, "strict": True}


class Pet(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=10)
    happy: bool


def streamed(client, **kwargs):
    """The stream's events and the final response the client's helper assembles from them."""
    with client.responses.stream(**kwargs) as stream:
        events = list(stream)
        # An answer the budget cut ends with response.incomplete, as OpenAI's do; the helper only
        # assembles completed ones.
        final = events[-1].response if events[-1].type == "response.incomplete" else stream.get_final_response()
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[0].type == "response.created" and events[1].type == "response.in_progress"
    assert events[-1].type in ("response.completed", "response.incomplete")
    return events, final


@pytest.mark.parametrize("max_tokens", [24, 200])
def test_text_is_chats_answer(client, max_tokens):
    """A plain answer: chat's greedy text and usage; status incomplete when the budget cut it; streamed as
    the same text."""
    chat = client.chat.completions.create(model=MODEL_NAME, messages=[
        {"role": "system", "content": "Be kind."}, {"role": "user", "content": QUESTION}],
        max_tokens=max_tokens, temperature=0)
    kwargs = dict(model=MODEL_NAME, instructions="Be kind.", input=QUESTION, max_output_tokens=max_tokens,
                  temperature=0)
    response = client.responses.create(**kwargs)
    assert response.output_text == chat.choices[0].message.content
    assert (response.usage.input_tokens, response.usage.output_tokens) == (chat.usage.prompt_tokens,
                                                                          chat.usage.completion_tokens)
    cut = chat.choices[0].finish_reason == "length"
    assert response.status == ("incomplete" if cut else "completed")
    assert (response.incomplete_details.reason if cut else response.incomplete_details) == (
        "max_output_tokens" if cut else None)
    (message,) = response.output
    assert message.type == "message" and message.status == response.status
    events, final = streamed(client, **kwargs)
    assert final.output_text == response.output_text and final.status == response.status
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == response.output_text
    assert [e.type for e in events if e.type.startswith("response.output_item")] == [
        "response.output_item.added", "response.output_item.done"]


def test_parse_with_a_text_format(client):
    parsed = client.responses.parse(model=MODEL_NAME, input="Tell me about a pet.", text_format=Pet,
                                    max_output_tokens=60, temperature=0)
    assert isinstance(parsed.output_parsed, Pet) and parsed.status == "completed"


def test_function_calls_in_and_out(client, http):
    """A named function's call (arguments streamed as deltas), and a conversation that sends the call and
    its output back: the prompt chat renders for the same messages."""
    kwargs = dict(model=MODEL_NAME, input="Weather in Paris?", tools=[WEATHER], max_output_tokens=60,
                  tool_choice={"type": "function", "name": "get_weather"}, temperature=0)
    response = client.responses.create(**kwargs)
    (call,) = response.output
    assert call.type == "function_call" and call.name == "get_weather" and call.status == "completed"
    assert isinstance(json.loads(call.arguments)["city"], str)
    events, final = streamed(client, **kwargs)
    (streamed_call,) = final.output
    assert (streamed_call.name, streamed_call.arguments) == (call.name, call.arguments)
    assert "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta") == call.arguments

    history = [{"role": "user", "content": "Weather in Paris?"},
               {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
               {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 21 degrees."}]
    answer = client.responses.create(model=MODEL_NAME, input=history, tools=[WEATHER], tool_choice="none",
                                     max_output_tokens=8, temperature=0)
    chat = http.post("/v1/chat/completions", json={
        "model": MODEL_NAME, "max_tokens": 8, "temperature": 0, "tool_choice": "none",
        "tools": [{"type": "function", "function": {k: v for k, v in WEATHER.items() if k != "type"}}],
        "messages": [history[0], {"role": "assistant", "content": None, "tool_calls": [
            {"id": call.call_id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}]},
            {"role": "tool", "tool_call_id": call.call_id, "content": "Sunny, 21 degrees."}]}).json()
    assert answer.usage.input_tokens == chat["usage"]["prompt_tokens"]
    assert answer.output_text == chat["choices"][0]["message"]["content"]


def test_allowed_tools_are_the_only_calls(client):
    """tool_choice of type allowed_tools (the flat form), "required": the call is of the allowed tool, and
    the response echoes the choice as given."""
    clock = {"type": "function", "name": "get_time", "parameters": {
        "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
        "additionalProperties": False}}
    choice = {"type": "allowed_tools", "mode": "required", "tools": [{"type": "function", "name": "get_time"}]}
    response = client.responses.create(model=MODEL_NAME, input="Weather in Paris?", tools=[WEATHER, clock],
                                       tool_choice=choice, parallel_tool_calls=False, max_output_tokens=60,
                                       extra_body={"seed": 3})
    (call,) = response.output
    assert call.type == "function_call" and call.name == "get_time"
    assert json.loads(call.arguments)["zone"] in ("UTC", "CET")
    assert response.tool_choice.type == "allowed_tools" and response.tool_choice.mode == "required"
    assert response.tool_choice.tools == choice["tools"] and [t.name for t in response.tools] == [
        "get_weather", "get_time"]


def test_reasoning_item_then_the_answer(client):
    """With the reasoning parser: a reasoning item (its text streamed as reasoning_text deltas), then the
    message (the output steered by vLLM's structured_outputs)."""
    pattern = r"<think>\nThe dog is [a-z]{1,8}\.\n</think>\n\nIt went [a-z]{1,8}\."
    kwargs = dict(model=MODEL_NAME, input=QUESTION, max_output_tokens=120, temperature=0,
                  extra_body={"structured_outputs": {"regex": pattern}})
    response = client.responses.create(**kwargs)
    reasoning, message = response.output
    assert reasoning.type == "reasoning" and re.fullmatch(r"The dog is [a-z]{1,8}\.", reasoning.content[0].text)
    assert re.fullmatch(r"It went [a-z]{1,8}\.", response.output_text) and response.status == "completed"
    events, final = streamed(client, **kwargs)
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == reasoning.content[0].text
    assert [item.type for item in final.output] == ["reasoning", "message"]
    assert final.output_text == response.output_text


@pytest.mark.parametrize("change, param", [
    ({"input": []}, "input"),
    ({"input": [{"type": "input_image", "image_url": "x"}]}, "input[0].type"),
    ({"input": [{"role": "user", "content": [{"type": "input_image"}]}]}, "input[0].content[0].type"),
    ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "input[0].call_id"),
    ({"previous_response_id": "resp_1"}, "previous_response_id"),
    ({"background": True}, "background"),
    ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice.name"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "allowed_tools", "mode": "required", "tools": [
        {"type": "function", "name": "nope"}]}}, "tool_choice.tools[0].name"),
    ({"tools": [WEATHER], "tool_choice": {"type": "allowed_tools", "mode": "never", "tools": [
        {"type": "function", "name": "get_weather"}]}}, "tool_choice.mode"),
    ({"text": {"format": {"type": "xml"}}}, "text.format.type"),
    ({"text": {"format": {"type": "json_schema", "schema": {}}}}, "text.format.name"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"temperature": 3}, "temperature"),
    ({"colour": "red"}, "colour"),
    ({"reasoning": {"effort": 3}}, "reasoning.effort"),
    ({"reasoning": {"depth": "high"}}, "reasoning"),
])
def test_bad_fields_are_refused_by_name(http, change, param):
    response = http.post("/v1/responses", json={"model": MODEL_NAME, "input": "Hi", **change})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param, response.text


def test_unauthorized_without_the_key(server):
    assert httpx.post(f"{server.url}/v1/responses", json={"input": "Hi"}, timeout=30).status_code == 401
