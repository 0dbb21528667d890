"""Chat templates: a conversation rendered into the prompt text a chat model was trained on.

A model ships its template as Jinja, in ``chat_template.jinja`` (plus named ones in
``additional_chat_templates/*.jinja``) or in ``tokenizer_config.json`` under ``chat_template`` (a string, or
a list of ``{"name", "template"}``); template files win over the config, as in ``transformers``.
Templates are rendered exactly as ``transformers``' ``apply_chat_template`` renders them — same
sandboxed Jinja environment (``trim_blocks``, ``lstrip_blocks``, ``loopcontrols``, a ``tojson`` that keeps
non-ASCII and HTML characters, ``raise_exception``, ``strftime_now``, the ``{% generation %}`` tag), same
variables (``messages``, ``tools``, ``documents``, ``add_generation_prompt`` and the special token strings
``bos_token``, ``eos_token``, … from the tokenizer config) — since the model only understands the exact
text it was trained on.
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import json
import pathlib
from collections.abc import Mapping, Sequence
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.sandbox

from llm_jax.special_tokens import ModelConfigs
from llm_jax.tokenizer import Tokenizer

TEMPLATE_FILE = "chat_template.jinja"
TEMPLATE_DIR = "additional_chat_templates"
TOKENIZER_CONFIG = "tokenizer_config.json"
# The special tokens transformers passes to every template (its SPECIAL_TOKENS_ATTRIBUTES).
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
# Marks the end of the final message when continuing it; removed with everything after it.
CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "
# Names a message's reasoning goes under; templates read the first, some the second.
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")

Message = Mapping[str, Any]


class ChatTemplateError(ValueError):
    """A template rejected a conversation (its ``raise_exception``), or could not be found or parsed."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class ChatTemplate:
    """A model's chat template(s) and the special token strings its templates may use."""

    templates: Mapping[str, str]  # name → Jinja source; a model's single template is named "default"
    special_tokens: Mapping[str, str]  # bos_token → "<s>", …, as the tokenizer config spells them
    source: str  # where the templates came from, for error messages

    def select(self, name: str | None = None, *, tools: Sequence[Mapping[str, Any]] | None = None) -> str:
        """The Jinja source to use: ``name``, else "tool_use" when tools are given, else "default"."""
        if name is not None:
            if name not in self.templates:
                raise ChatTemplateError(f"{self.source} has no chat template {name!r}; it has {sorted(self.templates)}")
            return self.templates[name]
        if tools is not None and "tool_use" in self.templates:
            return self.templates["tool_use"]
        if "default" in self.templates:
            return self.templates["default"]
        raise ChatTemplateError(
            f"{self.source} has several chat templates and none named 'default'; pick one of {sorted(self.templates)}"
        )

    def render(
        self,
        messages: Sequence[Message],
        *,
        add_generation_prompt: bool = False,
        continue_final_message: bool = False,
        tools: Sequence[Mapping[str, Any]] | None = None,
        documents: Sequence[Mapping[str, Any]] | None = None,
        template_name: str | None = None,
        **template_variables: Any,
    ) -> str:
        """The prompt text for ``messages`` (dicts with ``role`` and ``content``).

        ``add_generation_prompt`` appends the header that opens the assistant's turn;
        ``continue_final_message`` leaves the last message open so the model continues it.
        ``template_variables`` reach the template as extra variables (e.g. ``enable_thinking``).
        """
        if not messages:
            raise ChatTemplateError("cannot render an empty conversation: give at least one message")
        if continue_final_message and add_generation_prompt:
            raise ChatTemplateError("continue_final_message and add_generation_prompt exclude each other")
        source = self.select(template_name, tools=tools)
        chat = [_with_reasoning_aliases(_plain(message, "messages")) for message in messages]
        final_text = _mark_final_message(chat, source) if continue_final_message else None
        variables = {**self.special_tokens, **_plain(template_variables, "template variables")}
        try:
            rendered = _compile(source).render(
                messages=chat,
                tools=_plain(tools, "tools"),
                documents=_plain(documents, "documents"),
                add_generation_prompt=add_generation_prompt,
                **variables,
            )
        except jinja2.TemplateError as error:
            raise ChatTemplateError(f"chat template from {self.source}: {error}") from error
        return rendered if final_text is None else _cut_at_final_message(rendered, final_text)


