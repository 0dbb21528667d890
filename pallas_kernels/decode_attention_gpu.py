"""Decode attention for GPUs: Flash-Decoding in Pallas on Triton.

One new query per sequence reads the whole KV cache, so decode is bound by memory bandwidth and a
grid of (batch x kv heads) programs is too small to fill the GPU. Flash-Decoding (Dao, Haziza,
Massa, Sizov 2023) splits the keys into chunks processed in parallel, each producing a partial
softmax and its log-sum-exp, then combines the chunks. One program here handles one split of one
kv head of one sequence, for all G query heads that share that kv head, so every K/V row is read
once per step whatever the grouping.

With ``layer`` the caches are a model's stacked caches [L, B, S, K, H] and the kernel reads layer
``layer`` where it lies: Triton has no scalar prefetch to steer a block index, so each program's
K/V block spans all L layers of its (sequence, kv head), which costs nothing (a Triton block is a
pointer and strides, not a copy), and the kernel offsets its loads by the layer it reads from a
one-element operand. One layer's cache [B, S, K, H] is the case L = 1.
"""

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import gpu_tiles, masking, online_softmax, poison, shapes

# Streaming multiprocessors assumed when the device does not say (H100 / H200).
_DEFAULT_NUM_SMS = 132


def _decode_kernel(
    lengths_ref,  # [] int32: valid tokens of this sequence, the last is the query's position
    layer_ref,  # [] int32: the layer of the caches to read
    q_ref,  # [Gp, Hp]: the G query heads of one kv head (rows past G are masked off)
    k_ref,  # [L, S, Hp]: every key of that kv head in every layer (uint16: bfloat16 bits)
    v_ref,  # [L, S, Hp]
    o_ref,  # [Gp, Hp] float32: this split's normalised output
    lse_ref,  # [Gp] float32: this split's base-2 log-sum-exp (-inf if it saw no key)
    *,
    sm_scale: float,
    sliding_window: int | None,
    logit_softcap: float | None,
    block_k: int,
    num_splits: int,
    group: int,
    head_dim: int,
):
    group_padded, head_dim_padded = q_ref.shape
    length = lengths_ref[...]
    layer = layer_ref[...]
    keys = masking.decode_key_range(
        length, pl.program_id(0), num_keys=k_ref.shape[1], block_k=block_k,
        num_splits=num_splits, sliding_window=sliding_window,
    )
    rows_ok = None if group == group_padded else jnp.arange(group_padded) < group
    cols_ok = None if head_dim == head_dim_padded else jnp.arange(head_dim_padded) < head_dim
    q = gpu_tiles.load(q_ref, rows_ok, cols_ok)

    def fold_key_block(k_block, state):
        k_start = pl.multiple_of(k_block * block_k, block_k)
        k_pos = k_start + jnp.arange(block_k)
        keys_ok = masking.visible(length - 1, k_pos, keys.kv_hi, sliding_window)
        rows = pl.ds(k_start, block_k)
        k = shapes.as_values(gpu_tiles.load(k_ref.at[layer, rows, :], keys_ok, cols_ok))
        v = shapes.as_values(gpu_tiles.load(v_ref.at[layer, rows, :], keys_ok, cols_ok))
        s = online_softmax.scores(q, k, sm_scale=sm_scale, logit_softcap=logit_softcap)
        return online_softmax.update(state, s, v, keys_ok[None, :])

    state = online_softmax.initial_state(group_padded, head_dim_padded)
    state = lax.fori_loop(keys.first, keys.end, fold_key_block, state)
    o = online_softmax.finalize(state, row_valid=True)
    gpu_tiles.store(o_ref, o, rows_ok, cols_ok)
    plgpu.store(lse_ref, online_softmax.log_sum_exp(state)[:, 0], mask=rows_ok)


def default_num_splits(*, batch: int, kv_heads: int, num_key_blocks: int) -> int:
    """Enough splits for about two waves of programs over the GPU's SMs, at most one per block."""
    num_sms = getattr(jax.devices()[0], "core_count", None) or _DEFAULT_NUM_SMS
    return max(1, min(pl.cdiv(2 * num_sms, batch * kv_heads), num_key_blocks))


def choose_tiles(dims: shapes.AttentionDims, dtype, *, block_k: int | None,
                 num_stages: int | None) -> gpu_tiles.Tiles:
    """The given block_k and num_stages, or the largest that fit the device's shared memory.

    The query tile is the group of heads (rows padded to 16, as ``tl.dot`` needs), never split.
    Long key blocks (up to 128, never past the padded cache) amortise the loop, and two stages
    overlap each block's loads with the previous block's arithmetic.
    """
    shapes.check_positive("block_k", block_k)
    shapes.check_positive("num_stages", num_stages)
    if block_k is not None:
        gpu_tiles.check_tile_size("block_k", block_k)
    preferred = gpu_tiles.Tiles(
        block_q=gpu_tiles.tile_size(dims.G),
        block_k=block_k or min(128, gpu_tiles.tile_size(dims.S)),
        head_dim=gpu_tiles.tile_size(dims.H), num_stages=num_stages or 2)
    fixed = {"block_q"} | {name for name, value in (("block_k", block_k),
                                                     ("num_stages", num_stages)) if value}
    return gpu_tiles.fit_tiles(preferred, dtype=dtype, budget_bytes=gpu_tiles.smem_budget().bytes,
                               fixed=fixed)


