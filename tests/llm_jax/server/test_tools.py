"""Tool calling's request fields and output readers (no server): the readers recover the calls that the
model's chat template writes (rendered by ``transformers``) and agree with ``transformers``' own response
parser; streamed in any pieces they give what the whole text gives; bad tool fields are refused by name."""

import json
import random

import pytest
import transformers
from test_chat_template import CHATML, LLAMA3, TOOLS
from transformers.cli.serving.utils import get_response_template

from llm_jax import guided
from llm_jax.server import protocol, tools
from llm_jax.server.fields import ApiError
from llm_jax.tokenizer import load_tokenizer

LIMITS = protocol.Limits(vocab_size=512, max_logprobs=5)
CALLS = [  # (content, [(name, arguments)]) as an assistant message gives them to the template
    ("", [("get_weather", {"city": "Paris"})]),
    ("Let me look.", [("get_weather", {"city": "Zürich \"old town\" <b>"})]),
    ("Two at once:", [("get_weather", {"city": "Oslo"}),
                      ("get_time", {"zone": "UTC", "nested": {"a": [1, 2.5, None]}})]),
    ("", [("no_arguments", {})]),
]
TRANSFORMERS_PARSER = get_response_template(None, transformers.Qwen2Config())  # its reader of Qwen 2.5's calls


@pytest.fixture(scope="module")
def hf_tokenizer(stories260k_dir):
    return transformers.AutoTokenizer.from_pretrained(stories260k_dir / "hf")


def assistant_text(hf_tokenizer, template: str, content: str, calls, end: str, call_ids: bool = False) -> str:
    """What the template writes for an assistant turn with these calls, without its end marker (the model's
    end-of-turn token, which ends generation)."""
    user = [{"role": "user", "content": "What's the weather?"}]
    message = {"role": "assistant", "content": content,
               "tool_calls": [{"type": "function", "function": {"name": n, "arguments": a}} for n, a in calls]}
    if call_ids:
        message["tool_calls"] = [{**c, "id": tools.mistral_call_id()} for c in message["tool_calls"]]
    kwargs = dict(tools=TOOLS, tokenize=False, chat_template=template)
    before = hf_tokenizer.apply_chat_template(user, add_generation_prompt=True, **kwargs)
    after = hf_tokenizer.apply_chat_template([*user, message], **kwargs)
    assert after.startswith(before)
    text = after[len(before):]
    assert text.endswith(end)
    return text.removesuffix(end)


def read(reader: tools.Reader, text: str, rng: random.Random | None = None) -> tuple[str, list]:
    """Content and (index, name, arguments) of each call; fed whole, or in random pieces."""
    result = tools.Read()
    pieces = [text] if rng is None else _pieces(text, rng)
    for piece in pieces:
        result += reader.feed(piece)
    result += reader.finish()
    calls: list[list] = []
    for delta in result.calls:
        if delta.id is not None:
            assert delta.id and delta.index == len(calls)
            calls.append([delta.index, delta.name, ""])
        calls[delta.index][2] += delta.arguments
    return result.content, [tuple(c) for c in calls]


def _pieces(text: str, rng: random.Random) -> list[str]:
    cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(0, 12)))) if len(text) > 1 else []
    return [text[i:j] for i, j in zip([0, *cuts], [*cuts, len(text)])]


@pytest.mark.parametrize("case", range(len(CALLS)))
def test_hermes_reads_the_calls_the_template_writes(hf_tokenizer, case):
    content, calls = CALLS[case]
    text = assistant_text(hf_tokenizer, CHATML, content, calls, "<|im_end|>\n")
    got_content, got_calls = read(tools.HermesReader(), text)
    assert got_content == content
    assert [(name, json.loads(arguments)) for _, name, arguments in got_calls] == calls
    # transformers' reader of the same format (its response template for Qwen 2.5) reads the same
    theirs = hf_tokenizer.parse_response(text, TRANSFORMERS_PARSER, prefix="")
    assert theirs.get("content", "") == content
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in theirs["tool_calls"]] == calls
    rng = random.Random(case)
    for _ in range(20):
        assert read(tools.HermesReader(), text, rng) == (got_content, got_calls)
    # without parallel calls, the first only
    assert read(tools.HermesReader(parallel=False), text)[1] == got_calls[:1]


