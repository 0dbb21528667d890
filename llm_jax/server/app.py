"""The ASGI app (Starlette): the routes, the error handlers and the lifespan.

    POST /v1/completions        POST /v1/chat/completions     POST /v1/responses
    POST /v1/embeddings         GET  /v1/models               GET  /v1/models/{model}
    POST /v1/score (/score)     POST /v1/rerank (/rerank, /v2/rerank)
    POST /classify (/v1/classify: a sequence classifier's server)
    POST /tokenize              POST /detokenize
    GET  /health                GET  /version                 GET /metrics
    POST /v1/load_lora_adapter  POST /v1/unload_lora_adapter  (with --allow-runtime-lora-updating)

A request's "model" names the served model or one of its LoRA adapters (``Engine``'s ``lora_adapters``),
which run side by side in the engine's steps.

A sequence classifier (``*ForSequenceClassification``: reward models, classifiers, or a language model
made one by ``Model.as_classifier``) does not generate: its server answers ``POST /classify``
(``/v1/classify``; :mod:`llm_jax.server.classification`), ``/v1/embeddings``, and, with one logit (a
cross-encoder), ``/score`` and ``/rerank``, beside the routes that do not generate (models, tokenize,
detokenize, health, version, metrics); the generating routes answer 404 naming what it serves, as
``/classify`` does on a language model.

``build_app(engine, config)`` takes an :class:`~llm_jax.serving.async_engine.AsyncEngine` whose engine
is already compiled (``Engine.warm_up``): the server is ready the moment it listens; a classifier's
``build_app(None, config, model=model)``. At shutdown (the
lifespan's end, after the HTTP server's grace period) the requests still in flight are aborted and the
engine's thread stops.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import dataclasses
import importlib.metadata
import logging
import time
from collections.abc import Awaitable, Callable

import numpy as np
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from llm_jax.lora import LoraRows
from llm_jax.loading import Model
from llm_jax.pooling import classify, embed_texts
from llm_jax.server import classification, protocol, reasoning, responses_api, similarity, tools
from llm_jax.server.choices import Run
from llm_jax.server.fields import ApiError, Fields
from llm_jax.server.metrics import CONTENT_TYPE
from llm_jax.server.responses import ChatShape, CompletionShape
from llm_jax.server.service import ServerConfig, Service, error_response, request_id
from llm_jax.server.sse import CLIENT_CLOSED
from llm_jax.serving.async_engine import AsyncEngine

log = logging.getLogger("llm_jax.server")

Handler = Callable[[Service, Request], Awaitable[Response]]


def _version() -> str:
    try:
        return importlib.metadata.version("llm_jax")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


async def completions(service: Service, request: Request) -> Response:
    rid, arrival = request_id(request, "cmpl"), time.monotonic()
    try:
        parsed = protocol.parse_completion(await service.body(request), service.limits)
        g = dataclasses.replace(parsed.generation, lora=service.check_model(parsed.model))
        prompts = [service.budget(service.encode(p, "prompt"), g, "prompt") for p in parsed.prompts]
        truncated = g.truncate_prompt_tokens is not None  # the echo is what the model read
        echoes = [_echo(service, () if truncated else p, ids) if parsed.echo else ""
                  for p, (ids, _) in zip(parsed.prompts, prompts)]
        run = service.admit(g, prompts, rid, arrival)
    except ApiError as error:
        service.log_refusal(rid, error)
        raise
    return await service.respond(request, run, CompletionShape(rid, int(time.time()), service.name, run, echoes), rid)


def _echo(service: Service, prompt: protocol.Prompt, ids: tuple[int, ...]) -> str:
    """The prompt as given when it is a string, else its ids' text."""
    if isinstance(prompt, str):
        return prompt
    return service.tokenizer.decode(list(ids)) if service.tokenizer is not None else ""


def _conversation(service: Service, messages, calling: tools.ToolCalling | None, generation: protocol.Generation,
                  rid: str, arrival: float, param: str, **template) -> tuple[Run, Callable]:
    """A conversation's run (rendered by the chat template with its tools), and the reader of its answers."""
    parser = service.config.tool_call_parser
    tools.check_parser(calling, parser)
    ids, text = service.render_chat(messages, tools=calling.specs() if calling is not None else None, **template)
    if tools.keeps_special_tokens(calling, parser):
        generation = dataclasses.replace(generation, skip_special_tokens=False)
    if service.config.reasoning_parser is not None and generation.guided is not None:  # constrained after thinking
        generation = dataclasses.replace(generation,
                                         guided_after_token=reasoning.constraint_start(service.tokenizer, text))
    run = service.admit(generation, [service.budget(ids, generation, param)], rid, arrival)
    return run, reasoning.output_reader(calling, parser, service.config.reasoning_parser, prompt=text)


