"""OpenAI's Responses API: ``POST /v1/responses``, whole or streamed, on the same engine as chat.

A request's ``input`` (a string, or items: messages with text parts, ``function_call`` items the model
made, ``function_call_output`` items with their results) and ``instructions`` become a conversation for
the chat template, as chat completions' messages do. Generation takes ``max_output_tokens``,
``temperature``, ``top_p`` (and vLLM's extras: ``top_k``, ``min_p``, penalties, ``seed``, …),
``text.format`` (``text``, ``json_object``, ``json_schema``: a constraint, as ``response_format``; or
vLLM's ``structured_outputs``), ``include: ["message.output_text.logprobs"]`` with ``top_logprobs``
(log-probabilities of the answer's tokens, as chat's ``logprobs`` with ``top_logprobs``),
function ``tools`` with ``tool_choice`` and ``parallel_tool_calls`` (:mod:`llm_jax.server.tools`), and
``reasoning.effort`` (given to the template as ``reasoning_effort``).

The answer is a ``response`` whose ``output`` holds, in order, a ``reasoning`` item (with the server's
``--reasoning-parser``), a ``message`` with one ``output_text`` part, and ``function_call`` items; its
``status`` is ``completed``, or ``incomplete`` (``incomplete_details.reason: max_output_tokens``) when the
token budget cut it. Streamed, it is the API's events — ``response.created``, ``response.in_progress``,
each item's ``output_item.added``, its part's ``content_part.added``, text deltas
(``output_text.delta``, ``reasoning_text.delta``, ``function_call_arguments.delta``) and their
``done`` events, ``output_item.done`` — ending with ``response.completed`` (or ``response.incomplete``),
each with its ``sequence_number``. With logprobs, the message's ``output_text`` part holds ``logprobs:
[{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}]`` for every token of the answer (those
of its reasoning and tool calls too, as vLLM's); streamed, each ``output_text.delta`` carries
``[{token, logprob, top_logprobs: [{token, logprob}]}]`` for the tokens since the last one (a stream
leaves out those after the message's end: a tool call's). Nothing is stored: ``previous_response_id``,
``conversation`` and ``background`` are refused (send the whole conversation as ``input``), as are
built-in tools.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import uuid
from collections.abc import Callable, Sequence
from typing import Any

from llm_jax.guided import Json
from llm_jax.server import protocol, tools
from llm_jax.server.choices import Delta, Run, TokenLogprob
from llm_jax.server.fields import ApiError, Fields, check, check_kind, integer, show
from llm_jax.server.protocol import Generation, Limits

TEXT_PARTS = ("input_text", "output_text", "text")
LOGPROBS = "message.output_text.logprobs"  # the one thing ``include`` may ask for
MESSAGE_ROLES = ("user", "system", "developer", "assistant")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ResponsesRequest:
    model: str | None
    messages: tuple[dict[str, Any], ...]
    tools: tools.ToolCalling | None
    generation: Generation
    template_kwargs: dict[str, Any]
    echo: dict[str, Any]  # what the response object repeats of the request


def _text(value: Any, param: str) -> str:
    """A message's content: a string, or a list of text parts (joined by newlines)."""
    if isinstance(value, str):
        return value
    check_kind(value, param, "string", "array")
    texts = []
    for i, part in enumerate(value):
        check_kind(part, f"{param}[{i}]", "object")
        check(part.get("type") in TEXT_PARTS, f"{param}[{i}].type",
              f"must be input_text or output_text (only text is supported), got {show(part.get('type'))}")
        texts.append(check_kind(part.get("text"), f"{param}[{i}].text", "string"))
    return "\n".join(texts)


