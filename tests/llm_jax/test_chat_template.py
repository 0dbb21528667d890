"""Chat templates rendered as transformers' apply_chat_template renders them (text and token ids)."""

import json
import re
import shutil

import pytest
import transformers

from llm_jax.chat_template import ChatTemplate, ChatTemplateError, encode_chat, load_chat_template
from llm_jax.tokenizer import load_tokenizer

# Written after the published templates of each family: system prompt handling, tools as JSON,
# strftime_now, namespace, loop controls, raise_exception, trimming, the generation prompt.
LLAMA3 = """{{- bos_token }}
{%- set date_string = strftime_now("%d %b %Y") %}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}
{%- if tools is not none %}
    {{- "Environment: ipython\\n" }}
{%- endif %}
{{- "Today Date: " + date_string + "\\n\\n" }}
{%- if tools is not none %}
    {{- "You have access to the following functions:\\n\\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\\n\\n" }}
    {%- endfor %}
{%- endif %}
{{- system_message }}
{{- "<|eot_id|>" }}
{%- for message in messages %}
    {%- if message.role == 'assistant' and message.tool_calls is defined %}
        {%- set tool_call = message.tool_calls[0].function %}
        {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}
        {{- '{"name": "' + tool_call.name + '", "parameters": ' }}
        {{- tool_call.arguments | tojson }}
        {{- "}<|eot_id|>" }}
    {%- elif message.role == 'tool' %}
        {{- "<|start_header_id|>ipython<|end_header_id|>\\n\\n" }}
        {{- message.content | tojson if message.content is mapping else message.content }}
        {{- "<|eot_id|>" }}
    {%- else %}
        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim + '<|eot_id|>' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""

CHATML = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\\n\\n' }}
    {%- endif %}
    {{- "# Tools\\n\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools><|im_end|>\\n" }}
{%- elif messages[0].role == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- else %}
    {{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}
{%- endif %}
{%- set ns = namespace(last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- if message.role == "user" %}
        {%- set ns.last_query_index = messages|length - 1 - loop.index0 %}
        {%- break %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.role == "system" %}
        {%- continue %}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>assistant\\n' }}
        {%- if message.reasoning_content is defined and loop.index0 > ns.last_query_index %}
            {{- '<think>\\n' + message.reasoning_content.strip('\\n') + '\\n</think>\\n\\n' }}
        {%- endif %}
        {%- generation %}
        {{- message.content }}
        {%- endgeneration %}
        {%- for tool_call in message.tool_calls if message.tool_calls is defined %}
            {{- '\\n<tool_call>\\n{"name": "' + tool_call.function.name + '", "arguments": ' }}
            {{- tool_call.function.arguments | tojson }}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

GEMMA = """{{ bos_token }}{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}\
{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}\
{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}\
{% if (message['role'] == 'assistant') %}{% set role = 'model' %}{% else %}{% set role = message['role'] %}{% endif %}\
{{ '<start_of_turn>' + role + '\n' + message['content'] | trim + '<end_of_turn>\n' }}{% endfor %}\
{% if add_generation_prompt %}{{'<start_of_turn>model\n'}}{% endif %}"""

TEMPLATES = {"llama3": LLAMA3, "chatml": CHATML, "gemma": GEMMA}

TOOLS = [{
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather for a city — \"quoted\", <html> & ümlauts",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}]

CONVERSATIONS = {
    "single": [{"role": "user", "content": "Hello!"}],
    "multi_turn": [
        {"role": "user", "content": "  Wie geht's? 你好 😀  "},
        {"role": "assistant", "content": "Gut, danke! <b>bold</b> & more"},
        {"role": "user", "content": "Code:\n```python\nprint('hi')\n```"},
    ],
    "system": [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Explain JAX."},
        {"role": "assistant", "content": "XLA-compiled NumPy.", "reasoning_content": "\nShort answer.\n"},
        {"role": "user", "content": "More?"},
    ],
    "tool_call": [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
        ]},
        {"role": "tool", "content": "22°C, sunny", "tool_calls": None},
    ],
}


@pytest.fixture(scope="module")
def reference_tokenizer(byte_level_dir):
    return transformers.AutoTokenizer.from_pretrained(str(byte_level_dir))


@pytest.fixture(scope="module")
def special_tokens(reference_tokenizer):
    return dict(reference_tokenizer.special_tokens_map)


@pytest.mark.parametrize("template_name", sorted(TEMPLATES))
@pytest.mark.parametrize("conversation", sorted(CONVERSATIONS))
@pytest.mark.parametrize("add_generation_prompt", [False, True])
def test_render_equals_transformers(
    template_name, conversation, add_generation_prompt, reference_tokenizer, special_tokens, byte_level_dir
):
    source, messages = TEMPLATES[template_name], CONVERSATIONS[conversation]
    template = ChatTemplate(templates={"default": source}, special_tokens=special_tokens, source="test")
    tools = TOOLS if conversation == "tool_call" else None
    kwargs = dict(add_generation_prompt=add_generation_prompt, tools=tools)
    try:
        expected = reference_tokenizer.apply_chat_template(messages, chat_template=source, tokenize=False, **kwargs)
    except Exception as error:  # the template refused the conversation (Gemma has no system role)
        with pytest.raises(ChatTemplateError, match=re.escape(str(error))):
            template.render(messages, **kwargs)
        return
    rendered = template.render(messages, **kwargs)
    assert rendered == expected
    expected_ids = reference_tokenizer.apply_chat_template(
        messages, chat_template=source, tokenize=True, return_dict=False, **kwargs
    )
    assert encode_chat(load_tokenizer(byte_level_dir), rendered) == expected_ids


@pytest.mark.parametrize("template_name", ["chatml", "llama3"])
def test_continue_final_message_equals_transformers(template_name, reference_tokenizer, special_tokens):
    source = TEMPLATES[template_name]
    messages = [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "The colour is "}]
    template = ChatTemplate(templates={"default": source}, special_tokens=special_tokens, source="test")
    expected = reference_tokenizer.apply_chat_template(
        messages, chat_template=source, tokenize=False, continue_final_message=True
    )
    rendered = template.render(messages, continue_final_message=True)
    assert rendered == expected
    assert rendered.rstrip().endswith("The colour is")  # the assistant turn is left open


def model_folder(tmp_path, byte_level_dir, tokenizer_config, files=None):
    """A copy of the byte-level tokenizer with the given tokenizer_config.json and extra files."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    shutil.copy(byte_level_dir / "tokenizer.json", tmp_path / "tokenizer.json")
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|begin_of_text|>",
              "eos_token": "<|eot_id|>", **tokenizer_config}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    for name, text in (files or {}).items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    return tmp_path


