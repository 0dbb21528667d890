"""A position-weighted checksum of a tensor's bits, computable on the host and on (sharded) devices.

Orbax/TensorStore detect truncated files, but a flipped bit inside a data chunk restores silently as a
wrong weight. Checkpoints therefore record this checksum per tensor at save time and verify it after
restore, on the device that holds the tensor, so a sharded restore never gathers a full copy.

    checksum(x) = Σ_i bits(x_i) · w_i  (mod 2³²),   w_i = (2i + 1) · 0x9E3779B1  (mod 2³²)

``bits`` reinterprets each element as an unsigned integer of its own width; ``i`` is its row-major
index. Every weight is odd, hence invertible mod 2³², so any change to a single element changes the
sum, and weights differing by position catch moved or swapped chunks. The numpy and jax versions agree
bit for bit (both are exact integer arithmetic mod 2³²).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Hashable, TypeVar

import jax
import jax.numpy as jnp
import numpy as np

K = TypeVar("K", bound=Hashable)

_GOLDEN = 0x9E3779B1  # odd: 2^32 / golden ratio
_MASK = 0xFFFFFFFF
_HOST_CHUNK = 1 << 22  # elements per numpy step: bounds the temporaries to a few tens of MB

# Recorded in checkpoints next to each value, so a future change of algorithm is detected, not misread.
ALGORITHM = "bits-times-odd-position-weight-sum-mod-2^32"

_UNSIGNED = {1: np.uint8, 2: np.uint16, 4: np.uint32}


def _unsigned(dtype: np.dtype) -> np.dtype:
    try:
        return np.dtype(_UNSIGNED[np.dtype(dtype).itemsize])
    except KeyError:
        raise TypeError(f"no checksum for {np.dtype(dtype).name} tensors (8-byte elements)") from None


def host_checksum(x: np.ndarray) -> int:
    """The checksum of a numpy array, in chunks (never a full-size temporary)."""
    flat = np.ascontiguousarray(x).reshape(-1).view(_unsigned(x.dtype))
    total = 0
    for start in range(0, flat.size, _HOST_CHUNK):
        bits = flat[start:start + _HOST_CHUNK].astype(np.uint64)
        index = np.arange(start, start + bits.size, dtype=np.uint64)
        weights = ((2 * index + 1) * np.uint64(_GOLDEN)) & np.uint64(_MASK)
        # uint64 products wrap mod 2^64, which keeps the low 32 bits exact; chunk sums stay < 2^54.
        total = (total + int(np.sum((bits * weights) & np.uint64(_MASK), dtype=np.uint64))) & _MASK
    return total


def _device_checksum(x: jax.Array) -> jax.Array:
    bits = jax.lax.bitcast_convert_type(x, jnp.dtype(_unsigned(x.dtype))).astype(jnp.uint32)
    # Row-major index mod 2^32 from per-axis iotas, so nothing of size x is materialised, no sharded
    # array is reshaped, and tensors past 2^32 elements still work (the index wraps, weights stay odd).
    index = jnp.zeros(x.shape, jnp.uint32)
    stride = 1
    for axis in reversed(range(x.ndim)):
        index = index + jax.lax.broadcasted_iota(jnp.uint32, x.shape, axis) * jnp.uint32(stride & _MASK)
        stride *= x.shape[axis]
    weights = (2 * index + 1) * jnp.uint32(_GOLDEN)
    return jnp.sum(bits * weights, dtype=jnp.uint32)


# One program for a whole dict of tensors: compilation, not arithmetic, dominates for small models.
_device_checksums = jax.jit(lambda tensors: {k: _device_checksum(x) for k, x in tensors.items()})


def checksums(tensors: Mapping[K, np.ndarray | jax.Array]) -> dict[K, int]:
    """The checksum of each tensor: on its devices for a ``jax.Array`` (sharded or not), else on the host."""
    on_device = {k: x for k, x in tensors.items() if isinstance(x, jax.Array)}
    device_sums = {k: int(v) for k, v in _device_checksums(on_device).items()} if on_device else {}
    return {k: device_sums[k] if k in device_sums else host_checksum(np.asarray(x)) for k, x in tensors.items()}
