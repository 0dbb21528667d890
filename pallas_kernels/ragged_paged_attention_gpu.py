"""Ragged paged attention for GPUs: one serving step's attention in Pallas on Triton.

A step attends decode tokens and prefill chunks of many sequences together, their keys held in
fixed-size pages that each sequence's block table lists in order (PagedAttention, Kwon et al. 2023,
section 4.1). One program computes one query tile of one sequence (``ragged_paging``: block_q tokens
times the G query heads of one kv head, so a K/V tile is read once per group) against one kv head,
walking the sequence's key blocks with the online softmax of FlashAttention-2 (Dao 2023,
Algorithm 1): fully masked blocks are skipped, the interior needs no mask (section 3.1.1). A key
block gathers its rows page by page: key s is row s % Z of page block_tables[b, s // Z], so a block
may span pages in any order and a page size need not be a power of two. With ``num_splits`` C > 1
each program covers one of C splits of the tile's keys and the splits are merged after
(Flash-Decoding, Dao, Haziza, Massa, Sizov 2023), for steps of few tiles (decode at small batch).

Triton has no scalar prefetch to steer block indices, so every program's refs span the whole
arrays (a Triton block is a pointer and strides, not a copy) and the kernel computes its rows: the
work-list entry, the layer and the page ids are loaded from operands. Int8 pages come with float32
scales [L * P * Z] per kv head, loaded with the same row indices as the tile and multiplied into it
in registers. Letters: T query tokens, N query heads, K kv heads, G = N / K, H head dim (Hp
padded), B sequences, X pages per sequence, P pages, Z tokens per page, L layers, W query tiles,
C key splits.
"""

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import gpu_tiles, online_softmax, poison, ragged_paging, shapes
from pallas_kernels.decode_attention_gpu import default_num_splits


def _load_scales(ref, rows_ok):
    """Load a [rows] vector of scales, reading 0 (and no memory) where masked."""
    if rows_ok is None:
        return plgpu.load(ref)
    return plgpu.load(ref, mask=rows_ok, other=jnp.zeros((), ref.dtype))


