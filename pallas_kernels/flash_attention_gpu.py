"""Causal prefill attention for GPUs: FlashAttention-2 in Pallas on Triton.

One program computes one tile of ``block_q`` queries of one head (FlashAttention-2, Dao 2023,
section 3.2: parallelise over batch, heads and query blocks) and loops over only the key blocks the
tile can see, so the [T, S] scores never exist and fully masked blocks cost nothing. Grouped-query
attention reads kv head n // G in place: the G query heads of a group load the same K/V rows (from
L2) instead of a repeated copy.

Triton tiles must have power-of-two sizes: the head dim is padded to ``Hp`` and the query and key
tails are handled with masked loads and stores, never by padding the arrays in memory.
"""

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import gpu_tiles, masking, online_softmax, poison, shapes


def _flash_attention_kernel(
    lengths_ref,  # [] int32: valid tokens of this sequence
    q_ref,  # [block_q, Hp]: one query tile of one head
    k_ref,  # [S, Hp]: every key of the kv head this query head reads
    v_ref,  # [S, Hp]
    o_ref,  # [block_q, Hp]
    *,
    sm_scale: float,
    sliding_window: int | None,
    logit_softcap: float | None,
    block_k: int,
    num_queries: int,
    head_dim: int,
):
    block_q, head_dim_padded = q_ref.shape
    num_keys = k_ref.shape[0]
    # Tiles run last-to-first: the longest causal rows start first, which balances the tail.
    q_block = pl.num_programs(0) - 1 - pl.program_id(0)
    length = lengths_ref[...]
    kv_len = jnp.minimum(length, num_keys)
    q_pos = q_block * block_q + jnp.arange(block_q)
    cols_ok = None if head_dim == head_dim_padded else jnp.arange(head_dim_padded) < head_dim
    rows_ok = None if num_queries % block_q == 0 else q_pos < num_queries
    q = gpu_tiles.load(q_ref, rows_ok, cols_ok)

    def fold_key_block(masked: bool):
        def body(k_block, state):
            k_start = pl.multiple_of(k_block * block_k, block_k)
            k_pos = k_start + jnp.arange(block_k)
            keys_ok = k_pos < kv_len if masked else None
            k = gpu_tiles.load(k_ref.at[pl.ds(k_start, block_k), :], keys_ok, cols_ok)
            v = gpu_tiles.load(v_ref.at[pl.ds(k_start, block_k), :], keys_ok, cols_ok)
            s = online_softmax.scores(q, k, sm_scale=sm_scale, logit_softcap=logit_softcap)
            vis = (masking.visible(q_pos[:, None], k_pos[None, :], kv_len, sliding_window)
                   if masked else None)
            return online_softmax.update(state, s, v, vis)

        return body

    blocks = masking.prefill_key_blocks(
        q_block, length, block_q=block_q, block_k=block_k, num_queries=num_queries,
        sliding_window=sliding_window,
    )
    state = online_softmax.initial_state(block_q, head_dim_padded)
    state = lax.fori_loop(blocks.first, blocks.interior_lo, fold_key_block(True), state)
    state = lax.fori_loop(blocks.interior_lo, blocks.interior_hi, fold_key_block(False), state)
    state = lax.fori_loop(blocks.interior_hi, blocks.end, fold_key_block(True), state)
    o = online_softmax.finalize(state, row_valid=(q_pos < length)[:, None])
    gpu_tiles.store(o_ref, o, rows_ok, cols_ok)


