"""Tool calling as the official ``openai`` client sees it: a named function (the client's own ``parse``
with a pydantic tool), ``required`` calls, and calls the model makes on its own read by the server's
Hermes parser; whole and streamed. Prompts with tools and with past calls are the tokens
``transformers``' ``apply_chat_template`` gives; greedy arguments are ``llm_jax.generate``'s under the
same constraint."""

from __future__ import annotations

import json
import pathlib
import re
from typing import Literal

import openai
import pydantic
import pytest
import transformers
from server_process import CHAT_TEMPLATE, MODEL_NAME

import llm_jax
from llm_jax import guided
from llm_jax.chat_template import encode_chat
from llm_jax.tokenizer import load_tokenizer


class GetWeather(pydantic.BaseModel):
    city: str = pydantic.Field(max_length=12)
    unit: Literal["celsius", "fahrenheit"]


class GetTime(pydantic.BaseModel):
    zone: Literal["UTC", "CET", "PST"]


WEATHER = openai.pydantic_function_tool(GetWeather, description="The weather in a city")
TIME = openai.pydantic_function_tool(GetTime)
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
PLAIN_WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


@pytest.fixture(scope="module")
def model(model_path):
    return llm_jax.load(model_path)


@pytest.fixture(scope="module")
def hf_tokenizer(stories260k_dir):
    tokenizer = transformers.AutoTokenizer.from_pretrained(stories260k_dir / "hf")
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def prompt_ids(hf_tokenizer, messages, tools) -> list[int]:
    """The prompt as transformers renders it, tokenized as llm_jax tokenizes chat prompts (each stretch
    between special tokens with its own leading space, as Llama 2's chat code and the sentencepiece
    tokenizer do; tested in tests/llm_jax/test_chat_template.py)."""
    text = hf_tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False)
    return encode_chat(load_tokenizer(pathlib.Path(hf_tokenizer.name_or_path).parent / "tok512.model"), text)


def stream_calls(stream) -> tuple[dict[int, str], dict[int, list[dict]], dict[int, str]]:
    """Each choice's content, tool calls (merged from their deltas, as the client accumulates them) and
    finish reason."""
    content, calls, finish = {}, {}, {}
    for chunk in stream:
        for choice in chunk.choices:
            content[choice.index] = content.get(choice.index, "") + (choice.delta.content or "")
            for delta in choice.delta.tool_calls or ():
                mine = calls.setdefault(choice.index, [])
                if delta.id is not None:
                    assert delta.index == len(mine) and delta.type == "function" and delta.function.name
                    mine.append({"id": delta.id, "name": delta.function.name, "arguments": ""})
                mine[delta.index]["arguments"] += delta.function.arguments or ""
            if choice.finish_reason is not None:
                finish[choice.index] = choice.finish_reason
    return content, calls, finish


def test_named_function_is_generates_constrained_answer(client, model, hf_tokenizer):
    """tool_choice naming a function: its arguments follow its schema (the client's parse checks them
    with pydantic), are generate's greedy tokens under that schema, and stream as the same text."""
    named = {"type": "function", "function": {"name": "GetWeather"}}
    kwargs = dict(model=MODEL_NAME, messages=MESSAGES, tools=[WEATHER, TIME], tool_choice=named, temperature=0,
                  max_completion_tokens=60)
    parsed = client.chat.completions.parse(**kwargs)
    (choice,) = parsed.choices
    assert choice.finish_reason == "stop" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.id.startswith("call_") and call.type == "function" and call.function.name == "GetWeather"
    assert isinstance(call.function.parsed_arguments, GetWeather)
    ids = prompt_ids(hf_tokenizer, MESSAGES, [WEATHER, TIME])
    assert parsed.usage.prompt_tokens == len(ids)
    (expected,) = llm_jax.generate(model, [ids], max_new_tokens=60,
                                   guided=guided.Json(WEATHER["function"]["parameters"]))
    assert call.function.arguments == expected.text
    content, calls, finish = stream_calls(client.chat.completions.create(**kwargs, stream=True))
    assert finish == {0: "stop"} and content == {0: ""}
    assert [(c["name"], c["arguments"]) for c in calls[0]] == [("GetWeather", call.function.arguments)]


