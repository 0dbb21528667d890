"""vLLM's ``/classify`` (and ``/v1/classify``) for a served sequence classifier (``*ForSequenceClassification``:
reward models, classifiers; :func:`llm_jax.pooling.classify`).

In: ``input`` (as completions' ``prompt``: a string, strings, token ids or lists of them) or ``messages``
(a conversation the chat template renders, as a reward model reads one: ``add_generation_prompt`` default
false, ``continue_final_message``, ``chat_template_kwargs``); ``truncate_prompt_tokens``,
``add_special_tokens`` (default true), ``use_activation`` (default true: the probabilities the head's
problem type gives; false: its raw logits, a reward model's scores).

Out: ``{id, object: "list", created, model, data: [{index, label, probs, num_classes}], usage}``, ``label``
the most likely class's name.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from llm_jax.pooling import Classification
from llm_jax.server.fields import ApiError, Fields
from llm_jax.server.protocol import Limits, PoolingInput, pooling_input, truncation


@dataclasses.dataclass(frozen=True, kw_only=True)
class ClassifyRequest:
    model: str | None
    source: PoolingInput  # texts or token ids, or a conversation
    truncate_prompt_tokens: int | None = None
    add_special_tokens: bool = True
    use_activation: bool = True


def parse_classify(body: Any, limits: Limits) -> ClassifyRequest:
    fields = Fields(body)
    model = fields.take("model", "string")
    source = pooling_input(fields, limits)
    truncate = truncation(fields)
    add_special = fields.take("add_special_tokens", "boolean", default=True)
    activation = fields.take("use_activation", "boolean")
    legacy = fields.take("activation", "boolean")  # vLLM's earlier name
    if activation is not None and legacy is not None and activation != legacy:
        raise ApiError("use_activation and activation disagree: give one", param="activation", code="invalid_value")
    fields.take("user", "string")
    fields.take("priority", "integer")  # vLLM's; classifications run one batch at a time, in arrival order
    fields.finish()
    return ClassifyRequest(model=model, source=source, truncate_prompt_tokens=truncate, add_special_tokens=add_special,
                           use_activation=next((v for v in (activation, legacy) if v is not None), True))


def classify_response(request_id: str, created: int, model: str, result: Classification, use_activation: bool,
                      tokens: int) -> dict[str, Any]:
    values = result.probs if use_activation else result.logits
    return {"id": request_id, "object": "list", "created": created, "model": model,
            "data": [{"index": i, "label": label, "probs": [_finite(v) for v in row], "num_classes": len(row)}
                     for i, (label, row) in enumerate(zip(result.labels, values.tolist()))],
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0,
                      "prompt_tokens_details": None}}


def _finite(value: float) -> float:
    return value if math.isfinite(value) else 0.0
