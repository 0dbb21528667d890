"""Plain-``jnp`` causal attention: the oracle every Pallas kernel here is tested against.

It materialises the full [T, S] score matrix in float32, so it is for tests and small shapes only.
Semantics (those of Hugging Face ``transformers``' eager attention, with per-sequence lengths):

* scores = (q · k) * sm_scale; with a soft-cap, scores = cap * tanh(scores / cap) (Gemma 2);
* the query at position i sees key j iff j <= i, j < lengths[b], i < lengths[b] and, with a sliding
  window, i - j < sliding_window (Mistral, Gemma 2);
* query head n reads kv head n // G (grouped-query attention, G = N / K);
* softmax in float32, output in q's dtype; a row that sees no key (padding, lengths[b] == 0) is 0.

``ragged_paged_attention_reference`` applies the same rule to a serving step: a flat, ragged batch
of query tokens from many sequences, each sequence's keys in fixed-size pages named by its block
table (vLLM's PagedAttention, Kwon et al. 2023).
"""

import functools

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels import shapes


@functools.partial(jax.jit, static_argnames=("sm_scale", "sliding_window", "logit_softcap"))
def attention_reference(
    q_BTNH: jax.Array,
    k_BSKH: jax.Array,
    v_BSKH: jax.Array,
    lengths_B: jax.Array,
    *,
    sm_scale: float,
    q_offset: int | jax.Array = 0,
    sliding_window: int | None = None,
    logit_softcap: float | None = None,
) -> jax.Array:
    """Attention of T queries at positions ``q_offset + t`` against S keys at positions 0..S-1.

    ``q_offset`` is a scalar or one offset per sequence ([B]); decode is ``T == 1`` with
    ``q_offset = lengths_B - 1``. Returns o_BTNH in q's dtype.
    """
    B, T, N, H = q_BTNH.shape
    S, K = k_BSKH.shape[1], k_BSKH.shape[2]
    G = N // K
    q_BTKGH = q_BTNH.reshape(B, T, K, G, H).astype(jnp.float32)
    s_BKGTS = jnp.einsum(
        "btkgh,bskh->bkgts", q_BTKGH, k_BSKH.astype(jnp.float32),
        precision=jax.lax.Precision.HIGHEST,
    ) * sm_scale
    if logit_softcap is not None:
        s_BKGTS = logit_softcap * jnp.tanh(s_BKGTS / logit_softcap)

    lengths_B = jnp.asarray(lengths_B, jnp.int32)
    q_pos_BT = jnp.broadcast_to(jnp.asarray(q_offset, jnp.int32), (B,))[:, None] + jnp.arange(T)
    k_pos_S = jnp.arange(S)
    visible_BTS = (
        (k_pos_S[None, None, :] <= q_pos_BT[:, :, None])
        & (k_pos_S[None, None, :] < lengths_B[:, None, None])
        & (q_pos_BT[:, :, None] < lengths_B[:, None, None])
    )
    if sliding_window is not None:
        visible_BTS &= q_pos_BT[:, :, None] - k_pos_S[None, None, :] < sliding_window
    s_BKGTS = jnp.where(visible_BTS[:, None, None], s_BKGTS, -jnp.inf)

    # Softmax that maps an all -inf row to zeros instead of NaN.
    m_BKGT1 = jnp.max(s_BKGTS, axis=-1, keepdims=True)
    e_BKGTS = jnp.exp(s_BKGTS - jnp.where(jnp.isfinite(m_BKGT1), m_BKGT1, 0.0))
    denom_BKGT1 = jnp.sum(e_BKGTS, axis=-1, keepdims=True)
    p_BKGTS = e_BKGTS / jnp.where(denom_BKGT1 == 0.0, 1.0, denom_BKGT1)

    o_BTKGH = jnp.einsum(
        "bkgts,bskh->btkgh", p_BKGTS, v_BSKH.astype(jnp.float32),
        precision=jax.lax.Precision.HIGHEST,
    )
    return o_BTKGH.reshape(B, T, N, H).astype(q_BTNH.dtype)


@functools.partial(jax.jit, static_argnames=("sm_scale", "sliding_window", "logit_softcap"))
def decode_attention_reference(
    q_BNH: jax.Array,
    k_BSKH: jax.Array,
    v_BSKH: jax.Array,
    lengths_B: jax.Array,
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    logit_softcap: float | None = None,
) -> jax.Array:
    """One query per sequence at position ``lengths_B[b] - 1`` against the KV cache; o_BNH."""
    lengths_B = jnp.asarray(lengths_B, jnp.int32)
    o_B1NH = attention_reference(
        q_BNH[:, None], k_BSKH, v_BSKH, lengths_B, sm_scale=sm_scale, q_offset=lengths_B - 1,
        sliding_window=sliding_window, logit_softcap=logit_softcap,
    )
    return o_B1NH[:, 0]