# Written after Mistral 7B Instruct v0.3's published template: its tool-call turns (ids of nine characters);
# the tools go before the first user message here, not the last, so that a turn's text is its own.
MISTRAL = """{{- bos_token }}
{%- for message in messages %}
    {%- if message.role == 'user' %}
        {%- if loop.first and tools is not none %}
            {{- '[AVAILABLE_TOOLS] ' + tools | tojson + '[/AVAILABLE_TOOLS]' }}
        {%- endif %}
        {{- '[INST] ' + message.content + '[/INST]' }}
    {%- elif message.role == 'assistant' and message.tool_calls is defined %}
        {{- '[TOOL_CALLS] [' }}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.id is not defined or tool_call.id | length != 9 %}
                {{- raise_exception('Tool call IDs should be alphanumeric strings with length 9!') }}
            {%- endif %}
            {{- '{"name": "' + tool_call.function.name + '", "arguments": ' + tool_call.function.arguments | tojson }}
            {{- ', "id": "' + tool_call.id + '"}' }}
            {%- if not loop.last %}{{- ', ' }}{%- endif %}
        {%- endfor %}
        {{- ']' + eos_token }}
    {%- elif message.role == 'assistant' %}
        {{- ' ' + message.content + eos_token }}
    {%- endif %}
{%- endfor %}
"""


# Written after Mistral Small 3.2's published template (v11 tokenizer): each call as name[ARGS]{arguments}.
MISTRAL_V11 = """{{- bos_token }}
{%- for message in messages %}
    {%- if message.role == 'user' %}
        {{- '[INST]' + message.content + '[/INST]' }}
    {%- elif message.role == 'assistant' and message.tool_calls is defined and message.tool_calls %}
        {%- for tool in message.tool_calls %}
            {{- '[TOOL_CALLS]' }}
            {%- set arguments = tool.function.arguments %}
            {%- if arguments is not string %}
                {%- set arguments = arguments | tojson | safe %}
            {%- elif arguments == '' %}
                {%- set arguments = '{}' %}
            {%- endif %}
            {{- tool.function.name + '[ARGS]' + arguments }}
        {%- endfor %}
        {{- eos_token }}
    {%- elif message.role == 'assistant' %}
        {{- message.content + eos_token }}
    {%- endif %}
{%- endfor %}
"""


@pytest.mark.parametrize("template", ["v3", "v11"])
@pytest.mark.parametrize("case", [0, 2, 3])
def test_mistral_reads_the_calls_the_template_writes(hf_tokenizer, case, template):
    _, calls = CALLS[case]  # the templates write calls without content
    text = assistant_text(hf_tokenizer, MISTRAL if template == "v3" else MISTRAL_V11, "", calls, "</s>",
                          call_ids=True)
    content, got = read(tools.MistralReader(), text)
    assert content == "" and [(name, json.loads(arguments)) for _, name, arguments in got] == calls
    reader = tools.MistralReader()
    ids = [d.id for d in reader.feed(text).calls]
    assert all(len(i) == 9 and i.isalnum() for i in ids)  # what the template takes back
    rng = random.Random(case)
    for _ in range(20):
        assert read(tools.MistralReader(), text, rng) == (content, got)
    assert read(tools.MistralReader(parallel=False), text)[1] == got[:1]
    assert read(tools.MistralReader(), "Sure. " + text) == ("Sure.", got)


@pytest.mark.parametrize("case", [0, 1, 3])
def test_llama3_json_reads_the_call_the_template_writes(hf_tokenizer, case):
    _, calls = CALLS[case]  # the template writes one call and no content
    text = assistant_text(hf_tokenizer, LLAMA3, "", calls, "<|eot_id|>")
    content, got = read(tools.Llama3JsonReader(), text)
    assert content == "" and [(name, json.loads(arguments)) for _, name, arguments in got] == calls
    rng = random.Random(case)
    for _ in range(20):
        assert read(tools.Llama3JsonReader(), text, rng) == (content, got)
    several = "; ".join([text, text.replace("get_weather", "get_time")])  # parallel calls, ';'-separated
    assert [name for _, name, _ in read(tools.Llama3JsonReader(), several)[1]] == [calls[0][0],
                                                                               calls[0][0].replace("weather", "time")]
    assert len(read(tools.Llama3JsonReader(parallel=False), several)[1]) == 1


