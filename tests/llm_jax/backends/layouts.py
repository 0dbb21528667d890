"""Shared by the backend tests: one model computed two ways (backends, weight forms) gives the same output."""

import jax
import jax.numpy as jnp
import numpy as np

from llm_jax.config import ModelConfig
from llm_jax.kv_cache import init_cache
from llm_jax.model import forward, forward_extend, forward_prefill, init_params, unembed


def random_params(config: ModelConfig, seed: int = 0, scale: float = 0.3):
    """init_params with every leaf drawn (its norms and biases are constants that could hide a mix-up)."""
    rng = np.random.default_rng(seed)
    return jax.tree.map(lambda x: jnp.asarray(rng.normal(0.0, scale, x.shape), x.dtype), init_params(config))


def assert_same_model(ours, theirs, config: ModelConfig, atol: float = 1e-5) -> None:
    """``ours`` and ``theirs``, each (weights, backend): full-forward logits, then a prefill of 13 tokens and 6
    greedy one-token steps (the products' one-row form): the same greedy tokens, and logits within ``atol``."""
    tokens_BT = jnp.asarray(np.random.default_rng(1).integers(0, config.vocab_size, (2, 13)), jnp.int32)
    f = jax.jit(forward, static_argnums=1, static_argnames="backend")
    np.testing.assert_allclose(np.asarray(f(ours[0], config, tokens_BT, backend=ours[1])),
                               np.asarray(f(theirs[0], config, tokens_BT, backend=theirs[1])), atol=atol, rtol=0)

    def greedy(p, backend):
        @jax.jit
        def run(p):
            cache = init_cache(config, 2, 32)
            x_BTD, cache = forward_prefill(p, config, tokens_BT, jnp.full((2,), 13, jnp.int32), cache, backend=backend)
            logits_BV = unembed(p, config, x_BTD[:, -1:], backend)[:, 0]
            out = []
            for _ in range(6):
                token_B = jnp.argmax(logits_BV, axis=-1).astype(jnp.int32)
                x_BTD, cache = forward_extend(p, config, token_B[:, None], cache, jnp.ones((2,), bool), backend=backend)
                logits_BV = unembed(p, config, x_BTD, backend)[:, 0]
                out.append((token_B, logits_BV))
            return out
        return run(p)

    for (a_tokens, a_logits), (b_tokens, b_logits) in zip(greedy(*ours), greedy(*theirs)):
        np.testing.assert_array_equal(np.asarray(a_tokens), np.asarray(b_tokens))
        np.testing.assert_allclose(np.asarray(a_logits), np.asarray(b_logits), atol=atol, rtol=0)
