"""Grouped-query self-attention's projections: q/k/v/o, optional q/k/v bias and q/k RMSNorm (per head, or over
all heads: ``ModelConfig.qk_norm_scope``), RoPE.

How attention itself is computed (over fresh keys or the KV cache, with which kernel) is the backend's
(:meth:`llm_jax.backends.Backend.attention`, :meth:`~llm_jax.backends.Backend.append_and_attend`); its
reference is :func:`llm_jax.backends.base.xla_attention`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import linen as nn

from llm_jax.backends.base import Backend, Xla, layer_of
from llm_jax.config import ModelConfig, QKNormScope
from llm_jax.lora import LoraBatch
from llm_jax.model.layers import RMSNorm, stacked_param, weight
from llm_jax.model.rope import apply_rope, rotary_cos_sin


class Attention(nn.Module):
    """Q/K/V and output projections of one layer: q_proj [D, N, H], k/v_proj [D, K, H], o_proj [N, H, D]
    (each with a leading [L] axis when ``stack`` is L: see :mod:`llm_jax.model.layers`)."""

    config: ModelConfig
    backend: Backend = Xla()
    stack: int | None = None

    def setup(self) -> None:
        c, L = self.config, self.stack
        D, N, K, H = c.d_model, c.n_heads, c.n_kv_heads, c.head_dim
        self.q_proj = weight(self, "q_proj", (D, N, H), L)
        self.k_proj = weight(self, "k_proj", (D, K, H), L)
        self.v_proj = weight(self, "v_proj", (D, K, H), L)
        self.o_proj = weight(self, "o_proj", (N, H, D), L)
        if c.qkv_bias:
            self.q_bias = stacked_param(self, "q_bias", nn.initializers.zeros, (N, H), L)
            self.k_bias = stacked_param(self, "k_bias", nn.initializers.zeros, (K, H), L)
            self.v_bias = stacked_param(self, "v_bias", nn.initializers.zeros, (K, H), L)
        if c.qk_norm and c.qk_norm_scope is QKNormScope.HEAD:  # q_norm, k_norm: scales [H]
            self.q_norm = RMSNorm(eps=c.norm_eps, weight_offset=c.norm_weight_offset, stack=L)
            self.k_norm = RMSNorm(eps=c.norm_eps, weight_offset=c.norm_weight_offset, stack=L)
        elif c.qk_norm:  # each token's whole projection: q_proj_norm [N, H], k_proj_norm [K, H]
            self.q_proj_norm = RMSNorm(eps=c.norm_eps, weight_offset=c.norm_weight_offset, stack=L, axes=2)
            self.k_proj_norm = RMSNorm(eps=c.norm_eps, weight_offset=c.norm_weight_offset, stack=L, axes=2)

    def project(self, x_BTD: jax.Array, positions_BT: jax.Array, layer: jax.Array | None = None,
                lora: LoraBatch | None = None, sliding: bool = False, seq_lens_BT: jax.Array | None = None):
        """Queries [B, T, N, H] and keys/values [B, T, K, H] at ``positions_BT``, RoPE applied: a sliding-window
        layer's (``sliding``, static) or a global one's (:meth:`ModelConfig.layer_rope`), to the first
        ``config.rope_dim`` dimensions of each head. ``seq_lens_BT``: the sequence length that picks each token's
        LongRoPE factors (``transformer._rope_seq_lens``). ``lora``: each token's adapter updates the
        projections."""
        c, dtype = self.config, x_BTD.dtype
        q_BTNH, k_BTKH, v_BTKH = self.backend.dense_many(
            ["BTD,DNH->BTNH", "BTD,DKH->BTKH", "BTD,DKH->BTKH"], x_BTD, [self.q_proj, self.k_proj, self.v_proj],
            jnp.float32, layer)
        if lora is not None:
            q_BTNH, k_BTKH, v_BTKH = (lora.apply(name, x_BTD, y, layer) for name, y in
                                      (("q_proj", q_BTNH), ("k_proj", k_BTKH), ("v_proj", v_BTKH)))
        if c.qkv_bias:
            biases = (self.q_bias, self.k_bias, self.v_bias)
            q_NH, k_KH, v_KH = biases if layer is None else (layer_of(b, layer) for b in biases)
            q_BTNH, k_BTKH, v_BTKH = q_BTNH + q_NH, k_BTKH + k_KH, v_BTKH + v_KH
        q_BTNH, k_BTKH, v_BTKH = q_BTNH.astype(dtype), k_BTKH.astype(dtype), v_BTKH.astype(dtype)
        if c.qk_norm and c.qk_norm_scope is QKNormScope.HEAD:
            q_BTNH, k_BTKH = self.q_norm(q_BTNH, layer), self.k_norm(k_BTKH, layer)
        elif c.qk_norm:
            q_BTNH, k_BTKH = self.q_proj_norm(q_BTNH, layer), self.k_proj_norm(k_BTKH, layer)
        cos, sin = rotary_cos_sin(positions_BT, seq_lens_BT, c.rope_dim, *c.layer_rope(sliding))
        return apply_rope(q_BTNH, cos, sin), apply_rope(k_BTKH, cos, sin), v_BTKH

    def output(self, o_BTNH: jax.Array, layer: jax.Array | None = None, lora: LoraBatch | None = None) -> jax.Array:
        if lora is None:
            return self.backend.dense("BTNH,NHD->BTD", o_BTNH, self.o_proj, o_BTNH.dtype, layer)
        y_BTD = self.backend.dense("BTNH,NHD->BTD", o_BTNH, self.o_proj, jnp.float32, layer)
        return lora.apply("o_proj", o_BTNH, y_BTD, layer).astype(o_BTNH.dtype)
