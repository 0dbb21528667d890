"""How the TPU kernels tile the [B, S, K, H] attention arrays, and the VMEM their tiles need.

Mosaic DMAs blocks whose last two dims are multiples of (8, 128) or whole, so a [block_s, H] tile
of one head cannot be cut from [B, S, K, H] directly (the head is the second-to-last dim). With
H % 128 == 0 the array is viewed as [B, S, K*H] for free and head k is lane block k; otherwise it
is transposed to [B, K, S, H], which costs one copy of the array per call. A decode call reading
layer l of the stacked caches [L, B, S, K, H] views them as [L, B, S, K*H] and fetches from layer
l in place; otherwise it slices the layer out and transposes it, one copy of that layer as before.
"""

import math
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels import online_softmax

# The VMEM a kernel may use unless its compiler params raise the limit: the default scoped limit,
# 16 MiB on v4 and v5e (32 MiB on v5p and v6e). The kernels' default tiles fit the smallest.
SCOPED_VMEM_BYTES = 16 * 1024 * 1024


def fuses_heads(head_dim: int) -> bool:
    """Whether [B, S, K, H] can be tiled in place (as [B, S, K*H])."""
    return head_dim % 128 == 0


def to_tiled(x_BSKH: jax.Array) -> jax.Array:
    """The array the kernel reads: [B, S, K*H] (a free view) or [B, K, S, H] (a copy)."""
    B, S, K, H = x_BSKH.shape
    if fuses_heads(H):
        return x_BSKH.reshape(B, S, K * H)
    return x_BSKH.transpose(0, 2, 1, 3)


def tiled_shape(shape_BSKH: tuple[int, int, int, int]) -> tuple[int, ...]:
    B, S, K, H = shape_BSKH
    return (B, S, K * H) if fuses_heads(H) else (B, K, S, H)


def to_tiled_cache(cache: jax.Array, layer) -> tuple[jax.Array, jax.Array]:
    """The stacked array a decode kernel reads for ``cache`` and the layer to read in it.

    ``cache`` is [L, B, S, K, H] with an int32 ``layer`` ([1], from ``shapes.as_layer``), or one
    layer's [B, S, K, H] with ``layer`` None. Returns [L, B, S, K*H] (a free view) and the layer, or
    the layer sliced out and transposed to [1, B, K, S, H] (a copy of one layer) and layer 0.
    """
    if layer is None:
        cache, layer = cache.reshape(1, *cache.shape), jnp.zeros((1,), jnp.int32)
    L, B, S, K, H = cache.shape
    if fuses_heads(H):
        return cache.reshape(L, B, S, K * H), layer
    one_layer = lax.dynamic_index_in_dim(cache, layer[0], keepdims=True)
    return one_layer.transpose(0, 1, 3, 2, 4), jnp.zeros((1,), jnp.int32)


def cache_tile_spec(head_dim: int, block_s: int, index: Callable) -> pl.BlockSpec:
    """BlockSpec of a [block_s, H] tile of a ``to_tiled_cache`` array.

    ``index(*grid_indices, *scalar_prefetch_refs)`` returns (layer, batch, head, s_block).
    """
    if fuses_heads(head_dim):
        def fused_index(*args):
            layer, b, head, s_block = index(*args)
            return layer, b, s_block, head

        return pl.BlockSpec((None, None, block_s, head_dim), fused_index)

    def transposed_index(*args):
        layer, b, head, s_block = index(*args)
        return layer, b, head, s_block, 0

    return pl.BlockSpec((None, None, None, block_s, head_dim), transposed_index)


def from_tiled(x: jax.Array, shape_BSKH: tuple[int, int, int, int]) -> jax.Array:
    """Inverse of ``to_tiled``."""
    if fuses_heads(shape_BSKH[3]):
        return x.reshape(shape_BSKH)
    return x.transpose(0, 2, 1, 3)