def test_required_calls_one_of_the_tools(client):
    """tool_choice "required" without parallel calls: each sampled choice is one call of a listed tool,
    with valid arguments; the same seed streams the same calls."""
    kwargs = dict(model=MODEL_NAME, messages=MESSAGES, tools=[WEATHER, TIME], tool_choice="required",
                  parallel_tool_calls=False, n=3, seed=5, max_completion_tokens=80)
    whole = client.chat.completions.create(**kwargs)
    models = {"GetWeather": GetWeather, "GetTime": GetTime}
    for choice in whole.choices:
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        (call,) = choice.message.tool_calls
        models[call.function.name].model_validate_json(call.function.arguments)
    content, calls, finish = stream_calls(client.chat.completions.create(**kwargs, stream=True))
    assert finish == {i: "tool_calls" for i in range(3)}
    assert {i: [(c["name"], c["arguments"]) for c in calls[i]] for i in range(3)} == {
        c.index: [(t.function.name, t.function.arguments) for t in c.message.tool_calls] for c in whole.choices}


def test_allowed_tools_required_calls_only_those(client, hf_tokenizer):
    """tool_choice of type allowed_tools: the template shows only the allowed tool (the prompt is
    transformers' with that tool alone), and every sampled call, whole or streamed, is one of it."""
    choice = {"type": "allowed_tools", "allowed_tools": {
        "mode": "required", "tools": [{"type": "function", "function": {"name": "GetTime"}}]}}
    kwargs = dict(model=MODEL_NAME, messages=MESSAGES, tools=[WEATHER, TIME], tool_choice=choice, n=3, seed=11,
                  parallel_tool_calls=False, max_completion_tokens=80)
    whole = client.chat.completions.create(**kwargs)
    assert whole.usage.prompt_tokens == len(prompt_ids(hf_tokenizer, MESSAGES, [TIME]))
    for c in whole.choices:
        assert c.finish_reason == "tool_calls"
        (call,) = c.message.tool_calls
        assert call.function.name == "GetTime"
        GetTime.model_validate_json(call.function.arguments)
    content, calls, finish = stream_calls(client.chat.completions.create(**kwargs, stream=True))
    assert {i: [(c["name"], c["arguments"]) for c in calls[i]] for i in range(3)} == {
        c.index: [(t.function.name, t.function.arguments) for t in c.message.tool_calls] for c in whole.choices}


def test_auto_reads_the_calls_the_model_writes(client, model, hf_tokenizer):
    """tool_choice "auto" with the Hermes parser: a <tool_call> block in the output is a call and the text
    before it the content (the output is steered into that format by a regular expression); an output
    without one is content only, generate's text."""
    pattern = r'Let me check\.\n<tool_call>\{"name": "get_weather", "arguments": \{"city": "[a-z]{1,6}"\}\}</tool_call>'
    kwargs = dict(model=MODEL_NAME, messages=MESSAGES, tools=[PLAIN_WEATHER], temperature=0, max_completion_tokens=80,
                  extra_body={"structured_outputs": {"regex": pattern}})
    whole = client.chat.completions.create(**kwargs)
    (choice,) = whole.choices
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Let me check."
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather"
    assert re.fullmatch(r"[a-z]{1,6}", json.loads(call.function.arguments)["city"])
    content, calls, finish = stream_calls(client.chat.completions.create(**kwargs, stream=True))
    assert content == {0: "Let me check."} and finish == {0: "tool_calls"}
    assert [(c["name"], c["arguments"]) for c in calls[0]] == [("get_weather", call.function.arguments)]

    free = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, tools=[PLAIN_WEATHER], temperature=0,
                                          max_completion_tokens=24)
    (expected,) = llm_jax.generate(model, [prompt_ids(hf_tokenizer, MESSAGES, [PLAIN_WEATHER])], max_new_tokens=24)
    assert free.choices[0].message.content == expected.text and not free.choices[0].message.tool_calls
    assert free.choices[0].finish_reason == {"eos": "stop", "length": "length"}[expected.finish_reason]