ODD_OUTPUTS = [
    "plain text, no calls ",
    "x <tool_c",
    "a <tool_call> b",
    "A <tool_call>not json</tool_call> B <tool_call>{\"name\": \"f\", \"arguments\": {}}</tool_call>  C",
    "<tool_call>\n{\"name\": \"f\", \"arguments\": {\"a\": 1}}",  # cut short: the open block is read at the end
    "<tool_call>[1, 2]</tool_call>",
    "   ",
    "",
    "{\"name\": \"f\", \"parameters\": {\"x\": \"a;b\"}}; {\"name\": \"g\", \"parameters\": {}}",
    " {\"name\": 3}",
    "<|python_tag|>{\"name\": \"f\", \"arguments\": {}}",
    "{\"name\": \"f\", \"parameters\": {}} and more",
    "Here: [TOOL_CALLS] [{\"name\": \"f\", \"arguments\": {\"a\": 1}}, {\"name\": \"g\", \"arguments\": {}}]",
    "[TOOL_CALLS] not json",
    "[TOOL_CALLS] [{\"name\": \"f\", \"argu",
    "x [TOOL_CA",
    "[TOOL_CALLS]get_weather[ARGS]{\"city\": \"Oslo\"}[TOOL_CALLS]get_time[ARGS]{}",
    "Sure [TOOL_CALLS]bad name[ARGS]{}",
    "[TOOL_CALLS]f[ARGS]{\"a\": ",
]


@pytest.mark.parametrize("make", [tools.HermesReader, tools.Llama3JsonReader, tools.MistralReader, tools.ArrayReader],
                         ids=["hermes", "llama3_json", "mistral", "array"])
def test_streamed_pieces_read_as_the_whole(make):
    rng = random.Random(0)
    texts = [*ODD_OUTPUTS, "[{\"name\": \"f\", \"parameters\": {\"a\": [1]}}, {\"name\": \"g\", \"parameters\": {}}]",
             "[{\"name\": \"f\", \"para"]
    for text in texts:
        whole = read(make(), text)
        for _ in range(30):
            assert read(make(), text, rng) == whole, text
        if not whole[1]:
            assert whole[0] == text  # no calls: the text is the content, as written


def test_odd_outputs():
    assert read(tools.HermesReader(), ODD_OUTPUTS[3]) == (
        "A <tool_call>not json</tool_call> B\n\nC", [(0, "f", "{}")])
    assert read(tools.HermesReader(), ODD_OUTPUTS[4]) == ("", [(0, "f", '{"a": 1}')])
    assert read(tools.Llama3JsonReader(), ODD_OUTPUTS[8])[1] == [(0, "f", '{"x": "a;b"}'), (1, "g", "{}")]
    assert read(tools.Llama3JsonReader(), ODD_OUTPUTS[10])[1] == [(0, "f", "{}")]
    assert read(tools.ArrayReader(), '[{"name": "f", "parameters": {"a": 1}}]') == ("", [(0, "f", '{"a": 1}')])
    assert read(tools.NamedReader("f"), '{"a": 1}', random.Random(1)) == ("", [(0, "f", '{"a": 1}')])
    assert read(tools.MistralReader(), ODD_OUTPUTS[16]) == ("", [(0, "get_weather", '{"city": "Oslo"}'),
                                                                (1, "get_time", "{}")])
    assert read(tools.MistralReader(), ODD_OUTPUTS[12]) == ("Here:", [(0, "f", '{"a": 1}'), (1, "g", "{}")])


def chat(**fields):
    return protocol.parse_chat({"messages": [{"role": "user", "content": "hi"}], **fields}, LIMITS)


WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
CLOCK = {"type": "function", "function": {"name": "get_time", "description": "now"}}


