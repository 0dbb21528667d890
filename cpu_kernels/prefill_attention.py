"""Attention of many queries per row on CPU (prefill, a full forward, a prompt continuing a cache):
q [B, T, N, H] against one layer of keys and values [L, B, S, K, H], read in place
(``prefill_attention.cc``). Only the keys each query sees are computed: causal masks halve the work,
and a prompt continuing a long cache reads its filled slots only.

    prefill_attention(q_BTNH, k_LBSKH, v_LBSKH, layer, q_positions_BT, kv_lengths_B, *, scale, window,
                      softcap) -> o_BTNH float32

The semantics are ``llm_jax.backends.base.xla_attention``'s; keys and values may be float32,
bfloat16, or bfloat16 held as its bits (uint16). Forward only (the model gives it XLA's gradient).
Callers check :func:`cpu_kernels.available` first.
"""

from __future__ import annotations

import jax

from cpu_kernels.attention_call import attention_call


def prefill_attention(q_BTNH: jax.Array, k_LBSKH: jax.Array, v_LBSKH: jax.Array, layer: jax.Array | int,
                      q_positions_BT: jax.Array, kv_lengths_B: jax.Array, *, scale: float, window: int | None,
                      softcap: float | None) -> jax.Array:
    """Attention of q [B, T, N, H] (query head n uses kv head n // (N / K)) at ``q_positions_BT`` over layer
    ``layer`` of keys and values [L, B, S, K, H]: [B, T, N, H] float32."""
    L, B, S, K, H = k_LBSKH.shape
    if (v_LBSKH.shape != k_LBSKH.shape or v_LBSKH.dtype != k_LBSKH.dtype or q_BTNH.ndim != 4
            or q_BTNH.shape[0] != B or q_BTNH.shape[3] != H or q_BTNH.shape[2] % K
            or q_positions_BT.shape != q_BTNH.shape[:2] or kv_lengths_B.shape != (B,)):
        raise ValueError(f"prefill_attention needs q [B, T, N, H] with N a multiple of K, keys and values [L, B, S, "
                         f"K, H] alike, positions [B, T] and lengths [B], got q {q_BTNH.shape}, k {k_LBSKH.shape} "
                         f"{k_LBSKH.dtype}, v {v_LBSKH.shape} {v_LBSKH.dtype}, positions {q_positions_BT.shape}, "
                         f"lengths {kv_lengths_B.shape}")
    return attention_call("prefill", q_BTNH, k_LBSKH, v_LBSKH, layer, q_positions_BT, kv_lengths_B, scale=scale,
                          window=window, softcap=softcap)