@functools.partial(
    jax.jit,
    static_argnames=("sm_scale", "sliding_window", "logit_softcap", "block_k", "num_splits",
                     "num_warps", "num_stages", "interpret", "poison_output"),
)
def decode_attention_gpu(
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
    num_warps: int | None = None,
    num_stages: int | None = None,
    interpret: bool = False,
    poison_output: bool = False,
) -> jax.Array:
    """Attention of one query per sequence, at position lengths_B[b] - 1, over the cache: o_BNH.

    Semantics are those of ``reference.decode_attention_reference`` over ``k_cache[layer]``. The
    caches are [B, S, K, H], or with ``layer`` (an int32 scalar, traced or not, indexed as
    ``shapes.as_layer`` says) the stacked caches [L, B, S, K, H], read in place. They may hold
    bfloat16 as uint16 bits.
    ``block_k`` is a power of two >= 16 and, like ``num_stages``, defaults to the largest that fits
    shared memory (``choose_tiles``); ``num_splits`` defaults to ``default_num_splits``.
    ``poison_output`` starts the per-split outputs as NaN (see ``poison``).
    """
    dims = shapes.check_decode(q_BNH, k_cache, v_cache, lengths_B, layer=layer,
                               sliding_window=sliding_window, logit_softcap=logit_softcap)
    shapes.check_positive("num_splits", num_splits)
    tiles = choose_tiles(dims, q_BNH.dtype, block_k=block_k, num_stages=num_stages)
    num_key_blocks = pl.cdiv(dims.S, tiles.block_k)
    num_splits = num_splits or default_num_splits(batch=dims.B, kv_heads=dims.K,
                                                  num_key_blocks=num_key_blocks)
    B, K, P, G, L = dims.B, dims.K, num_splits, dims.G, dims.L
    group_padded, head_dim_padded = tiles.block_q, tiles.head_dim
    # One layer's cache is a stack of one (a free reshape).
    k_LBSKH, v_LBSKH = (c if layer is not None else c.reshape(1, *c.shape)
                        for c in (k_cache, v_cache))

    kv_spec = pl.BlockSpec((L, None, dims.S, None, head_dim_padded),
                           lambda p, b, k: (0, b, 0, k, 0))
    in_specs = [
        pl.BlockSpec((None,), lambda p, b, k: (b,)),
        pl.BlockSpec((None,), lambda p, b, k: (0,)),
        pl.BlockSpec((None, None, group_padded, head_dim_padded), lambda p, b, k: (b, k, 0, 0)),
        kv_spec,
        kv_spec,
    ]
    out_specs = [
        pl.BlockSpec((None, None, None, group_padded, head_dim_padded),
                     lambda p, b, k: (b, k, p, 0, 0)),
        pl.BlockSpec((None, None, None, group_padded), lambda p, b, k: (b, k, p, 0)),
    ]
    out_shapes = [
        jax.ShapeDtypeStruct((B, K, P, G, dims.H), jnp.float32),
        jax.ShapeDtypeStruct((B, K, P, G), jnp.float32),
    ]
    kernel = functools.partial(
        _decode_kernel, sm_scale=sm_scale, sliding_window=sliding_window,
        logit_softcap=logit_softcap, block_k=tiles.block_k, num_splits=P, group=G,
        head_dim=dims.H,
    )
    args = [shapes.as_lengths(lengths_B), shapes.as_layer(layer, L),
            q_BNH.reshape(B, K, G, dims.H), k_LBSKH, v_LBSKH]
    aliases = {}
    if poison_output:
        kernel, args, in_specs, aliases = poison.alias_nan_outputs(
            kernel, args, in_specs, out_shapes, out_specs)
    o_BKPGH, lse_BKPG = pl.pallas_call(
        kernel,
        grid=(P, B, K),
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shapes,
        input_output_aliases=aliases,
        compiler_params=plgpu.CompilerParams(num_warps=num_warps or 4,
                                             num_stages=tiles.num_stages),
        interpret=interpret,
        name="decode_attention_gpu",
    )(*args)
    o_BKGH = o_BKPGH[:, :, 0] if P == 1 else online_softmax.combine_splits(o_BKPGH, lse_BKPG)
    return o_BKGH.reshape(B, dims.N, dims.H).astype(q_BNH.dtype)