def test_a_conversation_with_calls_renders_as_transformers(http, hf_tokenizer):
    """Past calls (their arguments a JSON string, as the API sends them) and tool results reach the chat
    template as transformers gives them to it (arguments as objects)."""
    arguments = {"city": "Oslo", "unit": "celsius"}
    history = [*MESSAGES,
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": "call_1", "type": "function", "function": {"name": "GetWeather", "arguments": None}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "Rain, 7 degrees."}]
    ours = [*history[:1], {**history[1], "tool_calls": [{**history[1]["tool_calls"][0], "function": {
        "name": "GetWeather", "arguments": json.dumps(arguments)}}]}, history[2]]
    theirs = [*history[:1], {**history[1], "tool_calls": [{**history[1]["tool_calls"][0], "function": {
        "name": "GetWeather", "arguments": arguments}}]}, history[2]]
    response = http.post("/tokenize", json={"model": MODEL_NAME, "messages": ours, "tools": [WEATHER, TIME]})
    assert response.status_code == 200, response.text
    expected = prompt_ids(hf_tokenizer, theirs, [WEATHER, TIME])
    assert response.json()["tokens"] == expected and '"city": "Oslo"' in hf_tokenizer.decode(expected)
    chat = http.post("/v1/chat/completions", json={"model": MODEL_NAME, "messages": ours, "tools": [WEATHER, TIME],
                                                   "tool_choice": "none", "max_tokens": 1})
    assert chat.status_code == 200 and chat.json()["usage"]["prompt_tokens"] == len(expected)


def test_reasoning_apart_from_the_answer(client):
    """With the reasoning parser, <think> reasoning goes to reasoning_content and the rest to content (and
    tool calls), whole and streamed (the output steered by a regular expression)."""
    thinking = r"<think>\nThe user asks about [a-z]{1,8}\.\n</think>\n\n"
    answers = (r"It is [a-z]{1,8}\.",
               r'<tool_call>\{"name": "get_weather", "arguments": \{"city": "paris"\}\}</tool_call>')
    kinds = set()
    for answer in answers:
        kwargs = dict(model=MODEL_NAME, messages=MESSAGES, tools=[PLAIN_WEATHER], max_completion_tokens=150, n=2,
                      seed=3, extra_body={"structured_outputs": {"regex": thinking + answer}})
        whole = client.chat.completions.create(**kwargs)
        streamed_reasoning: dict[int, str] = {}
        chunks = list(client.chat.completions.create(**kwargs, stream=True))
        for chunk in chunks:
            for choice in chunk.choices:
                piece = (choice.delta.model_extra or {}).get("reasoning_content") or ""
                streamed_reasoning[choice.index] = streamed_reasoning.get(choice.index, "") + piece
        content, calls, finish = stream_calls(iter(chunks))
        for choice in whole.choices:
            message, i = choice.message, choice.index
            assert re.fullmatch(r"The user asks about [a-z]{1,8}\.", message.model_extra["reasoning_content"])
            assert streamed_reasoning[i] == message.model_extra["reasoning_content"]
            kinds.add("call" if message.tool_calls else "text")
            if message.tool_calls:
                assert message.content is None and choice.finish_reason == "tool_calls"
                assert json.loads(message.tool_calls[0].function.arguments) == {"city": "paris"}
                assert [(c["name"], c["arguments"]) for c in calls[i]] == [
                    ("get_weather", message.tool_calls[0].function.arguments)]
            else:
                assert re.fullmatch(r"It is [a-z]{1,8}\.", message.content) and choice.finish_reason == "stop"
                assert content[i] == message.content and i not in calls
            assert finish[i] == choice.finish_reason
    assert kinds == {"call", "text"}  # both answers were read
