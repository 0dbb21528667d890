"""Plain-``jnp`` causal attention: the oracle every Pallas kernel here is tested against.

It materialises the full [T, S] score matrix in float32, so it is for tests and small shapes only.
Semantics (those of Hugging Face ``transformers``' eager attention, with per-sequence lengths):

* scores = (q · k) * sm_scale; with a soft-cap, scores = cap * tanh(scores / cap) (Gemma 2);
* the query at position i sees key j iff j <= i, j < lengths[b], i < lengths[b] and, with a sliding
  window, i - j < sliding_window (Mistral, Gemma 2);
* query head n reads kv head n // G (grouped-query attention, G = N / K);
* softmax in float32, output in q's dtype; a row that sees no key (padding, lengths[b] == 0) is 0.
"""

import functools

import jax
import jax.numpy as jnp


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
