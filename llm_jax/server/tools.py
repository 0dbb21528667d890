"""Tool calling in chat completions: OpenAI's ``tools``, ``tool_choice`` and ``parallel_tool_calls``.

A request lists functions (name, description, a JSON schema of their parameters); the chat template
shows them to the model (its ``tools`` variable), and the answer's ``message.tool_calls`` holds the calls
the model makes. How the calls are found depends on ``tool_choice``:

- a named function (``{"type": "function", "function": {"name": …}}``): the output is constrained
  (:mod:`llm_jax.guided`) to a JSON object of that function's parameters, which streams as the call's
  ``arguments``; the finish reason stays ``stop``, as OpenAI's.
- ``"required"``: the output is constrained to a JSON array of one or more ``{"name", "parameters"}``
  objects, one per call (at most one without ``parallel_tool_calls``); finish reason ``tool_calls``.
- ``"auto"`` (the default with tools): the model writes text or calls in its own format, and the
  server's ``--tool-call-parser`` reads them: ``hermes`` (``<tool_call>{"name", "arguments"}</tool_call>``:
  Qwen 2.5, Hermes and other ChatML models), ``llama3_json`` (an answer that is JSON objects
  ``{"name", "parameters"}`` separated by ``;``: Llama 3.1 and later) or ``mistral`` (``[TOOL_CALLS]``,
  then a JSON array of ``{"name", "arguments"}``: Mistral 7B Instruct v0.3, Mistral Nemo; or
  ``name[ARGS]{…}`` after each marker: Mistral Small 3.2, Magistral, Devstral; the marker is a special
  token, so these requests keep special tokens' text). Without a parser, "auto" is refused, as vLLM does.
- ``"none"``: the model sees the tools and answers in text.
- ``{"type": "allowed_tools", "allowed_tools": {"mode": "auto" | "required", "tools": [...]}}``: "auto" or
  "required" among a subset of the tools, named as ``{"type": "function", "function": {"name": …}}``. The
  chat template shows the model only the allowed tools, so it neither sees nor calls the others, and a
  "required" output is constrained to calls of allowed tools.

Each choice's output goes through a :class:`Reader`, fed the text as it streams and finished with the
choice, so a streamed answer's content and calls are the whole answer's, piece by piece. Assistant
messages with ``tool_calls`` and ``tool`` messages pass to the template as ``transformers`` passes
them, each call's ``arguments`` (a JSON string in the API) parsed into an object.
"""

from __future__ import annotations

import dataclasses
import json
import re
import secrets
import string
import uuid
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from llm_jax.guided import Json

from llm_jax.server.fields import ApiError, Fields, check, check_kind, show

MAX_TOOLS = 128
NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # OpenAI's rule for function names
PARSERS = ("hermes", "llama3_json", "mistral")
NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}


@dataclasses.dataclass(frozen=True)
class Tool:
    """A function the model may call."""

    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of its arguments; None: it takes none
    strict: bool | None = None  # OpenAI's; the output follows the schema either way when it is forced

    def spec(self) -> dict[str, Any]:
        """As the chat template sees it: as the request gave it, less its null fields."""
        function = {"name": self.name, "description": self.description, "parameters": self.parameters,
                    "strict": self.strict}
        return {"type": "function", "function": {k: v for k, v in function.items() if v is not None}}

    @property
    def schema(self) -> dict[str, Any]:
        return self.parameters if self.parameters is not None else NO_PARAMETERS


@dataclasses.dataclass(frozen=True)
class Named:
    """``tool_choice`` naming the function to call."""

    name: str


ToolChoice = str | Named  # "none", "auto", "required", or a Named function


@dataclasses.dataclass(frozen=True)
class ToolCalling:
    """What a chat request asks about tools."""

    tools: tuple[Tool, ...]  # as the request lists them
    choice: ToolChoice
    parallel: bool = True
    allowed: tuple[str, ...] | None = None  # ``allowed_tools``: the names the model may call; None: all

    @property
    def callable(self) -> tuple[Tool, ...]:
        """The tools the model sees and may call."""
        return self.tools if self.allowed is None else tuple(t for t in self.tools if t.name in self.allowed)

    def specs(self) -> list[dict[str, Any]]:
        return [tool.spec() for tool in self.callable]

    @property
    def forced(self) -> bool:
        """The output is constrained to calls."""
        return self.choice == "required" or isinstance(self.choice, Named)

    def constraint(self) -> Json | None:
        """What the output must follow: the named function's arguments, or an array of calls."""
        from llm_jax.guided import Json  # not at import: the server's flags are read before JAX starts

        if isinstance(self.choice, Named):
            return Json(next(t for t in self.tools if t.name == self.choice.name).schema)
        if self.choice != "required":
            return None
        calls = [{"type": "object", "required": ["name", "parameters"], "additionalProperties": False,
                  "properties": {"name": {"type": "string", "enum": [t.name]}, "parameters": t.schema}}
                 for t in self.callable]
        schema = {"type": "array", "minItems": 1, "items": calls[0] if len(calls) == 1 else {"anyOf": calls}}
        if not self.parallel:
            schema["maxItems"] = 1
        return Json(schema)


