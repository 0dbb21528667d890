"""Causal prefill attention for TPUs: FlashAttention-2 in Pallas on Mosaic.

The grid is (batch, query head, query block, key step). The key step is the innermost, sequential
axis: each step folds one [block_k, H] block of K and V into the online-softmax state kept in VMEM
scratch, and the last step writes the output tile (FlashAttention-2, Dao 2023, Algorithm 1, with
the outer loop over query blocks in the grid, section 3.2). The sequence lengths are prefetched
into SMEM so the index maps can choose which key block each step fetches: step j fetches block
first + j of the tile's visible range, and steps past the range re-name the last block, which
Pallas does not fetch again; the kernel skips their arithmetic. Grouped-query attention reads kv
head n // G in place.
"""

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels import masking, online_softmax, poison, shapes, tpu_tiles


def _flash_attention_kernel(
    lengths_ref,  # [B] int32 in SMEM: valid tokens of each sequence
    q_ref,  # [block_q, H]: one query tile of one head
    k_ref,  # [block_k, H]: key block `blocks.first + step` of the kv head n // G
    v_ref,  # [block_k, H]
    o_ref,  # [block_q, H]
    m_ref,  # [block_q, 128] float32 scratch: online-softmax running max
    l_ref,  # [block_q, 128] float32 scratch: running sum
    acc_ref,  # [block_q, H] float32 scratch: unnormalised output
    *,
    sm_scale: float,
    sliding_window: int | None,
    logit_softcap: float | None,
    num_queries: int,
    num_keys: int,
):
    block_q, block_k = q_ref.shape[0], k_ref.shape[0]
    q_block, step = pl.program_id(2), pl.program_id(3)
    length = lengths_ref[pl.program_id(0)]
    kv_len = jnp.minimum(length, num_keys)
    blocks = masking.prefill_key_blocks(
        q_block, length, block_q=block_q, block_k=block_k, num_queries=num_queries,
        sliding_window=sliding_window,
    )
    k_block = blocks.first + step

    @pl.when(step == 0)
    def _init():
        tpu_tiles.init_state(m_ref, l_ref, acc_ref)

    def fold_key_block(masked: bool):
        v = v_ref[...]
        visible = None
        if masked:
            q_pos = q_block * block_q + lax.broadcasted_iota(jnp.int32, (block_q, block_k), 0)
            k_pos = k_block * block_k + lax.broadcasted_iota(jnp.int32, (block_q, block_k), 1)
            visible = masking.visible(q_pos, k_pos, kv_len, sliding_window)
            # Rows past the cache end are stale VMEM; a 0 weight times NaN would still be NaN.
            v_pos = k_block * block_k + lax.broadcasted_iota(jnp.int32, (block_k, 1), 0)
            v = jnp.where(v_pos < kv_len, v, jnp.zeros_like(v))
        s = online_softmax.scores(q_ref[...], k_ref[...], sm_scale=sm_scale,
                                  logit_softcap=logit_softcap)
        state = tpu_tiles.read_state(m_ref, l_ref, acc_ref)
        tpu_tiles.write_state(online_softmax.update(state, s, v, visible), m_ref, l_ref, acc_ref)

    in_range = k_block < blocks.end
    interior = (k_block >= blocks.interior_lo) & (k_block < blocks.interior_hi)
    pl.when(in_range & interior)(lambda: fold_key_block(masked=False))
    pl.when(in_range & jnp.logical_not(interior))(lambda: fold_key_block(masked=True))

    @pl.when(step == pl.num_programs(3) - 1)
    def _write_output():
        q_pos = q_block * block_q + lax.broadcasted_iota(jnp.int32, (block_q, 1), 0)
        state = tpu_tiles.read_state(m_ref, l_ref, acc_ref)
        o_ref[...] = online_softmax.finalize(state, row_valid=q_pos < length).astype(o_ref.dtype)


def _check_block(name: str, block: int, *, multiple: int, whole: int) -> None:
    if block % multiple and block != whole:
        raise ValueError(f"{name}={block} must be a multiple of {multiple} or the whole axis "
                         f"({whole}): Mosaic tiles are (8, 128)-aligned")


