"""Scoring: the log-likelihood of given continuations under the model, for evaluation and gradients.

``continuation_logprobs`` is the jitted, differentiable core (``jax.grad`` through it works for params
and steering vectors); ``score`` the batched host entry point.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from llm_jax import buckets
from llm_jax.config import ModelConfig
from llm_jax.loading import Model
from llm_jax.logprobs import token_logprobs
from llm_jax.backends import Backend
from llm_jax.model import LayerHooks, Params, forward_hidden, resolve_backend
from llm_jax.prefilling import pad_prompts

@functools.partial(jax.jit, static_argnames=("config", "backend"))
def continuation_logprobs(params: Params, config: ModelConfig, tokens_BT: jax.Array, lengths_B: jax.Array,
                          starts_B: jax.Array, hooks: LayerHooks | None = None, *,
                          backend: Backend | str | None = None) -> tuple[jax.Array, jax.Array]:
    """log p(``tokens_BT[b, t]`` | ``tokens_BT[b, :t]``) at continuation positions ``starts_B[b] <= t <
    lengths_B[b]`` (0 elsewhere), and whether each such token was the model's argmax (True elsewhere).

    Differentiable in ``params`` and ``hooks`` (steering vectors): ``jax.grad`` of the summed output is
    the gradient of the continuations' log-likelihood. ``starts_B`` must be >= 1.
    """
    backend = resolve_backend(backend)
    x_BTD = forward_hidden(params, config, tokens_BT, lengths_B, hooks=hooks, backend=backend)
    if hooks is not None:
        x_BTD = x_BTD[0]
    B, T = tokens_BT.shape
    # Position t predicts token t + 1; shift so that entry t scores token t.
    next_BT = jnp.concatenate([tokens_BT[:, 1:], jnp.zeros((B, 1), tokens_BT.dtype)], axis=1)
    predicted = token_logprobs(params, config, x_BTD, next_BT, top_n=1, backend=backend)
    logprobs_BT = jnp.pad(predicted.logprobs_BT[:, :-1], ((0, 0), (1, 0)))
    greedy_BT = jnp.pad(predicted.top_ids_BTN[:, :-1, 0] == tokens_BT[:, 1:], ((0, 0), (1, 0)))
    t_T = jnp.arange(T)
    scored_BT = (t_T >= jnp.maximum(starts_B, 1)[:, None]) & (t_T < lengths_B[:, None])
    return jnp.where(scored_BT, logprobs_BT, 0.0), jnp.where(scored_BT, greedy_BT, True)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Score:
    """A continuation's log-likelihood given its prompt (natural log)."""

    logprob: float  # the sum over the continuation's tokens
    token_logprobs: list[float]
    is_greedy: bool  # every continuation token was the model's most likely next token
    continuation_ids: list[int]


def ids_of(model: Model, text: str | Sequence[int], *, add_bos: bool, what: str) -> list[int]:
    """A text's token ids (BOS per the tokenizer's files with ``add_bos``), or a token-id list checked."""
    if isinstance(text, str):
        if model.tokenizer is None:
            raise ValueError(f"{model.path} has no tokenizer; pass the {what} as token-id lists")
        ids = model.tokenizer.encode(text, add_bos=None if add_bos else False)
    else:
        ids = [int(t) for t in text]
    bad = [t for t in ids if not 0 <= t < model.config.vocab_size]
    if bad:
        raise ValueError(f"{what} token ids {bad[:5]} are outside the vocabulary [0, {model.config.vocab_size})")
    return ids


def score(model: Model, prompts: Sequence[str | Sequence[int]],
          continuations: Sequence[str | Sequence[int]]) -> list[Score]:
    """The log-likelihood of each continuation after its prompt, in one batched forward pass.

    Strings are tokenized: a prompt as ``generate`` does (BOS per the tokenizer's files), a continuation
    on its own without BOS. Token-id lists are used exactly as given.
    """
    if len(prompts) != len(continuations):
        raise ValueError(f"{len(prompts)} prompts but {len(continuations)} continuations")
    prompt_ids = [ids_of(model, p, add_bos=True, what="prompt") for p in prompts]
    cont_ids = [ids_of(model, c, add_bos=False, what="continuation") for c in continuations]
    for i, (p, c) in enumerate(zip(prompt_ids, cont_ids)):
        if not p or not c:
            raise ValueError(f"pair {i}: prompt and continuation need at least one token each")
        if len(p) + len(c) > model.config.max_seq_len:
            raise ValueError(f"pair {i}: {len(p) + len(c)} tokens exceed the model's context of "
                             f"{model.config.max_seq_len}")
    sequences = [p + c for p, c in zip(prompt_ids, cont_ids)]
    block = buckets.prompt_bucket(max(map(len, sequences)), context=model.config.max_seq_len)
    tokens_BT, lengths_B = pad_prompts(sequences, block)
    starts_B = np.array([len(p) for p in prompt_ids], np.int32)
    logprobs_BT, greedy_BT = jax.device_get(
        continuation_logprobs(model.weights, model.config, tokens_BT, lengths_B, starts_B, backend=model.backend))
    return [Score(logprob=float(logprobs_BT[b, s:n].sum()), token_logprobs=logprobs_BT[b, s:n].tolist(),
                  is_greedy=bool(greedy_BT[b].all()), continuation_ids=c)
            for b, (s, n, c) in enumerate(zip(starts_B, lengths_B, cont_ids))]
