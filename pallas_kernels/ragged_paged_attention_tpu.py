"""Ragged paged attention for TPUs: one serving step's attention in Pallas on Mosaic.

The grid is (query tile, kv head, key step). A query tile is block_q tokens of one sequence times
the G query heads of one kv head (``ragged_paging``); the wrapper gathers each tile's rows of q into
a [W, K, R, H] array (R = block_q G rows, a copy of q) so that a tile is one block, and gathers the
output back. The work list, the block tables and the layer are prefetched into SMEM, and the index
maps walk the pages: key step j fetches the ``pages_per_step`` pages that follow the tile's first
visible page, named by the sequence's block table (PagedAttention, Kwon et al. 2023, section 4.1),
each through its own operand of the same page array, and folds them as one block of keys. Steps
past the tile's last visible page re-name it, which Pallas does not fetch again, and compute
nothing. Each step folds its block into the online-softmax state kept in VMEM scratch and the last
step writes the tile (FlashAttention-2, Dao 2023, Algorithm 1, with the query tiles in the grid,
section 3.2). Pages read in place when H % 128 == 0 ([L, P, Z, K*H], head k a lane block);
otherwise the layer's pages are transposed to [P, K, Z, H] first, a copy (``tpu_tiles``). Int8
pages come with their float32 scales [L, P, Z, K]: each page's [Z, K] block of them is fetched
beside it and the page is dequantized in VMEM as it is read.

Letters: T query tokens, N query heads, K kv heads, G = N / K, H head dim, B sequences, X pages per
sequence, P pages, Z tokens per page, L layers, W query tiles, R rows of a tile.
"""

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels import online_softmax, poison, ragged_paging, shapes, tpu_tiles

# Defaults: about 128 rows per query tile and 128 keys per step (the MXU's width), when they fit.
DEFAULT_ROWS = 128
DEFAULT_KEYS_PER_STEP = 128


def _ragged_paged_kernel(
    seq_ref,  # [W] int32 in SMEM: each tile's sequence (ragged_paging.WorkList) (index maps only)
    pos_ref,  # [W] int32 in SMEM: position of each tile's first token
    tokens_ref,  # [W] int32 in SMEM: each tile's tokens (0: idle)
    kv_len_ref,  # [W] int32 in SMEM: its sequence's length
    block_tables_ref,  # [B * X] int32 in SMEM: each sequence's page ids (index maps only)
    layer_ref,  # [1] int32 in SMEM: the layer of the stacked pages (index maps only)
    q_ref,  # [R, H]: tile rows for one kv head; row j G + g is head g of token j (0 past tokens)
    *refs,  # pages_per_step K pages [Z, H], as many V pages; int8 pages: then the scales of the
    #         K pages [Z, K] (every kv head's) and of the V pages; then o [R, H] (q's dtype) and
    #         the float32 scratch m [R, 128], l [R, 128] and acc [R, H]
    sm_scale: float,
    sliding_window: int | None,
    logit_softcap: float | None,
    pages_per_step: int,
    group: int,
    int8: bool,
):
    del seq_ref, block_tables_ref, layer_ref  # read by the index maps only
    pages = 2 * pages_per_step
    k_refs, v_refs = refs[:pages_per_step], refs[pages_per_step:pages]
    if int8:
        ks_refs = refs[pages:pages + pages_per_step]
        vs_refs = refs[pages + pages_per_step:2 * pages]
        refs = refs[2 * pages:]
    else:
        ks_refs = vs_refs = [None] * pages_per_step
        refs = refs[pages:]
    o_ref, m_ref, l_ref, acc_ref = refs
    rows, page_size = q_ref.shape[0], k_refs[0].shape[0]
    w, head, step = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    pos, tokens, kv_len = pos_ref[w], tokens_ref[w], kv_len_ref[w]
    blocks = ragged_paging.key_blocks(pos, tokens, kv_len, block_k=page_size,
                                      sliding_window=sliding_window)
    first_slot = blocks.first + step * pages_per_step
    # Keys at hi and past are visible to no row of the tile: a partial page's stale rows, or the
    # re-named page of a slot past the tile's range.
    hi = jnp.minimum(pos + tokens, kv_len)

    @pl.when(step == 0)
    def _init():
        tpu_tiles.init_state(m_ref, l_ref, acc_ref)

    @pl.when(first_slot < blocks.end)
    def _fold_pages():
        # The step's pages are consecutive slots, so their keys are one run of positions.
        block_k = pages_per_step * page_size
        k_start = first_slot * page_size
        k_pos = k_start + lax.broadcasted_iota(jnp.int32, (rows, block_k), 1)
        row = lax.broadcasted_iota(jnp.int32, (rows, block_k), 0)
        visible = ragged_paging.visible(row, k_pos, pos=pos, kv_len=kv_len, group=group,
                                        sliding_window=sliding_window)
        k = jnp.concatenate([_load_page(ref, s_ref, head, q_ref.dtype)
                             for ref, s_ref in zip(k_refs, ks_refs)], axis=0)
        v = jnp.concatenate([_load_page(ref, s_ref, head, q_ref.dtype)
                             for ref, s_ref in zip(v_refs, vs_refs)], axis=0)
        # A 0 weight times a stale NaN would still be NaN.
        v_pos = k_start + lax.broadcasted_iota(jnp.int32, (block_k, 1), 0)
        v = jnp.where(v_pos < hi, v, jnp.zeros_like(v))
        s = online_softmax.scores(q_ref[...], k, sm_scale=sm_scale, logit_softcap=logit_softcap)
        state = tpu_tiles.read_state(m_ref, l_ref, acc_ref)
        tpu_tiles.write_state(online_softmax.update(state, s, v, visible), m_ref, l_ref, acc_ref)

    @pl.when(step == pl.num_programs(2) - 1)
    def _write_output():
        state = tpu_tiles.read_state(m_ref, l_ref, acc_ref)
        o_ref[...] = online_softmax.finalize(state, row_valid=True).astype(o_ref.dtype)


