"""Next-token cross-entropy over right-padded rows."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from llm_jax.config import ModelConfig
from llm_jax.model import Params, forward


def target_mask(lengths_B: jax.Array, num_targets: int) -> jax.Array:
    """[B, T-1] True where position t predicts a real token: t + 1 < length."""
    return jnp.arange(num_targets)[None, :] + 1 < lengths_B[:, None]


def token_losses(params: Params, config: ModelConfig, tokens_BT: jax.Array,
                 lengths_B: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Per-position cross-entropy of predicting ``tokens_BT[:, t + 1]`` from ``tokens_BT[:, :t + 1]``.

    Returns ``(losses_BT, mask_BT)`` over the T-1 predicting positions; losses at masked (padding)
    positions are zero.
    """
    logits_BTV = forward(params, config, tokens_BT[:, :-1], lengths_B)
    mask_BT = target_mask(lengths_B, tokens_BT.shape[1] - 1)
    losses_BT = optax.softmax_cross_entropy_with_integer_labels(logits_BTV, tokens_BT[:, 1:])
    return jnp.where(mask_BT, losses_BT, 0.0), mask_BT


def mean_loss(params: Params, config: ModelConfig, tokens_BT: jax.Array, lengths_B: jax.Array) -> jax.Array:
    """Mean next-token cross-entropy (nats) over the real target tokens of the batch."""
    losses_BT, mask_BT = token_losses(params, config, tokens_BT, lengths_B)
    return losses_BT.sum() / jnp.maximum(mask_BT.sum(), 1)
