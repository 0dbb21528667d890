"""Grouped-query self-attention: projections, and the one place that picks how attention is computed.

``Attention`` owns the projections (q/k/v/o, optional q/k/v bias, optional q/k RMSNorm, RoPE).
``attention`` (keys of this call: prefill, full forward) and ``cached_attention`` (new tokens over a
KV cache: decode) compute softmax(q·kᵀ)·v with the :class:`AttentionImpl` the config selects; the XLA
versions group query heads as [K, G] so several query heads share one K/V head without a repeat.
"""

from __future__ import annotations

from typing import Callable

import jax.numpy as jnp
from flax import linen as nn

import pallas_kernels
from llm_jax.config import AttentionImpl, ModelConfig
from llm_jax.model.layers import RMSNorm, _init, dense, dense_many
from llm_jax.model.rope import apply_rope, inverse_frequencies, rope_angles

# Masked scores get a large finite negative value rather than -inf, so a row with no visible key
# (padding) gives zeros instead of NaN.
_MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)


class Attention(nn.Module):
    """Q/K/V and output projections of one layer. q_proj [D, N, H], k/v_proj [D, K, H], o_proj [N, H, D]."""

    config: ModelConfig

    def setup(self) -> None:
        c = self.config
        D, N, K, H = c.d_model, c.n_heads, c.n_kv_heads, c.head_dim
        self.q_proj = self.param("q_proj", _init, (D, N, H))
        self.k_proj = self.param("k_proj", _init, (D, K, H))
        self.v_proj = self.param("v_proj", _init, (D, K, H))
        self.o_proj = self.param("o_proj", _init, (N, H, D))
        if c.qkv_bias:
            self.q_bias = self.param("q_bias", nn.initializers.zeros, (N, H))
            self.k_bias = self.param("k_bias", nn.initializers.zeros, (K, H))
            self.v_bias = self.param("v_bias", nn.initializers.zeros, (K, H))
        if c.qk_norm:
            self.q_norm = RMSNorm(eps=c.norm_eps, weight_offset=c.norm_weight_offset)
            self.k_norm = RMSNorm(eps=c.norm_eps, weight_offset=c.norm_weight_offset)

    def project(self, x_BTD: jnp.ndarray, positions_BT: jnp.ndarray):
        """Queries [B, T, N, H] and keys/values [B, T, K, H] at ``positions_BT``, RoPE applied."""
        c, dtype = self.config, x_BTD.dtype
        q_BTNH, k_BTKH, v_BTKH = dense_many(["BTD,DNH->BTNH", "BTD,DKH->BTKH", "BTD,DKH->BTKH"], x_BTD,
                                            [self.q_proj, self.k_proj, self.v_proj], jnp.float32, c.matmul_impl)
        if c.qkv_bias:
            q_BTNH, k_BTKH, v_BTKH = q_BTNH + self.q_bias, k_BTKH + self.k_bias, v_BTKH + self.v_bias
        q_BTNH, k_BTKH, v_BTKH = q_BTNH.astype(dtype), k_BTKH.astype(dtype), v_BTKH.astype(dtype)
        if c.qk_norm:
            q_BTNH, k_BTKH = self.q_norm(q_BTNH), self.k_norm(k_BTKH)
        cos, sin = rope_angles(positions_BT, inverse_frequencies(c.head_dim, c.rope_theta, c.rope_scaling))
        return apply_rope(q_BTNH, cos, sin), apply_rope(k_BTKH, cos, sin), v_BTKH

    def output(self, o_BTNH: jnp.ndarray) -> jnp.ndarray:
        B, T, N, H = o_BTNH.shape
        # Contract one flattened (N·H) axis: given (N, H) as two contracting axes, XLA:CPU copies the
        # weights into another layout on every call.
        o_flat = o_BTNH.reshape(B, T, N * H)  # [B, T, N·H]
        return dense("BTi,iD->BTD", o_flat, self.o_proj.reshape(N * H, -1), o_BTNH.dtype, self.config.matmul_impl)


