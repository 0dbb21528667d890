"""Matrix products for LLM decode on CPU: XLA FFI custom calls written in C++ (``matmul.cc``).

Depends on jax only. ``matmul(x_RK, w)`` computes x [R, K] · W in float32 for W [K, N] or, with
``transposed=True``, W [N, K], in float32 or bfloat16 — the product decode runs for every weight
matrix, with few rows R. On CPU it streams the weights at memory bandwidth on every core and reads
bfloat16 weights as they are (XLA:CPU has no bfloat16 kernel and converts whole matrices to float32
first); on other platforms, and when the kernels cannot be built (no C++ compiler), it is XLA's
product. Gradients are XLA's.

    available() -> bool          # the kernels are built and registered for this process
    matmul(x_RK, w, *, transposed=False) -> y_RN (float32)
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from cpu_kernels import build

__all__ = ["available", "matmul"]


def available() -> bool:
    """True when the default backend is the CPU and the kernels are built and registered."""
    return jax.default_backend() == "cpu" and build.load()


def _xla(x_RK: jax.Array, w: jax.Array, transposed: bool) -> jax.Array:
    spec = "RK,NK->RN" if transposed else "RK,KN->RN"
    return jnp.einsum(spec, x_RK.astype(w.dtype), w, preferred_element_type=jnp.float32)


def _kernel(x_RK: jax.Array, w: jax.Array, transposed: bool) -> jax.Array:
    N = w.shape[0] if transposed else w.shape[1]
    target = f"llm_jax_matmul_{'nk' if transposed else 'kn'}_{'bf16' if w.dtype == jnp.bfloat16 else 'f32'}"
    call = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct((x_RK.shape[0], N), jnp.float32),
                            vmap_method="sequential")
    return call(x_RK.astype(jnp.float32), w)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _matmul(x_RK: jax.Array, w: jax.Array, transposed: bool) -> jax.Array:
    return jax.lax.platform_dependent(x_RK, w, cpu=functools.partial(_kernel, transposed=transposed),
                                      default=functools.partial(_xla, transposed=transposed))


def _matmul_fwd(x_RK, w, transposed):
    return _matmul(x_RK, w, transposed), (x_RK, w)


def _matmul_bwd(transposed, residuals, dy_RN):
    x_RK, w = residuals
    dy_RN = dy_RN.astype(jnp.float32)
    dx_RK = jnp.einsum("RN,NK->RK" if transposed else "RN,KN->RK", dy_RN, w.astype(jnp.float32))
    dw = jnp.einsum("RN,RK->NK" if transposed else "RK,RN->KN", *(
        (dy_RN, x_RK.astype(jnp.float32)) if transposed else (x_RK.astype(jnp.float32), dy_RN)))
    return dx_RK.astype(x_RK.dtype), dw.astype(w.dtype)


_matmul.defvjp(_matmul_fwd, _matmul_bwd)


def matmul(x_RK: jax.Array, w: jax.Array, *, transposed: bool = False) -> jax.Array:
    """x [R, K] · W → [R, N] float32, W [K, N] (or [N, K] when ``transposed``), float32 or bfloat16.

    Uses the kernels when :func:`available`, XLA's product otherwise.
    """
    k_axis = 1 if transposed else 0
    if x_RK.ndim != 2 or w.ndim != 2 or x_RK.shape[1] != w.shape[k_axis]:
        raise ValueError(f"matmul needs x [R, K] and w {'[N, K]' if transposed else '[K, N]'} with the same K, "
                         f"got x {x_RK.shape} and w {w.shape}")
    if w.dtype not in (jnp.float32, jnp.bfloat16) or not available():
        return _xla(x_RK, w, transposed)
    return _matmul(x_RK, w, transposed)
