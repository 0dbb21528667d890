"""Decode attention for TPUs: Flash-Decoding in Pallas on Mosaic.

The grid is (batch, kv head, split, key step). One program folds the key blocks of one split of
the visible keys into an online softmax for all G query heads of a kv head at once (so each K/V
block is fetched once per step whatever the grouping), and writes that split's normalised output
and log-sum-exp; the splits are combined afterwards (Flash-Decoding, Dao, Haziza, Massa, Sizov
2023). A TensorCore runs its grid sequentially, so on TPU splits only help to give both cores of a
megacore chip work when batch x kv heads is 1; the default is one split otherwise. As in the
prefill kernel, the prefetched lengths steer the index maps so steps past a split's visible range
fetch nothing new and compute nothing. The prefetched layer steers them to layer ``layer`` of the
stacked caches [L, B, S, K, H] (see ``tpu_tiles.to_tiled_cache``).
"""

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels import masking, online_softmax, poison, shapes, tpu_tiles


def _decode_kernel(
    lengths_ref,  # [B] int32 in SMEM: valid tokens of each sequence (the query is the last)
    layer_ref,  # [1] int32 in SMEM: the layer of the caches the index maps fetch from
    q_ref,  # [G, H]: the G query heads of one kv head
    k_ref,  # [block_k, H]: key block `keys.first + step` of that kv head (uint16: bfloat16 bits)
    v_ref,  # [block_k, H]
    o_ref,  # [G, H] float32: this split's normalised output
    lse_ref,  # [G, 128] float32: this split's base-2 log-sum-exp, replicated over lanes
    m_ref,  # [G, 128] float32 scratch: online-softmax running max
    l_ref,  # [G, 128] float32 scratch: running sum
    acc_ref,  # [G, H] float32 scratch: unnormalised output
    *,
    sm_scale: float,
    sliding_window: int | None,
    logit_softcap: float | None,
    num_splits: int,
    num_keys: int,
):
    del layer_ref  # read by the index maps only
    group, block_k = q_ref.shape[0], k_ref.shape[0]
    step = pl.program_id(3)
    length = lengths_ref[pl.program_id(0)]
    keys = masking.decode_key_range(
        length, pl.program_id(2), num_keys=num_keys, block_k=block_k, num_splits=num_splits,
        sliding_window=sliding_window,
    )
    k_block = keys.first + step

    @pl.when(step == 0)
    def _init():
        tpu_tiles.init_state(m_ref, l_ref, acc_ref)

    @pl.when(k_block < keys.end)
    def _fold_key_block():
        k_pos = k_block * block_k + lax.broadcasted_iota(jnp.int32, (group, block_k), 1)
        visible = masking.visible(length - 1, k_pos, keys.kv_hi, sliding_window)
        # Rows past the cache end are stale VMEM; a 0 weight times NaN would still be NaN.
        v_pos = k_block * block_k + lax.broadcasted_iota(jnp.int32, (block_k, 1), 0)
        v = shapes.as_values(v_ref[...])
        v = jnp.where(v_pos < keys.kv_hi, v, jnp.zeros_like(v))
        s = online_softmax.scores(q_ref[...], shapes.as_values(k_ref[...]), sm_scale=sm_scale,
                                  logit_softcap=logit_softcap)
        state = tpu_tiles.read_state(m_ref, l_ref, acc_ref)
        tpu_tiles.write_state(online_softmax.update(state, s, v, visible), m_ref, l_ref, acc_ref)

    @pl.when(step == pl.num_programs(3) - 1)
    def _write_output():
        state = tpu_tiles.read_state(m_ref, l_ref, acc_ref)
        o_ref[...] = online_softmax.finalize(state, row_valid=True)
        lse_ref[...] = jnp.broadcast_to(online_softmax.log_sum_exp(state), lse_ref.shape)


def default_num_splits(*, batch: int, kv_heads: int, num_key_blocks: int) -> int:
    """Two splits only when one (sequence, kv head) would leave a megacore's second core idle."""
    return min(2 if batch * kv_heads == 1 else 1, num_key_blocks)


def vmem_bytes(*, group: int, block_k: int, head_dim: int, dtype) -> int:
    """VMEM of one program's tiles: q, K, V, o and lse blocks, and the online-softmax scratch."""
    rows, lanes = (group, head_dim), (group, tpu_tiles.NUM_LANES)
    return tpu_tiles.vmem_bytes(
        blocks=[(rows, dtype), ((block_k, head_dim), dtype), ((block_k, head_dim), dtype),
                (rows, jnp.float32), (lanes, jnp.float32)],
        scratch=[(lanes, jnp.float32), (lanes, jnp.float32), (rows, jnp.float32)])