def _messages(value: Any, instructions: str | None) -> list[dict[str, Any]]:
    """``input`` as chat messages: the instructions as a system message first; consecutive function calls
    as one assistant message's ``tool_calls``; their outputs as ``tool`` messages."""
    messages = [{"role": "system", "content": instructions}] if instructions is not None else []
    if isinstance(value, str):
        return [*messages, {"role": "user", "content": value}]
    check_kind(value, "input", "string", "array")
    check(len(value) > 0, "input", "must not be empty")
    for i, item in enumerate(value):
        param = f"input[{i}]"
        check_kind(item, param, "object")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            check(role in MESSAGE_ROLES, f"{param}.role", f"must be one of {list(MESSAGE_ROLES)}, got {show(role)}")
            messages.append({"role": role, "content": _text(item.get("content"), f"{param}.content")})
        elif kind == "function_call":
            call_id = check_kind(item.get("call_id"), f"{param}.call_id", "string")
            name = check_kind(item.get("name"), f"{param}.name", "string")
            arguments = check_kind(item.get("arguments"), f"{param}.arguments", "string")
            call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
            if messages and messages[-1]["role"] == "assistant" and messages[-1].get("tool_calls") is not None:
                messages[-1]["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            call_id = check_kind(item.get("call_id"), f"{param}.call_id", "string")
            output = item.get("output")
            messages.append({"role": "tool", "tool_call_id": call_id, "content": _text(output, f"{param}.output")})
        elif kind == "reasoning":
            continue  # earlier reasoning: templates drop it from past turns
        else:
            raise ApiError(f"{param}.type must be message, function_call, function_call_output or reasoning, got "
                           f"{show(kind)}", param=f"{param}.type", code="invalid_value")
    return messages


def _tools(fields: Fields) -> tools.ToolCalling | None:
    """Function tools (the Responses API's flat form) and how they may be called."""
    value = fields.take("tools", "array", default=[])
    check(len(value) <= tools.MAX_TOOLS, "tools", f"may hold at most {tools.MAX_TOOLS} tools, got {len(value)}")
    found = []
    for i, tool in enumerate(value):
        check_kind(tool, f"tools[{i}]", "object")
        check(tool.get("type") == "function", f"tools[{i}].type",
              f"must be 'function' (this server runs no built-in tools), got {show(tool.get('type'))}")
        found.append(tools.function_tool({k: v for k, v in tool.items() if k != "type"}, f"tools[{i}]"))
    found = tools.unique(tuple(found))
    choice = fields.take("tool_choice", "string", "object", default="auto" if found else "none")
    allowed = None
    if isinstance(choice, dict) and choice.get("type") == "allowed_tools":
        choice, allowed = tools.allowed_tools(choice, found, flat=True)
    if isinstance(choice, dict):
        check(choice.get("type") == "function" and set(choice) == {"type", "name"}, "tool_choice",
              f"must be {{\"type\": \"function\", \"name\": ...}}, got {show(choice)}")
        name = check_kind(choice.get("name"), "tool_choice.name", "string")
        check(any(t.name == name for t in found), "tool_choice.name",
              f"names {show(name)}, which is not among the tools ({[t.name for t in found]})")
        choice = tools.Named(name)
    else:
        check(choice in ("none", "auto", "required"), "tool_choice",
              f"must be 'none', 'auto', 'required' or a named function, got {show(choice)}")
        check(choice == "none" or bool(found), "tool_choice", f"{show(choice)} needs tools")
    parallel = fields.take("parallel_tool_calls", "boolean", default=True)
    return tools.ToolCalling(tools=found, choice=choice, parallel=parallel, allowed=allowed) if found else None


def _text_format(fields: Fields) -> tuple[dict[str, Any], Json | None]:
    """``text.format`` (echoed back) and its constraint: ``{"type": "text" | "json_object" | "json_schema",
    "name", "schema", "strict", "description"}``."""
    text = check_kind(fields.take("text", "object", default={}), "text", "object")
    unknown = set(text) - {"format", "verbosity"}
    check(not unknown, "text", f"has unknown fields {sorted(unknown)}")
    spec = check_kind(text.get("format", {"type": "text"}), "text.format", "object")
    kind = spec.get("type")
    allowed = {"text": {"type"}, "json_object": {"type"}, "json_schema": {"type", "name", "schema", "strict",
                                                                          "description"}}
    check(kind in allowed, "text.format.type", f"must be text, json_object or json_schema, got {show(kind)}")
    unknown = set(spec) - allowed[kind]
    check(not unknown, "text.format", f"has unknown fields {sorted(unknown)}")
    if kind == "text":
        return spec, None
    if kind == "json_object":
        return spec, Json()
    check_kind(spec.get("name"), "text.format.name", "string")
    schema = check_kind(spec.get("schema", {}), "text.format.schema", "object")
    return spec, Json(schema)


def parse_responses(body: Any, limits: Limits) -> ResponsesRequest:
    fields = Fields(body)
    model = fields.take("model", "string")
    instructions = fields.take("instructions", "string")
    messages = protocol.messages(_messages(fields.required("input", "string", "array"), instructions), "input")
    max_output_tokens = integer(fields, "max_output_tokens", 1, 2**31 - 1, default=limits.defaults.get("max_tokens"))
    for name, why in (("previous_response_id", "this server stores no responses: send the whole conversation "
                                               "as input"),
                      ("conversation", "this server stores no conversations: send the whole conversation as input"),
                      ("prompt", "this server has no stored prompts"),
                      ("max_tool_calls", "this server does not bound tool calls")):
        fields.unsupported(name, why=f"is not supported: {why}")
    fields.unsupported("background", accepted=False, why="is not supported: responses run in the foreground")
    wants_logprobs = _include(fields.take("include", "array", default=[]))
    top_logprobs = integer(fields, "top_logprobs", 0, limits.max_logprobs)
    logprobs = (top_logprobs or 0) if wants_logprobs else None  # top_logprobs alone asks for none (as vLLM)
    fields.unsupported("truncation", accepted="disabled", why="is not supported: inputs are never truncated")
    fields.unsupported("stream_options", why="is not supported on /v1/responses")
    for ignored in ("safety_identifier", "prompt_cache_key", "prompt_cache_retention"):
        fields.take(ignored, "string")
    metadata = fields.take("metadata", "object", default={})
    effort = _effort(fields.take("reasoning", "object", default={}))
    calling = _tools(fields)
    spec, guided = _text_format(fields)
    structured = fields.take("structured_outputs", "object")  # vLLM's: a regex, a grammar, choices, …
    if structured is not None:
        check(guided is None, "structured_outputs", "cannot be given with a json text.format")
        guided = protocol.nested("structured_outputs", protocol.structured_outputs, structured)
    kwargs = fields.take("chat_template_kwargs", "object", default={})
    temperature, top_p = fields.peek("temperature"), fields.peek("top_p")
    sampling = protocol.read_sampling(fields, limits)
    seed = integer(fields, "seed", -protocol.MAX_SEED, protocol.MAX_SEED - 1)
    priority = integer(fields, "priority", -2**31, 2**31 - 1, default=0)
    stream = fields.take("stream", "boolean", default=False)
    fields.finish()
    guided_param = None if guided is None else "structured_outputs" if structured is not None else "text.format"
    if calling is not None and calling.forced:
        if guided is not None:
            raise ApiError("text.format cannot constrain the output when tool_choice forces tool calls",
                           param="tool_choice", code="invalid_value")
        guided, guided_param = calling.constraint(), "tools"
    generation = Generation(max_tokens=max_output_tokens, min_tokens=0, n=1, sampling=sampling, seed=seed, stop=(),
                            stop_token_ids=(), ignore_eos=False, logprobs=logprobs,
                            stream=stream, include_usage=False, continuous_usage=False, guided=guided,
                            guided_param=guided_param, priority=priority)
    if effort is not None:
        kwargs = {"reasoning_effort": effort, **kwargs}
    echo = {"instructions": instructions, "max_output_tokens": max_output_tokens, "metadata": metadata,
            "parallel_tool_calls": calling.parallel if calling is not None else True,
            "reasoning": {"effort": effort, "summary": None}, "text": {"format": spec},
            "temperature": 1.0 if temperature is None else temperature, "top_p": 1.0 if top_p is None else top_p,
            "tool_choice": _choice_echo(calling), "tools": [_tool_echo(t) for t in (calling.tools if calling else ())],
            "top_logprobs": top_logprobs}
    return ResponsesRequest(model=model, messages=messages, tools=calling, generation=generation,
                            template_kwargs=kwargs, echo=echo)


def _include(value: list[Any]) -> bool:
    """``include``: whether it asks for the answer's log-probabilities (nothing else can be included)."""
    for i, item in enumerate(value):
        check_kind(item, f"include[{i}]", "string")
        check(item == LOGPROBS, f"include[{i}]", f"must be {show(LOGPROBS)} (there is nothing else to include), "
                                                 f"got {show(item)}")
    return LOGPROBS in value


def _effort(value: dict[str, Any]) -> str | None:
    """``reasoning``: its ``effort`` (``summary`` and ``generate_summary`` accepted, without effect)."""
    unknown = set(value) - {"effort", "summary", "generate_summary"}
    check(not unknown, "reasoning", f"has unknown fields {sorted(unknown)}")
    for key, item in value.items():
        if item is not None:
            check_kind(item, f"reasoning.{key}", "string")
    return value.get("effort")


def _choice_echo(calling: tools.ToolCalling | None) -> Any:
    if calling is None:
        return "none"
    if isinstance(calling.choice, tools.Named):
        return {"type": "function", "name": calling.choice.name}
    if calling.allowed is not None:
        return {"type": "allowed_tools", "mode": calling.choice,
                "tools": [{"type": "function", "name": name} for name in calling.allowed]}
    return calling.choice


def _tool_echo(tool: tools.Tool) -> dict[str, Any]:
    return {"type": "function", "name": tool.name, "description": tool.description, "parameters": tool.parameters,
            "strict": tool.strict}


# --- the answer -----------------------------------------------------------------------------------------


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _part_logprob(entry: TokenLogprob) -> dict[str, Any]:
    """A token as an ``output_text`` part lists it."""
    return {**_scored(entry.token, entry.logprob), "bytes": list(entry.token.encode("utf-8")),
            "top_logprobs": [{**_scored(t.token, t.logprob), "bytes": list(t.token.encode("utf-8"))}
                             for t in entry.top]}


def _event_logprob(entry: TokenLogprob) -> dict[str, Any]:
    """A token as the ``output_text.delta`` and ``.done`` events list it (without bytes)."""
    return {**_scored(entry.token, entry.logprob), "top_logprobs": [_scored(t.token, t.logprob) for t in entry.top]}


def _scored(token: str, logprob: float) -> dict[str, Any]:
    return {"token": token, "logprob": logprob}


class _Output:
    """The response's output items, built from what the reader reads, with the events that build them.

    The log-probabilities of the tokens given (``apply``'s ``entries``) wait for the next message text, which
    carries them; those left at the end go with the message when it is still open."""

    def __init__(self, event: Callable[..., str]):
        self.event = event  # builds one event (a no-op for a whole answer)
        self.items: list[dict[str, Any]] = []
        self.open: int | None = None  # the item text still goes to
        self.pending: list[TokenLogprob] = []  # tokens whose log-probabilities no message text carried yet
        self.event_logprobs: dict[int, list[dict[str, Any]]] = {}  # by item: its tokens, as events list them

    def apply(self, read: tools.Read, entries: Sequence[TokenLogprob] = ()) -> list[str]:
        self.pending += entries
        events = []
        if read.reasoning:
            events += self._text("reasoning", read.reasoning)
        if read.content:
            events += self._text("message", read.content)
        for call in read.calls:
            if call.id is not None:
                events += self._close()
                events += self._open_call(call)
            if call.arguments:
                item = self.items[self.open]
                item["arguments"] += call.arguments
                events.append(self.event("response.function_call_arguments.delta", item_id=item["id"],
                                               output_index=self.open, delta=call.arguments))
        return events

    def finish(self, complete: bool) -> list[str]:
        """Close the open item; an answer with no output gets an empty message (which carries the tokens
        still pending, as an open message does)."""
        message_open = self.open is not None and self.items[self.open]["type"] == "message"
        events = self._text("message", "") if not self.items or (self.pending and message_open) else []
        self.pending = []
        return events + self._close("completed" if complete else "incomplete")

    def _text(self, kind: str, text: str) -> list[str]:
        events = []
        if self.open is None or self.items[self.open]["type"] != kind:
            events += self._close()
            events += self._open_text(kind)
        item = self.items[self.open]
        item["content"][0]["text"] += text
        if kind == "message":
            entries, self.pending = self.pending, []
            item["content"][0]["logprobs"] += [_part_logprob(e) for e in entries]
            logprobs = [_event_logprob(e) for e in entries]
            self.event_logprobs.setdefault(self.open, []).extend(logprobs)
            events.append(self.event("response.output_text.delta", item_id=item["id"], output_index=self.open,
                                           content_index=0, delta=text, logprobs=logprobs))
        else:
            events.append(self.event("response.reasoning_text.delta", item_id=item["id"],
                                           output_index=self.open, content_index=0, delta=text))
        return events

    def _open_text(self, kind: str) -> list[str]:
        if kind == "message":
            item = {"id": _id("msg"), "type": "message", "role": "assistant", "status": "in_progress", "content": []}
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        else:
            item = {"id": _id("rs"), "type": "reasoning", "summary": [], "content": [], "status": "in_progress"}
            part = {"type": "reasoning_text", "text": ""}
        events = self._add(item)
        item["content"].append(part)
        events.append(self.event("response.content_part.added", item_id=item["id"], output_index=self.open,
                                       content_index=0, part=copy.deepcopy(part)))
        return events

    def _open_call(self, call: tools.CallDelta) -> list[str]:
        return self._add({"id": _id("fc"), "type": "function_call", "call_id": call.id, "name": call.name,
                          "arguments": "", "status": "in_progress"})

    def _add(self, item: dict[str, Any]) -> list[str]:
        self.items.append(item)
        self.open = len(self.items) - 1
        return [self.event("response.output_item.added", output_index=self.open, item=copy.deepcopy(item))]

    def _close(self, status: str = "completed") -> list[str]:
        if self.open is None:
            return []
        index, item = self.open, self.items[self.open]
        self.open = None
        item["status"] = status
        events = []
        if item["type"] == "function_call":
            events.append(self.event("response.function_call_arguments.done", item_id=item["id"],
                                           output_index=index, name=item["name"], arguments=item["arguments"]))
        else:
            part = item["content"][0]
            name = "output_text" if item["type"] == "message" else "reasoning_text"
            extra = {"logprobs": self.event_logprobs.get(index, [])} if item["type"] == "message" else {}
            events.append(self.event(f"response.{name}.done", item_id=item["id"], output_index=index,
                                           content_index=0, text=part["text"], **extra))
            events.append(self.event("response.content_part.done", item_id=item["id"], output_index=index,
                                           content_index=0, part=copy.deepcopy(part)))
        events.append(self.event("response.output_item.done", output_index=index, item=copy.deepcopy(item)))
        return events


class ResponsesShape:
    """``/v1/responses``: one choice, its output read into items (``make_reader``: reasoning, tool calls)."""

    def __init__(self, request_id: str, created: int, model: str, run: Run, request: ResponsesRequest,
                 make_reader):
        self.request_id, self.created, self.model, self.run, self.request = request_id, created, model, run, request
        self.make_reader = lambda: make_reader() or tools.PlainReader()
        self.reader = self.make_reader()
        self.output = _Output(self.event)
        self.sequence = 0

    def event(self, kind: str, **fields: Any) -> str:
        body = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return f"event: {kind}\ndata: {json.dumps(body, ensure_ascii=False, separators=(',', ':'))}\n\n"

    def _object(self, status: str, output: list[dict[str, Any]], finished: bool) -> dict[str, Any]:
        (choice,) = self.run.choices
        cut = finished and choice.finish_reason == "length"
        usage = None
        if finished:
            prompt, completion = self.run.prompt_tokens, self.run.completion_tokens
            usage = {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": 0}, "output_tokens": completion,
                     "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": prompt + completion}
        return {"id": self.request_id, "object": "response", "created_at": self.created, "status": status,
                "background": False, "error": None,
                "incomplete_details": {"reason": "max_output_tokens"} if cut else None, "model": self.model,
                "output": copy.deepcopy(output), "previous_response_id": None, "store": False,
                "truncation": "disabled", "usage": usage, "user": None, **self.request.echo}

    def _status(self) -> str:
        (choice,) = self.run.choices
        return "completed" if choice.finish_reason in ("stop", "tool_calls") else "incomplete"

    def response(self) -> dict[str, Any]:
        (choice,) = self.run.choices
        output, reader = _Output(lambda kind, **fields: ""), self.make_reader()
        read = reader.feed(choice.text)
        read += reader.finish()
        output.apply(read, choice.logprobs)
        output.finish(self._status() == "completed")
        return self._object(self._status(), output.items, finished=True)

    def opening(self) -> list[str]:
        shell = self._object("in_progress", [], finished=False)
        return [self.event("response.created", response=shell), self.event("response.in_progress", response=shell)]

    def chunk(self, delta: Delta) -> str | None:
        read = self.reader.feed(delta.text)
        if delta.finish_reason is not None:
            read += self.reader.finish()
        events = self.output.apply(read, delta.logprobs)
        if delta.finish_reason is not None:
            events += self.output.finish(self._status() == "completed")
        return "".join(events) or None

    def closing(self) -> list[str]:
        status = self._status()
        kind = "response.completed" if status == "completed" else "response.incomplete"
        return [self.event(kind, response=self._object(status, self.output.items, finished=True))]

    def failure(self, error: ApiError) -> list[str]:
        return [self.event("error", code=error.code, message=error.message, param=error.param)]