def _ragged_paged_kernel(
    work_ref,  # [5] int32: this program's query tile, the fields of ragged_paging.WorkList
    layer_ref,  # [] int32: the layer of the stacked pages to read
    block_tables_ref,  # [B * X] int32: each sequence's page ids in order, clamped to [0, P)
    q_ref,  # [T * N, Hp]: head n of query token t at row t * N + n
    k_ref,  # [L * P * Z, Hp]: this kv head's keys; row z of page p of layer l is (l P + p) Z + z
    v_ref,  # [L * P * Z, Hp]  (k and v: uint16 holds bfloat16 bits; or int8, then scaled)
    *refs,  # int8 pages: their scales, ks and vs [L * P * Z] float32 (rows as k's); then
    #         o [T * N * C, Hp]: head n of token t, split c, at row (t N + n) C + c; with C > 1,
    #         lse [T * N * C] float32, each split's base-2 log-sum-exp (-inf: no key)
    sm_scale: float,
    sliding_window: int | None,
    logit_softcap: float | None,
    block_k: int,
    rows: int,
    num_splits: int,
    dims: shapes.PagedDims,
    int8: bool,
):
    ks_ref, vs_ref = refs[:2] if int8 else (None, None)
    o_ref, *lse_ref = refs[2:] if int8 else refs
    G, Z = dims.G, dims.Z
    head_dim_padded = q_ref.shape[1]
    seq, token, tokens, pos, kv_len = (work_ref[field] for field in range(5))
    kv_head, split = pl.program_id(1), pl.program_id(2)
    r = jnp.arange(rows)
    row_token = token + r // G
    rows_ok = (r < tokens * G) & (row_token >= 0) & (row_token < dims.T)
    q_row = row_token * dims.N + kv_head * G + r % G
    cols = jnp.arange(head_dim_padded)
    cols_ok = None if dims.H == head_dim_padded else cols < dims.H
    q = gpu_tiles.load(q_ref.at[q_row[:, None], cols[None, :]], rows_ok, cols_ok)
    layer_base = layer_ref[...] * (dims.P * Z)
    table_base = seq * dims.X

    def fold_key_block(masked: bool):
        def body(k_block, state):
            k_pos = k_block * block_k + jnp.arange(block_k)
            page = block_tables_ref[table_base + jnp.minimum(k_pos // Z, dims.X - 1)]
            key_rows = layer_base + page * Z + k_pos % Z
            key_row = key_rows[:, None]
            keys_ok = k_pos < kv_len if masked else None
            k = gpu_tiles.load(k_ref.at[key_row, cols[None, :]], keys_ok, cols_ok)
            v = gpu_tiles.load(v_ref.at[key_row, cols[None, :]], keys_ok, cols_ok)
            if int8:  # each key's scale, from the same rows: dequantized as loaded
                k_scale, v_scale = (_load_scales(ref.at[key_rows], keys_ok)[:, None]
                                    for ref in (ks_ref, vs_ref))
                k, v = (shapes.dequantize(x, scale, q.dtype)
                        for x, scale in ((k, k_scale), (v, v_scale)))
            else:
                k, v = shapes.as_values(k), shapes.as_values(v)
            s = online_softmax.scores(q, k, sm_scale=sm_scale, logit_softcap=logit_softcap)
            vis = ragged_paging.visible(r[:, None], k_pos[None, :], pos=pos, kv_len=kv_len,
                                        group=G, sliding_window=sliding_window) if masked else None
            return online_softmax.update(state, s, v, vis)

        return body

    blocks = ragged_paging.key_blocks(pos, tokens, kv_len, block_k=block_k,
                                      sliding_window=sliding_window)
    blocks = ragged_paging.split_key_blocks(blocks, split, num_splits)
    state = online_softmax.initial_state(rows, head_dim_padded)
    state = jax.lax.fori_loop(blocks.first, blocks.interior_lo, fold_key_block(True), state)
    state = jax.lax.fori_loop(blocks.interior_lo, blocks.interior_hi, fold_key_block(False), state)
    state = jax.lax.fori_loop(blocks.interior_hi, blocks.end, fold_key_block(True), state)
    o = online_softmax.finalize(state, row_valid=True)
    o_row = q_row * num_splits + split
    gpu_tiles.store(o_ref.at[o_row[:, None], cols[None, :]], o, rows_ok, cols_ok)
    if lse_ref:
        plgpu.store(lse_ref[0].at[o_row], online_softmax.log_sum_exp(state)[:, 0], mask=rows_ok)


def choose_tiles(dims: shapes.PagedDims, dtype, *, block_q: int | None, block_k: int | None,
                 num_stages: int | None) -> tuple[gpu_tiles.Tiles, int]:
    """(tiles, query tokens per tile): the given sizes, or the largest that fit shared memory.

    A tile's rows (``Tiles.block_q``) are its tokens times G, padded to a power of two >= 16. By
    default a tile has about 64 rows (64 // G tokens, at least one, at most T), and key blocks and
    stages are those of the prefill kernel; ``gpu_tiles.fit_tiles`` then shrinks what the caller
    left open, never below the G rows of one token.
    """
    for name, value in (("block_q", block_q), ("block_k", block_k), ("num_stages", num_stages)):
        shapes.check_positive(name, value)
    if block_k is not None:
        gpu_tiles.check_tile_size("block_k", block_k)
    head_dim_padded = gpu_tiles.tile_size(dims.H)
    default_k = 64 if head_dim_padded * jnp.dtype(dtype).itemsize <= 256 else 32
    tokens = min(block_q or max(1, 64 // dims.G), dims.T)
    preferred_k = block_k or default_k
    preferred = gpu_tiles.Tiles(
        block_q=gpu_tiles.tile_size(tokens * dims.G), block_k=preferred_k,
        head_dim=head_dim_padded,
        num_stages=num_stages or (3 if preferred_k * head_dim_padded <= 64 * 128 else 2))
    fixed = {name for name, value in (("block_q", block_q), ("block_k", block_k),
                                      ("num_stages", num_stages)) if value}
    budget = gpu_tiles.smem_budget().bytes
    tiles = gpu_tiles.fit_tiles(preferred, dtype=dtype, budget_bytes=budget, fixed=fixed)
    one_token = gpu_tiles.tile_size(dims.G)
    if tiles.block_q < one_token:
        tiles = gpu_tiles.fit_tiles(
            gpu_tiles.Tiles(block_q=one_token, block_k=preferred.block_k, head_dim=head_dim_padded,
                            num_stages=preferred.num_stages),
            dtype=dtype, budget_bytes=budget, fixed=fixed | {"block_q"})
    return tiles, tokens if block_q else max(1, min(tokens, tiles.block_q // dims.G))


@functools.partial(
    jax.jit,
    static_argnames=("sm_scale", "sliding_window", "logit_softcap", "block_q", "block_k",
                     "num_splits", "num_warps", "num_stages", "interpret", "poison_output"),
)
def ragged_paged_attention_gpu(
    q_TNH: jax.Array,
    k_pages: jax.Array | tuple[jax.Array, jax.Array],
    v_pages: jax.Array | tuple[jax.Array, jax.Array],
    block_tables_BX: jax.Array,
    query_start_B: jax.Array,
    num_tokens_B: jax.Array,
    seq_lens_B: jax.Array,
    *,
    sm_scale: float,
    layer: jax.Array | int | None = None,
    sliding_window: int | None = None,
    logit_softcap: float | None = None,
    block_q: int | None = None,
    block_k: int | None = None,
    num_splits: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    interpret: bool = False,
    poison_output: bool = False,
) -> jax.Array:
    """Attention of a ragged batch of query tokens over paged keys: o_TNH in q's dtype.

    Semantics are those of ``reference.ragged_paged_attention_reference``. The pages are
    [P, Z, K, H], or with ``layer`` (an int32 scalar, traced or not) the stacked [L, P, Z, K, H],
    read in place; they may hold bfloat16 as uint16 bits, or be int8 pairs (values, float32 scales
    [..., Z, K]) for k and v both: each tile is loaded as int8 with its rows' scales and
    dequantized in registers (in float32, then q's dtype). ``block_q`` is query tokens per tile,
    ``block_k`` (a power of two >= 16) keys per step; they and ``num_stages`` default to
    ``choose_tiles``, ``num_splits`` to ``decode_attention_gpu.default_num_splits`` over the tiles.
    ``poison_output`` starts the kernel's outputs as NaN (see ``poison``).
    """
    dims = shapes.check_ragged_paged(
        q_TNH, k_pages, v_pages, block_tables_BX, query_start_B, num_tokens_B, seq_lens_B,
        layer=layer, sliding_window=sliding_window, logit_softcap=logit_softcap)
    k_pages, v_pages, k_scales, v_scales = shapes.split_int8_pages(k_pages, v_pages)
    int8 = k_scales is not None
    shapes.check_positive("num_splits", num_splits)
    tiles, tokens_per_tile = choose_tiles(dims, q_TNH.dtype, block_q=block_q, block_k=block_k,
                                          num_stages=num_stages)
    T, N, K, H, L, P, Z = dims.T, dims.N, dims.K, dims.H, dims.L, dims.P, dims.Z
    W = ragged_paging.max_tiles(T, dims.B, tokens_per_tile)
    work = ragged_paging.work_list(query_start_B, num_tokens_B, seq_lens_B,
                                   block_q=tokens_per_tile, size=W)
    C = num_splits or default_num_splits(
        batch=W, kv_heads=K, num_key_blocks=ragged_paging.max_key_blocks(
            block_q=tokens_per_tile, block_k=tiles.block_k, pages_per_seq=dims.X, page_size=Z,
            sliding_window=sliding_window))
    Hp = tiles.head_dim

    def whole(*shape):
        return pl.BlockSpec(shape, lambda w, k, c: (0,) * len(shape))

    kv_spec = pl.BlockSpec((L * P * Z, None, Hp), lambda w, k, c: (0, k, 0))
    in_specs = [pl.BlockSpec((None, 5), lambda w, k, c: (w, 0)),
                pl.BlockSpec((None,), lambda w, k, c: (0,)),
                whole(dims.B * dims.X), whole(T * N, Hp), kv_spec, kv_spec]
    if int8:  # the scales of this kv head, [L * P * Z], indexed by the same rows as the pages
        in_specs += [pl.BlockSpec((L * P * Z, None), lambda w, k, c: (0, k))] * 2
    out_shapes = [jax.ShapeDtypeStruct((T * N * C, H), q_TNH.dtype if C == 1 else jnp.float32)]
    out_specs = [whole(T * N * C, Hp)]
    if C > 1:
        out_shapes.append(jax.ShapeDtypeStruct((T * N * C,), jnp.float32))
        out_specs.append(whole(T * N * C))
    kernel = functools.partial(
        _ragged_paged_kernel, sm_scale=sm_scale, sliding_window=sliding_window,
        logit_softcap=logit_softcap, block_k=tiles.block_k, rows=tiles.block_q, num_splits=C,
        dims=dims, int8=int8)
    args = [
        jnp.stack(work, axis=1),
        shapes.as_layer(layer, L),
        jnp.clip(jnp.asarray(block_tables_BX).astype(jnp.int32), 0, P - 1).reshape(-1),
        q_TNH.reshape(T * N, H),
        k_pages.reshape(L * P * Z, K, H),  # free: the row-major pages are already rows
        v_pages.reshape(L * P * Z, K, H),
    ]
    if int8:
        args += [k_scales.reshape(L * P * Z, K), v_scales.reshape(L * P * Z, K)]  # free as well
    aliases = {}
    if poison_output:
        kernel, args, in_specs, aliases = poison.alias_nan_outputs(
            kernel, args, in_specs, out_shapes, out_specs)
    outs = pl.pallas_call(
        kernel,
        grid=(W, K, C),
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shapes,
        input_output_aliases=aliases,
        compiler_params=plgpu.CompilerParams(
            num_warps=num_warps or (4 if tiles.block_q * Hp <= 64 * 128 else 8),
            num_stages=tiles.num_stages),
        interpret=interpret,
        name="ragged_paged_attention_gpu",
    )(*args)
    if C == 1:
        o_TNH = outs[0].reshape(T, N, H)
    else:
        o_TNH = online_softmax.combine_splits(
            outs[0].reshape(1, T * N, C, 1, H), outs[1].reshape(1, T * N, C, 1)).reshape(T, N, H)
    # Rows no sequence owns are padding; no program wrote them.
    owned_T = ragged_paging.token_tiles(work, num_tokens=T, block_q=tokens_per_tile).owned_T
    return jnp.where(owned_T[:, None, None], o_TNH, 0).astype(q_TNH.dtype)