@functools.partial(jax.jit, static_argnames=("sm_scale", "sliding_window", "logit_softcap"))
def ragged_paged_attention_reference(
    q_TNH: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    block_tables_BX: jax.Array,
    query_start_B: jax.Array,
    num_tokens_B: jax.Array,
    seq_lens_B: jax.Array,
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    logit_softcap: float | None = None,
    layer: jax.Array | int | None = None,
) -> jax.Array:
    """Attention of a ragged batch of query tokens over paged keys: o_TNH in q's dtype.

    Sequence b owns the query rows ``query_start_B[b] + [0, num_tokens_B[b])``, the last
    num_tokens_B[b] of its seq_lens_B[b] tokens: its query i is at position
    ``seq_lens_B[b] - num_tokens_B[b] + i``. Its key at position s is row s % Z of page
    ``block_tables_BX[b, s // Z]`` of ``k_pages`` [P, Z, K, H] (with ``layer``, of
    ``k_pages[layer]`` [L, P, Z, K, H], indexed as ``shapes.as_layer`` says); pages may be uint16
    holding bfloat16 bits, or int8 pairs (values [..., Z, K, H], float32 scales [..., Z, K]) for k
    and v both, read as values * scales in float32. A query at p sees the keys s <= p of its
    sequence (and p - s < sliding_window). Rows of q that no sequence owns, and queries that see no
    key, are 0.

    It gathers each token's sequence's keys, [T, X * Z, K, H]: for tests and small shapes only.
    """
    k_pages, v_pages, k_scales, v_scales = shapes.split_int8_pages(k_pages, v_pages)
    if layer is not None:
        index = shapes.as_layer(layer, k_pages.shape[0])[0]
        k_pages, v_pages, k_scales, v_scales = (
            None if p is None else lax.dynamic_index_in_dim(p, index, keepdims=False)
            for p in (k_pages, v_pages, k_scales, v_scales))
    k_pages, v_pages = (shapes.as_values(p).astype(jnp.float32) if s is None
                        else p.astype(jnp.float32) * s[..., None]
                        for p, s in ((k_pages, k_scales), (v_pages, v_scales)))
    T, N, H = q_TNH.shape
    P, Z, K, _ = k_pages.shape
    B, X = block_tables_BX.shape
    G = N // K

    # Each sequence's keys in order: key s of sequence b is row s % Z of page table[b, s // Z].
    pages_BX = jnp.clip(jnp.asarray(block_tables_BX, jnp.int32), 0, P - 1)
    k_BSKH = k_pages[pages_BX].reshape(B, X * Z, K, H)
    v_BSKH = v_pages[pages_BX].reshape(B, X * Z, K, H)

    # Each query row's sequence and position.
    query_start_B, num_tokens_B, seq_lens_B = (jnp.asarray(x, jnp.int32) for x in (
        query_start_B, num_tokens_B, seq_lens_B))
    t_T = jnp.arange(T)
    owns_TB = (t_T[:, None] >= query_start_B) & (t_T[:, None] < query_start_B + num_tokens_B)
    owned_T = jnp.any(owns_TB, axis=1)
    seq_T = jnp.argmax(owns_TB, axis=1)
    pos_T = seq_lens_B[seq_T] - num_tokens_B[seq_T] + t_T - query_start_B[seq_T]

    q_TKGH = q_TNH.reshape(T, K, G, H).astype(jnp.float32)
    k_TSKH, v_TSKH = k_BSKH[seq_T], v_BSKH[seq_T]
    s_TKGS = jnp.einsum("tkgh,tskh->tkgs", q_TKGH, k_TSKH,
                        precision=jax.lax.Precision.HIGHEST) * sm_scale
    if logit_softcap is not None:
        s_TKGS = logit_softcap * jnp.tanh(s_TKGS / logit_softcap)

    k_pos_S = jnp.arange(X * Z)
    visible_TS = ((k_pos_S[None, :] <= pos_T[:, None])
                  & (k_pos_S[None, :] < seq_lens_B[seq_T][:, None])
                  & owned_T[:, None])
    if sliding_window is not None:
        visible_TS &= pos_T[:, None] - k_pos_S[None, :] < sliding_window
    s_TKGS = jnp.where(visible_TS[:, None, None], s_TKGS, -jnp.inf)

    # Softmax that maps an all -inf row to zeros instead of NaN; masked keys weigh exactly 0 (so
    # the contents of unused page rows never matter, NaN included).
    m_TKG1 = jnp.max(s_TKGS, axis=-1, keepdims=True)
    e_TKGS = jnp.exp(s_TKGS - jnp.where(jnp.isfinite(m_TKG1), m_TKG1, 0.0))
    denom_TKG1 = jnp.sum(e_TKGS, axis=-1, keepdims=True)
    p_TKGS = e_TKGS / jnp.where(denom_TKG1 == 0.0, 1.0, denom_TKG1)
    v_TSKH = jnp.where(visible_TS[:, :, None, None], v_TSKH, 0.0)
    o_TKGH = jnp.einsum("tkgs,tskh->tkgh", p_TKGS, v_TSKH, precision=jax.lax.Precision.HIGHEST)
    return o_TKGH.reshape(T, N, H).astype(q_TNH.dtype)