# --- reading a request --------------------------------------------------------------------------------


def _tool(value: Any, param: str) -> Tool:
    check_kind(value, param, "object")
    check(value.get("type", "function") == "function", f"{param}.type",
          f"must be 'function' (the only kind of tool), got {show(value.get('type'))}")
    unknown = set(value) - {"type", "function"}
    check(not unknown, param, f"has unknown fields {sorted(unknown)}")
    return function_tool(check_kind(value.get("function"), f"{param}.function", "object"), f"{param}.function")


def function_tool(function: dict[str, Any], param: str) -> Tool:
    """A function's ``name``, ``description``, ``parameters`` and ``strict`` checked; ``param`` names the
    object (chat's ``tools[i].function``, the Responses API's flat ``tools[i]``)."""
    unknown = set(function) - {"name", "description", "parameters", "strict"}
    check(not unknown, param, f"has unknown fields {sorted(unknown)}")
    name = check_kind(function.get("name"), f"{param}.name", "string")
    check(NAME.match(name) is not None, f"{param}.name",
          f"must be 1 to 64 letters, digits, underscores or dashes, got {show(name)}")
    description = function.get("description")
    if description is not None:
        check_kind(description, f"{param}.description", "string")
    parameters = function.get("parameters")
    if parameters is not None:
        check_kind(parameters, f"{param}.parameters", "object")
    strict = function.get("strict")
    if strict is not None:
        check_kind(strict, f"{param}.strict", "boolean")
    return Tool(name=name, description=description, parameters=parameters, strict=strict)


def _tool_choice(value: Any, tools: tuple[Tool, ...]) -> ToolChoice:
    if isinstance(value, str):
        check(value in ("none", "auto", "required"), "tool_choice",
              f"must be 'none', 'auto', 'required' or a named function, got {show(value)}")
        check(value == "none" or bool(tools), "tool_choice", f"{show(value)} needs tools")
        return value
    check_kind(value, "tool_choice", "string", "object")
    check(value.get("type") == "function" and set(value) == {"type", "function"}, "tool_choice",
          f"must be {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}, got {show(value)}")
    function = check_kind(value.get("function"), "tool_choice.function", "object")
    name = check_kind(function.get("name"), "tool_choice.function.name", "string")
    check(any(t.name == name for t in tools), "tool_choice.function.name",
          f"names {show(name)}, which is not among the tools ({[t.name for t in tools]})")
    return Named(name)


def allowed_tools(value: dict[str, Any], tools: tuple[Tool, ...], *, flat: bool) -> tuple[str, tuple[str, ...]]:
    """``tool_choice`` of type ``allowed_tools``: its mode and the names of the allowed tools. Chat's form
    nests them (``{"allowed_tools": {"mode", "tools": [{"type": "function", "function": {"name"}}]}}``); the
    Responses API's is ``flat`` (``{"mode", "tools": [{"type": "function", "name"}]}``)."""
    if flat:
        check(set(value) == {"type", "mode", "tools"}, "tool_choice",
              f"of type allowed_tools must have the fields mode and tools, got {sorted(value)}")
        where, body = "tool_choice", value
    else:
        check(set(value) == {"type", "allowed_tools"}, "tool_choice",
              f"of type allowed_tools must have the field allowed_tools, got {sorted(value)}")
        where = "tool_choice.allowed_tools"
        body = check_kind(value["allowed_tools"], where, "object")
        check(set(body) == {"mode", "tools"}, where, f"must have the fields mode and tools, got {sorted(body)}")
    mode = body["mode"]
    check(mode in ("auto", "required"), f"{where}.mode", f"must be 'auto' or 'required', got {show(mode)}")
    listed = check_kind(body["tools"], f"{where}.tools", "array")
    check(bool(listed), f"{where}.tools", "must name at least one tool")
    names = []
    for i, entry in enumerate(listed):
        param = f"{where}.tools[{i}]"
        check_kind(entry, param, "object")
        check(entry.get("type") == "function", f"{param}.type",
              f"must be 'function' (the only kind of tool), got {show(entry.get('type'))}")
        if flat:
            check(set(entry) == {"type", "name"}, param, f"must be {{\"type\": \"function\", \"name\": ...}}, "
                                                          f"got {show(entry)}")
            name, name_param = entry["name"], f"{param}.name"
        else:
            check(set(entry) == {"type", "function"}, param,
                  f"must be {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}, got {show(entry)}")
            function = check_kind(entry["function"], f"{param}.function", "object")
            check(set(function) == {"name"}, f"{param}.function", f"must hold only the name, got {sorted(function)}")
            name, name_param = function["name"], f"{param}.function.name"
        check_kind(name, name_param, "string")
        check(any(t.name == name for t in tools), name_param,
              f"names {show(name)}, which is not among the tools ({[t.name for t in tools]})")
        check(name not in names, name_param, f"names {show(name)} twice")
        names.append(name)
    return mode, tuple(names)


