"""The FFI call both attention kernels share: (layer, q, keys, values, q positions, kv lengths) and the
attributes scale, window and softcap, with keys and values of float32, bfloat16 or bfloat16 bits."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

_TARGETS = {np.dtype(jnp.float32): "f32", np.dtype(jnp.bfloat16): "bf16", np.dtype(jnp.uint16): "u16"}


def attention_call(kind: str, q: jax.Array, k_LBSKH: jax.Array, v_LBSKH: jax.Array, layer, q_positions: jax.Array,
                   kv_lengths_B: jax.Array, *, scale: float, window: int | None, softcap: float | None) -> jax.Array:
    """Runs ``llm_jax_{kind}_attention_{dtype}``: float32 [q's shape]. Shapes are checked by the caller."""
    if np.dtype(k_LBSKH.dtype) not in _TARGETS:
        raise ValueError(f"{kind}_attention: keys and values of {k_LBSKH.dtype} are not supported (float32, bfloat16)")
    if window is not None and window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    call = jax.ffi.ffi_call(f"llm_jax_{kind}_attention_{_TARGETS[np.dtype(k_LBSKH.dtype)]}",
                            jax.ShapeDtypeStruct(q.shape, jnp.float32), vmap_method="sequential")
    return call(jnp.asarray(layer, jnp.int32), q.astype(jnp.float32), k_LBSKH, v_LBSKH,
                jnp.asarray(q_positions, jnp.int32), jnp.asarray(kv_lengths_B, jnp.int32), scale=np.float32(scale),
                window=np.int64(window or 0), softcap=np.float32(softcap or 0.0))
