"""Decode attention on CPU: one query per row against one layer of the stacked KV cache, read in place
(``decode_attention.cc``). Forward only: decode is never differentiated.

    decode_attention(q_BNH, k_LBSKH, v_LBSKH, layer, q_positions_B, kv_lengths_B, *, scale, window, softcap)
        -> o_BNH float32

The semantics are ``llm_jax.model.attention.xla_attention`` 's for one query per row at
``q_positions_B``; the caches may be float32, bfloat16, or bfloat16 held as its bits (uint16).
Callers check :func:`cpu_kernels.available` first.
"""

from __future__ import annotations

import jax

from cpu_kernels.attention_call import attention_call


def decode_attention(q_BNH: jax.Array, k_LBSKH: jax.Array, v_LBSKH: jax.Array, layer: jax.Array,
                     q_positions_B: jax.Array, kv_lengths_B: jax.Array, *, scale: float, window: int | None,
                     softcap: float | None) -> jax.Array:
    """Attention of q [B, N, H] (query head n uses kv head n // (N / K)) over layer ``layer`` of the caches
    [L, B, S, K, H]: [B, N, H] float32."""
    L, B, S, K, H = k_LBSKH.shape
    if (v_LBSKH.shape != k_LBSKH.shape or v_LBSKH.dtype != k_LBSKH.dtype or q_BNH.ndim != 3
            or q_BNH.shape[0] != B or q_BNH.shape[2] != H or q_BNH.shape[1] % K):
        raise ValueError(f"decode_attention needs q [B, N, H] with N a multiple of K and caches [L, B, S, K, H] "
                         f"alike, got q {q_BNH.shape}, k {k_LBSKH.shape} {k_LBSKH.dtype}, v {v_LBSKH.shape} "
                         f"{v_LBSKH.dtype}")
    return attention_call("decode", q_BNH, k_LBSKH, v_LBSKH, layer, q_positions_B, kv_lengths_B, scale=scale,
                          window=window, softcap=softcap)