def unique(tools: tuple[Tool, ...]) -> tuple[Tool, ...]:
    names = [t.name for t in tools]
    duplicate = next((name for name in names if names.count(name) > 1), None)
    check(duplicate is None, "tools", f"names the function {show(duplicate)} twice")
    return tools


def parse_tool_calling(fields: Fields) -> ToolCalling | None:
    """``tools``, ``tool_choice`` and ``parallel_tool_calls``; None when the request has no tools."""
    value = fields.take("tools", "array", default=[])
    check(len(value) <= MAX_TOOLS, "tools", f"may hold at most {MAX_TOOLS} tools, got {len(value)}")
    tools = unique(tuple(_tool(tool, f"tools[{i}]") for i, tool in enumerate(value)))
    value = fields.take("tool_choice", "string", "object", default="auto" if tools else "none")
    allowed = None
    if isinstance(value, dict) and value.get("type") == "allowed_tools":
        value, allowed = allowed_tools(value, tools, flat=False)
    choice = _tool_choice(value, tools)
    parallel = fields.take("parallel_tool_calls", "boolean", default=True)
    fields.unsupported("functions", accepted=[], why="is deprecated: give tools instead")
    fields.unsupported("function_call", accepted="none", why="is deprecated: give tool_choice instead")
    return ToolCalling(tools=tools, choice=choice, parallel=parallel, allowed=allowed) if tools else None


def check_parser(calling: ToolCalling | None, parser: str | None) -> None:
    """Refuse "auto" on a server that cannot read the calls a model makes on its own."""
    if calling is not None and calling.choice == "auto" and parser is None:
        raise ApiError('tool_choice "auto" (the default with tools) needs a server started with --tool-call-parser '
                       f"({' or '.join(PARSERS)}); give tool_choice \"required\", a named function or \"none\"",
                       param="tool_choice", code="invalid_value")


def template_message(message: dict[str, Any], param: str) -> dict[str, Any]:
    """A message as the chat template takes it: an assistant's ``tool_calls`` checked, each call's
    ``arguments`` (a JSON string) parsed into an object, as ``transformers``' templates read them."""
    calls = message.get("tool_calls")
    if message.get("tool_call_id") is not None:
        check_kind(message["tool_call_id"], f"{param}.tool_call_id", "string")
    if calls is None:
        return message
    check(message["role"] == "assistant", f"{param}.tool_calls", "belong to assistant messages only")
    check_kind(calls, f"{param}.tool_calls", "array")
    out = []
    for j, call in enumerate(calls):
        where = f"{param}.tool_calls[{j}]"
        check_kind(call, where, "object")
        function = check_kind(call.get("function"), f"{where}.function", "object")
        check_kind(function.get("name"), f"{where}.function.name", "string")
        arguments = check_kind(function.get("arguments", "{}"), f"{where}.function.arguments", "string", "object")
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except ValueError as error:
                raise ApiError(f"{where}.function.arguments is not valid JSON: {error}",
                               param=f"{where}.function.arguments", code="invalid_value") from None
        out.append({**call, "type": call.get("type", "function"), "function": {**function, "arguments": arguments}})
    return {**message, "tool_calls": out}


# --- reading the model's output -------------------------------------------------------------------------


