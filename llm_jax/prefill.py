"""Prefill: run a batch of prompts through the model, fill the KV cache, return last-token logits.

Prompts are **right-padded**: row b holds its ``lengths_B[b]`` tokens at slots [0, length) and padding
after. Keys past a row's length are masked, so padding never influences real tokens, and decode later
overwrites the padded slots. (Right padding keeps slot = position, so RoPE positions need no offset.)
"""

from __future__ import annotations

import functools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from llm_jax.compilation import COMPILER_OPTIONS
from llm_jax.config import ModelConfig
from llm_jax.kv_cache import KVCache
from llm_jax.model import Params, forward_prefill, unembed


@functools.partial(jax.jit, static_argnames=("config",), donate_argnames=("cache",), compiler_options=COMPILER_OPTIONS)
def prefill(params: Params, config: ModelConfig, tokens_BT: jax.Array, lengths_B: jax.Array,
            cache: KVCache) -> tuple[jax.Array, KVCache]:
    """Logits [B, V] (float32) of each row's last real token, and the cache holding the prompts.

    ``cache`` must be empty (fresh from ``init_cache``) with at least T slots; it is donated.
    """
    x_BTD, cache = forward_prefill(params, config, tokens_BT, lengths_B, cache)
    last_B1D = jnp.take_along_axis(x_BTD, (lengths_B - 1)[:, None, None], axis=1)
    return unembed(params, config, last_B1D)[:, 0], cache


def pad_prompts(prompts: Sequence[Sequence[int]], length: int, pad_id: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Right-pad token lists into ``tokens_BT`` [B, length] and their ``lengths_B``."""
    lengths = np.array([len(p) for p in prompts], np.int32)
    if lengths.min(initial=1) < 1:
        raise ValueError("every prompt needs at least one token (add BOS to empty prompts)")
    if lengths.max(initial=0) > length:
        raise ValueError(f"a prompt of {lengths.max()} tokens does not fit the padded length {length}")
    tokens = np.full((len(prompts), length), pad_id, np.int32)
    for row, prompt in enumerate(prompts):
        tokens[row, : len(prompt)] = prompt
    return tokens, lengths