async def chat_completions(service: Service, request: Request) -> Response:
    rid, arrival = request_id(request, "chatcmpl"), time.monotonic()
    try:
        parsed = protocol.parse_chat(await service.body(request), service.limits)
        generation = dataclasses.replace(parsed.generation, lora=service.check_model(parsed.model))
        run, make_reader = _conversation(service, parsed.messages, parsed.tools, generation, rid, arrival,
                                         "messages", add_generation_prompt=parsed.add_generation_prompt,
                                         continue_final_message=parsed.continue_final_message,
                                         template_kwargs=parsed.template_kwargs)
    except ApiError as error:
        service.log_refusal(rid, error)
        raise
    shape = ChatShape(rid, int(time.time()), service.name, run, parsed.tools, make_reader)
    return await service.respond(request, run, shape, rid)


async def responses(service: Service, request: Request) -> Response:
    rid, arrival = request_id(request, "resp"), time.monotonic()
    try:
        parsed = responses_api.parse_responses(await service.body(request), service.limits)
        generation = dataclasses.replace(parsed.generation, lora=service.check_model(parsed.model))
        run, make_reader = _conversation(service, parsed.messages, parsed.tools, generation, rid, arrival,
                                         "input", add_generation_prompt=True, template_kwargs=parsed.template_kwargs)
    except ApiError as error:
        service.log_refusal(rid, error)
        raise
    shape = responses_api.ResponsesShape(rid, int(time.time()), service.name, run, parsed, make_reader)
    return await service.respond(request, run, shape, rid)