@dataclasses.dataclass
class CallDelta:
    """New text of call ``index``: its id and name when it starts, then pieces of its arguments."""

    index: int
    id: str | None
    name: str | None
    arguments: str


@dataclasses.dataclass
class Read:
    """What a piece of output adds: content text, tool-call deltas, reasoning text."""

    content: str = ""
    calls: list[CallDelta] = dataclasses.field(default_factory=list)
    reasoning: str = ""

    def __iadd__(self, other: Read) -> Read:
        self.content += other.content
        self.calls += other.calls
        self.reasoning += other.reasoning
        return self


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def mistral_call_id() -> str:
    """Nine letters and digits: Mistral's chat templates refuse other ids in the calls sent back."""
    return "".join(secrets.choice(string.ascii_letters + string.digits) for _ in range(9))


class Reader:
    """One choice's output, read as it streams: ``feed`` each new piece of text, ``finish`` at its end."""

    new_id = staticmethod(call_id)

    def __init__(self) -> None:
        self.num_calls = 0

    def feed(self, text: str) -> Read:
        raise NotImplementedError

    def finish(self) -> Read:
        raise NotImplementedError

    def _call(self, name: str, arguments: Any) -> CallDelta:
        self.num_calls += 1
        if not isinstance(arguments, str):
            arguments = json.dumps(arguments, ensure_ascii=False)
        return CallDelta(index=self.num_calls - 1, id=self.new_id(), name=name, arguments=arguments)


class PlainReader(Reader):
    """Text is content."""

    def feed(self, text: str) -> Read:
        return Read(content=text)

    def finish(self) -> Read:
        return Read()


def _as_call(value: Any, arguments_keys: tuple[str, ...]) -> tuple[str, Any] | None:
    """(name, arguments) of a parsed call object, or None when it is not one."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = next((value[key] for key in arguments_keys if key in value), {})
    if not isinstance(arguments, (dict, str)):
        return None
    return value["name"], arguments


class NamedReader(Reader):
    """The output is the named function's arguments: it streams as they come."""

    def __init__(self, name: str):
        super().__init__()
        self.name, self.started = name, False

    def feed(self, text: str) -> Read:
        if not self.started:
            self.started = True
            call = self._call(self.name, text)
            return Read(calls=[call])
        return Read(calls=[CallDelta(index=0, id=None, name=None, arguments=text)] if text else [])

    def finish(self) -> Read:
        return self.feed("") if not self.started else Read()


class _CallRun(Reader):
    """Calls one after another in a text that grows; each is given once complete (``_next`` finds it)."""

    def __init__(self, parallel: bool):
        super().__init__()
        self.parallel = parallel
        self.text, self.at = "", 0  # all of it; where the next call may start

    def _next(self, decoder: json.JSONDecoder) -> tuple[tuple[str, Any] | None, int] | None:
        """The call starting at ``at`` ((name, arguments), or None for something that is not a call) and
        where it ends; None while it is not complete."""
        raise NotImplementedError

    def feed(self, text: str) -> Read:
        self.text += text
        read, decoder = Read(), json.JSONDecoder()
        while (found := self._next(decoder)) is not None:
            call, self.at = found
            if call is not None and (self.parallel or self.num_calls == 0):
                read.calls.append(self._call(*call))
        return read

    def finish(self) -> Read:
        return Read()


class ArrayReader(_CallRun):
    """The output is a JSON array of ``{"name", "parameters"}`` (``tool_choice="required"``): each call is
    given as soon as its object is complete."""

    def __init__(self, parallel: bool = True, arguments_keys: tuple[str, ...] = ("parameters", "arguments")):
        super().__init__(parallel)
        self.arguments_keys = arguments_keys

    def _next(self, decoder: json.JSONDecoder) -> tuple[tuple[str, Any] | None, int] | None:
        rest = self.text[self.at:]
        try:
            value, end = decoder.raw_decode(self.text, self.at + len(rest) - len(rest.lstrip(" \t\r\n[,")))
        except ValueError:
            return None
        return _as_call(value, self.arguments_keys), end

    def finish(self) -> Read:
        if self.num_calls == 0:  # cut short, or not calls: the text is all there is
            return Read(content=self.text)
        return Read()


