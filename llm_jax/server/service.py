"""What the routes share: the engine, the model's limits, the API key, the requests in flight.

Requests run on an :class:`~llm_jax.serving.async_engine.AsyncEngine`, whose thread steps the engine
while the event loop parses, streams and answers; a sequence classifier, which does not generate, is
served without one (its requests run beside the event loop, one batch at a time). With an API key, the
API's routes (``PROTECTED``) need ``Authorization: Bearer <key>`` (the probes and the scraper need none). The server
takes at most ``max_num_seqs + max_waiting`` engine requests (choices) at once; past that it answers 503
with ``Retry-After`` rather than queueing without bound. Every refusal is a 4xx (5xx only for the
server's own failures) with ``{"error": {"message", "type", "param", "code"}}``. Each completion or chat
request is logged on one line: its id, status, tokens in and out, time to first token, total time and
finish reasons.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import math
import secrets
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from llm_jax import guided
from llm_jax.chat_template import ChatTemplate, encode_chat
from llm_jax.decoding import processor_defaults
from llm_jax.loading import Model
from llm_jax.server import protocol
from llm_jax.server.choices import BeamRun, Run
from llm_jax.server.fields import ApiError, parse_json
from llm_jax.server.metrics import ServerMetrics
from llm_jax.server.protocol import Generation, Limits, check_context
from llm_jax.server.responses import DONE, Shape, error_event
from llm_jax.server.sse import CLIENT_CLOSED, Disconnected, EventStream, unless_disconnected
from llm_jax.serving.async_engine import AsyncEngine
from llm_jax.serving.batching import END_WIDTH
from llm_jax.serving.step import BANNED

log = logging.getLogger("llm_jax.server")

MAX_BODY_BYTES = 32 * 2**20
PROTECTED = ("/v1/", "/v2/", "/tokenize", "/detokenize", "/score", "/rerank", "/classify")
STOPPED = ApiError("the server stopped before this request finished", status=503, type="service_unavailable_error",
                   code="shutting_down")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ServerConfig:
    model_names: tuple[str, ...]  # what requests may name in "model"; the first is the one reported
    api_key: str | None = None
    max_waiting: int = 64  # engine requests queued beyond the running batch before 503s
    chat_template: ChatTemplate | None = None
    max_body_bytes: int = MAX_BODY_BYTES
    tool_call_parser: str | None = None  # how tool calls are read from a model calling tools on its own
    reasoning_parser: str | None = None  # how a thinking model's reasoning is told from its answer
    allowed_origins: tuple[str, ...] = ()  # origins browsers may call the API from (CORS); "*": any
    scheduling_policy: str = "fcfs"  # "priority": requests' priority orders them
    embedding_pooling: str = "last"  # /v1/embeddings: the last token's hidden state, or the mean ("mean")
    allow_runtime_lora_updating: bool = False  # POST /v1/load_lora_adapter and /v1/unload_lora_adapter
    # What requests leave out: the model's recommended sampling settings (``llm_jax.server.defaults``).
    sampling_defaults: dict = dataclasses.field(default_factory=dict)
    max_model_len: int | None = None  # a classifier's context (an engine has its own); None: the model's


def error_response(error: ApiError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status, headers=error.headers)


def _first_line(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    return lines[0] if lines else type(error).__name__


class Service:
    """The routes' state: the engine (None for a sequence classifier: ``model`` then), the model's tokenizer
    and limits, the requests in flight."""

    def __init__(self, engine: AsyncEngine | None, config: ServerConfig, model: Model | None = None):
        self.engine, self.config = engine, config
        self.model = engine.engine.model if engine is not None else model
        self.tokenizer = self.model.tokenizer
        self.name = config.model_names[0]
        self.side_lock = asyncio.Lock()  # one computation beside the engine's steps at a time: embeddings, beams
        model_config = self.model.config
        if engine is None:  # a classifier: its context, no generation
            self.limits = Limits(vocab_size=model_config.vocab_size, max_logprobs=0, embedding_dim=model_config.d_model,
                                 defaults=config.sampling_defaults)
            self.max_model_len = min(config.max_model_len or model_config.max_seq_len, model_config.max_seq_len)
            self.capacity = config.max_waiting
            self.metrics = ServerMetrics(None, self.name)
        else:
            inner = engine.engine
            self.limits = Limits(vocab_size=model_config.vocab_size, max_logprobs=inner.max_logprobs,
                                 embedding_dim=model_config.d_model, defaults=config.sampling_defaults,
                                 processor_arguments=processor_defaults(inner.processors))
            self.max_model_len, self.block_size = inner.max_model_len, inner.block_size
            self.num_block_slots = inner.scheduler.pool.capacity  # blocks a request may hold at most
            self.capacity = inner.max_num_seqs + config.max_waiting
            lora = None if inner.lora is None else (lambda: (inner.lora.num_slots, *inner.lora_requests()))
            self.metrics = ServerMetrics(inner.stats, self.name, lora)
        self.created = int(time.time())
        self.shutting_down = False
        self._runs: dict[Run, str] = {}  # in flight → request id

    @property
    def healthy(self) -> bool:
        """Taking requests, with the engine's loop alive."""
        return not self.shutting_down and (self.engine is None or self.engine.is_running)

    async def shutdown(self) -> None:
        """Refuse new requests, abort those still in flight (the HTTP server's grace period is over), and
        stop the engine's thread."""
        self.shutting_down = True
        if self.engine is None:
            return
        for run in list(self._runs):
            for choice in run.choices:
                self.engine.abort(choice.engine_id)
        await self.engine.shutdown()

    @property
    def in_flight(self) -> int:
        """Engine requests (choices) admitted and not yet finished."""
        return sum(len(run.choices) for run in self._runs)

    # --- the request's edges: key, body, model, admission, logging -----------------------------------

    def authorize(self, request: Request) -> None:
        if self.config.api_key is None or not request.url.path.startswith(PROTECTED):
            return
        scheme, _, key = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not secrets.compare_digest(key.strip().encode(), self.config.api_key.encode()):
            raise ApiError("Incorrect or missing API key: send it as 'Authorization: Bearer <key>'", status=401,
                           type="authentication_error", code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})

    async def body(self, request: Request) -> Any:
        limit, chunks, size = self.config.max_body_bytes, [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise ApiError(f"the request body exceeds {limit} bytes", status=413, code="request_too_large")
            chunks.append(chunk)
        return parse_json(b"".join(chunks))

    @property
    def lora_names(self) -> tuple[str, ...]:
        """The LoRA adapters requests may name as their model."""
        return () if self.engine is None else self.engine.engine.lora_names

    def check_model(self, model: str | None) -> str | None:
        """The LoRA adapter ``model`` names, None for the base model (or no model given); a 404 for others."""
        if model is None or model in self.config.model_names:
            return None
        if model in self.lora_names:
            return model
        raise ApiError(f"The model `{model}` does not exist; this server serves "
                       f"{[*self.config.model_names, *self.lora_names]}", status=404, type="not_found_error",
                       param="model", code="model_not_found")

    def encode(self, prompt: protocol.Prompt, param: str, add_special_tokens: bool = True) -> tuple[int, ...]:
        if isinstance(prompt, tuple):
            return prompt
        if self.tokenizer is None:
            raise ApiError("the model has no tokenizer: send prompts as token ids", param=param, code="invalid_type")
        try:
            ids = self.tokenizer.encode(prompt, add_bos=None if add_special_tokens else False)
        except Exception as error:  # text the tokenizer cannot take is the request's fault
            raise ApiError(f"{param} could not be tokenized: {_first_line(error)}", param=param) from None
        if not ids:
            raise ApiError(f"{param} encodes to no tokens", param=param, code="invalid_value")
        return tuple(ids)

    def budget(self, ids: tuple[int, ...], generation: Generation, param: str) -> tuple[tuple[int, ...], int]:
        """The prompt (truncated as asked) and its completion's token budget, checked against the context
        and the KV cache."""
        ids = protocol.truncate(ids, generation.truncate_prompt_tokens, self.max_model_len)
        budget = check_context(len(ids), generation.max_tokens, self.max_model_len, param=param)
        blocks = math.ceil((len(ids) + budget - 1) / self.block_size)
        if blocks > self.num_block_slots:
            raise ApiError(f"the prompt ({len(ids)} tokens) and max_tokens ({budget}) need {blocks} KV-cache blocks; "
                           f"the server has {self.num_block_slots}", param="max_tokens", code="context_length_exceeded")
        return ids, budget

    def admit(self, generation: Generation, prompts: list[tuple[tuple[int, ...], int]], request_id: str,
              arrival: float) -> Run:
        """A run for the request, or a refusal: too many stop ids, shutting down, too many choices, full."""
        eos_ids = () if generation.ignore_eos else self.model.eos_ids
        end_ids = {*generation.stop_token_ids, *self.model.stop_ids, *eos_ids}
        if len(end_ids) > END_WIDTH:
            raise ApiError(f"at most {END_WIDTH} stop and end-of-sequence token ids in all, got {len(end_ids)}",
                           param="stop_token_ids", code="invalid_value")
        if generation.priority != 0 and self.config.scheduling_policy != "priority":
            raise ApiError("priority needs a server started with --scheduling-policy priority", param="priority",
                           code="invalid_value")
        protocol.check_beam_search(generation)
        if generation.guided is not None:
            self.check_guided(generation)
        if generation.bad_words:
            generation = dataclasses.replace(generation, sampling=dataclasses.replace(
                generation.sampling, bad_words_ids=self.bad_words_ids(generation.bad_words)))
        wanted = len(prompts) * generation.n
        if self.shutting_down:
            raise ApiError("the server is shutting down", status=503, type="service_unavailable_error",
                           code="shutting_down")
        if wanted > self.capacity:
            raise ApiError(f"the request asks for {wanted} completions (prompts × n); this server runs or queues at "
                           f"most {self.capacity} at once", param="n", code="too_many_completions")
        if self.in_flight + wanted > self.capacity:
            self.metrics.rejected("queue_full")
            raise ApiError(f"the server is full ({self.in_flight} completions running or queued); retry later",
                           status=503, type="service_unavailable_error", code="queue_full",
                           headers={"Retry-After": "1"})
        kind, extra = (Run, {}) if generation.beam_search is None else (BeamRun, dict(model=self.model,
                                                                                       lock=self.side_lock))
        run = kind(self.engine, self.tokenizer, generation, prompts, stop_ids=self.model.stop_ids,
                   metrics=self.metrics, arrival=arrival, **extra)
        self._runs[run] = request_id
        return run

    def bad_words_ids(self, words: tuple[str, ...]) -> tuple[tuple[int, ...], ...]:
        """The token sequences ``words`` ban, as vLLM tokenizes them: each word alone, and after a space where
        that spells it with other tokens of the same count (so it is banned at the start of the text and
        after a space)."""
        if self.tokenizer is None:
            raise ApiError("bad_words needs the model's tokenizer, and this model has none", param="bad_words")
        sequences: dict[tuple[int, ...], None] = {}
        for word in words:
            alone = tuple(self.tokenizer.encode(word.lstrip(), add_bos=False, parse_special=False))
            spaced = tuple(self.tokenizer.encode(" " + word.lstrip(), add_bos=False, parse_special=False))
            for ids in (alone, spaced) if spaced[:1] != alone[:1] and len(spaced) == len(alone) else (alone,):
                if len(ids) > BANNED[1]:
                    raise ApiError(f"bad_words: {word!r} is {len(ids)} tokens; at most {BANNED[1]}", param="bad_words",
                                   code="invalid_value")
                sequences[ids] = None
        if len(sequences) > BANNED[0]:
            raise ApiError(f"bad_words come to {len(sequences)} token sequences; at most {BANNED[0]}",
                           param="bad_words", code="invalid_value")
        return tuple(sequences)

    def check_guided(self, generation: Generation) -> None:
        """A refusal naming the field when the request's constraint does not compile for this model."""
        param = generation.guided_param
        if self.tokenizer is None:
            raise ApiError(f"{param} needs the model's tokenizer, and this model has none", param=param,
                           code="invalid_value")
        try:
            guided.check(guided.vocabulary(self.tokenizer, tuple(self.model.eos_ids), self.model.config.vocab_size),
                         generation.guided)
        except guided.GuidedError as error:
            raise ApiError(f"{param}: {_first_line(error)}", param=param, code="invalid_value") from None

    def finish(self, run: Run, status: int, error: ApiError | None = None) -> None:
        """The run is over (once): it leaves the server's count, and its log line is written."""
        request_id = self._runs.pop(run, None)
        if request_id is None:
            return
        if error is not None:
            self.log_refusal(request_id, error)
            return
        ttft = f"{run.first_token_at - run.arrival:.3f}s" if run.first_token_at is not None else "-"
        reasons = ",".join(c.finish_reason or "abort" for c in run.choices)
        log.info("%s %d prompt_tokens=%d completion_tokens=%d ttft=%s total=%.3fs finish=%s", request_id, status,
                 run.prompt_tokens, run.completion_tokens, ttft, time.monotonic() - run.arrival, reasons)

    def log_refusal(self, request_id: str, error: ApiError) -> None:
        log.info("%s %d %s param=%s: %s", request_id, error.status, error.code or error.type, error.param,
                 error.message)

    # --- running a request --------------------------------------------------------------------------

    async def respond(self, request: Request, run: Run, shape: Shape,
                      request_id: str) -> Response:
        headers = {"x-request-id": request_id}
        if run.generation.stream:
            return EventStream(self._events(run, shape), headers=headers, cut_events=error_event(STOPPED) + DONE,
                               on_close=lambda status: self.finish(run, status))

        async def collect() -> dict[str, Any]:
            async with contextlib.aclosing(run.deltas()) as deltas:
                async for _ in deltas:
                    pass
            return shape.response()

        try:
            body = await unless_disconnected(request.receive, collect())
        except asyncio.CancelledError:  # the server is stopping and its grace period is over
            self.finish(run, STOPPED.status)
            return error_response(STOPPED)
        except ApiError as error:
            self.finish(run, error.status, error)
            return error_response(error)
        except Disconnected:
            self.finish(run, CLIENT_CLOSED)
            return Response(status_code=CLIENT_CLOSED)
        self.finish(run, 200)
        return JSONResponse(body, headers=headers)

    async def _events(self, run: Run, shape: Shape) -> AsyncIterator[str]:
        try:
            for chunk in shape.opening():
                yield chunk
            async with contextlib.aclosing(run.deltas()) as deltas:
                async for delta in deltas:
                    if (chunk := shape.chunk(delta)) is not None:
                        yield chunk
            for chunk in shape.closing():
                yield chunk
        except ApiError as error:  # the response has begun: the error is its last event
            self.finish(run, error.status, error)
            for chunk in shape.failure(error):
                yield chunk

    def render_chat(self, messages, *, add_generation_prompt: bool, continue_final_message: bool = False,
                    template_kwargs: dict | None = None, tools: list | None = None) -> tuple[tuple[int, ...], str]:
        """The prompt's token ids, and its text."""
        template = self.config.chat_template
        if template is None or self.tokenizer is None:
            raise ApiError("this model has no chat template: start the server with --chat-template FILE",
                           param="messages", code="no_chat_template")
        try:
            text = template.render(list(messages), add_generation_prompt=add_generation_prompt,
                                   continue_final_message=continue_final_message, tools=tools,
                                   **(template_kwargs or {}))
            ids = encode_chat(self.tokenizer, text)
        except Exception as error:  # the template refused these messages (raise_exception, a type error, …)
            raise ApiError(f"the chat template cannot render these messages: {_first_line(error)}",
                           param="messages", code="invalid_messages") from None
        if not ids:
            raise ApiError("the chat template renders these messages as no tokens", param="messages")
        return tuple(ids), text


def request_id(request: Request, prefix: str) -> str:
    """The client's ``X-Request-Id`` when it gives a usable one, else a new id."""
    given = request.headers.get("x-request-id", "")
    if given and len(given) <= 128 and given.isprintable():
        return given
    return f"{prefix}-{uuid.uuid4().hex}"
