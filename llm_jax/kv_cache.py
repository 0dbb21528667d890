"""The KV cache: an immutable pytree of every layer's keys and values plus per-sequence lengths.

Layout: one pair of arrays per layer, keys transposed: ``k_BKHS[l]`` [batch, kv head, head dim, slot]
and ``v_BKSH[l]`` [batch, kv head, slot, head dim]. Slot s holds position s of its sequence (prompts are
right-padded), and ``lengths_B[b]`` slots of row b are valid; slots past it hold stale values that
attention masks out and later writes overwrite.

Why this layout (each choice measured on XLA:CPU decode, see ``scripts/benchmark.py``):

- one buffer per layer, not one stacked [L, ...] array: attention reads a layer's keys where they
  are and XLA updates them in place, whereas a layer sliced out of a stacked array is a copy, made
  every step;
- heads before slots, so that attention is a batched matrix product over (b, k) with the batch
  dimensions leading; with [B, S, K, H] XLA transposes the layer's whole cache first, every step
  (2× slower decode at batch 32 for the 15M story model);
- keys as [H, S]: scores = q [G·T, H] @ k [H, S] and outputs = p [G·T, S] @ v [S, H] are then both
  plain row-major products; with keys as [S, H] XLA again transposes them on every step.

Functions return a new cache; jitted callers donate the old one so XLA updates the buffers in place.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from llm_jax.config import ModelConfig


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
    k_BKHS: tuple[jax.Array, ...]  # one per layer
    v_BKSH: tuple[jax.Array, ...]
    lengths_B: jax.Array  # int32: valid slots per sequence

    @property
    def batch_size(self) -> int:
        return self.v_BKSH[0].shape[0]

    @property
    def max_len(self) -> int:
        return self.v_BKSH[0].shape[2]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in (*self.k_BKHS, *self.v_BKSH)) + self.lengths_B.nbytes


def init_cache(config: ModelConfig, batch_size: int, max_len: int, dtype=None) -> KVCache:
    """An empty cache for ``batch_size`` sequences of up to ``max_len`` tokens (default dtype: compute)."""
    if max_len > config.max_seq_len:
        raise ValueError(f"cache max_len={max_len} exceeds the model's context of {config.max_seq_len} tokens")
    if batch_size <= 0 or max_len <= 0:
        raise ValueError(f"cache needs a positive batch_size and max_len, got {batch_size=} {max_len=}")
    dtype = jnp.dtype(dtype or config.compute_dtype)
    B, K, S, H = batch_size, config.n_kv_heads, max_len, config.head_dim
    layers = range(config.n_layers)
    return KVCache(k_BKHS=tuple(jnp.zeros((B, K, H, S), dtype) for _ in layers),
                   v_BKSH=tuple(jnp.zeros((B, K, S, H), dtype) for _ in layers),
                   lengths_B=jnp.zeros((batch_size,), jnp.int32))


def cache_bytes_per_token(config: ModelConfig, dtype=None) -> int:
    """Bytes of K and V one token occupies across all layers."""
    itemsize = jnp.dtype(dtype or config.compute_dtype).itemsize
    return 2 * config.n_layers * config.n_kv_heads * config.head_dim * itemsize


def write_prefix(k_BKHS: jax.Array, v_BKSH: jax.Array, k_BTKH: jax.Array, v_BTKH: jax.Array):
    """Write a block of T tokens at slots [0, T) of every row (prefill)."""
    zero = jnp.zeros((), jnp.int32)
    start = (zero, zero, zero, zero)
    k_BKHT = k_BTKH.transpose(0, 2, 3, 1).astype(k_BKHS.dtype)
    v_BKTH = v_BTKH.transpose(0, 2, 1, 3).astype(v_BKSH.dtype)
    return jax.lax.dynamic_update_slice(k_BKHS, k_BKHT, start), jax.lax.dynamic_update_slice(v_BKSH, v_BKTH, start)


def write_tokens(k_BKHS: jax.Array, v_BKSH: jax.Array, slots_BT: jax.Array, k_BTKH: jax.Array, v_BTKH: jax.Array):
    """Write token (b, t) at slot ``slots_BT[b, t]``; out-of-range slots are dropped (finished rows)."""
    B, T = slots_BT.shape
    b_BT = jnp.broadcast_to(jnp.arange(B)[:, None], (B, T))
    # Advanced indices around sliced axes put their [B, T] shape first: both updates are [B, T, K, H].
    k_BKHS = k_BKHS.at[b_BT, :, :, slots_BT].set(k_BTKH.astype(k_BKHS.dtype), mode="drop")
    v_BKSH = v_BKSH.at[b_BT, :, slots_BT].set(v_BTKH.astype(v_BKSH.dtype), mode="drop")
    return k_BKHS, v_BKSH
