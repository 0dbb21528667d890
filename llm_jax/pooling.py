"""Pooling models: embeddings and sequence classifiers, one output per text from its final hidden states.

The hidden states are the decoder's output after its final norm — what the LM head reads, and what
``transformers``' base model (``AutoModel``) returns as ``last_hidden_state``. ``pooling="last"`` takes
the last token's (decoder-only embedding models: Qwen3-Embedding, e5-mistral, gte-Qwen2), ``"mean"``
the mean over the text's tokens; ``normalize`` scales each vector to unit length, and ``dimensions``
keeps the first dimensions (Matryoshka-trained models), normalized after.

A sequence classifier (``*ForSequenceClassification``: reward models, classifiers; ``config.classifier``)
reads the last token's hidden state with its ``score`` head: :func:`classify` gives each text's logits,
probabilities (:func:`class_probabilities`) and most likely label.

``pooled_hidden`` and ``classifier_logits`` are the jitted cores; ``embed_texts`` and ``classify`` the
batched host entry points (texts sorted by length into batches of ``batch_size``, each padded to a
power-of-two length bucket, so a server compiles one program per bucket).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from llm_jax import buckets
from llm_jax.backends import Backend
from llm_jax.config import Classifier, ModelConfig, Problem
from llm_jax.loading import Model, lora_rows
from llm_jax.lora import LoraRows
from llm_jax.model import Params, final_norm, forward_hidden, resolve_backend
from llm_jax.prefilling import pad_prompts
from llm_jax.scoring import ids_of

POOLINGS = ("last", "mean")
BATCH_SIZE = 16


@functools.partial(jax.jit, static_argnames=("config", "pooling", "backend"))
def pooled_hidden(params: Params, config: ModelConfig, tokens_BT: jax.Array, lengths_B: jax.Array, *,
                  pooling: str = "last", backend: Backend | str | None = None,
                  lora: LoraRows | None = None) -> jax.Array:
    """Each sequence's final hidden state (after the final norm) pooled over its ``lengths_B`` tokens:
    [B, D] float32. ``lora``: each row's LoRA adapter."""
    backend = resolve_backend(backend)
    adapters = None if lora is None else lora.batch(tokens_BT.shape[1])
    x_BTD = final_norm(params, config, forward_hidden(params, config, tokens_BT, lengths_B, backend=backend,
                                                      lora=adapters))
    x_BTD = x_BTD.astype(jnp.float32)
    if pooling == "last":
        return x_BTD[jnp.arange(x_BTD.shape[0]), lengths_B - 1]
    real_BT = jnp.arange(x_BTD.shape[1])[None, :] < lengths_B[:, None]
    return jnp.where(real_BT[..., None], x_BTD, 0.0).sum(1) / lengths_B[:, None].astype(jnp.float32)


def embed_texts(model: Model, texts: Sequence[str | Sequence[int]], *, pooling: str = "last",
                normalize: bool = True, dimensions: int | None = None, batch_size: int = BATCH_SIZE,
                lora=None) -> np.ndarray:
    """One embedding per text (a string, tokenized with BOS as ``generate`` does, or token ids as given):
    [len(texts), dimensions or D] float32. ``lora``: a LoRA adapter (a ``LoraAdapter`` or PEFT folder) for
    every text, one (or None) per text, or a ``LoraRows`` naming each text's slot."""
    if pooling not in POOLINGS:
        raise ValueError(f"pooling must be one of {POOLINGS}, got {pooling!r}")
    D = model.config.d_model
    if dimensions is not None and not 1 <= dimensions <= D:
        raise ValueError(f"dimensions must be in [1, {D}], got {dimensions}")
    out = _batched(model, texts, functools.partial(pooled_hidden, pooling=pooling), D, batch_size, lora)
    if dimensions is not None:
        out = out[:, :dimensions]
    if normalize or dimensions is not None:
        out /= np.maximum(np.linalg.norm(out, axis=1, keepdims=True), np.finfo(np.float32).tiny)
    return out


@functools.partial(jax.jit, static_argnames=("config", "backend"))
def classifier_logits(params: Params, config: ModelConfig, tokens_BT: jax.Array, lengths_B: jax.Array, *,
                      backend: Backend | str | None = None, lora: LoraRows | None = None) -> jax.Array:
    """A sequence classifier's logits [B, C] float32: its ``score`` head on each sequence's last token's
    final hidden state (``transformers``' ``*ForSequenceClassification``)."""
    if config.classifier is None:
        raise ValueError("the model has no classifier head (config.classifier is None)")
    x_BD = pooled_hidden(params, config, tokens_BT, lengths_B, pooling="last", backend=backend, lora=lora)
    return jnp.einsum("BD,DC->BC", x_BD, params["score"].astype(jnp.float32))