def _masked_softmax(scores_BKGTS: jnp.ndarray, visible_B11TS: jnp.ndarray) -> jnp.ndarray:
    """Softmax over the last axis of the visible entries (float32); rows with none visible are 0."""
    scores_BKGTS = jnp.where(visible_B11TS, scores_BKGTS, _MASK_VALUE)
    probs_BKGTS = jnp.exp(scores_BKGTS - jnp.max(scores_BKGTS, axis=-1, keepdims=True))
    probs_BKGTS = jnp.where(visible_B11TS, probs_BKGTS, 0.0)
    denom_BKGT1 = jnp.maximum(jnp.sum(probs_BKGTS, axis=-1, keepdims=True), jnp.finfo(jnp.float32).tiny)
    return probs_BKGTS / denom_BKGT1


def _softcapped(scores: jnp.ndarray, softcap: float | None) -> jnp.ndarray:
    return scores if softcap is None else softcap * jnp.tanh(scores / softcap)


def xla_attention(q_BTNH, k_BSKH, v_BSKH, q_positions_BT, kv_lengths_B, *, scale: float,
                  window: int | None, softcap: float | None) -> jnp.ndarray:
    """Masked attention in plain jnp. Key slot s is position s; it is visible to a query at position p
    iff s <= p, s < kv_lengths_B[b] and (no window or p - s < window). Rows with no visible key are 0."""
    B, T, N, H = q_BTNH.shape
    K = k_BSKH.shape[2]
    q_BTKGH = q_BTNH.reshape(B, T, K, N // K, H)
    scores_BKGTS = jnp.einsum("BTKGH,BSKH->BKGTS", q_BTKGH, k_BSKH,
                              preferred_element_type=jnp.float32) * scale
    s_S = jnp.arange(k_BSKH.shape[1])
    p_BT1 = q_positions_BT[:, :, None]
    visible_BTS = (s_S <= p_BT1) & (s_S < kv_lengths_B[:, None, None])
    if window is not None:
        visible_BTS &= p_BT1 - s_S < window
    probs_BKGTS = _masked_softmax(_softcapped(scores_BKGTS, softcap), visible_BTS[:, None, None])
    o_BTKGH = jnp.einsum("BKGTS,BSKH->BTKGH", probs_BKGTS.astype(v_BSKH.dtype), v_BSKH,
                         preferred_element_type=jnp.float32)
    return o_BTKGH.reshape(B, T, N, H).astype(q_BTNH.dtype)


def xla_cached_attention(q_BTNH, k_BTKH, v_BTKH, k_cache_BKHS, v_cache_BKSH, cache_lengths_B, *, scale: float,
                         window: int | None, softcap: float | None) -> jnp.ndarray:
    """T new queries per row, at positions ``cache_lengths_B[b] + t``, over the cache as it was
    (slots s < ``cache_lengths_B[b]``) and over this call's own T keys (t' <= t); window as in
    :func:`xla_attention`.

    Reading the cache before the new keys are written (instead of writing, then attending over the
    cache) leaves the write with no reader, so XLA performs it in place, and attention reads each
    layer's cache where it lies; scores and probabilities of the two key sets are concatenated.
    """
    B, T, N, H = q_BTNH.shape
    K, S = v_cache_BKSH.shape[1], v_cache_BKSH.shape[2]
    q_BKGTH = q_BTNH.reshape(B, T, K, N // K, H).transpose(0, 2, 3, 1, 4)
    # Keys are the S cache slots followed by this call's T tokens (in the einsums, this call's
    # k_BTKH / v_BTKH play the key axis S).
    cached_BKGTS = jnp.einsum("BKGTH,BKHS->BKGTS", q_BKGTH, k_cache_BKHS, preferred_element_type=jnp.float32)
    own_BKGTS = jnp.einsum("BKGTH,BSKH->BKGTS", q_BKGTH, k_BTKH, preferred_element_type=jnp.float32)
    scores_BKGTS = _softcapped(jnp.concatenate([cached_BKGTS, own_BKGTS], axis=-1) * scale, softcap)
    length_B11 = cache_lengths_B[:, None, None]
    p_BT1 = length_B11 + jnp.arange(T)[:, None]
    key_position_BTS = jnp.concatenate([jnp.broadcast_to(jnp.arange(S), (B, T, S)),
                                        jnp.broadcast_to(length_B11 + jnp.arange(T), (B, T, T))], axis=-1)
    # Cache slots at or past a row's length are stale; its own tokens are all valid.
    valid_B1S = jnp.concatenate([jnp.arange(S) < length_B11, jnp.ones((B, 1, T), bool)], axis=-1)
    visible_BTS = valid_B1S & (key_position_BTS <= p_BT1)
    if window is not None:
        visible_BTS &= p_BT1 - key_position_BTS < window
    probs_BKGTS = _masked_softmax(scores_BKGTS, visible_BTS[:, None, None]).astype(v_BTKH.dtype)
    o_BKGTH = (jnp.einsum("BKGTS,BKSH->BKGTH", probs_BKGTS[..., :S], v_cache_BKSH,
                          preferred_element_type=jnp.float32)
               + jnp.einsum("BKGTS,BSKH->BKGTH", probs_BKGTS[..., S:], v_BTKH, preferred_element_type=jnp.float32))
    return o_BKGTH.transpose(0, 3, 1, 2, 4).reshape(B, T, N, H).astype(q_BTNH.dtype)


def attention(q_BTNH, k_BSKH, v_BSKH, q_positions_BT, kv_lengths_B, *, config: ModelConfig,
              window: int | None) -> jnp.ndarray:
    """Attention of ``q`` over keys/values [B, S, K, H] computed in this call (prefill and full
    forward: query t sits at position t), with the implementation the config selects."""
    match config.attention_impl:
        case AttentionImpl.PALLAS:
            return pallas_kernels.flash_attention(q_BTNH, k_BSKH, v_BSKH, kv_lengths_B, sm_scale=config.attn_scale,
                                                  sliding_window=window, logit_softcap=config.attn_logit_softcap)
        case _:
            return xla_attention(q_BTNH, k_BSKH, v_BSKH, q_positions_BT, kv_lengths_B, scale=config.attn_scale,
                                 window=window, softcap=config.attn_logit_softcap)


CacheWrite = Callable[[jnp.ndarray, jnp.ndarray], tuple[jnp.ndarray, jnp.ndarray]]


def cached_attention(q_BTNH, k_BTKH, v_BTKH, k_cache_BKHS, v_cache_BKSH, cache_lengths_B, write: CacheWrite, *,
                     config: ModelConfig, window: int | None):
    """Attention of T new tokens per row over the cache and themselves (decode, extend); returns the
    output [B, T, N, H] and the cache after ``write(k_cache, v_cache)`` stored the new keys and values.

    The implementation decides the order: the XLA path attends over the old cache and the new keys,
    then writes (see :func:`xla_cached_attention`); the fused decode kernel reads the written cache.
    """
    match config.attention_impl:
        case AttentionImpl.PALLAS if q_BTNH.shape[1] == 1:
            k_cache_BKHS, v_cache_BKSH = write(k_cache_BKHS, v_cache_BKSH)
            # The kernels take [B, S, K, H] caches.
            o_BNH = pallas_kernels.decode_attention(
                q_BTNH[:, 0], k_cache_BKHS.transpose(0, 3, 1, 2), v_cache_BKSH.transpose(0, 2, 1, 3),
                cache_lengths_B + 1, sm_scale=config.attn_scale, sliding_window=window,
                logit_softcap=config.attn_logit_softcap)
            return o_BNH[:, None], k_cache_BKHS, v_cache_BKSH
        case _:
            o_BTNH = xla_cached_attention(q_BTNH, k_BTKH, v_BTKH, k_cache_BKHS, v_cache_BKSH, cache_lengths_B,
                                          scale=config.attn_scale, window=window,
                                          softcap=config.attn_logit_softcap)
            return (o_BTNH, *write(k_cache_BKHS, v_cache_BKSH))
