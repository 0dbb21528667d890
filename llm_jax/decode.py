"""Decode: generate tokens one step at a time inside a ``lax.scan``, entirely on device.

A step feeds each running sequence its last token, appends its K/V to the cache, samples the next
token and checks the stop conditions. A finished sequence stops changing: it writes nothing to the
cache and emits ``PAD_ID``. The host sees tokens only once per call (a chunk of ``num_steps`` steps).
"""

from __future__ import annotations

import dataclasses
import enum
import functools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from llm_jax.config import ModelConfig
from llm_jax.kv_cache import KVCache
from llm_jax.model import Params, forward_extend, unembed
from llm_jax.sampling import Sampling, SamplingParams, sample
from llm_jax.sharding import constrain_cache, constrain_replicated

PAD_ID = -1  # emitted by finished sequences


class FinishReason(enum.IntEnum):
    RUNNING = 0
    EOS = 1  # an end-of-sequence id
    STOP = 2  # a user stop token id (or stop string, detected on the host)
    LENGTH = 3  # the token budget or the cache is exhausted

    @property
    def label(self) -> str | None:
        return None if self is FinishReason.RUNNING else self.name.lower()


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DecodeControls:
    """What each sequence stops on and how it samples (fixed for a whole generation)."""

    sampling: SamplingParams
    eos_ids_BE: jax.Array  # int32, padded with PAD_ID
    stop_ids_BX: jax.Array  # int32, padded with PAD_ID
    max_new_tokens_B: jax.Array  # int32

    @classmethod
    def create(cls, sampling: Sequence[Sampling], *, eos_ids: Sequence[Sequence[int]],
               stop_ids: Sequence[Sequence[int]], max_new_tokens: Sequence[int]) -> "DecodeControls":
        def padded(rows: Sequence[Sequence[int]]) -> np.ndarray:
            out = np.full((len(rows), max(1, max((len(r) for r in rows), default=0))), PAD_ID, np.int32)
            for i, r in enumerate(rows):
                out[i, : len(r)] = r
            return out

        budgets = np.asarray(max_new_tokens, np.int32)
        if (budgets < 1).any():
            raise ValueError(f"max_new_tokens must be >= 1, got {list(max_new_tokens)}")
        return cls(sampling=SamplingParams.stack(sampling), eos_ids_BE=padded(eos_ids),
                   stop_ids_BX=padded(stop_ids), max_new_tokens_B=budgets)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DecodeState:
    tokens_B: jax.Array  # int32: each row's latest token, not yet in the cache
    num_generated_B: jax.Array  # int32: tokens generated so far, the latest included
    finish_reason_B: jax.Array  # int32 FinishReason

    @property
    def done_B(self) -> jax.Array:
        return self.finish_reason_B != FinishReason.RUNNING


def _advance(token_B: jax.Array, running_B: jax.Array, num_generated_B: jax.Array, finish_B: jax.Array,
             controls: DecodeControls, cache_lengths_B: jax.Array, cache_len: int) -> DecodeState:
    """The state after ``running_B`` rows produced ``token_B``: count it, check stop conditions."""
    num_generated_B = num_generated_B + running_B.astype(jnp.int32)
    is_eos_B = jnp.any(token_B[:, None] == controls.eos_ids_BE, axis=-1)
    is_stop_B = jnp.any(token_B[:, None] == controls.stop_ids_BX, axis=-1)
    # No room for this token in the cache, or the budget is spent.
    out_of_room_B = (num_generated_B >= controls.max_new_tokens_B) | (cache_lengths_B >= cache_len)
    reason_B = jnp.select([is_eos_B, is_stop_B, out_of_room_B],
                          [FinishReason.EOS, FinishReason.STOP, FinishReason.LENGTH], FinishReason.RUNNING)
    finish_B = jnp.where(running_B, reason_B, finish_B).astype(jnp.int32)
    return DecodeState(tokens_B=jnp.where(running_B, token_B, PAD_ID).astype(jnp.int32),
                       num_generated_B=num_generated_B, finish_reason_B=finish_B)


@functools.partial(jax.jit, static_argnames=("mesh",))
def start(last_logits_BV: jax.Array, cache: KVCache, controls: DecodeControls, *,
          mesh: Mesh | None = None) -> DecodeState:
    """Sample each sequence's first token from its prefill logits (the state whole on every device of
    ``mesh``, for the host to read)."""
    B = last_logits_BV.shape[0]
    zeros_B = jnp.zeros((B,), jnp.int32)
    token_B = sample(last_logits_BV, controls.sampling, zeros_B)
    state = _advance(token_B, jnp.ones((B,), bool), zeros_B, zeros_B, controls, cache.lengths_B, cache.max_len)
    return constrain_replicated(state, mesh)


@functools.partial(jax.jit, static_argnames=("config", "num_steps", "mesh"), donate_argnames=("cache", "state"))
def decode(params: Params, config: ModelConfig, cache: KVCache, state: DecodeState, controls: DecodeControls,
           *, num_steps: int, mesh: Mesh | None = None) -> tuple[KVCache, DecodeState, jax.Array]:
    """Run ``num_steps`` decode steps: the new cache and state, and the emitted tokens [B, num_steps]
    (``PAD_ID`` for rows that had already finished). ``cache`` and ``state`` are donated.

    With a ``mesh`` (params and cache laid out by ``llm_jax.sharding``) the cache stays sharded from step
    to step; the state and tokens come back whole on every device, for the host to read.
    """
    cache, state = constrain_cache(cache, mesh), constrain_replicated(state, mesh)

    def step(carry, _):
        cache, state = carry

        def run(cache, state):
            running_B = ~state.done_B
            x_B1D, cache = forward_extend(params, config, state.tokens_B[:, None], cache, running_B, mesh)
            logits_BV = unembed(params, config, x_B1D)[:, 0]
            token_B = sample(logits_BV, controls.sampling, state.num_generated_B)
            new_state = _advance(token_B, running_B, state.num_generated_B, state.finish_reason_B, controls,
                                 cache.lengths_B, cache.max_len)
            return cache, new_state

        def idle(cache, state):
            return cache, dataclasses.replace(state, tokens_B=jnp.full_like(state.tokens_B, PAD_ID))

        # Once every row has finished, the remaining steps of the chunk cost nothing.
        cache, state = jax.lax.cond(jnp.all(state.done_B), idle, run, cache, state)
        return (cache, state), state.tokens_B

    (cache, state), tokens_SB = jax.lax.scan(step, (cache, state), None, length=num_steps)
    return constrain_cache(cache, mesh), *constrain_replicated((state, tokens_SB.T), mesh)
