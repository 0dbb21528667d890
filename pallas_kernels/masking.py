"""Which keys a query sees, and which key blocks a tile of queries can skip.

Shared by every kernel (GPU and TPU, prefill and decode) and by the TPU index maps, so the block
ranges a kernel loops over and the blocks its pipeline fetches can never disagree. Everything here
is scalar integer arithmetic or elementwise comparisons that lower on Triton and Mosaic alike.

Visibility is that of ``reference.attention_reference``: key j is visible to the query at position i
iff j <= i, j < length and (with a sliding window) i - j < window. Query rows at i >= length are
padding; the kernels zero them when they write the output, so the masks below need not know them.
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax


def cdiv(x, d: int):
    """Ceil division of a non-negative traced int32 (or Python int) by a static positive int."""
    if isinstance(x, int):
        return -(-x // d)
    return lax.div(x + (d - 1), d)


def visible(q_pos, k_pos, kv_len, sliding_window: int | None):
    """True where the key at ``k_pos`` is visible to the query at ``q_pos`` (they broadcast).

    ``kv_len`` is min(length, S): keys past it are padding or beyond the cache.
    """
    ok = (k_pos <= q_pos) & (k_pos < kv_len)
    if sliding_window is not None:
        ok &= q_pos - k_pos < sliding_window
    return ok


class KeyBlocks(NamedTuple):
    """Key blocks ``[first, end)`` hold every key a query tile can see; the sub-range
    ``[interior_lo, interior_hi)`` is fully visible to every valid row of the tile: no mask."""

    first: jax.Array
    interior_lo: jax.Array
    interior_hi: jax.Array
    end: jax.Array


def prefill_key_blocks(
    q_block, length, *, block_q: int, block_k: int, num_queries: int,
    sliding_window: int | None,
) -> KeyBlocks:
    """Key blocks for query tile ``q_block`` (rows ``q_block * block_q + [0, block_q)``).

    Skipping blocks outside ``[first, end)`` is the causal block skipping of FlashAttention-2
    (Dao 2023, section 3.1.1, "Causal masking"), extended to padding and to a sliding window;
    the interior needs no mask (ibid.: "we only need to apply the causal mask to 1 block").
    """
    q_start = q_block * block_q
    # Valid rows of the tile are [q_start, q_stop): below the sequence's length and T.
    q_stop = jnp.minimum(jnp.minimum(q_start + block_q, length), num_queries)
    has_rows = q_stop > q_start
    lowest_key = 0 if sliding_window is None else jnp.maximum(q_start - sliding_window + 1, 0)
    first = lax.div(jnp.asarray(lowest_key, jnp.int32), block_k)
    end = jnp.where(has_rows, cdiv(jnp.maximum(q_stop, 0), block_k), first)
    # Fully visible: the window of the last valid row reaches the block's first key, and the
    # block's last key is at or before the tile's first row (so also below length and S).
    if sliding_window is None:
        interior_lo = first
    else:
        interior_lo = cdiv(jnp.maximum(q_stop - sliding_window, 0), block_k)
    interior_lo = jnp.clip(interior_lo, first, end)
    interior_hi = jnp.clip(lax.div(q_start + 1, block_k), interior_lo, end)
    return KeyBlocks(first, interior_lo, interior_hi, end)


class KeyRange(NamedTuple):
    """The keys ``[kv_lo, kv_hi)`` visible to a decode query, and the blocks ``[first, end)`` of
    them that one split of the key axis covers (empty when ``first >= end``)."""

    kv_lo: jax.Array
    kv_hi: jax.Array
    first: jax.Array
    end: jax.Array


def decode_key_range(
    length, split, *, num_keys: int, block_k: int, num_splits: int, sliding_window: int | None,
) -> KeyRange:
    """Split ``split`` of the visible keys of a query at position ``length - 1``.

    Flash-Decoding (Dao, Haziza, Massa, Sizov 2023, step 1: "split the keys/values in smaller
    chunks"). The split is over the visible blocks of this sequence, not over the cache capacity S,
    so a short sequence in a long cache still spreads its work over every split.
    """
    kv_hi = jnp.clip(length, 0, num_keys)
    kv_lo = 0 if sliding_window is None else jnp.maximum(length - sliding_window, 0)
    kv_lo = jnp.minimum(jnp.asarray(kv_lo, jnp.int32), kv_hi)
    all_first = lax.div(kv_lo, block_k)
    all_end = jnp.where(kv_hi > kv_lo, cdiv(kv_hi, block_k), all_first)
    per_split = cdiv(all_end - all_first, num_splits)
    first = all_first + split * per_split
    end = jnp.minimum(first + per_split, all_end)
    return KeyRange(kv_lo, kv_hi, first, end)


def max_key_blocks_per_query_block(
    *, block_q: int, block_k: int, num_queries: int, num_keys: int, sliding_window: int | None,
) -> int:
    """Static bound on ``end - first`` of ``prefill_key_blocks`` over all tiles (a grid extent)."""
    bound = cdiv(min(num_queries, num_keys), block_k)
    if sliding_window is not None:
        # A tile sees block_q + window - 1 consecutive keys, which straddle at most one extra block.
        bound = min(bound, cdiv(block_q + sliding_window - 1, block_k) + 1)
    return max(bound, 1)
