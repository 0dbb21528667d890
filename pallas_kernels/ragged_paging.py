"""How a ragged paged batch is cut into work, shared by both variants of ragged paged attention.

A serving step's T query tokens belong to B sequences, each a run of rows of q (a decode token, or
a chunk of a prompt). Each sequence's run is cut into query tiles of ``block_q`` tokens from its
first row, so a tile never spans two sequences and every tile sees the keys of one sequence. The
work list enumerates the tiles of all sequences, W entries in all: a static bound on their number
(``max_tiles``), the entries past the real tiles idle. The grid runs over that list, not over
(sequence, query block), which would be mostly empty when decode tokens and long chunks mix. vLLM's
Triton "unified attention" flattens its grid the same way, each program searching the cumulative
per-sequence block counts for its sequence; here the wrapper does that search once, in jnp.

A tile's rows are its tokens times the G query heads that share one kv head: row r holds head
r % G of token r // G (as the decode kernels group heads), so each K/V tile is read once per group.
Everything here is jnp on the whole batch (the wrappers' bookkeeping, small next to attention) or
scalar and elementwise integer arithmetic that lowers on Triton and Mosaic alike (the kernels and
index maps).
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels import masking


class WorkList(NamedTuple):
    """The query tiles of a step, W of them, each [W] int32. Idle entries have ``tokens_W == 0``
    and point at sequence 0."""

    seq_W: jax.Array  # the tile's sequence (its row of the block tables)
    token_W: jax.Array  # its first query row in q
    tokens_W: jax.Array  # its query tokens, 0 < tokens <= block_q (0: idle)
    pos_W: jax.Array  # position of its first token in the sequence
    kv_len_W: jax.Array  # the sequence's length: its keys are at positions [0, kv_len)


def max_tiles(num_tokens: int, num_seqs: int, block_q: int) -> int:
    """Static bound on the query tiles of T tokens in B sequences: each tile holds a token, and all
    but the last of a sequence's tiles are full, so there are at most (T + n (block_q - 1)) //
    block_q of them with n = min(B, T) sequences that have tokens."""
    busy = min(num_seqs, num_tokens)
    return max(1, min(num_tokens, (num_tokens + busy * (block_q - 1)) // block_q))


def work_list(query_start_B, num_tokens_B, seq_lens_B, *, block_q: int, size: int) -> WorkList:
    """The query tiles of the step, sequence by sequence, then idle entries up to ``size``."""
    query_start_B, num_tokens_B, seq_lens_B = (jnp.asarray(x).astype(jnp.int32) for x in (
        query_start_B, num_tokens_B, seq_lens_B))
    num_tokens_B = jnp.maximum(num_tokens_B, 0)
    tiles_B = masking.cdiv(num_tokens_B, block_q)
    ends_B = jnp.cumsum(tiles_B)
    w = jnp.arange(size, dtype=jnp.int32)
    seq_W = jnp.searchsorted(ends_B, w, side="right").astype(jnp.int32)
    busy_W = seq_W < ends_B.shape[0]
    seq_W = jnp.where(busy_W, seq_W, 0)
    first_W = (w - (ends_B - tiles_B)[seq_W]) * block_q  # the tile's first token in its sequence
    tokens_W = jnp.where(busy_W, jnp.clip(num_tokens_B[seq_W] - first_W, 0, block_q), 0)
    return WorkList(
        seq_W=seq_W,
        token_W=query_start_B[seq_W] + first_W,
        tokens_W=tokens_W,
        pos_W=seq_lens_B[seq_W] - num_tokens_B[seq_W] + first_W,
        kv_len_W=seq_lens_B[seq_W],
    )


class TokenTiles(NamedTuple):
    """Where each query row of q went: tile ``tile_T`` (W when no sequence owns the row), token
    ``row_T`` of that tile."""

    tile_T: jax.Array
    row_T: jax.Array
    owned_T: jax.Array  # bool: some sequence owns the row; the others are padding, output 0


def token_tiles(work: WorkList, *, num_tokens: int, block_q: int) -> TokenTiles:
    """The inverse of the work list, one scatter of W x block_q indices."""
    size = work.seq_W.shape[0]
    j = jnp.arange(block_q, dtype=jnp.int32)
    token_WJ = work.token_W[:, None] + j
    valid_WJ = (j < work.tokens_W[:, None]) & (token_WJ >= 0) & (token_WJ < num_tokens)
    tile_WJ = jnp.broadcast_to(jnp.arange(size, dtype=jnp.int32)[:, None], token_WJ.shape)
    tile_T = jnp.full((num_tokens,), size, jnp.int32).at[
        jnp.where(valid_WJ, token_WJ, num_tokens)].set(tile_WJ, mode="drop")
    owned_T = tile_T < size
    row_T = jnp.arange(num_tokens, dtype=jnp.int32) - work.token_W[jnp.minimum(tile_T, size - 1)]
    return TokenTiles(tile_T=tile_T, row_T=jnp.where(owned_T, row_T, 0), owned_T=owned_T)


def key_blocks(pos, tokens, kv_len, *, block_k: int, sliding_window: int | None
               ) -> masking.KeyBlocks:
    """Key blocks (of ``block_k`` positions) that tile queries at positions [pos, pos + tokens) see.

    As ``masking.prefill_key_blocks`` (FlashAttention-2's causal block skipping, Dao 2023, section
    3.1.1), for queries that start at any position: keys past the tile's last query or the
    sequence's end are never visible, nor keys before the first query's window; the interior
    [interior_lo, interior_hi) is visible to every query of the tile, so it needs no mask.
    """
    q_stop = pos + tokens
    hi = jnp.maximum(jnp.minimum(q_stop, kv_len), 0)  # keys at hi and past are invisible
    lo = 0 if sliding_window is None else jnp.maximum(pos - sliding_window + 1, 0)
    lo = jnp.minimum(jnp.asarray(lo, jnp.int32), hi)
    first = lax.div(lo, block_k)
    end = jnp.where((tokens > 0) & (hi > lo), masking.cdiv(hi, block_k), first)
    if sliding_window is None:
        interior_lo = first
    else:  # the last query's window reaches the block's first key
        interior_lo = masking.cdiv(jnp.maximum(q_stop - sliding_window, 0), block_k)
    interior_lo = jnp.clip(interior_lo, first, end)
    # The block's last key is at or before the first query (so before kv_len too).
    interior_hi = lax.div(jnp.maximum(jnp.minimum(pos + 1, kv_len), 0), block_k)
    interior_hi = jnp.clip(interior_hi, interior_lo, end)
    return masking.KeyBlocks(first, interior_lo, interior_hi, end)


def split_key_blocks(blocks: masking.KeyBlocks, split, num_splits: int) -> masking.KeyBlocks:
    """Split ``split`` of ``num_splits`` of a tile's key blocks (Flash-Decoding, Dao, Haziza,
    Massa, Sizov 2023: "split the keys/values in smaller chunks"), with its part of the interior."""
    if num_splits == 1:
        return blocks
    per_split = masking.cdiv(blocks.end - blocks.first, num_splits)
    first = jnp.minimum(blocks.first + split * per_split, blocks.end)
    end = jnp.minimum(first + per_split, blocks.end)
    interior_lo = jnp.clip(blocks.interior_lo, first, end)
    interior_hi = jnp.clip(blocks.interior_hi, interior_lo, end)
    return masking.KeyBlocks(first, interior_lo, interior_hi, end)


def max_key_blocks(*, block_q: int, block_k: int, pages_per_seq: int, page_size: int,
                   sliding_window: int | None) -> int:
    """Static bound on ``end - first`` of ``key_blocks`` over all tiles (a grid extent)."""
    bound = masking.cdiv(pages_per_seq * page_size, block_k)
    if sliding_window is not None:
        # A tile sees block_q + window - 1 consecutive keys, which straddle at most one more block.
        bound = min(bound, masking.cdiv(block_q + sliding_window - 1, block_k) + 1)
    return max(bound, 1)


def visible(row, k_pos, *, pos, kv_len, group: int, sliding_window: int | None):
    """True where key ``k_pos`` is visible to tile row ``row`` (they broadcast).

    Row r is token r // G, at position pos + r // G. The comparisons with r // G are multiplied
    out, since d <= r // G iff d * G <= r and r // G < e iff r < e * G (integers, r >= 0), so the
    Mosaic kernel needs no vector integer division.
    """
    d = k_pos - pos  # key position relative to the tile's first query
    ok = (d * group <= row) & (k_pos < kv_len)
    if sliding_window is not None:
        ok &= row < (d + sliding_window) * group
    return ok
