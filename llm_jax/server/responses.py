"""Responses out: a run's choices as OpenAI objects, whole or as Server-Sent Events.

``/v1/completions`` answers a ``text_completion`` (streamed: one per event), ``/v1/chat/completions`` a
``chat.completion`` (streamed: ``chat.completion.chunk`` s, the first of each choice carrying the role).
Each choice has OpenAI's ``finish_reason`` and vLLM's ``stop_reason`` (the stop string or token id that
ended it, null for end-of-sequence). Log-probabilities come in each API's own shape: completions'
``{tokens, token_logprobs, top_logprobs, text_offset}`` (``top_logprobs`` maps token text to
log-probability and includes the chosen token), chat's ``{content: [{token, logprob, bytes,
top_logprobs}]}``. vLLM's ``prompt_logprobs`` is each completion choice's (chat: the response's): None
for the prompt's first token, then per token ``{token id: {logprob, rank, decoded_token}}`` for the token
and its most likely alternatives, the token first; streams never carry it (as vLLM's). A stream ends with
the usage chunk when asked (``stream_options.include_usage``), then ``data: [DONE]``; an error inside it
is an ``{"error": ...}`` event before ``[DONE]``. A chat request with tools reads each choice's output
into content and ``tool_calls`` (:mod:`llm_jax.server.tools`), and a reasoning parser the reasoning into
``reasoning_content`` (:mod:`llm_jax.server.reasoning`); streamed, a call's first delta carries its id
and name, the next ones pieces of its arguments.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from llm_jax.server.choices import Choice, Delta, Run, TokenLogprob
from llm_jax.server import tools
from llm_jax.server.fields import ApiError

DONE = "data: [DONE]\n\n"


def event(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


def error_event(error: ApiError) -> str:
    return event(error.body())


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


class Shape(Protocol):
    """How a run's choices are answered: whole (``response``), or as the events of a stream."""

    def response(self) -> dict[str, Any]: ...

    def opening(self) -> list[str]: ...

    def chunk(self, delta: Delta) -> str | None: ...

    def closing(self) -> list[str]: ...

    def failure(self, error: ApiError) -> list[str]: ...


class _Shape:
    """What every response and chunk of one request shares."""

    object_name: str
    chunk_name: str

    def __init__(self, request_id: str, created: int, model: str, run: Run):
        self.request_id, self.created, self.model, self.run = request_id, created, model, run

    def _head(self, name: str) -> dict[str, Any]:
        return {"id": self.request_id, "object": name, "created": self.created, "model": self.model}

    def usage(self) -> dict[str, int]:
        return usage(self.run.prompt_tokens, self.run.completion_tokens)

    def _chunk(self, choices: list[dict[str, Any]]) -> str:
        g = self.run.generation
        chunk = {**self._head(self.chunk_name), "choices": choices}
        if g.include_usage or g.continuous_usage:
            chunk["usage"] = self.usage() if g.continuous_usage else None
        return event(chunk)

    def usage_chunk(self) -> str:
        return event({**self._head(self.chunk_name), "choices": [], "usage": self.usage()})

    def opening(self) -> list[str]:
        """The events before the first delta's."""
        return []

    def closing(self) -> list[str]:
        """The events after the last delta's: the usage chunk when asked, and [DONE]."""
        return [*([self.usage_chunk()] if self.run.generation.include_usage else []), DONE]

    def failure(self, error: ApiError) -> list[str]:
        """The events that end a stream an error cut short."""
        return [error_event(error), DONE]


class CompletionShape(_Shape):
    """``/v1/completions``; ``echoes[i]``: the text echoed before prompt ``i``'s choices ("" without echo)."""

    object_name = chunk_name = "text_completion"

    def __init__(self, request_id: str, created: int, model: str, run: Run, echoes: Sequence[str]):
        super().__init__(request_id, created, model, run)
        self.echoes = echoes
        self._offsets = {c.index: len(echoes[c.prompt_index]) for c in run.choices}  # next token's text offset
        self._echoed: set[int] = set()

    def _logprobs(self, choice: Choice, entries: Sequence[TokenLogprob],
                  prompt: Sequence[TokenLogprob] = ()) -> dict[str, Any] | None:
        """``prompt``: the echoed prompt's entries, first (their offsets count from the echo's start; the
        first has no log-probability, as OpenAI's echo gives it)."""
        g = self.run.generation
        if g.logprobs is None:
            return None
        offsets, offset = [], 0
        for entry in prompt:
            offsets.append(offset)
            offset += len(entry.token)
        for entry in entries:
            offsets.append(self._offsets[choice.index])
            self._offsets[choice.index] += len(entry.token)
        every = [*prompt, *entries]
        return {"tokens": [e.token for e in every], "token_logprobs": [e.logprob for e in every],
                "top_logprobs": [None if e.logprob is None else {**{t.token: t.logprob for t in e.top[:g.logprobs]},
                                                                 e.token: e.logprob} for e in every],
                "text_offset": offsets}

    def _echoed_prompt(self, entries: Sequence[TokenLogprob]) -> Sequence[TokenLogprob]:
        return entries if self.run.generation.echo_logprobs is not None else ()

    def response(self) -> dict[str, Any]:
        g = self.run.generation
        choices = [{"index": c.index, "text": self.echoes[c.prompt_index] + c.text,
                    "logprobs": self._logprobs(c, c.logprobs, self._echoed_prompt(c.prompt_logprobs)),
                    "finish_reason": c.finish_reason, "stop_reason": c.stop_reason,
                    "prompt_logprobs": prompt_logprobs(c.prompt_logprobs, g.prompt_logprobs)}
                   for c in self.run.choices]
        return {**self._head(self.object_name), "choices": choices, "usage": self.usage()}

    def chunk(self, delta: Delta) -> str | None:
        choice = delta.choice
        text = delta.text
        if choice.index not in self._echoed:
            self._echoed.add(choice.index)
            text = self.echoes[choice.prompt_index] + text
        echoed = self._echoed_prompt(delta.prompt_logprobs)
        if not text and delta.finish_reason is None and not delta.logprobs and not echoed:
            return None  # nothing to show yet (text held back)
        return self._chunk([{"index": choice.index, "text": text,
                             "logprobs": self._logprobs(choice, delta.logprobs, echoed),
                             "finish_reason": delta.finish_reason, "stop_reason": choice.stop_reason}])


