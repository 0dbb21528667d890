"""Tile helpers for the Triton kernels: tile sizes that fit shared memory, masked loads and stores.

Triton tensors must have power-of-two sizes and ``tl.dot`` needs at least 16 along each dimension,
so a head dim of 80 (or a group of 2 query heads) becomes a tile of 128 (or 16). The arrays are
never padded in memory; the part of a tile past the array is masked instead: loads read 0 there
and stores skip it.

A choice of tiles must also fit the shared memory one program (thread block) may use, or Triton
refuses to compile it ("out of resource: shared memory"). ``smem_bytes`` computes what a choice
needs, ``smem_budget`` what the device allows, and ``fit_tiles`` shrinks a preferred choice until
it fits; every wrapper picks its default tiles that way.
"""

import dataclasses
from collections.abc import Collection

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

# Shared memory one thread block may opt into, by CUDA compute capability (CUDA C++ Programming
# Guide, "Technical Specifications per Compute Capability": maximum shared memory per thread block).
# Used when the device does not report it; with no GPU at all (interpreting, or lowering for CUDA
# ahead of time) the smallest entry is assumed, so the tiles fit every GPU here.
SMEM_PER_BLOCK_BYTES = {
    "8.0": 163 * 1024,  # A100
    "8.6": 99 * 1024,  # A10, A40, RTX 30xx
    "8.7": 163 * 1024,  # Jetson Orin
    "8.9": 99 * 1024,  # L4, L40S, RTX 40xx
    "9.0": 227 * 1024,  # H100, H200
    "10.0": 227 * 1024,  # B200
    "12.0": 99 * 1024,  # RTX 50xx
}
MIN_TILE = 16


def tile_size(n: int) -> int:
    """The smallest power of two >= max(n, 16)."""
    return max(MIN_TILE, pl.next_power_of_2(n))


def check_tile_size(name: str, size: int) -> None:
    if size < MIN_TILE or size & (size - 1):
        raise ValueError(f"{name}={size} must be a power of two >= 16 (Triton tile sizes)")


@dataclasses.dataclass(frozen=True, kw_only=True)
class SmemBudget:
    """Shared memory per program, in bytes, and where the figure comes from (for reports)."""

    bytes: int
    source: str


def smem_budget(device: jax.Device | None = None) -> SmemBudget:
    """The shared memory one program may use on ``device`` (default: the first device).

    What the device reports (jax exposes CUDA's ``sharedMemPerBlockOptin`` as
    ``shared_memory_per_block_optin``), else ``SMEM_PER_BLOCK_BYTES`` for its compute capability,
    else the smallest entry of that table.
    """
    device = device or jax.devices()[0]
    kind = getattr(device, "device_kind", device.platform)
    reported = getattr(device, "shared_memory_per_block_optin", None)
    if reported:
        return SmemBudget(bytes=int(reported), source=f"{kind}: reported by the device")
    capability = getattr(device, "compute_capability", None)
    if capability in SMEM_PER_BLOCK_BYTES:
        return SmemBudget(bytes=SMEM_PER_BLOCK_BYTES[capability],
                          source=f"{kind}: compute capability {capability} in the table")
    return SmemBudget(bytes=min(SMEM_PER_BLOCK_BYTES.values()),
                      source=f"{kind}: not a known GPU, the smallest in the table")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Tiles:
    """One tile choice of an attention kernel: a [block_q, head_dim] query tile folding
    [block_k, head_dim] key and value tiles, loaded ``num_stages`` blocks ahead."""

    block_q: int  # query rows (prefill: queries of one head; decode: the padded group of heads)
    block_k: int  # keys per step
    head_dim: int  # the head dim padded to a power of two (Hp)
    num_stages: int  # Triton software-pipeline stages of the K/V loads

    def __str__(self):
        return (f"block_q={self.block_q} block_k={self.block_k} Hp={self.head_dim} "
                f"num_stages={self.num_stages}")


def smem_bytes(tiles: Tiles, dtype) -> int:
    """Shared memory the tiles need, in bytes, for inputs of ``dtype``.

    Triton stages the operands of a dot through shared memory: the query tile (block_q x Hp, loaded
    once), the K and V tiles (block_k x Hp each) in a ring of ``num_stages`` buffers for the
    software pipeline, and the probabilities (block_q x block_k), the left operand of p @ v, all in
    the input dtype. The float32 scores, accumulator and softmax statistics live in registers. It is
    an upper bound: Triton may keep q or p in registers (Hopper's wgmma reads its left operand from
    registers) and share buffers whose lifetimes do not overlap.
    """
    t = tiles
    elements = t.block_q * t.head_dim + 2 * t.num_stages * t.block_k * t.head_dim \
        + t.block_q * t.block_k
    return elements * jnp.dtype(dtype).itemsize


def fit_tiles(preferred: Tiles, *, dtype, budget_bytes: int, fixed: Collection[str] = ()
              ) -> Tiles:
    """The largest tiles no larger than ``preferred`` whose ``smem_bytes`` fit ``budget_bytes``.

    Shrinks first what costs the least speed: pipeline stages beyond two, then block_k, then block_q
    (halving each down to 16), then the second stage. The fields named in ``fixed`` (the caller's
    explicit choices) never change; a ValueError names the tiles and bytes when nothing fits.
    """
    tiles = preferred
    while smem_bytes(tiles, dtype) > budget_bytes:
        if tiles.num_stages > 2 and "num_stages" not in fixed:
            tiles = dataclasses.replace(tiles, num_stages=tiles.num_stages - 1)
        elif tiles.block_k > MIN_TILE and "block_k" not in fixed:
            tiles = dataclasses.replace(tiles, block_k=tiles.block_k // 2)
        elif tiles.block_q > MIN_TILE and "block_q" not in fixed:
            tiles = dataclasses.replace(tiles, block_q=tiles.block_q // 2)
        elif tiles.num_stages > 1 and "num_stages" not in fixed:
            tiles = dataclasses.replace(tiles, num_stages=tiles.num_stages - 1)
        else:
            raise ValueError(
                f"tiles {tiles} need {smem_bytes(tiles, dtype)} bytes of shared memory for "
                f"{jnp.dtype(dtype).name}, more than the {budget_bytes} a program may use"
                + (f" (fixed by the caller: {sorted(fixed)})" if fixed else ""))
    return tiles


def tile_mask(rows_ok, cols_ok):
    """[rows, cols] mask from optional per-row and per-column masks (None: all in bounds)."""
    if rows_ok is None and cols_ok is None:
        return None
    if rows_ok is None:
        return cols_ok[None, :]
    if cols_ok is None:
        return rows_ok[:, None]
    return rows_ok[:, None] & cols_ok[None, :]


def load(ref, rows_ok, cols_ok):
    """Load a [rows, cols] tile, reading 0 (and no memory) where masked."""
    mask = tile_mask(rows_ok, cols_ok)
    if mask is None:
        return plgpu.load(ref)
    return plgpu.load(ref, mask=mask, other=jnp.zeros((), ref.dtype))


def store(ref, value, rows_ok, cols_ok) -> None:
    """Store a [rows, cols] tile, writing only where unmasked."""
    plgpu.store(ref, value.astype(ref.dtype), mask=tile_mask(rows_ok, cols_ok))