def _load_page(ref, scales_ref, head, dtype) -> jax.Array:
    """A page [Z, H] as values: bfloat16 bits bitcast; int8 times its rows' scales of kv head
    ``head`` (the program's).

    The scales' block is the page's [Z, K] of every kv head (see ``scales_spec``); this head's
    column is picked with a select and a lane sum (exact: one nonzero term), not a dynamic lane
    slice, then multiplied into the tile in float32.
    """
    if scales_ref is None:
        return shapes.as_values(ref[...])
    scales = scales_ref[...]
    ours = lax.broadcasted_iota(jnp.int32, scales.shape, 1) == head
    column = jnp.sum(jnp.where(ours, scales, 0.0), axis=1, keepdims=True)
    return shapes.dequantize(ref[...], column, dtype)


def vmem_bytes(*, rows: int, page_size: int, pages_per_step: int, head_dim: int, dtype,
               int8_kv_heads: int | None = None) -> int:
    """VMEM of one program's tiles: q, the K and V pages, o, and the online-softmax scratch.

    With ``int8_kv_heads`` (K) the pages are int8 and each comes with its float32 block of scales
    [page_size, K].
    """
    tile = ((rows, head_dim), dtype)
    page = ((page_size, head_dim), dtype if int8_kv_heads is None else jnp.int8)
    scales = [] if int8_kv_heads is None else [((page_size, int8_kv_heads), jnp.float32)]
    return tpu_tiles.vmem_bytes(
        blocks=[tile, *[page, *scales] * (2 * pages_per_step), tile],
        scratch=[((rows, tpu_tiles.NUM_LANES), jnp.float32)] * 2
        + [((rows, head_dim), jnp.float32)])


def _stacked_scales(scales: jax.Array, layer, head_dim: int) -> jax.Array:
    """The scales [L, P, Z, K] the kernel reads at ``to_tiled_cache``'s layer: read in place where
    it reads the pages in place; where it slices the layer out, that layer's scales ([1, P, Z, K],
    a copy 1/H the size of the pages' own)."""
    if layer is None:
        return scales.reshape(1, *scales.shape)
    if tpu_tiles.fuses_heads(head_dim):
        return scales
    return lax.dynamic_index_in_dim(scales, layer[0], keepdims=True)


