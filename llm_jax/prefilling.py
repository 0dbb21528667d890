"""Prefill: run a batch of prompts through the model, fill the KV cache, return last-token logits.

Prompts are **right-padded**: row b holds its ``lengths_B[b]`` tokens at slots [0, length) and padding
after. Keys past a row's length are masked, so padding never influences real tokens, and decode later
overwrites the padded slots. (Right padding keeps slot = position, so RoPE positions need no offset.)
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from llm_jax.config import ModelConfig
from llm_jax.kv_cache import KVCache
from llm_jax.logprobs import TokenLogprobs, token_logprobs
from llm_jax.lora import LoraRows
from llm_jax.backends import Backend
from llm_jax.model import LayerHooks, Params, forward_prefill, resolve_backend, unembed
from llm_jax.sharding import constrain, constrain_cache, constrain_replicated


@functools.partial(jax.jit, static_argnames=("config", "mesh", "backend"), donate_argnames=("cache",))
def prefill(params: Params, config: ModelConfig, tokens_BT: jax.Array, lengths_B: jax.Array,
            cache: KVCache, *, mesh: Mesh | None = None, backend: Backend | str | None = None,
            lora: LoraRows | None = None) -> tuple[jax.Array, KVCache]:
    """Logits [B, V] (float32) of each row's last real token, and the cache holding the prompts.

    ``cache`` must be empty (fresh from ``init_cache``) with at least T slots; it is donated. With a
    ``mesh``, params and cache are laid out by ``llm_jax.sharding``: the cache keeps its sharding and
    the logits stay split by batch and vocabulary. ``lora``: each row's LoRA adapter.
    """
    backend = resolve_backend(backend)
    tokens_BT, lengths_B = constrain(tokens_BT, "BT", mesh), constrain(lengths_B, "B", mesh)
    x_BTD, cache = forward_prefill(params, config, tokens_BT, lengths_B, constrain_cache(cache, mesh), mesh,
                                   backend=backend, lora=None if lora is None else lora.batch(tokens_BT.shape[1]))
    last_B1D = jnp.take_along_axis(x_BTD, (lengths_B - 1)[:, None, None], axis=1)
    return constrain(unembed(params, config, last_B1D, backend)[:, 0], "BV", mesh), constrain_cache(cache, mesh)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PrefillExtras:
    """What ``prefill_with_extras`` returns besides the last logits and the cache."""

    hidden_BTRD: jax.Array | None  # the hook's recorded layers at every prompt position
    # Position t: log p(prompt token t + 1 | tokens <= t) and the top alternatives there (raw model).
    prompt_logprobs: TokenLogprobs | None


@functools.partial(jax.jit, static_argnames=("config", "prompt_logprobs", "mesh", "backend"),
                   donate_argnames=("cache",))
def prefill_with_extras(params: Params, config: ModelConfig, tokens_BT: jax.Array, lengths_B: jax.Array,
                        cache: KVCache, hooks: LayerHooks, *, prompt_logprobs: int | None = None,
                        mesh: Mesh | None = None, backend: Backend | str | None = None,
                        lora: LoraRows | None = None) -> tuple[jax.Array, KVCache, PrefillExtras]:
    """``prefill`` with research hooks (steering vectors, recorded layers) and, when ``prompt_logprobs`` is
    an int, the prompt tokens' log-probabilities with that many top alternatives per position. The
    extras come back whole on every device of ``mesh``."""
    backend = resolve_backend(backend)
    tokens_BT, lengths_B = constrain(tokens_BT, "BT", mesh), constrain(lengths_B, "B", mesh)
    x_BTD, cache, hidden_BTRD = forward_prefill(params, config, tokens_BT, lengths_B, constrain_cache(cache, mesh),
                                                mesh, hooks=hooks, backend=backend,
                                                lora=None if lora is None else lora.batch(tokens_BT.shape[1]))
    last_B1D = jnp.take_along_axis(x_BTD, (lengths_B - 1)[:, None, None], axis=1)
    scored = None
    if prompt_logprobs is not None:
        next_BT = jnp.concatenate([tokens_BT[:, 1:], jnp.zeros_like(tokens_BT[:, :1])], axis=1)
        scored = token_logprobs(params, config, x_BTD, next_BT, top_n=prompt_logprobs, backend=backend)
    return (constrain(unembed(params, config, last_B1D, backend)[:, 0], "BV", mesh), constrain_cache(cache, mesh),
            constrain_replicated(PrefillExtras(hidden_BTRD, scored), mesh))


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