@functools.partial(
    jax.jit,
    static_argnames=("sm_scale", "sliding_window", "logit_softcap", "block_k", "num_splits",
                     "interpret", "poison_output"),
)
def decode_attention_tpu(
    q_BNH: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    lengths_B: jax.Array,
    *,
    sm_scale: float,
    layer: jax.Array | int | None = None,
    sliding_window: int | None = None,
    logit_softcap: float | None = None,
    block_k: int | None = None,
    num_splits: int | None = None,
    interpret: bool = False,
    poison_output: bool = False,
) -> jax.Array:
    """Attention of one query per sequence, at position lengths_B[b] - 1, over the cache: o_BNH.

    Semantics are those of ``reference.decode_attention_reference`` over ``k_cache[layer]``. The
    caches are [B, S, K, H], or with ``layer`` (an int32 scalar, traced or not, indexed as
    ``shapes.as_layer`` says) the stacked caches [L, B, S, K, H]; they may hold bfloat16 as uint16
    bits. ``block_k`` is a multiple of 128 or S (default 512, or S when shorter); ``num_splits``
    defaults to ``default_num_splits``. ``interpret`` runs Pallas' TPU interpreter;
    ``poison_output`` starts the per-split outputs as NaN (see ``poison`` and
    ``tpu_tiles.interpreter``).
    """
    dims = shapes.check_decode(q_BNH, k_cache, v_cache, lengths_B, layer=layer,
                               sliding_window=sliding_window, logit_softcap=logit_softcap)
    shapes.check_positive("block_k", block_k)
    shapes.check_positive("num_splits", num_splits)
    block_k = min(block_k or 512, dims.S)
    if block_k % 128 and block_k != dims.S:
        raise ValueError(f"block_k={block_k} must be a multiple of 128 or the whole cache "
                         f"(S={dims.S}): Mosaic tiles are (8, 128)-aligned")
    tpu_tiles.check_vmem("decode_attention_tpu", vmem_bytes(
        group=dims.G, block_k=block_k, head_dim=dims.H, dtype=q_BNH.dtype), block_k=block_k)
    num_key_blocks = pl.cdiv(dims.S, block_k)
    num_splits = num_splits or default_num_splits(batch=dims.B, kv_heads=dims.K,
                                                  num_key_blocks=num_key_blocks)
    B, K, P, G, H = dims.B, dims.K, num_splits, dims.G, dims.H

    def kv_tile(b, k, p, step, lengths_ref, layer_ref):
        keys = masking.decode_key_range(
            lengths_ref[b], p, num_keys=dims.S, block_k=block_k, num_splits=P,
            sliding_window=sliding_window,
        )
        last = jnp.clip(keys.end - 1, 0, num_key_blocks - 1)
        return layer_ref[0], b, k, jnp.clip(keys.first + step, 0, last)

    def per_head(b, k, p, step, lengths_ref, layer_ref):
        return b, k, 0, 0

    def per_split(b, k, p, step, lengths_ref, layer_ref):
        return b, k, p, 0, 0

    kv_spec = tpu_tiles.cache_tile_spec(H, block_k, kv_tile)
    in_specs = [pl.BlockSpec((None, None, G, H), per_head), kv_spec, kv_spec]
    out_specs = [
        pl.BlockSpec((None, None, None, G, H), per_split),
        pl.BlockSpec((None, None, None, G, tpu_tiles.NUM_LANES), per_split),
    ]
    out_shapes = [
        jax.ShapeDtypeStruct((B, K, P, G, H), jnp.float32),
        jax.ShapeDtypeStruct((B, K, P, G, tpu_tiles.NUM_LANES), jnp.float32),
    ]
    kernel = functools.partial(
        _decode_kernel, sm_scale=sm_scale, sliding_window=sliding_window,
        logit_softcap=logit_softcap, num_splits=P, num_keys=dims.S,
    )
    layer = None if layer is None else shapes.as_layer(layer, dims.L)
    k_tiled, read_layer = tpu_tiles.to_tiled_cache(k_cache, layer)
    v_tiled, _ = tpu_tiles.to_tiled_cache(v_cache, layer)
    args = [shapes.as_lengths(lengths_B), read_layer, q_BNH.reshape(B, K, G, H), k_tiled, v_tiled]
    aliases = {}
    if poison_output:
        kernel, args, in_specs, aliases = poison.alias_nan_outputs(
            kernel, args, in_specs, out_shapes, out_specs)
    o_BKPGH, lse_replicated = pl.pallas_call(  # lse: [B, K, P, G, 128]
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2,
            grid=(B, K, P, pl.cdiv(num_key_blocks, P)),
            in_specs=in_specs,
            out_specs=out_specs,
            scratch_shapes=tpu_tiles.state_scratch_shapes(G, H),
        ),
        out_shape=out_shapes,
        input_output_aliases=aliases,
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "parallel", "arbitrary")),
        interpret=tpu_tiles.interpreter(interpret, poison_output),
        name="decode_attention_tpu",
    )(*args)
    o_BKGH = (o_BKPGH[:, :, 0] if P == 1
              else online_softmax.combine_splits(o_BKPGH, lse_replicated[..., 0]))
    return o_BKGH.reshape(B, dims.N, H).astype(q_BNH.dtype)