def tile_queries(q_TNH: jax.Array, work: ragged_paging.WorkList, *, block_q: int, kv_heads: int
                 ) -> jax.Array:
    """q_WKRH: tile w's rows for kv head k, head g of its token j at row j G + g (0 past its
    tokens)."""
    T, N, H = q_TNH.shape
    W, G = work.seq_W.shape[0], N // kv_heads
    j = jnp.arange(block_q)
    token_WJ = jnp.clip(work.token_W[:, None] + j, 0, T - 1)
    q_WJNH = jnp.where((j < work.tokens_W[:, None])[:, :, None, None], q_TNH[token_WJ], 0)
    return (q_WJNH.reshape(W, block_q, kv_heads, G, H).transpose(0, 2, 1, 3, 4)
            .reshape(W, kv_heads, block_q * G, H))


def untile_output(o_WKRH: jax.Array, tiles: ragged_paging.TokenTiles, *, block_q: int
                  ) -> jax.Array:
    """o_TNH from the tiles' rows: each owned row of q from its tile, the others 0."""
    W, K, R, H = o_WKRH.shape
    T = tiles.tile_T.shape[0]
    o_WKJGH = o_WKRH.reshape(W, K, block_q, R // block_q, H)
    o_TKGH = o_WKJGH[jnp.minimum(tiles.tile_T, W - 1), :, tiles.row_T]
    return jnp.where(tiles.owned_T[:, None, None, None], o_TKGH, 0).reshape(T, -1, H)


@functools.partial(
    jax.jit,
    static_argnames=("sm_scale", "sliding_window", "logit_softcap", "block_q", "pages_per_step",
                     "interpret", "poison_output"),
)
def ragged_paged_attention_tpu(
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
    pages_per_step: int | None = None,
    interpret: bool = False,
    poison_output: bool = False,
) -> jax.Array:
    """Attention of a ragged batch of query tokens over paged keys: o_TNH in q's dtype.

    Semantics are those of ``reference.ragged_paged_attention_reference``. The pages are
    [P, Z, K, H], or with ``layer`` (an int32 scalar, traced or not) the stacked [L, P, Z, K, H];
    they may hold bfloat16 as uint16 bits, or be int8 pairs (values, float32 scales [..., Z, K])
    for k and v both: each page is fetched as int8 with its scales and dequantized in VMEM (in
    float32, then q's dtype). ``block_q`` is query tokens per tile (default
    ``DEFAULT_ROWS // G``, at most T), ``pages_per_step`` the pages each key step fetches (default
    ``DEFAULT_KEYS_PER_STEP // Z``, at most X). ``interpret`` runs Pallas' TPU interpreter;
    ``poison_output`` starts the output as NaN (see ``poison`` and ``tpu_tiles.interpreter``).
    """
    dims = shapes.check_ragged_paged(
        q_TNH, k_pages, v_pages, block_tables_BX, query_start_B, num_tokens_B, seq_lens_B,
        layer=layer, sliding_window=sliding_window, logit_softcap=logit_softcap)
    k_pages, v_pages, k_scales, v_scales = shapes.split_int8_pages(k_pages, v_pages)
    int8 = k_scales is not None
    shapes.check_positive("block_q", block_q)
    shapes.check_positive("pages_per_step", pages_per_step)
    T, K, G, H, X, Z = dims.T, dims.K, dims.G, dims.H, dims.X, dims.Z
    block_q = min(block_q or max(1, DEFAULT_ROWS // G), T)
    pages_per_step = min(pages_per_step or max(1, DEFAULT_KEYS_PER_STEP // Z), X)
    tpu_tiles.check_vmem("ragged_paged_attention_tpu", vmem_bytes(
        rows=block_q * G, page_size=Z, pages_per_step=pages_per_step, head_dim=H,
        dtype=q_TNH.dtype, int8_kv_heads=K if int8 else None), block_q=block_q,
        pages_per_step=pages_per_step)
    W = ragged_paging.max_tiles(T, dims.B, block_q)
    work = ragged_paging.work_list(query_start_B, num_tokens_B, seq_lens_B, block_q=block_q,
                                   size=W)
    num_steps = pl.cdiv(ragged_paging.max_key_blocks(
        block_q=block_q, block_k=Z, pages_per_seq=X, page_size=Z, sliding_window=sliding_window),
        pages_per_step)

    def page_index(i: int):
        """Page i of each key step: slot first + step * pages_per_step + i of the block table,
        held at the tile's last visible slot past its range."""
        def index(w, k, step, seq_ref, pos_ref, tokens_ref, kv_len_ref, tables_ref, layer_ref):
            pages = ragged_paging.key_blocks(pos_ref[w], tokens_ref[w], kv_len_ref[w], block_k=Z,
                                             sliding_window=sliding_window)
            last = jnp.clip(pages.end - 1, 0, X - 1)
            slot = jnp.clip(pages.first + step * pages_per_step + i, 0, last)
            return layer_ref[0], tables_ref[seq_ref[w] * X + slot], k, 0

        return index

    def page_spec(i: int) -> pl.BlockSpec:
        return tpu_tiles.cache_tile_spec(H, Z, page_index(i))

    def scales_spec(i: int) -> pl.BlockSpec:
        """The scales of page i of each key step: its [Z, K] block of the [L, P, Z, K] scales,
        every kv head's, as they lie. Mosaic DMAs blocks whose last two dims are multiples of
        (8, 128) or whole: a [Z] block of one head cannot be cut from any layout (with Z last,
        e.g. [L, P, K, Z], a copy, the second-to-last dim is cut to 1), so each program fetches
        the page's whole (Z, K), both dims whole: no copy of the scales, a DMA of K x 4 bytes per
        slot next to the page's H (in VMEM the block pads to 128 lanes, see ``vmem_bytes``), and
        ``_load_page`` picks its head's column."""
        def index(*args):
            layer, page, _, _ = page_index(i)(*args)
            return layer, page, 0, 0

        return pl.BlockSpec((None, None, Z, K), index)

    def per_tile(w, k, step, *prefetch_refs):
        return w, k, 0, 0

    tile_spec = pl.BlockSpec((None, None, block_q * G, H), per_tile)
    in_specs = [tile_spec, *[page_spec(i) for i in range(pages_per_step)] * 2]
    if int8:
        in_specs += [scales_spec(i) for i in range(pages_per_step)] * 2
    out_shape = jax.ShapeDtypeStruct((W, K, block_q * G, H), q_TNH.dtype)
    kernel = functools.partial(
        _ragged_paged_kernel, sm_scale=sm_scale, sliding_window=sliding_window,
        logit_softcap=logit_softcap, pages_per_step=pages_per_step, group=G, int8=int8)
    layer = None if layer is None else shapes.as_layer(layer, dims.L)
    k_tiled, read_layer = tpu_tiles.to_tiled_cache(k_pages, layer)  # pages as the batch axis
    v_tiled, _ = tpu_tiles.to_tiled_cache(v_pages, layer)
    tables = jnp.clip(jnp.asarray(block_tables_BX).astype(jnp.int32), 0, dims.P - 1).reshape(-1)
    args = [work.seq_W, work.pos_W, work.tokens_W, work.kv_len_W, tables, read_layer,
            tile_queries(q_TNH, work, block_q=block_q, kv_heads=K),
            *[k_tiled] * pages_per_step, *[v_tiled] * pages_per_step]
    if int8:
        args += [*[_stacked_scales(k_scales, layer, H)] * pages_per_step,
                 *[_stacked_scales(v_scales, layer, H)] * pages_per_step]
    aliases = {}
    if poison_output:
        kernel, args, in_specs, aliases = poison.alias_nan_outputs(
            kernel, args, in_specs, [out_shape], [tile_spec])
    o_WKRH = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=6,
            grid=(W, K, num_steps),
            in_specs=in_specs,
            out_specs=tile_spec,
            scratch_shapes=tpu_tiles.state_scratch_shapes(block_q * G, H),
        ),
        out_shape=out_shape,
        input_output_aliases=aliases,
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "arbitrary")),
        interpret=tpu_tiles.interpreter(interpret, poison_output),
        name="ragged_paged_attention_tpu",
    )(*args)
    tiles = ragged_paging.token_tiles(work, num_tokens=T, block_q=block_q)
    return untile_output(o_WKRH, tiles, block_q=block_q)
