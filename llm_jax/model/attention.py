"""Grouped-query self-attention: projections, and the one place that picks how attention is computed.

``Attention`` owns the projections (q/k/v/o, optional q/k/v bias, optional q/k RMSNorm, RoPE).
``attention`` computes softmax(q·kᵀ)·v for a chosen :class:`AttentionImpl`; the XLA version groups
query heads as [K, G] so several query heads share one K/V head without materialising a repeat.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import linen as nn
from jax.sharding import Mesh

import cpu_kernels
import pallas_kernels
from llm_jax import kv_cache as kvc
from llm_jax.config import AttentionImpl, MatmulImpl, ModelConfig
from llm_jax.model.fused import split_qkv
from llm_jax.model.layers import (Panels, RMSNorm, dense, dense_many, has_projection, layer_of, projection_param,
                                  stacked_param)
from llm_jax.model.rope import apply_rope, inverse_frequencies, rope_angles
from llm_jax.sharding import attention_on_shards

# Masked scores get a large finite negative value rather than -inf, so a row with no visible key
# (padding) gives zeros instead of NaN.
_MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)


class Attention(nn.Module):
    """Q/K/V and output projections of one layer. q_proj [D, N, H], k/v_proj [D, K, H], o_proj [N, H, D]
    (each with a leading [L] axis when ``stack`` is L: see :mod:`llm_jax.model.layers`); or, in the fused
    layout (:mod:`llm_jax.model.fused`), qkv_proj [D, (N + 2K)·H] in place of q/k/v_proj."""

    config: ModelConfig
    stack: int | None = None

    def setup(self) -> None:
        c, L = self.config, self.stack
        D, N, K, H = c.d_model, c.n_heads, c.n_kv_heads, c.head_dim
        if has_projection(self, "qkv_proj"):
            self.qkv_proj = projection_param(self, "qkv_proj", (D,), ((N + 2 * K) * H,), L)
        else:
            self.q_proj = projection_param(self, "q_proj", (D,), (N, H), L)
            self.k_proj = projection_param(self, "k_proj", (D,), (K, H), L)
            self.v_proj = projection_param(self, "v_proj", (D,), (K, H), L)
        self.o_proj = projection_param(self, "o_proj", (N, H), (D,), L)
        if c.qkv_bias:
            self.q_bias = stacked_param(self, "q_bias", nn.initializers.zeros, (N, H), L)
            self.k_bias = stacked_param(self, "k_bias", nn.initializers.zeros, (K, H), L)
            self.v_bias = stacked_param(self, "v_bias", nn.initializers.zeros, (K, H), L)
        if c.qk_norm:
            self.q_norm = RMSNorm(eps=c.norm_eps, weight_offset=c.norm_weight_offset, stack=L)
            self.k_norm = RMSNorm(eps=c.norm_eps, weight_offset=c.norm_weight_offset, stack=L)

    def project(self, x_BTD: jnp.ndarray, positions_BT: jnp.ndarray, layer: jnp.ndarray | None = None):
        """Queries [B, T, N, H] and keys/values [B, T, K, H] at ``positions_BT``, RoPE applied."""
        c, dtype = self.config, x_BTD.dtype
        if hasattr(self, "qkv_proj"):
            B, T = x_BTD.shape[:2]
            qkv_BTE = dense("BTD,DE->BTE", x_BTD, self.qkv_proj, jnp.float32, c.matmul_impl, layer)
            q_BTE, k_BTE, v_BTE = split_qkv(qkv_BTE, c)
            q_BTNH = q_BTE.reshape(B, T, c.n_heads, c.head_dim)
            k_BTKH, v_BTKH = (a.reshape(B, T, c.n_kv_heads, c.head_dim) for a in (k_BTE, v_BTE))
        else:
            q_BTNH, k_BTKH, v_BTKH = dense_many(["BTD,DNH->BTNH", "BTD,DKH->BTKH", "BTD,DKH->BTKH"], x_BTD,
                                                [self.q_proj, self.k_proj, self.v_proj], jnp.float32,
                                                c.matmul_impl, layer)
        if c.qkv_bias:
            biases = (self.q_bias, self.k_bias, self.v_bias)
            q_NH, k_KH, v_KH = biases if layer is None else (layer_of(b, layer) for b in biases)
            q_BTNH, k_BTKH, v_BTKH = q_BTNH + q_NH, k_BTKH + k_KH, v_BTKH + v_KH
        q_BTNH, k_BTKH, v_BTKH = q_BTNH.astype(dtype), k_BTKH.astype(dtype), v_BTKH.astype(dtype)
        if c.qk_norm:
            q_BTNH, k_BTKH = self.q_norm(q_BTNH, layer), self.k_norm(k_BTKH, layer)
        cos, sin = rope_angles(positions_BT, inverse_frequencies(c.head_dim, c.rope_theta, c.rope_scaling))
        return apply_rope(q_BTNH, cos, sin), apply_rope(k_BTKH, cos, sin), v_BTKH

    def output(self, o_BTNH: jnp.ndarray, layer: jnp.ndarray | None = None) -> jnp.ndarray:
        # One [N·H, D] product on a contiguous [B, T, N·H] input: given "BTNH,NHD" with o_BTNH in the
        # layout attention leaves it in, XLA:CPU transposes the whole o_proj weight instead (a copy of the
        # weight on every decode step: 110M float32, 10 of 50 ms per step).
        B, T, N, H = o_BTNH.shape
        o_BTE = o_BTNH.reshape(B, T, N * H)
        o_proj_ED = self.o_proj  # panels stand for W [N·H, D] already
        if not isinstance(o_proj_ED, Panels):
            o_proj_ED = o_proj_ED.reshape(*o_proj_ED.shape[:-3], N * H, -1)
        return dense("BTE,ED->BTD", o_BTE, o_proj_ED, o_BTNH.dtype, self.config.matmul_impl, layer)


def xla_attention(q_BTNH, k_BSKH, v_BSKH, q_positions_BT, kv_lengths_B, *, scale: float,
                  window: int | None, softcap: float | None) -> jnp.ndarray:
    """Masked attention in plain jnp. Key slot s is position s; it is visible to a query at position p
    iff s <= p, s < kv_lengths_B[b] and (no window or p - s < window). Rows with no visible key are 0."""
    B, T, N, H = q_BTNH.shape
    K = k_BSKH.shape[2]
    q_BTKGH = q_BTNH.reshape(B, T, K, N // K, H)
    scores_BKGTS = jnp.einsum("BTKGH,BSKH->BKGTS", q_BTKGH, k_BSKH,
                              preferred_element_type=jnp.float32) * scale
    if softcap is not None:
        scores_BKGTS = softcap * jnp.tanh(scores_BKGTS / softcap)
    s_S = jnp.arange(k_BSKH.shape[1])
    p_BT1 = q_positions_BT[:, :, None]
    visible_BTS = (s_S <= p_BT1) & (s_S < kv_lengths_B[:, None, None])
    if window is not None:
        visible_BTS &= p_BT1 - s_S < window
    visible_B11TS = visible_BTS[:, None, None]
    scores_BKGTS = jnp.where(visible_B11TS, scores_BKGTS, _MASK_VALUE)
    probs_BKGTS = jnp.exp(scores_BKGTS - jnp.max(scores_BKGTS, axis=-1, keepdims=True))
    probs_BKGTS = jnp.where(visible_B11TS, probs_BKGTS, 0.0)
    denom_BKGT1 = jnp.maximum(jnp.sum(probs_BKGTS, axis=-1, keepdims=True), jnp.finfo(jnp.float32).tiny)
    probs_BKGTS = (probs_BKGTS / denom_BKGT1).astype(v_BSKH.dtype)
    o_BTKGH = jnp.einsum("BKGTS,BSKH->BTKGH", probs_BKGTS, v_BSKH, preferred_element_type=jnp.float32)
    return o_BTKGH.reshape(B, T, N, H).astype(q_BTNH.dtype)


def _cpu_kernels_attend(config: ModelConfig, mesh: Mesh | None, kv_dtype) -> bool:
    """Whether the CPU kernels compute XLA attention here: selected (``AttentionImpl.XLA`` with
    ``MatmulImpl.AUTO``), on one CPU device where they are built, for float32 or bfloat16 keys."""
    return (config.attention_impl is AttentionImpl.XLA and config.matmul_impl is MatmulImpl.AUTO and mesh is None
            and jnp.dtype(kv_dtype) in (jnp.float32, jnp.bfloat16, jnp.uint16) and jax.device_count() == 1
            and cpu_kernels.available())


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7))
def kernel_attention(q_BTNH, k_BSKH, v_BSKH, q_positions_BT, kv_lengths_B, scale: float, window: int | None,
                     softcap: float | None) -> jnp.ndarray:
    """:func:`xla_attention` computed by :func:`cpu_kernels.prefill_attention`, which scores only the keys
    each query sees (110M, 1000 tokens, one layer: 20–40 ms against 170–190 for XLA's masked square);
    gradients are XLA's."""
    o_BTNH = cpu_kernels.prefill_attention(q_BTNH, k_BSKH[None], v_BSKH[None], 0, q_positions_BT, kv_lengths_B,
                                           scale=scale, window=window, softcap=softcap)
    return o_BTNH.astype(q_BTNH.dtype)


def _kernel_attention_fwd(q_BTNH, k_BSKH, v_BSKH, q_positions_BT, kv_lengths_B, scale, window, softcap):
    o_BTNH = kernel_attention(q_BTNH, k_BSKH, v_BSKH, q_positions_BT, kv_lengths_B, scale, window, softcap)
    return o_BTNH, (q_BTNH, k_BSKH, v_BSKH, q_positions_BT, kv_lengths_B)


def _kernel_attention_bwd(scale, window, softcap, residuals, do_BTNH):
    q_BTNH, k_BSKH, v_BSKH, q_positions_BT, kv_lengths_B = residuals
    _, vjp = jax.vjp(lambda q, k, v: xla_attention(q, k, v, q_positions_BT, kv_lengths_B, scale=scale, window=window,
                                                   softcap=softcap), q_BTNH, k_BSKH, v_BSKH)
    return (*vjp(do_BTNH), None, None)


kernel_attention.defvjp(_kernel_attention_fwd, _kernel_attention_bwd)


def attention(q_BTNH, k_BSKH, v_BSKH, q_positions_BT, kv_lengths_B, *, config: ModelConfig,
              window: int | None, queries_from_zero: bool, mesh: Mesh | None = None) -> jnp.ndarray:
    """Attention of ``q`` over keys/values [B, S, K, H] with the implementation the config selects.

    ``queries_from_zero`` says that query t sits at position t (prefill and full forward), which the
    fused prefill kernel assumes; otherwise a single query per row sits at ``kv_lengths_B - 1`` (decode).
    ``mesh``: the mesh of a sharded run, on whose shards a kernel runs (XLA cannot partition a kernel).
    """
    common = dict(sm_scale=config.attn_scale, sliding_window=window, logit_softcap=config.attn_logit_softcap)
    match config.attention_impl:
        case AttentionImpl.PALLAS if queries_from_zero:
            kernel = functools.partial(pallas_kernels.flash_attention, **common)
            return attention_on_shards(kernel, mesh, q_BTNH, k_BSKH, v_BSKH, kv_lengths_B)
        case AttentionImpl.PALLAS if q_BTNH.shape[1] == 1:
            kernel = functools.partial(pallas_kernels.decode_attention, **common)
            return attention_on_shards(kernel, mesh, q_BTNH[:, 0], k_BSKH, v_BSKH, kv_lengths_B)[:, None]
        case AttentionImpl.XLA if q_BTNH.shape[1] > 1 and _cpu_kernels_attend(config, mesh, k_BSKH.dtype):
            return kernel_attention(q_BTNH, k_BSKH, v_BSKH, q_positions_BT, kv_lengths_B, config.attn_scale, window,
                                    config.attn_logit_softcap)
        case _:
            return xla_attention(q_BTNH, k_BSKH, v_BSKH, q_positions_BT, kv_lengths_B, scale=config.attn_scale,
                                 window=window, softcap=config.attn_logit_softcap)


def cached_attention(q_BTNH, k_LBSKH, v_LBSKH, layer, q_positions_BT, kv_lengths_B, *, config: ModelConfig,
                     window: int | None, mesh: Mesh | None = None) -> jnp.ndarray:
    """:func:`attention` of new queries over layer ``layer`` of the stacked cache [L, B, S, K, H] (decode, or
    a prompt continuing a cache).

    With XLA attention on one CPU device (``MatmulImpl.AUTO``) the CPU kernels run it, reading the layer
    where it lies in the cache (XLA would slice it out and transpose it for its dot products: two copies
    of the layer's cache per layer and step), and only the slots each query sees. Otherwise the layer is
    sliced out for :func:`attention`.
    """
    if _cpu_kernels_attend(config, mesh, k_LBSKH.dtype):
        common = dict(scale=config.attn_scale, window=window, softcap=config.attn_logit_softcap)
        if q_BTNH.shape[1] == 1:
            o_BNH = cpu_kernels.decode_attention(q_BTNH[:, 0], k_LBSKH, v_LBSKH, layer, q_positions_BT[:, 0],
                                                 kv_lengths_B, **common)
            return o_BNH[:, None].astype(q_BTNH.dtype)
        o_BTNH = cpu_kernels.prefill_attention(q_BTNH, k_LBSKH, v_LBSKH, layer, q_positions_BT, kv_lengths_B, **common)
        return o_BTNH.astype(q_BTNH.dtype)
    return attention(q_BTNH, kvc.read_layer(k_LBSKH, layer), kvc.read_layer(v_LBSKH, layer), q_positions_BT,
                     kv_lengths_B, config=config, window=window, queries_from_zero=False, mesh=mesh)


def append_and_attend(q_BTNH, k_BTKH, v_BTKH, k_LBSKH, v_LBSKH, layer, slots_BT, q_positions_BT, *,
                      config: ModelConfig, window: int | None, mesh: Mesh | None = None):
    """Write the new keys and values [B, T, K, H] at ``slots_BT`` of layer ``layer`` of the stacked caches
    (a slot outside the cache writes nothing: a finished row), then :func:`cached_attention` of the new
    queries, each row seeing its slots up to its last query: (o_BTNH, k_LBSKH, v_LBSKH).

    For one query per row (decode) where the CPU kernels attend, one kernel does both, updating the caches
    in place: the write was eight small XLA ops per layer and step.
    """
    kv_lengths_B = q_positions_BT[:, -1] + 1
    if q_BTNH.shape[1] == 1 and _cpu_kernels_attend(config, mesh, k_LBSKH.dtype):
        o_BNH, k_LBSKH, v_LBSKH = cpu_kernels.decode_attention_append(
            q_BTNH[:, 0], kvc.stored(k_LBSKH, k_BTKH[:, 0]), kvc.stored(v_LBSKH, v_BTKH[:, 0]), k_LBSKH, v_LBSKH,
            layer, slots_BT[:, 0], q_positions_BT[:, 0], kv_lengths_B, scale=config.attn_scale, window=window,
            softcap=config.attn_logit_softcap)
        return o_BNH[:, None].astype(q_BTNH.dtype), k_LBSKH, v_LBSKH
    k_LBSKH = kvc.write_tokens(k_LBSKH, layer, slots_BT, k_BTKH)
    v_LBSKH = kvc.write_tokens(v_LBSKH, layer, slots_BT, v_BTKH)
    o_BTNH = cached_attention(q_BTNH, k_LBSKH, v_LBSKH, layer, q_positions_BT, kv_lengths_B, config=config,
                              window=window, mesh=mesh)
    return o_BTNH, k_LBSKH, v_LBSKH