def render_both(folder, messages, **kwargs):
    ours = load_chat_template(folder).render(messages, **kwargs)
    theirs = transformers.AutoTokenizer.from_pretrained(str(folder)).apply_chat_template(
        messages, tokenize=False, **kwargs
    )
    return ours, theirs


def test_template_sources_as_transformers_loads_them(tmp_path, byte_level_dir):
    messages = CONVERSATIONS["multi_turn"]
    from_config = model_folder(tmp_path / "config", byte_level_dir, {"chat_template": CHATML})
    ours, theirs = render_both(from_config, messages, add_generation_prompt=True)
    assert ours == theirs and ours.startswith("<|im_start|>system")

    named = [{"name": "default", "template": GEMMA}, {"name": "tool_use", "template": CHATML}]
    from_list = model_folder(tmp_path / "list", byte_level_dir, {"chat_template": named})
    assert render_both(from_list, messages)[0] == render_both(from_list, messages)[1]
    ours, theirs = render_both(from_list, CONVERSATIONS["tool_call"], tools=TOOLS)  # picks "tool_use"
    assert ours == theirs and "<tools>" in ours
    assert load_chat_template(from_list).render(messages, template_name="tool_use") == load_chat_template(
        from_config
    ).render(messages)

    # chat_template.jinja wins over the config's template, as in transformers.
    jinja_file = model_folder(tmp_path / "jinja", byte_level_dir, {"chat_template": CHATML},
                              files={"chat_template.jinja": LLAMA3})
    ours, theirs = render_both(jinja_file, messages)
    assert ours == theirs and ours.startswith("<|begin_of_text|><|start_header_id|>")

    extra = model_folder(tmp_path / "extra", byte_level_dir, {}, files={
        "chat_template.jinja": GEMMA, "additional_chat_templates/tool_use.jinja": CHATML})
    assert load_chat_template(extra).templates.keys() == {"default", "tool_use"}
    ours, theirs = render_both(extra, CONVERSATIONS["tool_call"], tools=TOOLS)
    assert ours == theirs


def test_template_errors(tmp_path, byte_level_dir, special_tokens):
    with pytest.raises(ChatTemplateError, match=r"has no chat template: no chat_template.jinja"):
        load_chat_template(model_folder(tmp_path / "base", byte_level_dir, {}))
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_chat_template(tmp_path / "missing")
    no_default = model_folder(tmp_path / "no_default", byte_level_dir,
                              {"chat_template": [{"name": "a", "template": GEMMA}, {"name": "b", "template": CHATML}]})
    template = load_chat_template(no_default)
    with pytest.raises(ChatTemplateError, match=r"none named 'default'; pick one of \['a', 'b'\]"):
        template.render(CONVERSATIONS["single"])
    with pytest.raises(ChatTemplateError, match=r"has no chat template 'c'"):
        template.render(CONVERSATIONS["single"], template_name="c")

    gemma = ChatTemplate(templates={"default": GEMMA}, special_tokens=special_tokens, source="gemma folder")
    with pytest.raises(ChatTemplateError, match="gemma folder: System role not supported"):
        gemma.render(CONVERSATIONS["system"])
    with pytest.raises(ChatTemplateError, match="roles must alternate"):
        gemma.render([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])
    with pytest.raises(ChatTemplateError, match="empty conversation"):
        gemma.render([])
    broken = ChatTemplate(templates={"default": "{% for m in messages %}"}, special_tokens={}, source="x")
    with pytest.raises(ChatTemplateError, match=r"does not parse \(line 1\)"):
        broken.render(CONVERSATIONS["single"])
    with pytest.raises(TypeError, match="messages must be JSON-like data"):
        gemma.render([{"role": "user", "content": object()}])


def test_template_is_sandboxed(special_tokens):
    escape = "{{ messages.__class__.__mro__ }}"
    template = ChatTemplate(templates={"default": escape}, special_tokens=special_tokens, source="x")
    with pytest.raises(Exception, match="unsafe|not safely|access"):
        template.render(CONVERSATIONS["single"])
    namespace = "{% set ns = namespace(_x=1) %}"
    with pytest.raises(Exception, match="underscore"):
        ChatTemplate(templates={"default": namespace}, special_tokens={}, source="x").render(CONVERSATIONS["single"])
