"""Tile helpers for the Triton kernels: power-of-two tile sizes and masked loads and stores.

Triton tensors must have power-of-two sizes and ``tl.dot`` needs at least 16 along each dimension,
so a head dim of 80 (or a group of 2 query heads) becomes a tile of 128 (or 16). The arrays are
never padded in memory; the part of a tile past the array is masked instead: loads read 0 there
and stores skip it.
"""

from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu


def tile_size(n: int) -> int:
    """The smallest power of two >= max(n, 16)."""
    return max(16, pl.next_power_of_2(n))


def check_tile_size(name: str, size: int) -> None:
    if size < 16 or size & (size - 1):
        raise ValueError(f"{name}={size} must be a power of two >= 16 (Triton tile sizes)")


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
    return plgpu.load(ref, mask=mask, other=0.0)


def store(ref, value, rows_ok, cols_ok) -> None:
    """Store a [rows, cols] tile, writing only where unmasked."""
    plgpu.store(ref, value.astype(ref.dtype), mask=tile_mask(rows_ok, cols_ok))