def choose_tiles(dims: shapes.AttentionDims, dtype, *, block_q: int | None,
                 block_k: int | None, num_stages: int | None) -> gpu_tiles.Tiles:
    """The given tiles, or the largest that fit the device's shared memory, capped by the sequence.

    The preferred tiles keep the float32 accumulator (block_q x Hp) and scores (block_q x block_k)
    within an SM's registers: 128 x 64 for rows of up to 256 bytes (bfloat16 with H <= 128), else
    64 x 64, or 64 x 32 past 512 bytes, with three pipeline stages where a K tile is at most
    64 x 128 elements. ``gpu_tiles.fit_tiles`` then shrinks what the caller left open until the
    tiles fit shared memory.
    """
    shapes.check_positive("block_q", block_q)
    shapes.check_positive("block_k", block_k)
    shapes.check_positive("num_stages", num_stages)
    for name, value in (("block_q", block_q), ("block_k", block_k)):
        if value is not None:
            gpu_tiles.check_tile_size(name, value)
    head_dim_padded = gpu_tiles.tile_size(dims.H)
    row_bytes = head_dim_padded * jnp.dtype(dtype).itemsize
    if row_bytes <= 256:
        default_q, default_k = 128, 64
    elif row_bytes <= 512:
        default_q, default_k = 64, 64
    else:
        default_q, default_k = 64, 32
    preferred_k = block_k or min(default_k, gpu_tiles.tile_size(dims.T))
    preferred = gpu_tiles.Tiles(
        block_q=block_q or min(default_q, gpu_tiles.tile_size(dims.T)), block_k=preferred_k,
        head_dim=head_dim_padded,
        num_stages=num_stages or (3 if preferred_k * head_dim_padded <= 64 * 128 else 2))
    fixed = {name for name, value in (("block_q", block_q), ("block_k", block_k),
                                      ("num_stages", num_stages)) if value}
    return gpu_tiles.fit_tiles(preferred, dtype=dtype, budget_bytes=gpu_tiles.smem_budget().bytes,
                               fixed=fixed)


@functools.partial(
    jax.jit,
    static_argnames=("sm_scale", "sliding_window", "logit_softcap", "block_q", "block_k",
                     "num_warps", "num_stages", "interpret", "poison_output"),
)
def flash_attention_gpu(
    q_BTNH: jax.Array,
    k_BSKH: jax.Array,
    v_BSKH: jax.Array,
    lengths_B: jax.Array,
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    logit_softcap: float | None = None,
    block_q: int | None = None,
    block_k: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    interpret: bool = False,
    poison_output: bool = False,
) -> jax.Array:
    """Causal attention of queries at positions 0..T-1 against keys 0..S-1 (S >= T): o_BTNH.

    Semantics are those of ``reference.attention_reference`` with ``q_offset=0``. Block sizes are
    powers of two >= 16; by default they, and ``num_stages``, are the largest that fit the device's
    shared memory (``choose_tiles``), never larger than the (padded) sequence. ``poison_output``
    starts the output as NaN (see ``poison``).
    """
    dims = shapes.check_prefill(q_BTNH, k_BSKH, v_BSKH, lengths_B, sliding_window=sliding_window,
                                logit_softcap=logit_softcap)
    tiles = choose_tiles(dims, q_BTNH.dtype, block_q=block_q, block_k=block_k,
                         num_stages=num_stages)
    block_q, block_k, head_dim_padded = tiles.block_q, tiles.block_k, tiles.head_dim
    num_q_blocks = pl.cdiv(dims.T, block_q)
    G = dims.G

    def q_tile(i, b, n):
        return b, num_q_blocks - 1 - i, n, 0

    def kv_head(i, b, n):
        return b, 0, lax.div(n, G), 0

    in_specs = [
        pl.BlockSpec((None,), lambda i, b, n: (b,)),
        pl.BlockSpec((None, block_q, None, head_dim_padded), q_tile),
        pl.BlockSpec((None, dims.S, None, head_dim_padded), kv_head),
        pl.BlockSpec((None, dims.S, None, head_dim_padded), kv_head),
    ]
    out_spec = pl.BlockSpec((None, block_q, None, head_dim_padded), q_tile)
    out_shape = jax.ShapeDtypeStruct(q_BTNH.shape, q_BTNH.dtype)
    kernel = functools.partial(
        _flash_attention_kernel, sm_scale=sm_scale, sliding_window=sliding_window,
        logit_softcap=logit_softcap, block_k=block_k, num_queries=dims.T, head_dim=dims.H,
    )
    args = [shapes.as_lengths(lengths_B), q_BTNH, k_BSKH, v_BSKH]
    aliases = {}
    if poison_output:
        kernel, args, in_specs, aliases = poison.alias_nan_outputs(
            kernel, args, in_specs, [out_shape], [out_spec])
    return pl.pallas_call(
        kernel,
        grid=(num_q_blocks, dims.B, dims.N),
        in_specs=in_specs,
        out_specs=out_spec,
        out_shape=out_shape,
        input_output_aliases=aliases,
        compiler_params=plgpu.CompilerParams(
            num_warps=num_warps or (4 if head_dim_padded <= 64 else 8),
            num_stages=tiles.num_stages,
        ),
        interpret=interpret,
        name="flash_attention_gpu",
    )(*args)