def head_tile_spec(head_dim: int, block_s: int, index: Callable) -> pl.BlockSpec:
    """BlockSpec of a [block_s, H] tile of a ``to_tiled`` array.

    ``index(*grid_indices, *scalar_prefetch_refs)`` returns (batch, head, s_block).
    """
    if fuses_heads(head_dim):
        def fused_index(*args):
            b, head, s_block = index(*args)
            return b, s_block, head

        return pl.BlockSpec((None, block_s, head_dim), fused_index)

    def transposed_index(*args):
        b, head, s_block = index(*args)
        return b, head, s_block, 0

    return pl.BlockSpec((None, None, block_s, head_dim), transposed_index)


# The online-softmax state lives in VMEM scratch across the key-block grid steps. m and l are
# replicated over the 128 lanes, as in the upstream Mosaic kernels, so they load and store as whole
# vector registers; the arithmetic in ``online_softmax`` sees their [rows, 1] column.
NUM_LANES = 128


def state_scratch_shapes(rows: int, head_dim: int) -> list:
    """VMEM scratch for m [rows, 128], l [rows, 128] and acc [rows, H], all float32."""
    return [
        pltpu.VMEM((rows, NUM_LANES), jnp.float32),
        pltpu.VMEM((rows, NUM_LANES), jnp.float32),
        pltpu.VMEM((rows, head_dim), jnp.float32),
    ]


def init_state(m_ref, l_ref, acc_ref) -> None:
    state = online_softmax.initial_state(*acc_ref.shape)
    write_state(state, m_ref, l_ref, acc_ref)


def read_state(m_ref, l_ref, acc_ref) -> online_softmax.State:
    return online_softmax.State(m=m_ref[...][:, :1], l=l_ref[...][:, :1], acc=acc_ref[...])


def write_state(state: online_softmax.State, m_ref, l_ref, acc_ref) -> None:
    m_ref[...] = jnp.broadcast_to(state.m, m_ref.shape)
    l_ref[...] = jnp.broadcast_to(state.l, l_ref.shape)
    acc_ref[...] = state.acc


def interpreter(interpret: bool, poison_output: bool) -> pltpu.InterpretParams | bool:
    """The ``interpret`` argument of a TPU ``pallas_call``.

    Normally Pallas' TPU interpreter, which simulates DMAs and VMEM and raises on out-of-bounds
    reads. It copies each output block back from VMEM whether or not the kernel wrote it, as the
    hardware does, so an unwritten tile would show a stale tile rather than the poison; with
    ``poison_output`` the generic interpreter runs instead, whose output blocks round-trip through
    the (NaN-poisoned) output array.
    """
    if not interpret:
        return False
    return True if poison_output else pltpu.InterpretParams()


def vmem_bytes(blocks: Sequence[tuple[tuple[int, ...], jnp.dtype]],
               scratch: Sequence[tuple[tuple[int, ...], jnp.dtype]]) -> int:
    """VMEM a kernel's tiles take: each (shape, dtype) block twice (the pipeline fetches the next
    block while the kernel reads this one), each scratch array once; every array padded to Mosaic's
    tiles of (8 x 32-bit packing) sublanes by 128 lanes, e.g. (16, 128) for bfloat16."""
    def padded_bytes(shape, dtype):
        itemsize = jnp.dtype(dtype).itemsize
        sublanes = 8 * max(1, 4 // itemsize)
        rows, lanes = (1, *shape)[-2:]
        tiles = pl.cdiv(rows, sublanes) * sublanes * pl.cdiv(lanes, NUM_LANES) * NUM_LANES
        return math.prod(shape[:-2]) * tiles * itemsize

    return (2 * sum(padded_bytes(*block) for block in blocks)
            + sum(padded_bytes(*array) for array in scratch))


def check_vmem(kernel: str, needed: int, budget: int = SCOPED_VMEM_BYTES, **tiles) -> None:
    """A ValueError naming the tiles when ``needed`` bytes of VMEM exceed the scoped limit."""
    if needed > budget:
        choice = " ".join(f"{name}={value}" for name, value in tiles.items())
        raise ValueError(f"{kernel} tiles {choice} need {needed} bytes of VMEM, more than the "
                         f"{budget} of the default scoped limit; choose smaller blocks")