@dataclasses.dataclass(frozen=True)
class Classification:
    """A sequence classifier's outputs for each text: ``logits`` [n, C] float32; ``probs`` [n, C], the logits
    through the head's activation (:func:`class_probabilities`); ``labels``, each text's most likely label."""

    logits: np.ndarray
    probs: np.ndarray
    labels: tuple[str, ...]


def class_probabilities(logits: np.ndarray, classifier: Classifier) -> np.ndarray:
    """Logits [..., C] as the head's problem reads them (vLLM's ``/classify``): a softmax over the classes of
    a single-label classifier (a sigmoid when it has one logit), a sigmoid per label of a multi-label one,
    the logits themselves for a regression."""
    logits = np.asarray(logits, np.float64)
    if classifier.problem is Problem.REGRESSION:
        probs = logits
    elif classifier.problem is Problem.MULTI_LABEL or classifier.num_labels == 1:
        probs = 1.0 / (1.0 + np.exp(-logits))
    else:
        shifted = np.exp(logits - logits.max(-1, keepdims=True))
        probs = shifted / shifted.sum(-1, keepdims=True)
    return probs.astype(np.float32)


def classify(model: Model, texts: Sequence[str | Sequence[int]], *, batch_size: int = BATCH_SIZE,
             lora=None) -> Classification:
    """A sequence classifier's outputs (reward models, classifiers: ``*ForSequenceClassification``) for each
    text (a string, tokenized with BOS as ``generate`` does, or token ids as given). ``lora`` as
    :func:`embed_texts`."""
    classifier = model.config.classifier
    if classifier is None:
        raise ValueError(f"{model.path or 'the model'} is a language model, not a sequence classifier: it has no "
                         "classifier head (a *ForSequenceClassification checkpoint has one)")
    logits = _batched(model, texts, classifier_logits, classifier.num_labels, batch_size, lora)
    return Classification(logits=logits, probs=class_probabilities(logits, classifier),
                          labels=tuple(classifier.labels[i] for i in np.argmax(logits, axis=-1)))


def _batched(model: Model, texts: Sequence[str | Sequence[int]], fn, width: int, batch_size: int,
             lora) -> np.ndarray:
    """``fn(weights, config, tokens_BT, lengths_B, backend=, lora=)`` → [B, width] over ``texts`` sorted by
    length into padded batches of ``batch_size``: [len(texts), width] float32 in the texts' order."""
    ids = [ids_of(model, text, add_bos=True, what="text") for text in texts]
    for i, seq in enumerate(ids):
        if not seq:
            raise ValueError(f"text {i} has no tokens")
        if len(seq) > model.config.max_seq_len:
            raise ValueError(f"text {i}: {len(seq)} tokens exceed the model's context of {model.config.max_seq_len}")
    rows_lora = _text_adapters(model, lora, len(ids))
    out = np.zeros((len(ids), width), np.float32)
    order = sorted(range(len(ids)), key=lambda i: len(ids[i]))
    for start in range(0, len(order), batch_size):
        rows = order[start:start + batch_size]
        batch = [ids[i] for i in rows] + [[0]] * (batch_size - len(rows))  # a fixed batch: one program per bucket
        block = buckets.prompt_bucket(max(map(len, batch)), context=model.config.max_seq_len)
        tokens_BT, lengths_B = pad_prompts(batch, block)
        batch_lora = None
        if rows_lora is not None:  # the batch's rows' slots, padding rows on the base model
            slots = np.full((batch_size,), -1, np.int32)
            slots[:len(rows)] = np.asarray(rows_lora.slots_B)[rows]
            batch_lora = dataclasses.replace(rows_lora, slots_B=slots)
        values = jax.device_get(fn(model.weights, model.config, tokens_BT, lengths_B, backend=model.backend,
                                   lora=batch_lora))
        out[rows] = values[:len(rows)]
    return out


def _text_adapters(model: Model, lora, count: int) -> LoraRows | None:
    """Each text's adapter as ``LoraRows`` (None: none at all)."""
    if lora is None or isinstance(lora, LoraRows):
        if lora is not None and np.asarray(lora.slots_B).shape != (count,):
            raise ValueError(f"lora names {np.asarray(lora.slots_B).shape} slots for {count} texts")
        return lora
    adapters = list(lora) if isinstance(lora, (list, tuple)) else [lora] * count
    if len(adapters) != count:
        raise ValueError(f"lora has {len(adapters)} entries for {count} texts")
    return None if all(a is None for a in adapters) else lora_rows(model, adapters)