async def embeddings(service: Service, request: Request) -> Response:
    """Each input's embedding (:func:`llm_jax.pooling.embed_texts`), as OpenAI's ``list`` of ``embedding`` s."""
    rid, arrival = request_id(request, "embd"), time.monotonic()
    try:
        parsed = protocol.parse_embeddings(await service.body(request), service.limits)
        lora = service.check_model(parsed.model)
        ids = _pooling_ids(service, parsed.source, parsed.truncate_prompt_tokens)
    except ApiError as error:
        service.log_refusal(rid, error)
        raise
    vectors = await _embed(service, ids, parsed.dimensions, lora)
    if parsed.encoding_format == "base64":
        data = [base64.b64encode(v.astype("<f4").tobytes()).decode("ascii") for v in vectors]
    else:
        data = vectors.tolist()
    tokens = sum(map(len, ids))
    log.info("%s 200 prompt_tokens=%d inputs=%d total=%.3fs", rid, tokens, len(ids), time.monotonic() - arrival)
    return JSONResponse({"object": "list", "model": service.name,
                         "data": [{"object": "embedding", "index": i, "embedding": e} for i, e in enumerate(data)],
                         "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}, headers={"x-request-id": rid})


def _embedding_inputs(service: Service, texts, param: str, truncate: int | None = None,
                      add_special_tokens: bool = True) -> list[tuple[int, ...]]:
    """Each text's (or token list's) ids (its last ``truncate`` tokens, vLLM's ``truncate_prompt_tokens``),
    each within the context; ``param`` names the field."""
    ids = []
    for i, text in enumerate(texts):
        name = param if len(texts) == 1 else f"{param}[{i}]"
        encoded = protocol.truncate(service.encode(text, name, add_special_tokens), truncate, service.max_model_len)
        if len(encoded) > service.max_model_len:
            raise ApiError(f"{name} has {len(encoded)} tokens; this model's context is {service.max_model_len}",
                           param=name, code="context_length_exceeded")
        ids.append(encoded)
    return ids


def _pooling_ids(service: Service, source: protocol.PoolingInput, truncate: int | None,
                 add_special_tokens: bool = True) -> list[tuple[int, ...]]:
    """The token ids a pooling request reads: each input's, or its conversation's as the chat template
    renders it."""
    if source.messages is None:
        return _embedding_inputs(service, source.inputs, "input", truncate, add_special_tokens)
    ids, _ = service.render_chat(source.messages, add_generation_prompt=source.add_generation_prompt,
                                 continue_final_message=source.continue_final_message,
                                 template_kwargs=source.template_kwargs)
    return _embedding_inputs(service, (ids,), "messages", truncate)


async def _embed(service: Service, ids: list[tuple[int, ...]], dimensions: int | None = None,
                 lora: str | None = None):
    """Unit embeddings [len(ids), D] (:func:`llm_jax.pooling.embed_texts`), beside the engine's steps;
    ``lora``: the LoRA adapter (of the engine's) they come from."""
    rows = None
    if lora is not None:  # the engine's stack of adapters, as it stands now (a classifier's server has none)
        slots = service.engine.engine.lora
        rows = LoraRows(weights=slots.weights, slots_B=np.full((len(ids),), slots.slot(lora), np.int32))
    async with service.side_lock:
        return await asyncio.to_thread(embed_texts, service.model, ids, pooling=service.config.embedding_pooling,
                                       dimensions=dimensions, lora=rows)


async def classify_route(service: Service, request: Request) -> Response:
    """vLLM's classification: each input's (or the conversation's) classes (:func:`llm_jax.pooling.classify`)."""
    rid, arrival = request_id(request, "classify"), time.monotonic()
    try:
        parsed = classification.parse_classify(await service.body(request), service.limits)
        service.check_model(parsed.model)
        ids = _pooling_ids(service, parsed.source, parsed.truncate_prompt_tokens, parsed.add_special_tokens)
    except ApiError as error:
        service.log_refusal(rid, error)
        raise
    async with service.side_lock:
        result = await asyncio.to_thread(classify, service.model, ids)
    tokens = sum(map(len, ids))
    service.metrics.prompt_tokens.inc(tokens)
    log.info("%s 200 prompt_tokens=%d inputs=%d total=%.3fs", rid, tokens, len(ids), time.monotonic() - arrival)
    return JSONResponse(classification.classify_response(rid, int(time.time()), service.name, result,
                                                         parsed.use_activation, tokens),
                        headers={"x-request-id": rid})


async def _pair_scores(service: Service, queries: list[tuple[int, ...]], documents: list[tuple[int, ...]],
                       lora: str | None, param: str) -> tuple[np.ndarray, int]:
    """Each (query, document) pair's score (one query: against every document) and the tokens read: the cosine
    similarity of their embeddings, or a cross-encoder's (a one-logit classifier: a reranker) probability
    for the pair's tokens, the query's then the document's, each encoded as alone (``transformers``' pair
    encoding for these tokenizers)."""
    classifier = service.model.config.classifier
    if classifier is None:
        vectors = await _embed(service, queries + documents, lora=lora)
        return (similarity.pair_scores(vectors[:len(queries)], vectors[len(queries):]),
                sum(map(len, queries + documents)))
    if classifier.num_labels != 1:
        raise ApiError(f"scores need a cross-encoder (a classifier with one logit); {service.name!r} has "
                       f"{classifier.num_labels} labels: use /classify", param="model", code="invalid_value")
    pairs = [q + d for q, d in zip(queries * len(documents) if len(queries) == 1 else queries, documents)]
    for i, ids in enumerate(pairs):
        if len(ids) > service.max_model_len:
            raise ApiError(f"pair {i} has {len(ids)} tokens; this model's context is {service.max_model_len}",
                           param=param, code="context_length_exceeded")
    async with service.side_lock:
        result = await asyncio.to_thread(classify, service.model, pairs)
    tokens = sum(map(len, pairs))
    service.metrics.prompt_tokens.inc(tokens)
    return result.probs[:, 0].astype(np.float64), tokens


async def score(service: Service, request: Request) -> Response:
    """vLLM's score: the cosine similarity of each pair of texts' embeddings (:mod:`llm_jax.server.similarity`)."""
    rid, arrival = request_id(request, "score"), time.monotonic()
    try:
        parsed = similarity.parse_score(await service.body(request))
        lora = service.check_model(parsed.model)
        queries = _embedding_inputs(service, parsed.queries, "text_1")
        documents = _embedding_inputs(service, parsed.documents, "text_2")
    except ApiError as error:
        service.log_refusal(rid, error)
        raise
    scores, tokens = await _pair_scores(service, queries, documents, lora, "text_2")
    log.info("%s 200 prompt_tokens=%d pairs=%d total=%.3fs", rid, tokens, len(scores), time.monotonic() - arrival)
    return JSONResponse(similarity.score_response(rid, int(time.time()), service.name, scores, tokens),
                        headers={"x-request-id": rid})


async def rerank(service: Service, request: Request) -> Response:
    """Jina's and Cohere's rerank: documents by the cosine similarity of their embedding to the query's."""
    rid, arrival = request_id(request, "rerank"), time.monotonic()
    try:
        parsed = similarity.parse_rerank(await service.body(request))
        lora = service.check_model(parsed.model)
        query = _embedding_inputs(service, (parsed.query,), "query")
        documents = _embedding_inputs(service, parsed.documents, "documents")
    except ApiError as error:
        service.log_refusal(rid, error)
        raise
    scores, tokens = await _pair_scores(service, query, documents, lora, "documents")
    log.info("%s 200 prompt_tokens=%d documents=%d total=%.3fs", rid, tokens, len(scores), time.monotonic() - arrival)
    return JSONResponse(similarity.rerank_response(rid, service.name, parsed, scores, tokens),
                        headers={"x-request-id": rid})


def _model_card(service: Service, name: str) -> dict:
    """The base model's card, or a LoRA adapter's (its folder as root, the base model as parent)."""
    card = {"id": name, "object": "model", "created": service.created, "owned_by": "llm_jax",
            "root": service.model.path, "parent": None, "max_model_len": service.max_model_len}
    if name in service.config.model_names:
        return card
    return {**card, "root": service.engine.engine.lora.adapter(name).path, "parent": service.name}


async def models(service: Service, request: Request) -> Response:
    names = [*service.config.model_names, *service.lora_names]
    return JSONResponse({"object": "list", "data": [_model_card(service, name) for name in names]})


async def model(service: Service, request: Request) -> Response:
    name = request.path_params["model"]
    service.check_model(name)
    return JSONResponse(_model_card(service, name))


async def load_lora_adapter(service: Service, request: Request) -> Response:
    """vLLM's runtime loading: ``{"lora_name", "lora_path"}`` (a PEFT folder on the server) into a free slot."""
    fields = Fields(await service.body(request))
    name, path = fields.required("lora_name", "string"), fields.required("lora_path", "string")
    fields.finish()
    if name in (*service.config.model_names, *service.lora_names):
        raise ApiError(f"lora_name {name!r} is taken: the server serves "
                       f"{[*service.config.model_names, *service.lora_names]}", param="lora_name", code="invalid_value")
    try:
        await service.engine.call(lambda engine: engine.add_lora(path, name))
    except ValueError as error:  # not an adapter of this model, or no free slot
        raise ApiError(str(error), param="lora_path", code="invalid_value") from None
    log.info("loaded LoRA adapter %r from %s", name, path)
    return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")


async def unload_lora_adapter(service: Service, request: Request) -> Response:
    """vLLM's runtime unloading: ``{"lora_name"}``; refused while requests run with it."""
    fields = Fields(await service.body(request))
    name = fields.required("lora_name", "string")
    fields.take("lora_int_id", "integer", default=None)  # vLLM's, unused: adapters are named
    fields.finish()
    if name not in service.lora_names:
        raise ApiError(f"The LoRA adapter `{name}` does not exist; loaded: {list(service.lora_names)}", status=404,
                       type="not_found_error", param="lora_name", code="model_not_found")
    try:
        await service.engine.call(lambda engine: engine.remove_lora(name))
    except ValueError as error:
        raise ApiError(str(error), param="lora_name", code="invalid_value") from None
    log.info("unloaded LoRA adapter %r", name)
    return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")


async def tokenize(service: Service, request: Request) -> Response:
    parsed = protocol.parse_tokenize(await service.body(request))
    service.check_model(parsed.model)
    if parsed.messages is not None:
        ids, _ = service.render_chat(parsed.messages, add_generation_prompt=parsed.add_generation_prompt,
                                     tools=parsed.tools.specs() if parsed.tools is not None else None)
    elif service.tokenizer is None:
        raise ApiError("the model has no tokenizer", param="prompt", code="no_tokenizer")
    else:
        try:
            ids = service.tokenizer.encode(parsed.prompt, add_bos=None if parsed.add_special_tokens else False)
        except Exception as error:
            raise ApiError(f"prompt could not be tokenized: {error}", param="prompt") from None
    token_strs = [service.tokenizer.id_to_piece(i) for i in ids] if parsed.return_token_strs else None
    return JSONResponse({"count": len(ids), "max_model_len": service.max_model_len, "tokens": list(ids),
                         "token_strs": token_strs})


async def detokenize(service: Service, request: Request) -> Response:
    parsed = protocol.parse_detokenize(await service.body(request), service.limits)
    service.check_model(parsed.model)
    if service.tokenizer is None:
        raise ApiError("the model has no tokenizer", param="tokens", code="no_tokenizer")
    return JSONResponse({"prompt": service.tokenizer.decode(list(parsed.tokens))})


async def health(service: Service, request: Request) -> Response:
    return Response(status_code=200 if service.healthy else 503)


async def version(service: Service, request: Request) -> Response:
    return JSONResponse({"version": _version()})


async def metrics(service: Service, request: Request) -> Response:
    return Response(service.metrics.render(), media_type=CONTENT_TYPE)


def _not_served(what: str, served: str) -> Handler:
    """A route the served model has no use for: a 404 saying what it is and what it serves."""
    async def handler(service: Service, request: Request) -> Response:
        raise ApiError(f"{request.url.path}: the model {service.name!r} is {what}; this server answers {served}",
                       status=404, type="not_found_error", code="not_found")
    return handler


GENERATING = (  # a language model's routes
    ("/v1/completions", "POST", completions),
    ("/v1/chat/completions", "POST", chat_completions),
    ("/v1/responses", "POST", responses),
)
CLASSIFYING = (  # a sequence classifier's
    ("/classify", "POST", classify_route),
    ("/v1/classify", "POST", classify_route),
)
ROUTES: tuple[tuple[str, str, Handler], ...] = (  # every server's
    ("/v1/embeddings", "POST", embeddings),
    ("/v1/score", "POST", score),
    ("/score", "POST", score),
    ("/v1/rerank", "POST", rerank),
    ("/rerank", "POST", rerank),
    ("/v2/rerank", "POST", rerank),
    ("/v1/models", "GET", models),
    ("/v1/models/{model:path}", "GET", model),
    ("/tokenize", "POST", tokenize),
    ("/detokenize", "POST", detokenize),
    ("/health", "GET", health),
    ("/version", "GET", version),
    ("/metrics", "GET", metrics),
)
LORA_ROUTES: tuple[tuple[str, str, Handler], ...] = (  # with --allow-runtime-lora-updating
    ("/v1/load_lora_adapter", "POST", load_lora_adapter),
    ("/v1/unload_lora_adapter", "POST", unload_lora_adapter),
)


def _endpoint(service: Service, handler: Handler) -> Callable[[Request], Awaitable[Response]]:
    async def endpoint(request: Request) -> Response:
        try:
            service.authorize(request)
            return await handler(service, request)
        except ApiError as error:
            return error_response(error)
        except ClientDisconnect:  # gone while sending its body: nobody to answer
            return Response(status_code=CLIENT_CLOSED)

    return endpoint


async def _http_error(request: Request, error: HTTPException) -> Response:
    """Starlette's own refusals (no such route, a method the route does not take), in the API's format."""
    not_found = error.status_code == 404
    return error_response(ApiError(f"{request.method} {request.url.path}: {error.detail}", status=error.status_code,
                                   type="not_found_error" if not_found else "invalid_request_error",
                                   code="not_found" if not_found else None, headers=error.headers))


async def _internal_error(request: Request, error: Exception) -> Response:
    """A bug: the client hears it was the server's fault; the traceback goes to the log."""
    log.error("%s %s failed", request.method, request.url.path, exc_info=error)
    return error_response(ApiError(f"internal server error: {type(error).__name__}", status=500,
                                   type="internal_error"))


def build_app(engine: AsyncEngine | None, config: ServerConfig, model: Model | None = None) -> Starlette:
    """The server's ASGI app over ``engine`` (compiled already), or over a sequence classifier ``model`` without
    one; ``app.state.service`` holds its state."""
    service = Service(engine, config, model)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette):
        yield
        await service.shutdown()

    # Browsers may call the API from the origins allowed (preflight requests are answered before the key check).
    cors = [Middleware(CORSMiddleware, allow_origins=list(config.allowed_origins), allow_methods=["GET", "POST"],
                       allow_headers=["*"], expose_headers=["x-request-id", "retry-after"])]
    cors = cors if config.allowed_origins else []
    if engine is None:
        absent = _not_served("a sequence classifier, which does not generate", "/classify, /score, /rerank and "
                             "/v1/embeddings")
        routes = ROUTES + CLASSIFYING + tuple((path, method, absent) for path, method, _ in GENERATING)
    else:
        absent = _not_served("a language model, not a sequence classifier", "completions, chat, responses, "
                             "embeddings, score and rerank")
        routes = ROUTES + GENERATING + tuple((path, method, absent) for path, method, _ in CLASSIFYING)
        routes += LORA_ROUTES if config.allow_runtime_lora_updating else ()
    app = Starlette(routes=[Route(path, _endpoint(service, handler), methods=[method])
                            for path, method, handler in routes], middleware=cors,
                    exception_handlers={HTTPException: _http_error, Exception: _internal_error}, lifespan=lifespan)
    app.state.service = service
    return app
