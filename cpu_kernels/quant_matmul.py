"""Products with quantized weights in the panel layout (``quant_matmul.cc``): the CPU kernel, and XLA's
product of the same function where the kernels do not run.

    quant_matmul(x_RK, q, s, bits=8 | 4, group_size=G, layer=None, offsets=None) -> y_RN float32

``q``: int8 [N / 16, K, 16] (8 bits) or uint8 [N / 16, ceil(K / 2), 16] (4 bits: byte j of a column holds
inputs 2j, low nibble, and 2j + 1, high nibble, each q + 8); ``s``: float32 [N / 16, ceil(K / G), 16]; with
``layer`` both are stacks [L, ...] and layer ``layer`` is read in place. W[k, n] = s[k // G, n] · q[k, n],
plus ``o[k // G, n]`` with ``offsets`` o (laid out as s).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

import cpu_kernels  # the package's helpers, read at call time (this module is imported while it loads)


def quant_matmul(x_RK: jax.Array, q: jax.Array, s: jax.Array, *, bits: int, group_size: int,
                 layer: jax.Array | int | None = None, offsets: jax.Array | None = None) -> jax.Array:
    """x [R, K] · W → [R, N] float32 for W quantized as the module docstring says (x read as float32)."""
    stacked = layer is not None
    rank = 4 if stacked else 3
    K = x_RK.shape[1]
    rows = K if bits == 8 else -(-K // 2)
    groups = -(-K // group_size)
    dtype = jnp.int8 if bits == 8 else jnp.uint8
    if (bits not in (8, 4) or q.ndim != rank or s.ndim != rank or q.dtype != dtype or s.dtype != jnp.float32
            or q.shape[-2:] != (rows, cpu_kernels.PANEL) or s.shape[-2:] != (groups, cpu_kernels.PANEL)
            or q.shape[:-2] != s.shape[:-2]
            or (offsets is not None and (offsets.shape != s.shape or offsets.dtype != jnp.float32))
            or (bits == 4 and group_size % 2)):
        stack = "L, " if stacked else ""
        raise ValueError(f"quant_matmul({bits=}, {group_size=}) needs x [R, K], q {jnp.dtype(dtype).name} "
                         f"[{stack}N / 16, {'K' if bits == 8 else 'ceil(K / 2)'}, 16] and s float32 "
                         f"[{stack}N / 16, ceil(K / G), 16] (an even G for 4 bits; offsets as s); got x {x_RK.shape}, "
                         f"q {q.dtype} {q.shape}, s {s.dtype} {s.shape}"
                         + ("" if offsets is None else f", offsets {offsets.dtype} {offsets.shape}"))
    index = jnp.zeros((), jnp.int32) if layer is None else jnp.asarray(layer, jnp.int32)
    if not stacked:
        q, s = q[None], s[None]
        offsets = None if offsets is None else offsets[None]
    x_RK = x_RK.astype(jnp.float32)
    operands = (x_RK, q, s, index) + (() if offsets is None else (offsets,))
    if not cpu_kernels.available():
        return _xla(*operands, bits=bits, group_size=group_size)
    return jax.lax.platform_dependent(*operands, cpu=functools.partial(_kernel, bits=bits, group_size=group_size),
                                      default=functools.partial(_xla, bits=bits, group_size=group_size))


def _kernel(x_RK, q, s, index, offsets=None, *, bits: int, group_size: int):
    out = jax.ShapeDtypeStruct((x_RK.shape[0], q.shape[1] * cpu_kernels.PANEL), jnp.float32)
    name = f"llm_jax_quant_matmul_i{bits}" + ("" if offsets is None else "_offsets")
    call = jax.ffi.ffi_call(name, out, vmap_method="sequential")
    return call(index, x_RK, q, s, *(() if offsets is None else (offsets,)), group_size=group_size)


def _xla(x_RK, q, s, index, offsets=None, *, bits: int, group_size: int):
    """The same function as XLA's ops: the layer's integers unpacked, scaled (offset), multiplied."""
    K = x_RK.shape[1]
    q_KN = cpu_kernels.from_panels(jax.lax.dynamic_index_in_dim(q, index, keepdims=False))
    s_GN = cpu_kernels.from_panels(jax.lax.dynamic_index_in_dim(s, index, keepdims=False))
    if bits == 4:
        pairs = jnp.stack([(q_KN & 0xF).astype(jnp.int8) - 8, (q_KN >> 4).astype(jnp.int8) - 8], axis=1)
        q_KN = pairs.reshape(-1, q_KN.shape[-1])[:K]
    w_KN = q_KN.astype(jnp.float32) * jnp.repeat(s_GN, group_size, axis=0)[:K]
    if offsets is not None:
        o_GN = cpu_kernels.from_panels(jax.lax.dynamic_index_in_dim(offsets, index, keepdims=False))
        w_KN = w_KN + jnp.repeat(o_GN, group_size, axis=0)[:K]
    return jnp.dot(x_RK, w_KN, preferred_element_type=jnp.float32)