def test_tool_choice_sets_the_constraint(stories260k_dir):
    assert chat().tools is None
    assert chat(tools=[WEATHER]).tools.choice == "auto"
    assert chat(tools=[WEATHER], tool_choice="none").generation.guided is None
    named = chat(tools=[WEATHER, CLOCK], tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert named.generation.guided == guided.Json(WEATHER["function"]["parameters"])
    assert named.generation.guided_param == "tools"
    assert named.tools.specs() == [WEATHER, CLOCK]
    required = chat(tools=[WEATHER, CLOCK], tool_choice="required", parallel_tool_calls=False).generation.guided
    schema = required.schema
    assert schema["maxItems"] == 1 and [s["properties"]["name"]["enum"] for s in schema["items"]["anyOf"]] == [
        ["get_weather"], ["get_time"]]
    assert schema["items"]["anyOf"][1]["properties"]["parameters"] == tools.NO_PARAMETERS
    vocabulary = guided.vocabulary(load_tokenizer(stories260k_dir / "tok512.model"), (2,), 512)
    guided.check(vocabulary, required)  # compiles
    history = chat(messages=[
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "rain"}]).messages
    assert history[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Oslo"}


def allowed(mode, *names):
    return {"type": "allowed_tools", "allowed_tools": {
        "mode": mode, "tools": [{"type": "function", "function": {"name": name}} for name in names]}}


def test_allowed_tools_narrow_what_the_model_sees_and_calls():
    required = chat(tools=[WEATHER, CLOCK], tool_choice=allowed("required", "get_time"))
    assert required.tools.choice == "required" and required.tools.allowed == ("get_time",)
    assert required.tools.specs() == [CLOCK]
    items = required.generation.guided.schema["items"]
    assert items["properties"]["name"]["enum"] == ["get_time"] and required.generation.guided_param == "tools"
    auto = chat(tools=[WEATHER, CLOCK], tool_choice=allowed("auto", "get_weather", "get_time"))
    assert auto.tools.choice == "auto" and auto.tools.specs() == [WEATHER, CLOCK] and auto.generation.guided is None
    with pytest.raises(ApiError) as refused:
        tools.check_parser(auto.tools, None)
    assert refused.value.param == "tool_choice"


@pytest.mark.parametrize("fields, param", [
    ({"tools": {"a": 1}}, "tools"),
    ({"tools": [WEATHER], "tool_choice": allowed("sometimes", "get_weather")}, "tool_choice.allowed_tools.mode"),
    ({"tools": [WEATHER], "tool_choice": allowed("auto")}, "tool_choice.allowed_tools.tools"),
    ({"tools": [WEATHER], "tool_choice": allowed("auto", "nope")},
     "tool_choice.allowed_tools.tools[0].function.name"),
    ({"tools": [WEATHER], "tool_choice": allowed("auto", "get_weather", "get_weather")},
     "tool_choice.allowed_tools.tools[1].function.name"),
    ({"tools": [WEATHER], "tool_choice": {"type": "allowed_tools", "mode": "auto", "tools": []}}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "allowed_tools", "allowed_tools": {
        "mode": "auto", "tools": [{"type": "function", "name": "get_weather"}]}}},
     "tool_choice.allowed_tools.tools[0]"),
    ({"tools": [{"type": "retrieval", "function": {"name": "f"}}]}, "tools[0].type"),
    ({"tools": [{"type": "function"}]}, "tools[0].function"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools[0].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "{}"}}]}, "tools[0].function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "f", "colour": 1}}]}, "tools[0].function"),
    ({"tools": [WEATHER, WEATHER]}, "tools"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice.function.name"),
    ({"tools": [WEATHER], "tool_choice": {"function": {"name": "get_weather"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"tools": [WEATHER], "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ({"functions": [{"name": "f"}]}, "functions"),
    ({"messages": [{"role": "user", "content": "hi", "tool_calls": []}]}, "messages[0].tool_calls"),
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": [
        {"type": "function", "function": {"name": "f", "arguments": "{bad"}}]}]},
     "messages[0].tool_calls[0].function.arguments"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"type": "function", "function": {"arguments": "{}"}}]}]},
     "messages[0].tool_calls[0].function.name"),
    ({"messages": [{"role": "tool", "content": "x", "tool_call_id": 7}]}, "messages[0].tool_call_id"),
])
def test_bad_tool_fields_are_refused_by_name(fields, param):
    with pytest.raises(ApiError) as refused:
        chat(**fields)
    assert refused.value.status == 400 and refused.value.param == param, refused.value.message


def test_auto_needs_a_parser():
    with pytest.raises(ApiError) as refused:
        tools.check_parser(chat(tools=[WEATHER]).tools, None)
    assert refused.value.param == "tool_choice" and "--tool-call-parser" in refused.value.message
    tools.check_parser(chat(tools=[WEATHER]).tools, "hermes")
    tools.check_parser(chat(tools=[WEATHER], tool_choice="required").tools, None)
    tools.check_parser(chat().tools, None)
