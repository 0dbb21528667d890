"""Shared by the layout tests (fused, panels): two params pytrees of one config compute the same model."""

import jax
import jax.numpy as jnp
import numpy as np

from llm_jax.config import ModelConfig
from llm_jax.kv_cache import init_cache
from llm_jax.model import forward, forward_extend, forward_prefill, unembed


def assert_same_model(ours, theirs, config: ModelConfig, atol: float = 1e-5) -> None:
    """Full-forward logits, then a prefill of 13 tokens and 6 greedy one-token steps (the products'
    one-row form): the same greedy tokens, and logits within ``atol``."""
    tokens_BT = jnp.asarray(np.random.default_rng(1).integers(0, config.vocab_size, (2, 13)), jnp.int32)
    f = jax.jit(forward, static_argnums=1)
    np.testing.assert_allclose(np.asarray(f(ours, config, tokens_BT)), np.asarray(f(theirs, config, tokens_BT)),
                               atol=atol, rtol=0)

    @jax.jit
    def greedy(p):
        cache = init_cache(config, 2, 32)
        x_BTD, cache = forward_prefill(p, config, tokens_BT, jnp.full((2,), 13, jnp.int32), cache)
        logits_BV = unembed(p, config, x_BTD[:, -1:])[:, 0]
        out = []
        for _ in range(6):
            token_B = jnp.argmax(logits_BV, axis=-1).astype(jnp.int32)
            x_BTD, cache = forward_extend(p, config, token_B[:, None], cache, jnp.ones((2,), bool))
            logits_BV = unembed(p, config, x_BTD)[:, 0]
            out.append((token_B, logits_BV))
        return out

    for (a_tokens, a_logits), (b_tokens, b_logits) in zip(greedy(ours), greedy(theirs)):
        np.testing.assert_array_equal(np.asarray(a_tokens), np.asarray(b_tokens))
        np.testing.assert_allclose(np.asarray(a_logits), np.asarray(b_logits), atol=atol, rtol=0)
