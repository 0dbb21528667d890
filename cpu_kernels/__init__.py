"""Matrix products, attention and greedy argmax for LLM inference on CPU: XLA FFI custom calls written
in C++ (``matmul.cc``, ``decode_attention.cc``, ``prefill_attention.cc``, ``argmax.cc``); and
``stream_read.cc``, the benchmark's memory-bandwidth probe (``build.stream_read()``).

Depends on jax only. ``matmul(x_RK, w)`` computes x [R, K] · W in float32 for W [K, N] or, with
``transposed=True``, W [N, K], in float32 or bfloat16 — the product decode runs for every weight
matrix. On CPU, with few rows R (decode), it streams the weights at memory bandwidth on every core;
with many (batched decode, prefill) it runs register-tiled products on packed panels of the weights
(a tied LM head [N, K] at up to 32 rows: on its rows as they lie, against x transposed);
either way it reads bfloat16 weights as they are (XLA:CPU has no bfloat16 kernel and converts whole
matrices to float32 first); on other platforms, and when the kernels cannot be built (no C++
compiler), it is XLA's product. Gradients are XLA's.

    available() -> bool          # the kernels are built and registered for this process
    matmul(x_RK, w, *, transposed=False, layer=None) -> y_RN (float32; x is rounded to w's dtype first, as
        in XLA; with ``layer``, w is a stack [L, ...] of which that layer is read, in place)
    matmuls(x_RK, ws, *, transposed=False, layer=None) -> (y_RN, ...)   # several weights sharing x, one call
    decode_attention(q_BNH, k_LBSKH, v_LBSKH, layer, ...) -> o_BNH  # one query per row, cache read in place
    prefill_attention(q_BTNH, k_LBSKH, v_LBSKH, layer, ...) -> o_BTNH  # many queries per row: visible keys only
    argmax(x_BV) -> i_B   # jnp.argmax over the last axis (float32), vectorized; XLA's off the CPU
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from cpu_kernels import build
from cpu_kernels.decode_attention import decode_attention
from cpu_kernels.prefill_attention import prefill_attention

__all__ = ["argmax", "available", "decode_attention", "matmul", "matmuls", "prefill_attention"]


def available() -> bool:
    """True when the default backend is the CPU and the kernels are built and registered."""
    return jax.default_backend() == "cpu" and build.load()


def _layer(w: jax.Array, layer: jax.Array | None) -> jax.Array:
    """Layer ``layer`` of a stack of weights [L, ...] (``w`` itself when not stacked)."""
    return w if layer is None else jax.lax.dynamic_index_in_dim(w, layer, keepdims=False)


def _xla(x_RK: jax.Array, ws: tuple[jax.Array, ...], layer: jax.Array | None, transposed: bool):
    spec = "RK,NK->RN" if transposed else "RK,KN->RN"
    return tuple(jnp.einsum(spec, x_RK.astype(w.dtype), _layer(w, layer), preferred_element_type=jnp.float32)
                 for w in ws)


def _kernel(x_RK: jax.Array, ws: tuple[jax.Array, ...], layer: jax.Array | None, transposed: bool):
    dtype = "bf16" if ws[0].dtype == jnp.bfloat16 else "f32"
    target = f"llm_jax_matmul_{'nk' if transposed else 'kn'}_{dtype}"
    shapes = [jax.ShapeDtypeStruct((x_RK.shape[0], w.shape[-2] if transposed else w.shape[-1]), jnp.float32)
              for w in ws]
    call = jax.ffi.ffi_call(target, shapes, vmap_method="sequential")
    index = jnp.zeros((), jnp.int32) if layer is None else jnp.asarray(layer, jnp.int32)
    # x rounded to the weights' dtype, as XLA's product (``_xla``) does: both routes compute the same.
    return tuple(call(index, x_RK.astype(ws[0].dtype).astype(jnp.float32), *ws))


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _matmuls(x_RK: jax.Array, ws: tuple[jax.Array, ...], layer: jax.Array | None, transposed: bool):
    return jax.lax.platform_dependent(x_RK, ws, layer, cpu=functools.partial(_kernel, transposed=transposed),
                                      default=functools.partial(_xla, transposed=transposed))


def _matmuls_fwd(x_RK, ws, layer, transposed):
    return _matmuls(x_RK, ws, layer, transposed), (x_RK, ws, layer)


def _matmuls_bwd(transposed, residuals, dys):
    x_RK, ws, layer = residuals
    x32 = x_RK.astype(jnp.float32)
    dx_RK = jnp.zeros(x_RK.shape, jnp.float32)
    dws = []
    for w, dy_RN in zip(ws, dys):
        dy_RN, w32 = dy_RN.astype(jnp.float32), _layer(w, layer).astype(jnp.float32)
        # The forward reads x rounded to w's dtype: its cotangent is rounded the same way (as XLA's is).
        if transposed:
            dx_RK += (dy_RN @ w32).astype(w.dtype).astype(jnp.float32)
            dw = (dy_RN.T @ x32).astype(w.dtype)
        else:
            dx_RK += (dy_RN @ w32.T).astype(w.dtype).astype(jnp.float32)
            dw = (x32.T @ dy_RN).astype(w.dtype)
        dws.append(dw if layer is None else jnp.zeros_like(w).at[layer].set(dw))
    return dx_RK.astype(x_RK.dtype), tuple(dws), None


_matmuls.defvjp(_matmuls_fwd, _matmuls_bwd)


def matmuls(x_RK: jax.Array, ws, *, transposed: bool = False, layer: jax.Array | int | None = None):
    """x [R, K] · W_i → [R, N_i] float32 for each W_i in ``ws`` ([K, N_i], or [N_i, K] when ``transposed``;
    all float32 or all bfloat16). On CPU one kernel call streams every W_i: one fork-join for all.

    With ``layer`` (an int32 scalar, may be traced), every W_i is a stack [L, K, N_i] (or [L, N_i, K]) and
    its layer ``layer`` is used: the kernel reads it inside the stack, with no copy.

    Uses the kernels when :func:`available`, XLA's products otherwise.
    """
    ws = tuple(ws)
    k_axis = -1 if transposed else -2
    rank = 2 if layer is None else 3
    for w in ws:
        if x_RK.ndim != 2 or w.ndim != rank or x_RK.shape[1] != w.shape[k_axis]:
            stack = "" if layer is None else "L, "
            raise ValueError(f"matmul needs x [R, K] and w [{stack}{'N, K' if transposed else 'K, N'}] with the same "
                             f"K, got x {x_RK.shape} and w {w.shape}")
    if layer is not None:
        layer = jnp.asarray(layer, jnp.int32)
    dtypes = {w.dtype for w in ws}
    if len(dtypes) != 1 or dtypes.pop() not in (jnp.float32, jnp.bfloat16) or not available():
        return _xla(x_RK, ws, layer, transposed)
    return _matmuls(x_RK, ws, layer, transposed)


def matmul(x_RK: jax.Array, w: jax.Array, *, transposed: bool = False, layer: jax.Array | int | None = None):
    """x [R, K] · W → [R, N] float32, W [K, N] (or [N, K] when ``transposed``; with ``layer``, a stack
    [L, ...] of them), float32 or bfloat16."""
    return matmuls(x_RK, (w,), transposed=transposed, layer=layer)[0]


def argmax(x_BV: jax.Array) -> jax.Array:
    """``jnp.argmax(x_BV, axis=-1)`` as int32 [B] for float32 x [B, V]: the first index of each row's
    maximum (of its first NaN, if any). On CPU a kernel (XLA:CPU reduces (value, index) pairs one element
    at a time: 1.3 ms for [32, 32000]); XLA's elsewhere and when the kernels are not available."""
    if x_BV.ndim != 2 or x_BV.dtype != jnp.float32:
        raise ValueError(f"argmax needs float32 x [B, V], got {x_BV.dtype} {x_BV.shape}")
    xla = lambda x: jnp.argmax(x, axis=-1).astype(jnp.int32)
    if not available():
        return xla(x_BV)
    call = jax.ffi.ffi_call("llm_jax_argmax_f32", jax.ShapeDtypeStruct(x_BV.shape[:1], jnp.int32),
                            vmap_method="sequential")
    return jax.lax.platform_dependent(x_BV, cpu=call, default=xla)
