"""Log-probabilities of chosen tokens and their top alternatives, from logits or hidden states.

``token_logprobs`` reads log-softmax values a chunk of positions at a time, so the [B, T, V] logits of a
long sequence never exist at once (and, under ``jax.grad``, are recomputed per chunk rather than stored).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from llm_jax.config import ModelConfig
from llm_jax.backends import Backend
from llm_jax.model import Params, unembed

CHUNK = 128  # positions unembedded at once


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TokenLogprobs:
    """Per position: the log-probability of the chosen token and of the ``top_n`` most likely ones, and the
    chosen token's rank (1 + the tokens more likely than it)."""

    logprobs_BT: jax.Array  # float32
    top_ids_BTN: jax.Array | None = None  # int32
    top_logprobs_BTN: jax.Array | None = None  # float32
    ranks_BT: jax.Array | None = None  # int32


def token_logprobs(params: Params, config: ModelConfig, x_BTD: jax.Array, targets_BT: jax.Array, *,
                   top_n: int = 0, backend: Backend | None = None) -> TokenLogprobs:
    """Log-probabilities of ``targets_BT`` under the logits of the final residual stream ``x_BTD``.

    Targets outside the vocabulary (padding) read token 0's value; mask them afterwards.
    """
    B, T, D = x_BTD.shape
    chunk = min(CHUNK, T)
    chunks = -(-T // chunk)
    pad = chunks * chunk - T
    x_CBcD = jnp.pad(x_BTD, ((0, 0), (0, pad), (0, 0))).reshape(B, chunks, chunk, D).swapaxes(0, 1)
    targets_CBc = jnp.pad(targets_BT, ((0, 0), (0, pad))).reshape(B, chunks, chunk).swapaxes(0, 1)
    targets_CBc = jnp.clip(targets_CBc, 0, config.vocab_size - 1)

    @jax.checkpoint
    def one_chunk(inputs):
        x_BcD, targets_Bc = inputs
        logp_BcV = jax.nn.log_softmax(unembed(params, config, x_BcD, backend), axis=-1)
        chosen_Bc = jnp.take_along_axis(logp_BcV, targets_Bc[..., None], axis=-1)[..., 0]
        rank_Bc = 1 + jnp.sum(logp_BcV > chosen_Bc[..., None], axis=-1, dtype=jnp.int32)
        if not top_n:
            return chosen_Bc, None, None, rank_Bc
        top_logprobs_BcN, top_ids_BcN = jax.lax.top_k(logp_BcV, top_n)
        return chosen_Bc, top_ids_BcN.astype(jnp.int32), top_logprobs_BcN, rank_Bc

    out = jax.lax.map(one_chunk, (x_CBcD, targets_CBc))

    def unchunk(a):
        return None if a is None else a.swapaxes(0, 1).reshape(B, chunks * chunk, *a.shape[3:])[:, :T]

    return TokenLogprobs(*(unchunk(a) for a in out))


def chosen_and_top(scores_BV: jax.Array, chosen_B: jax.Array, top_n: int):
    """Under softmax(``scores_BV``): the log-probability of ``chosen_B`` [B], and the ``top_n`` most likely
    tokens' ids and log-probabilities [B, top_n] (None when ``top_n`` is 0)."""
    logp_BV = jax.nn.log_softmax(scores_BV.astype(jnp.float32), axis=-1)
    chosen_B = jnp.take_along_axis(logp_BV, jnp.clip(chosen_B, 0, scores_BV.shape[-1] - 1)[:, None], axis=-1)[:, 0]
    if not top_n:
        return chosen_B, None, None
    top_logprobs_BN, top_ids_BN = jax.lax.top_k(logp_BV, top_n)
    return chosen_B, top_ids_BN.astype(jnp.int32), top_logprobs_BN