class HermesReader(Reader):
    """``<tool_call>{"name": …, "arguments": {…}}</tool_call>`` blocks amid text. The content is the text
    outside the blocks, without the white space that separates it from them; a block whose JSON is not a
    call stays in the content as written."""

    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def __init__(self, parallel: bool = True):
        super().__init__()
        self.parallel = parallel
        self.pending = ""  # text not yet given out: white space, a marker's beginning, an open block
        self.after_call = False  # the next content starts after a call: its leading white space goes
        self.gave_content = False  # content after a call is set apart from the content before it

    def feed(self, text: str) -> Read:
        self.pending += text
        return self._drain(final=False)

    def finish(self) -> Read:
        return self._drain(final=True)

    def _content(self, text: str) -> str:
        if self.after_call:
            text = text.lstrip()
            self.after_call = not text
            if text and self.gave_content:
                text = "\n\n" + text
        self.gave_content = self.gave_content or bool(text)
        return text

    def _drain(self, *, final: bool) -> Read:
        read = Read()
        while True:
            start = self.pending.find(self.OPEN)
            if start < 0:
                keep = 0 if final else held_back(self.pending, self.OPEN)
                read.content += self._content(self.pending[:len(self.pending) - keep])
                self.pending = self.pending[len(self.pending) - keep:]
                return read
            end = self.pending.find(self.CLOSE, start + len(self.OPEN))
            if end < 0 and not final:
                before = self.pending[:start]  # text up to the block, less the white space before it
                given = before.rstrip()
                read.content += self._content(given)
                self.pending = self.pending[len(given):]
                return read
            body_end = end if end >= 0 else len(self.pending)
            block_end = end + len(self.CLOSE) if end >= 0 else len(self.pending)
            call = _parse_call(self.pending[start + len(self.OPEN):body_end], ("arguments", "parameters"))
            if call is None:  # not a call: the block is text
                read.content += self._content(self.pending[:block_end])
            else:
                read.content += self._content(self.pending[:start].rstrip())
                if self.parallel or self.num_calls == 0:
                    read.calls.append(self._call(*call))
                self.after_call = True
            self.pending = self.pending[block_end:]


class _NamedCalls(_CallRun):
    """``name[ARGS]{…}`` calls, each after ``[TOOL_CALLS]`` but the first (Mistral's form since its v11
    tokenizer: Mistral Small 3.2, Magistral, Devstral); each is given once its arguments are complete."""

    ARGS = "[ARGS]"

    def __init__(self, parallel: bool, marker: str):
        super().__init__(parallel)
        self.marker = marker

    def _next(self, decoder: json.JSONDecoder) -> tuple[tuple[str, Any] | None, int] | None:
        rest = self.text[self.at:].lstrip().removeprefix(self.marker)
        start = len(self.text) - len(rest)
        args = self.text.find(self.ARGS, start)
        if args < 0:
            return None
        begin = args + len(self.ARGS)
        begin += len(self.text[begin:]) - len(self.text[begin:].lstrip())
        try:
            value, end = decoder.raw_decode(self.text, begin)
        except ValueError:
            return None
        name = self.text[start:args].strip()
        return ((name, value) if NAME.match(name) and isinstance(value, dict) else None), end


class MistralReader(Reader):
    """``[TOOL_CALLS]`` then a JSON array of ``{"name": …, "arguments": {…}}`` (Mistral 7B Instruct v0.3,
    Nemo), or ``name[ARGS]{…}`` for each call (since Mistral's v11 tokenizer); the text before the marker
    is the content. Calls are given as they complete; a marker followed by no call leaves the whole text
    content."""

    MARKER = "[TOOL_CALLS]"

    def __init__(self, parallel: bool = True):  # no super().__init__(): the calls are the tail's
        self.pending = ""  # content not given out yet
        self.after: str | None = None  # past the marker, until its form is known
        self.tail: ArrayReader | _NamedCalls | None = None  # what reads the calls
        self.parallel = parallel

    @property
    def num_calls(self) -> int:
        return self.tail.num_calls if self.tail is not None else 0

    def feed(self, text: str) -> Read:
        if self.tail is not None:
            return self.tail.feed(text)
        if self.after is not None:
            return self._after(text)
        self.pending += text
        start = self.pending.find(self.MARKER)
        if start < 0:
            keep = held_back(self.pending, self.MARKER)
            given, self.pending = self.pending[:len(self.pending) - keep], self.pending[len(self.pending) - keep:]
            return Read(content=given)
        before, rest = self.pending[:start], self.pending[start + len(self.MARKER):]
        self.pending = before[len(before.rstrip()):]  # the white space before the marker, while calls may come
        self.after = ""
        read = Read(content=before.rstrip())
        read += self._after(rest)
        return read

    def _after(self, text: str) -> Read:
        self.after += text
        head = self.after.lstrip()
        if not head:
            return Read()
        if head.startswith("["):
            self.tail = ArrayReader(self.parallel, ("arguments", "parameters"))
        else:
            self.tail = _NamedCalls(self.parallel, self.MARKER)
        self.tail.new_id = mistral_call_id
        return self.tail.feed(self.after)

    def finish(self) -> Read:
        if self.after is None:
            text, self.pending = self.pending, ""
            return Read(content=text)
        if self.num_calls == 0:  # not calls after all: the text as written
            return Read(content=self.pending + self.MARKER + (self.tail.text if self.tail is not None else self.after))
        return Read()


