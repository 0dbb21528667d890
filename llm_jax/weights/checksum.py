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

import functools
from collections.abc import Mapping
from typing import Hashable, TypeVar

import jax
import jax.numpy as jnp
import numpy as np

K = TypeVar("K", bound=Hashable)

_GOLDEN = 0x9E3779B1  # odd: 2^32 / golden ratio
_MASK = 0xFFFFFFFF
_HOST_CHUNK = 1 << 20  # elements per numpy step: bounds the temporaries to a few MB
_DEVICE_BLOCK = 1 << 22  # elements per device step, likewise

# Recorded in checkpoints next to each value, so a future change of algorithm is detected, not misread.
ALGORITHM = "bits-times-odd-position-weight-sum-mod-2^32"

_UNSIGNED = {1: np.uint8, 2: np.uint16, 4: np.uint32}


def _unsigned(dtype: np.dtype) -> np.dtype:
    try:
        return np.dtype(_UNSIGNED[np.dtype(dtype).itemsize])
    except KeyError:
        raise TypeError(f"no checksum for {np.dtype(dtype).name} tensors (8-byte elements)") from None


def _host_sum(bits: np.ndarray, starts: tuple[int, ...], global_shape: tuple[int, ...]) -> int:
    """Σ bits · weight over a block of unsigned ``bits`` at ``starts`` in an array of ``global_shape``,
    in chunks of rows (temporaries of a few MB, never the tensor's size). numpy's uint32 arithmetic
    wraps mod 2³², exactly as the device version's."""
    if bits.ndim == 0:
        bits, starts, global_shape = bits.reshape(1), (0,), (1,)
    strides = [int(np.prod(global_shape[axis + 1:])) & _MASK for axis in range(len(global_shape))]
    rows = max(1, _HOST_CHUNK // max(1, int(np.prod(bits.shape[1:]))))
    total = 0
    for row in range(0, bits.shape[0], rows):
        chunk = bits[row:row + rows]
        index = _global_index(chunk.shape, [s + (row if axis == 0 else 0) for axis, s in enumerate(starts)], strides)
        weights = (index * np.uint32(2) + np.uint32(1)) * np.uint32(_GOLDEN)
        total = (total + int(np.sum(chunk.astype(np.uint32) * weights, dtype=np.uint32))) & _MASK
    return total


def _global_index(shape: tuple[int, ...], starts: list[int], strides: list[int]) -> np.ndarray:
    """Global row-major index (mod 2³²) of each element of a block at ``starts``."""
    index = np.zeros((), np.uint32)
    for axis, (start, stride) in enumerate(zip(starts, strides)):
        axis_shape = [1] * len(shape)
        axis_shape[axis] = shape[axis]
        positions = np.arange(shape[axis], dtype=np.uint32) + np.uint32(start & _MASK)
        index = index + positions.reshape(axis_shape) * np.uint32(stride)
    return np.broadcast_to(index, shape)


def host_checksum(x: np.ndarray) -> int:
    """The checksum of a numpy array."""
    x = np.ascontiguousarray(x)
    return _host_sum(x.view(_unsigned(x.dtype)), (0,) * x.ndim, x.shape)


def _rows_per_block(shape: tuple[int, ...]) -> int:
    """Rows of axis 0 per block: the largest divisor of shape[0] within _DEVICE_BLOCK elements, so all
    blocks of a shard have one shape."""
    row = int(np.prod(shape[1:]))
    fitting = [r for r in range(1, shape[0] + 1) if shape[0] % r == 0 and r * row <= _DEVICE_BLOCK]
    return max(fitting, default=1)


def _block_sum(data: jax.Array, starts: jax.Array, global_shape: tuple[int, ...], rows: int) -> jax.Array:
    """Σ bits · weight over one shard (``data``, at ``starts`` in an array of ``global_shape``), looping
    over blocks of ``rows`` rows so that no temporary has the shard's size."""
    strides = [int(np.prod(global_shape[axis + 1:])) & _MASK for axis in range(len(global_shape))]
    block_shape = (rows, *data.shape[1:])

    def add_block(i, total):
        block = jax.lax.dynamic_slice_in_dim(data, i * rows, rows, axis=0)
        bits = jax.lax.bitcast_convert_type(block, jnp.dtype(_unsigned(block.dtype))).astype(jnp.uint32)
        # Row-major global index mod 2^32 from per-axis iotas: no sharded array is reshaped, and tensors
        # past 2^32 elements still work (the index wraps, the weights stay odd).
        index = jnp.zeros(block_shape, jnp.uint32)
        for axis, stride in enumerate(strides):
            offset = starts[axis] + (i * rows).astype(jnp.uint32) if axis == 0 else starts[axis]
            index = index + (jax.lax.broadcasted_iota(jnp.uint32, block_shape, axis) + offset) * jnp.uint32(stride)
        weights = (2 * index + 1) * jnp.uint32(_GOLDEN)
        return total + jnp.sum(bits * weights, dtype=jnp.uint32)

    return jax.lax.fori_loop(0, data.shape[0] // rows, add_block, jnp.uint32(0))


@functools.partial(jax.jit, static_argnames=("global_shapes", "rows"))
def _shard_sums(shards: list[jax.Array], starts: list[jax.Array], global_shapes: tuple[tuple[int, ...], ...],
                rows: tuple[int, ...]) -> list[jax.Array]:
    """One program for all shards on one device: compilation, not arithmetic, dominates small models."""
    return [_block_sum(x, s, g, r) for x, s, g, r in zip(shards, starts, global_shapes, rows)]


def device_partial_sums(device: jax.Device, shards: list[tuple[jax.Array, tuple[int, ...], tuple[int, ...]]]
                        ) -> list[int]:
    """The sums of ``(data, starts, global_shape)`` shards held by ``device``, computed there."""
    datas = [d.reshape(1) if d.ndim == 0 else d for d, _, _ in shards]
    starts = [jax.device_put(np.array(s or (0,), np.uint32), device) for _, s, _ in shards]
    shapes = tuple(g or (1,) for _, _, g in shards)
    sums = _shard_sums(datas, starts, global_shapes=shapes, rows=tuple(_rows_per_block(d.shape) for d in datas))
    return [int(v) for v in jax.device_get(sums)]


def _array_checksums(tensors: Mapping[K, jax.Array]) -> dict[K, int]:
    """Each device sums the shards it holds (one replica of each); the host adds the partial sums.

    CPU shards are summed by numpy through a zero-copy view: XLA:CPU materialises integer products and
    widens bfloat16 blocks, so its temporaries would grow with the model; accelerators fuse them away.
    """
    totals = {key: 0 for key in tensors}
    per_device: dict[jax.Device, list[tuple[K, tuple[jax.Array, tuple[int, ...], tuple[int, ...]]]]] = {}
    for key, x in tensors.items():
        if not x.is_fully_addressable:
            raise NotImplementedError(f"checksums of arrays spanning several processes are not supported "
                                      f"({key}); load with verify=False")
        for shard in x.addressable_shards:
            if shard.replica_id != 0:
                continue
            starts = tuple(sl.start or 0 for sl in shard.index)
            if shard.device.platform == "cpu":
                host = np.asarray(shard.data)
                totals[key] = (totals[key] + _host_sum(host.view(_unsigned(host.dtype)), starts, x.shape)) & _MASK
            else:
                per_device.setdefault(shard.device, []).append((key, (shard.data, starts, x.shape)))
    for device, items in per_device.items():
        for (key, _), value in zip(items, device_partial_sums(device, [shard for _, shard in items])):
            totals[key] = (totals[key] + value) & _MASK
    return totals


def checksums(tensors: Mapping[K, np.ndarray | jax.Array]) -> dict[K, int]:
    """The checksum of each tensor: where its shards live for a ``jax.Array`` (sharded or not), else on
    the host."""
    on_device = _array_checksums({k: x for k, x in tensors.items() if isinstance(x, jax.Array)})
    return {k: on_device[k] if k in on_device else host_checksum(np.asarray(x)) for k, x in tensors.items()}