def prompt_logprobs(entries: Sequence[TokenLogprob], n: int | None) -> list[dict[str, Any] | None] | None:
    """vLLM's ``prompt_logprobs`` of a prompt's entries, with ``n`` alternatives (None: not asked for)."""
    if n is None:
        return None
    out = []
    for e in entries:
        if e.logprob is None:
            out.append(None)
            continue
        scores = {str(e.token_id): {"logprob": e.logprob, "rank": e.rank, "decoded_token": e.token}}
        for t in e.top[:n]:
            # Ranked as the token is: 1 + the alternatives above it (all among the top).
            rank = 1 + sum(other.logprob > t.logprob for other in e.top)
            scores.setdefault(str(t.token_id), {"logprob": t.logprob, "rank": rank, "decoded_token": t.token})
        out.append(scores)
    return out


def _chat_entry(token: str, logprob: float) -> dict[str, Any]:
    return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8"))}


class ChatShape(_Shape):
    """``/v1/chat/completions``; ``calling``: the request's tools; ``make_reader``: a reader of each choice's
    output (:func:`llm_jax.server.reasoning.output_reader`)."""

    object_name, chunk_name = "chat.completion", "chat.completion.chunk"

    def __init__(self, request_id: str, created: int, model: str, run: Run,
                 calling: tools.ToolCalling | None = None,
                 make_reader: Callable[[], tools.Reader | None] = lambda: None):
        super().__init__(request_id, created, model, run)
        self.calling, self.make_reader = calling, make_reader
        self._readers = {c.index: make_reader() for c in run.choices}

    def _finish_reason(self, reason: str | None, num_calls: int) -> str | None:
        """``tool_calls`` for an answer that ended calling tools it chose (not a named function)."""
        named = self.calling is not None and isinstance(self.calling.choice, tools.Named)
        return "tool_calls" if reason == "stop" and num_calls and not named else reason

    def _message(self, choice: Choice) -> dict[str, Any]:
        reader = self.make_reader()
        if reader is None:
            return {"role": "assistant", "content": choice.text}
        content, calls, reasoning = tools.read_all(reader, choice.text)
        message = {"role": "assistant", "content": content or (None if calls or reasoning else content)}
        if reasoning:
            message["reasoning_content"] = reasoning
        if calls:
            message["tool_calls"] = calls
        return message

    def _logprobs(self, entries: Sequence[TokenLogprob]) -> dict[str, Any] | None:
        if self.run.generation.logprobs is None:
            return None
        return {"content": [{**_chat_entry(e.token, e.logprob),
                             "top_logprobs": [_chat_entry(t.token, t.logprob) for t in e.top]} for e in entries]}

    def response(self) -> dict[str, Any]:
        choices = []
        for c in self.run.choices:
            message = self._message(c)
            choices.append({"index": c.index, "message": message, "logprobs": self._logprobs(c.logprobs),
                            "finish_reason": self._finish_reason(c.finish_reason, len(message.get("tool_calls", ()))),
                            "stop_reason": c.stop_reason})
        g = self.run.generation
        return {**self._head(self.object_name), "choices": choices, "usage": self.usage(),
                "prompt_logprobs": prompt_logprobs(self.run.choices[0].prompt_logprobs, g.prompt_logprobs)}

    def opening(self) -> list[str]:
        """The first chunk of each choice: the assistant's role."""
        return [self._chunk([{"index": c.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                              "finish_reason": None}]) for c in self.run.choices]

    def chunk(self, delta: Delta) -> str | None:
        reader = self._readers[delta.choice.index]
        if reader is None:
            body, finish = {"content": delta.text}, delta.finish_reason
        else:
            read = reader.feed(delta.text)
            if delta.finish_reason is not None:
                read += reader.finish()
            body = {"content": read.content} if read.content or not (read.calls or read.reasoning) else {}
            if read.reasoning:
                body["reasoning_content"] = read.reasoning
            if read.calls:
                body["tool_calls"] = [_call_delta(call) for call in read.calls]
            finish = self._finish_reason(delta.finish_reason, reader.num_calls)
        if len(body) == 1 and body.get("content") == "" and finish is None and not delta.logprobs:
            return None
        return self._chunk([{"index": delta.choice.index, "delta": body, "logprobs": self._logprobs(delta.logprobs),
                             "finish_reason": finish, "stop_reason": delta.choice.stop_reason}])


def _call_delta(call: tools.CallDelta) -> dict[str, Any]:
    if call.id is None:
        return {"index": call.index, "function": {"arguments": call.arguments}}
    return {"index": call.index, "id": call.id, "type": "function",
            "function": {"name": call.name, "arguments": call.arguments}}
