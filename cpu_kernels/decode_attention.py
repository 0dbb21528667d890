"""Decode attention on CPU: one query per row against one layer of the stacked KV cache, read in place
(``decode_attention.cc``). Forward only: decode is never differentiated.

    decode_attention(q_BNH, k_LBSKH, v_LBSKH, layer, q_positions_B, kv_lengths_B, *, scale, window, softcap)
        -> o_BNH float32
    decode_attention_append(q_BNH, k_new_BKH, v_new_BKH, k_LBSKH, v_LBSKH, layer, slots_B, q_positions_B,
                            kv_lengths_B, *, scale, window, softcap) -> (o_BNH, k_LBSKH, v_LBSKH)

The semantics are ``llm_jax.backends.base.xla_attention``'s for one query per row at
``q_positions_B``; the caches may be float32, bfloat16, or bfloat16 held as its bits (uint16). The
``_append`` form first writes each row's new key and value at its slot of the layer (a decode step's
cache write) and returns the caches too, updated in place: donate them, or carry them in a loop.
Callers check :func:`cpu_kernels.available` first.
"""

from __future__ import annotations

import jax

from cpu_kernels.attention_call import append_call, attention_call


def _check(name: str, q_BNH: jax.Array, k_LBSKH: jax.Array, v_LBSKH: jax.Array) -> None:
    L, B, S, K, H = k_LBSKH.shape
    if (v_LBSKH.shape != k_LBSKH.shape or v_LBSKH.dtype != k_LBSKH.dtype or q_BNH.ndim != 3
            or q_BNH.shape[0] != B or q_BNH.shape[2] != H or q_BNH.shape[1] % K):
        raise ValueError(f"{name} needs q [B, N, H] with N a multiple of K and caches [L, B, S, K, H] "
                         f"alike, got q {q_BNH.shape}, k {k_LBSKH.shape} {k_LBSKH.dtype}, v {v_LBSKH.shape} "
                         f"{v_LBSKH.dtype}")


def decode_attention(q_BNH: jax.Array, k_LBSKH: jax.Array, v_LBSKH: jax.Array, layer: jax.Array,
                     q_positions_B: jax.Array, kv_lengths_B: jax.Array, *, scale: float, window: int | None,
                     softcap: float | None) -> jax.Array:
    """Attention of q [B, N, H] (query head n uses kv head n // (N / K)) over layer ``layer`` of the caches
    [L, B, S, K, H]: [B, N, H] float32."""
    _check("decode_attention", q_BNH, k_LBSKH, v_LBSKH)
    return attention_call("decode", q_BNH, k_LBSKH, v_LBSKH, layer, q_positions_B, kv_lengths_B, scale=scale,
                          window=window, softcap=softcap)


def decode_attention_append(q_BNH: jax.Array, k_new_BKH: jax.Array, v_new_BKH: jax.Array, k_LBSKH: jax.Array,
                            v_LBSKH: jax.Array, layer: jax.Array, slots_B: jax.Array, q_positions_B: jax.Array,
                            kv_lengths_B: jax.Array, *, scale: float, window: int | None,
                            softcap: float | None) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Write row b's key and value [K, H] (the caches' dtype) at slot ``slots_B[b]`` of layer ``layer`` (nothing
    for a slot outside [0, S)), then :func:`decode_attention`: (o [B, N, H] float32, keys, values)."""
    _check("decode_attention_append", q_BNH, k_LBSKH, v_LBSKH)
    L, B, S, K, H = k_LBSKH.shape
    for name, new in (("k_new", k_new_BKH), ("v_new", v_new_BKH)):
        if new.shape != (B, K, H) or new.dtype != k_LBSKH.dtype:
            raise ValueError(f"decode_attention_append: {name} must be [B, K, H] = {(B, K, H)} of the caches' dtype "
                             f"{k_LBSKH.dtype}, got {new.shape} {new.dtype}")
    if slots_B.shape != (B,):
        raise ValueError(f"decode_attention_append: slots must be [B] = ({B},), got {slots_B.shape}")
    return append_call(q_BNH, k_new_BKH, v_new_BKH, k_LBSKH, v_LBSKH, layer, slots_B, q_positions_B, kv_lengths_B,
                       scale=scale, window=window, softcap=softcap)
