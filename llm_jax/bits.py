"""bfloat16 arrays moved as their bits (uint16), for the data movement XLA:CPU has no bfloat16 kernel for.

XLA:CPU has no bfloat16 dynamic-slice, dynamic-update-slice, scatter or gather: around one it converts
the whole operand to float32 and back (for stacked weights in a loop, hoisted: a float32 copy of the
model in every decode call; for the KV cache, the whole cache on every write). Moving the bits instead
is exact and converts nothing.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

__all__ = ["as_bits", "from_bits", "moving_bits"]


def as_bits(a: jnp.ndarray) -> jnp.ndarray:
    """bfloat16 arrays as uint16 (others unchanged), to slice, gather or update them."""
    return jax.lax.bitcast_convert_type(a, jnp.uint16) if a.dtype == jnp.bfloat16 else a


def from_bits(a: jnp.ndarray, dtype) -> jnp.ndarray:
    """Undoes :func:`as_bits` for an array that was of ``dtype``."""
    return jax.lax.bitcast_convert_type(a, jnp.bfloat16) if dtype == jnp.bfloat16 else a


def moving_bits(fn):
    """``fn`` — pure data movement (reshapes, transposes, concatenation, slicing) of arrays of one dtype —
    applied to bfloat16 arrays as their bits: around a bfloat16 concatenate or transpose XLA:CPU converts
    to float32 and back, which briefly needs memory for a float32 copy of the whole operand."""

    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        bf16 = any(getattr(x, "dtype", None) == jnp.bfloat16 for x in jax.tree.leaves((args, kwargs)))
        args, kwargs = jax.tree.map(lambda x: as_bits(x) if hasattr(x, "dtype") else x, (args, kwargs))
        out = fn(*args, **kwargs)
        return jax.tree.map(lambda y: from_bits(y, jnp.bfloat16), out) if bf16 else out

    return wrapped

