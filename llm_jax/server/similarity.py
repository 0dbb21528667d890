"""vLLM's similarity endpoints on the served model's embeddings (``/v1/embeddings``' vectors):

- ``POST /v1/score`` (and ``/score``): ``text_1`` and ``text_2``, each a string or a list of strings: one
  against many (``text_1`` a string), or pair by pair (two lists of one length). Each pair's score is the
  cosine similarity of the two texts' embeddings: ``data: [{index, object: "score", score}]``.
- ``POST /v1/rerank`` (and ``/rerank``, ``/v2/rerank``; Jina's and Cohere's API): ``query``, ``documents``
  (strings), ``top_n`` (default: all), ``return_documents`` (default true): ``results: [{index,
  relevance_score, document: {text}}]``, most similar first.

The embeddings are those the server's ``--embedding-pooling`` gives, normalized, so a score is a dot
product in [-1, 1]; a decoder embedding model (Qwen3-Embedding, e5-mistral) is what makes them useful. A
served cross-encoder (a sequence classifier with one logit: a reranker, or a language model made one with
``--classifier-from-token``) scores each pair instead: the sigmoid of its logit for the two texts' tokens
one after the other, as vLLM scores with such models.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np

from llm_jax.server.fields import ApiError, Fields, check, check_kind, integer

MAX_TEXTS = 1024  # texts one request may score


@dataclasses.dataclass(frozen=True, kw_only=True)
class ScoreRequest:
    model: str | None
    queries: tuple[str, ...]  # one per pair, or one for all
    documents: tuple[str, ...]


@dataclasses.dataclass(frozen=True, kw_only=True)
class RerankRequest:
    model: str | None
    query: str
    documents: tuple[str, ...]
    top_n: int
    return_documents: bool


def _texts(value: Any, param: str) -> tuple[str, ...]:
    check_kind(value, param, "string", "array")
    texts = (value,) if isinstance(value, str) else value
    check(0 < len(texts) <= MAX_TEXTS, param, f"must hold 1 to {MAX_TEXTS} texts, got {len(texts)}")
    for i, text in enumerate(texts):
        check_kind(text, f"{param}[{i}]", "string")
        check(text != "", f"{param}[{i}]" if len(texts) > 1 or not isinstance(value, str) else param,
              "must not be empty")
    return tuple(texts)


def parse_score(body: Any) -> ScoreRequest:
    fields = Fields(body)
    model = fields.take("model", "string")
    first, second = fields.required("text_1", "string", "array"), fields.required("text_2", "string", "array")
    queries, documents = _texts(first, "text_1"), _texts(second, "text_2")
    if not isinstance(first, str) and len(queries) != len(documents):
        raise ApiError(f"text_1 holds {len(queries)} texts and text_2 {len(documents)}: give one text_1 for all, or "
                       "lists of one length", param="text_2", code="invalid_value")
    fields.take("encoding_format", "string")  # vLLM's, without effect on scores
    fields.finish()
    return ScoreRequest(model=model, queries=queries, documents=documents)


def parse_rerank(body: Any) -> RerankRequest:
    fields = Fields(body)
    model = fields.take("model", "string")
    query = fields.required("query", "string")
    check(query != "", "query", "must not be empty")
    documents = _texts(fields.required("documents", "array"), "documents")
    top_n = integer(fields, "top_n", 0, 2**31 - 1, default=0)  # 0: all (vLLM's default)
    return_documents = fields.take("return_documents", "boolean", default=True)
    fields.finish()
    return RerankRequest(model=model, query=query, documents=documents, top_n=top_n or len(documents),
                         return_documents=return_documents)


def pair_scores(query_vectors: np.ndarray, document_vectors: np.ndarray) -> np.ndarray:
    """Cosine similarities of unit vectors: row i of one against row i of the other (a single query row
    against every document)."""
    return np.sum(query_vectors * document_vectors, axis=-1).astype(np.float64)


def score_response(request_id: str, created: int, model: str, scores: np.ndarray, tokens: int) -> dict[str, Any]:
    return {"id": request_id, "object": "list", "created": created, "model": model,
            "data": [{"index": i, "object": "score", "score": _finite(s)} for i, s in enumerate(scores)],
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}


def rerank_response(request_id: str, model: str, request: RerankRequest, scores: np.ndarray,
                    tokens: int) -> dict[str, Any]:
    order = sorted(range(len(scores)), key=lambda i: -scores[i])[:request.top_n]
    results = []
    for i in order:
        result = {"index": i, "relevance_score": _finite(scores[i])}
        if request.return_documents:
            result["document"] = {"text": request.documents[i]}
        results.append(result)
    return {"id": request_id, "model": model, "usage": {"total_tokens": tokens}, "results": results}


def _finite(score: float) -> float:
    return float(score) if math.isfinite(score) else 0.0