class Llama3JsonReader(Reader):
    """An answer that is one or more JSON objects ``{"name": …, "parameters": {…}}`` separated by ``;``
    (optionally after ``<|python_tag|>``) is calls; any other answer is content. Whether it is calls is
    known at its end, so an answer that begins with ``{`` is held until then."""

    TAG = "<|python_tag|>"

    def __init__(self, parallel: bool = True):
        super().__init__()
        self.parallel, self.text, self.held = parallel, "", True

    def feed(self, text: str) -> Read:
        self.text += text
        if self.held:
            head = self.text.lstrip()
            self.held = head == "" or self.TAG.startswith(head) or head.startswith((self.TAG, "{"))
            if not self.held:
                return Read(content=self.text)
            return Read()
        return Read(content=text)

    def finish(self) -> Read:
        if not self.held:
            return Read()
        body = self.text.strip().removeprefix(self.TAG).strip()
        calls = []
        for part in _split_objects(body):
            call = _parse_call(part, ("parameters", "arguments"))
            if call is None:
                return Read(content=self.text)
            calls.append(call)
        if not calls:
            return Read(content=self.text)
        return Read(calls=[self._call(*call) for call in (calls if self.parallel else calls[:1])])


def _split_objects(text: str) -> list[str]:
    """``{…}; {…}`` → its objects' texts (the ``;`` inside strings left alone)."""
    parts, decoder, at = [], json.JSONDecoder(), 0
    while at < len(text):
        try:
            _, end = decoder.raw_decode(text, at)
        except ValueError:
            return [text]  # not JSON: the caller's parse fails on it
        parts.append(text[at:end])
        at = end
        rest = text[at:].lstrip()
        if rest and not rest.startswith(";"):
            return [text]
        at = len(text) - len(rest.removeprefix(";").lstrip())
    return parts


def _parse_call(text: str, arguments_keys: tuple[str, ...]) -> tuple[str, Any] | None:
    try:
        value = json.loads(text)
    except ValueError:
        return None
    return _as_call(value, arguments_keys)


def held_back(text: str, marker: str) -> int:
    """How many of ``text``'s last characters to hold: trailing white space (a block may follow), and a
    beginning of ``marker``."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-size:]):
            head = text[:-size]
            return size + len(head) - len(head.rstrip())
    return len(text) - len(text.rstrip())


def reader(calling: ToolCalling | None, parser: str | None) -> Reader | None:
    """A fresh reader of one choice's output; None when the output is plain text (as far as tools go)."""
    if calling is None or calling.choice == "none":
        return None
    if isinstance(calling.choice, Named):
        return NamedReader(calling.choice.name)
    if calling.choice == "required":
        return ArrayReader()
    if parser == "hermes":
        return HermesReader(calling.parallel)
    if parser == "llama3_json":
        return Llama3JsonReader(calling.parallel)
    if parser == "mistral":
        return MistralReader(calling.parallel)
    raise ValueError(f"unknown tool-call parser {parser!r}; known: {PARSERS}")


def keeps_special_tokens(calling: ToolCalling | None, parser: str | None) -> bool:
    """Whether the model's calls are marked by a special token (whose text the request must keep)."""
    return parser == "mistral" and calling is not None and calling.choice == "auto"


def read_all(reader: Reader, text: str) -> tuple[str, list[dict[str, Any]], str]:
    """A whole output's content, calls (OpenAI's ``tool_calls`` entries) and reasoning."""
    read = reader.feed(text)
    read += reader.finish()
    calls: list[dict[str, Any]] = []
    for delta in read.calls:
        if delta.id is not None:
            calls.append({"id": delta.id, "type": "function", "function": {"name": delta.name, "arguments": ""}})
        calls[delta.index]["function"]["arguments"] += delta.arguments
    return read.content, calls, read.reasoning