def load_chat_template(path: str | pathlib.Path) -> ChatTemplate:
    """The chat template(s) of a model folder (or of the folder of a tokenizer file given)."""
    path = pathlib.Path(path)
    if not path.exists():
        raise FileNotFoundError(f"chat template path {path} does not exist")
    if path.suffix == ".gguf":  # tokenizer.chat_template in its metadata
        from llm_jax.gguf_tokenizer import gguf_chat_template

        return gguf_chat_template(path)
    folder = path if path.is_dir() else path.parent
    configs = ModelConfigs.read(folder)
    config_file, config = folder / TOKENIZER_CONFIG, configs.get(TOKENIZER_CONFIG)
    declared = {name: configs.special_token(name) for name in SPECIAL_TOKEN_NAMES}
    special_tokens = {name: found[1] for name, found in declared.items() if found is not None and found[1] is not None}
    templates = {}
    if (folder / TEMPLATE_FILE).is_file():
        templates["default"] = (folder / TEMPLATE_FILE).read_text(encoding="utf-8")
    for file in sorted((folder / TEMPLATE_DIR).glob("*.jinja")):
        templates[file.name.removesuffix(".jinja")] = file.read_text(encoding="utf-8")
    if templates:
        return ChatTemplate(templates=templates, special_tokens=special_tokens, source=str(folder))
    match config.get("chat_template"):
        case str(template):
            templates = {"default": template}
        case list(named):
            templates = {entry["name"]: entry["template"] for entry in named}
        case None:
            raise ChatTemplateError(
                f"{folder} has no chat template: no {TEMPLATE_FILE}, no {TEMPLATE_DIR}/*.jinja and no "
                f"'chat_template' in {TOKENIZER_CONFIG} (a base model, not a chat model?)"
            )
        case other:
            raise ChatTemplateError(f"{config_file} chat_template must be a string or a list, not {type(other)}")
    return ChatTemplate(templates=templates, special_tokens=special_tokens, source=str(config_file))


def encode_chat(tokenizer: Tokenizer, prompt: str) -> list[int]:
    """Token ids of a rendered chat prompt, as ``apply_chat_template(tokenize=True)`` makes them.

    The template already wrote BOS and the turn markers as text, so no BOS is added and special tokens
    in the text become their ids.
    """
    return tokenizer.encode(prompt, add_bos=False, parse_special=True)


def _plain(value: Any, what: str) -> Any:
    """A copy of JSON-like data with exact builtin types, so the sandboxed template sees no other objects."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, Mapping):
        return {_plain(key, what): _plain(item, what) for key, item in value.items()}
    if isinstance(value, list):
        return [_plain(item, what) for item in value]
    if isinstance(value, tuple):
        return tuple(_plain(item, what) for item in value)
    for base in (str, int, float):  # subclasses (str enums, …) lose their extra methods
        if isinstance(value, base):
            return base(value) if base is not str else str.__str__(value)
    raise TypeError(f"{what} must be JSON-like data (dicts, lists, strings, numbers); got {type(value).__name__}")


def _with_reasoning_aliases(message: Any) -> dict[str, Any]:
    """Drop None fields (templates test for presence) and copy reasoning under the names templates read."""
    if not isinstance(message, dict):
        raise TypeError(f"each message must be a dict with 'role' and 'content'; got {message!r}")
    message = {key: value for key, value in message.items() if value is not None}
    reasoning = next((message[key] for key in REASONING_FIELDS if message.get(key) is not None), None)
    if reasoning is not None:
        message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
    return message


def _mark_final_message(chat: list[dict[str, Any]], source: str) -> str:
    """Append CONTINUE_TAG to the final message's content (in place); return the content before it."""
    final = chat[-1]
    if "content" not in source:
        raise ChatTemplateError("continue_final_message needs a template that reads message 'content'")
    content = final.get("content")
    if isinstance(content, str):
        final["content"] = content + CONTINUE_TAG
        return content
    for block in reversed(content or []):  # a list of content blocks: continue the last text block
        if isinstance(block, dict) and "text" in block:
            text = block["text"]
            block["text"] = text + CONTINUE_TAG
            return text
    raise ChatTemplateError("continue_final_message: the final message has no text content to continue")


def _cut_at_final_message(rendered: str, final_text: str) -> str:
    """The rendered prompt up to the end of the final message's text, without the template's turn end."""
    tag = CONTINUE_TAG.strip()
    if final_text.strip() not in rendered or tag not in rendered:
        raise ChatTemplateError("continue_final_message: the template does not reproduce the final message's text")
    cut = rendered.rindex(tag)
    if rendered[cut : cut + len(CONTINUE_TAG)] == CONTINUE_TAG:
        return rendered[:cut]
    return rendered[:cut].rstrip()  # the template trimmed the message's trailing space


class _GenerationTag(jinja2.ext.Extension):
    """``{% generation %}…{% endgeneration %}`` marks assistant text for training masks; it renders its body."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render_body"), [], [], body).set_lineno(lineno)

    def _render_body(self, caller: Any) -> str:
        return caller()


class _TemplateDict:
    """``dict`` for templates, without attribute access to the dict type itself."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    """``namespace`` for templates, refusing underscore attributes (a way into CPython internals)."""

    def __init__(*args: Any, **kwargs: Any):  # Jinja's signature trick, so namespace(self=...) works
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"chat templates cannot set underscore attributes ({name!r})")


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    # Jinja's own tojson escapes HTML characters (<, >, &, ') — not what a model saw in training.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    return datetime.datetime.now().strftime(format)


@functools.lru_cache(maxsize=32)
def _compile(source: str) -> jinja2.Template:
    # Templates come from model repositories: untrusted code, hence the sandbox.
    environment = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    environment.filters["tojson"] = _tojson
    environment.globals["raise_exception"] = _raise_exception
    environment.globals["strftime_now"] = _strftime_now
    environment.globals["dict"] = _TemplateDict()
    environment.globals["namespace"] = _TemplateNamespace
    try:
        return environment.from_string(source)
    except jinja2.TemplateSyntaxError as error:
        raise ChatTemplateError(f"chat template does not parse (line {error.lineno}): {error.message}") from error
