"""Choosing the next token inside jit: greedy, temperature, top-k, top-p, min-p — per sequence.

Every row of a batch carries its own settings (a :class:`SamplingParams` pytree of [B] arrays) and its
own randomness: the key for a row's n-th generated token is ``fold_in(key(seed), n)``, so a sequence
samples the same tokens alone or in any batch, at any position.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True, kw_only=True)
class Sampling:
    """One sequence's sampling settings (host side). ``temperature=0`` is greedy decoding.

    Filters apply in the order of Hugging Face ``transformers``: temperature, top-k, top-p, min-p.
    ``top_k=0``, ``top_p=1`` and ``min_p=0`` disable their filter.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if not 0 <= self.seed < 2**32:
            raise ValueError(f"seed must be in [0, 2**32), got {self.seed}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


GREEDY = Sampling()


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """Device-side settings, one row per sequence."""

    temperature_B: jax.Array  # float32; 0 = greedy
    top_k_B: jax.Array  # int32; 0 = off
    top_p_B: jax.Array  # float32; 1 = off
    min_p_B: jax.Array  # float32; 0 = off
    seed_B: jax.Array  # uint32

    @classmethod
    def stack(cls, rows: Sequence[Sampling]) -> "SamplingParams":
        return cls(temperature_B=np.array([r.temperature for r in rows], np.float32),
                   top_k_B=np.array([r.top_k for r in rows], np.int32),
                   top_p_B=np.array([r.top_p for r in rows], np.float32),
                   min_p_B=np.array([r.min_p for r in rows], np.float32),
                   seed_B=np.array([r.seed for r in rows], np.uint32))


def row_keys(seed_B: jax.Array, step_B: jax.Array) -> jax.Array:
    """One PRNG key per row, from the row's seed and how many tokens it has generated."""
    return jax.vmap(lambda seed, step: jax.random.fold_in(jax.random.key(seed), step))(seed_B, step_B)


def filter_logits(logits_BV: jax.Array, params: SamplingParams) -> jax.Array:
    """Temperature-scaled logits with tokens outside each row's top-k / top-p / min-p set at -inf."""
    temperature_B1 = jnp.where(params.temperature_B > 0, params.temperature_B, 1.0)[:, None]
    logits_BV = logits_BV.astype(jnp.float32) / temperature_B1
    V = logits_BV.shape[-1]
    sorted_BV = -jnp.sort(-logits_BV, axis=-1)  # descending

    # top-k: keep logits >= the k-th largest.
    k_B = jnp.where(params.top_k_B > 0, jnp.minimum(params.top_k_B, V), V)
    kth_B1 = jnp.take_along_axis(sorted_BV, (k_B - 1)[:, None], axis=-1)
    sorted_BV = jnp.where(sorted_BV >= kth_B1, sorted_BV, -jnp.inf)

    # top-p (nucleus, Holtzman et al. 2020): the smallest prefix of the sorted distribution whose mass
    # reaches p; a token is kept when the mass before it is still below p (so the first always is).
    probs_BV = jax.nn.softmax(sorted_BV, axis=-1)
    mass_before_BV = jnp.cumsum(probs_BV, axis=-1) - probs_BV
    keep_BV = mass_before_BV < params.top_p_B[:, None]
    num_kept_B = jnp.sum(keep_BV, axis=-1)
    pth_B1 = jnp.take_along_axis(sorted_BV, (num_kept_B - 1)[:, None], axis=-1)
    threshold_B1 = jnp.maximum(kth_B1, jnp.where(params.top_p_B[:, None] < 1, pth_B1, -jnp.inf))

    # min-p (Nguyen et al. 2024): keep tokens with probability >= min_p * max probability, computed
    # on the distribution left by top-k and top-p.
    filtered_BV = jnp.where(logits_BV >= threshold_B1, logits_BV, -jnp.inf)
    max_B1 = sorted_BV[:, :1]
    min_p_logit_B1 = max_B1 + jnp.log(jnp.maximum(params.min_p_B[:, None], 1e-38))
    filtered_BV = jnp.where((params.min_p_B[:, None] > 0) & (filtered_BV < min_p_logit_B1), -jnp.inf,
                            filtered_BV)
    return filtered_BV


def sample(logits_BV: jax.Array, params: SamplingParams, step_B: jax.Array) -> jax.Array:
    """Next token per row [B] (int32): argmax for greedy rows, a draw from the filtered distribution else."""
    greedy_B = jnp.argmax(logits_BV, axis=-1).astype(jnp.int32)

    def draw(_):
        keys_B = row_keys(params.seed_B, step_B)
        filtered_BV = filter_logits(logits_BV, params)
        drawn_B = jax.vmap(jax.random.categorical)(keys_B, filtered_BV).astype(jnp.int32)
        return jnp.where(params.temperature_B > 0, drawn_B, greedy_B)

    # Skip the sort entirely when every row is greedy.
    return jax.lax.cond(jnp.any(params.temperature_B > 0), draw, lambda _: greedy_B, None)
