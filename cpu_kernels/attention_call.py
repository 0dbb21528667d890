"""The FFI calls the attention kernels share: (layer, q, keys, values, q positions, kv lengths) and the
attributes scale, window and softcap, with keys and values of float32, bfloat16 or bfloat16 bits; and
decode attention's form that first writes the step's keys and values into the caches."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

_TARGETS = {np.dtype(jnp.float32): "f32", np.dtype(jnp.bfloat16): "bf16", np.dtype(jnp.uint16): "u16"}


def _target(kind: str, k_LBSKH: jax.Array) -> str:
    if np.dtype(k_LBSKH.dtype) not in _TARGETS:
        raise ValueError(f"{kind}_attention: keys and values of {k_LBSKH.dtype} are not supported (float32, bfloat16)")
    return f"llm_jax_{kind}_attention_{_TARGETS[np.dtype(k_LBSKH.dtype)]}"


def _attributes(window: int | None, scale: float, softcap: float | None) -> dict:
    if window is not None and window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    return dict(scale=np.float32(scale), window=np.int64(window or 0), softcap=np.float32(softcap or 0.0))


def attention_call(kind: str, q: jax.Array, k_LBSKH: jax.Array, v_LBSKH: jax.Array, layer, q_positions: jax.Array,
                   kv_lengths_B: jax.Array, *, scale: float, window: int | None, softcap: float | None) -> jax.Array:
    """Runs ``llm_jax_{kind}_attention_{dtype}``: float32 [q's shape]. Shapes are checked by the caller."""
    call = jax.ffi.ffi_call(_target(kind, k_LBSKH), jax.ShapeDtypeStruct(q.shape, jnp.float32),
                            vmap_method="sequential")
    return call(jnp.asarray(layer, jnp.int32), q.astype(jnp.float32), k_LBSKH, v_LBSKH,
                jnp.asarray(q_positions, jnp.int32), jnp.asarray(kv_lengths_B, jnp.int32),
                **_attributes(window, scale, softcap))


def append_call(q_BNH: jax.Array, k_new_BKH: jax.Array, v_new_BKH: jax.Array, k_LBSKH: jax.Array, v_LBSKH: jax.Array,
                layer, slots_B: jax.Array, q_positions_B: jax.Array, kv_lengths_B: jax.Array, *, scale: float,
                window: int | None, softcap: float | None) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Runs ``llm_jax_decode_attention_append_{dtype}``: (o [B, N, H] float32, keys, values), the caches
    aliased to their operands (updated in place). Shapes are checked by the caller."""
    results = (jax.ShapeDtypeStruct(q_BNH.shape, jnp.float32), jax.ShapeDtypeStruct(k_LBSKH.shape, k_LBSKH.dtype),
               jax.ShapeDtypeStruct(v_LBSKH.shape, v_LBSKH.dtype))
    call = jax.ffi.ffi_call(_target("decode", k_LBSKH).replace("_attention_", "_attention_append_"), results,
                            vmap_method="sequential", input_output_aliases={4: 1, 5: 2})
    o_BNH, k_LBSKH, v_LBSKH = call(jnp.asarray(layer, jnp.int32), q_BNH.astype(jnp.float32), k_new_BKH, v_new_BKH,
                                   k_LBSKH, v_LBSKH, jnp.asarray(slots_B, jnp.int32),
                                   jnp.asarray(q_positions_B, jnp.int32), jnp.asarray(kv_lengths_B, jnp.int32),
                                   **_attributes(window, scale, softcap))
    return o_BNH, k_LBSKH, v_LBSKH