def vmem_bytes(*, block_q: int, block_k: int, head_dim: int, dtype) -> int:
    """VMEM of one program's tiles: q, K, V and o blocks, and the online-softmax scratch."""
    q_tile, kv_tile = ((block_q, head_dim), dtype), ((block_k, head_dim), dtype)
    return tpu_tiles.vmem_bytes(
        blocks=[q_tile, kv_tile, kv_tile, q_tile],
        scratch=[((block_q, tpu_tiles.NUM_LANES), jnp.float32)] * 2
        + [((block_q, head_dim), jnp.float32)])


@functools.partial(
    jax.jit,
    static_argnames=("sm_scale", "sliding_window", "logit_softcap", "block_q", "block_k",
                     "interpret", "poison_output"),
)
def flash_attention_tpu(
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
    interpret: bool = False,
    poison_output: bool = False,
) -> jax.Array:
    """Causal attention of queries at positions 0..T-1 against keys 0..S-1 (S >= T): o_BTNH.

    Semantics are those of ``reference.attention_reference`` with ``q_offset=0``. ``block_q`` is a
    multiple of 8 or T, ``block_k`` a multiple of 128 or S (defaults 128 and 256, or the whole axis
    when shorter). ``interpret`` runs Pallas' TPU interpreter (on any backend); ``poison_output``
    starts the output as NaN (see ``poison`` and ``tpu_tiles.interpreter``).
    """
    dims = shapes.check_prefill(q_BTNH, k_BSKH, v_BSKH, lengths_B, sliding_window=sliding_window,
                                logit_softcap=logit_softcap)
    shapes.check_positive("block_q", block_q)
    shapes.check_positive("block_k", block_k)
    block_q = min(block_q or 128, dims.T)
    block_k = min(block_k or 256, dims.S)
    _check_block("block_q", block_q, multiple=8, whole=dims.T)
    _check_block("block_k", block_k, multiple=128, whole=dims.S)
    tpu_tiles.check_vmem("flash_attention_tpu", vmem_bytes(
        block_q=block_q, block_k=block_k, head_dim=dims.H, dtype=q_BTNH.dtype),
        block_q=block_q, block_k=block_k)
    num_q_blocks = pl.cdiv(dims.T, block_q)
    num_steps = masking.max_key_blocks_per_query_block(
        block_q=block_q, block_k=block_k, num_queries=dims.T, num_keys=dims.S,
        sliding_window=sliding_window,
    )
    G = dims.G

    def q_tile(b, n, i, step, lengths_ref):
        return b, n, i

    def kv_tile(b, n, i, step, lengths_ref):
        blocks = masking.prefill_key_blocks(
            i, lengths_ref[b], block_q=block_q, block_k=block_k, num_queries=dims.T,
            sliding_window=sliding_window,
        )
        last = jnp.maximum(blocks.end - 1, blocks.first)
        return b, lax.div(n, G), jnp.minimum(blocks.first + step, last)

    q_spec = tpu_tiles.head_tile_spec(dims.H, block_q, q_tile)
    kv_spec = tpu_tiles.head_tile_spec(dims.H, block_k, kv_tile)
    in_specs = [q_spec, kv_spec, kv_spec]
    out_shape = jax.ShapeDtypeStruct(tpu_tiles.tiled_shape(q_BTNH.shape), q_BTNH.dtype)
    kernel = functools.partial(
        _flash_attention_kernel, sm_scale=sm_scale, sliding_window=sliding_window,
        logit_softcap=logit_softcap, num_queries=dims.T, num_keys=dims.S,
    )
    args = [shapes.as_lengths(lengths_B), tpu_tiles.to_tiled(q_BTNH),
            tpu_tiles.to_tiled(k_BSKH), tpu_tiles.to_tiled(v_BSKH)]
    aliases = {}
    if poison_output:
        kernel, args, in_specs, aliases = poison.alias_nan_outputs(
            kernel, args, in_specs, [out_shape], [q_spec])
    o = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1,
            grid=(dims.B, dims.N, num_q_blocks, num_steps),
            in_specs=in_specs,
            out_specs=q_spec,
            scratch_shapes=tpu_tiles.state_scratch_shapes(block_q, dims.H),
        ),
        out_shape=out_shape,
        input_output_aliases=aliases,
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "parallel", "arbitrary")),
        interpret=tpu_tiles.interpreter(interpret, poison_output),
        name="flash_attention_tpu",
    )(*args)
    return tpu_tiles.from_tiled(o, q_BTNH.shape)
