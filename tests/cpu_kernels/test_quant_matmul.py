"""``cpu_kernels.quant_matmul``: products with int8 and int4 weights in panels, read as they lie.

The oracle is numpy in float64 on the integers and scales as the layout describes them (unpacked here,
not by llm_jax), so both the kernel and XLA's fallback are checked against arithmetic nobody here wrote
twice; float32 sums of K terms differ from it by a few ulp of the largest partial sums.
"""

from __future__ import annotations

import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import cpu_kernels

qm = importlib.import_module("cpu_kernels.quant_matmul")  # the module (the package exports its function)


def make(rng, L: int, K: int, N: int, bits: int, G: int):
    """Random integers and scales as numpy arrays [L, K, N] and [L, ceil(K / G), N], and their panels."""
    lo, hi = (-127, 128) if bits == 8 else (-8, 8)
    q = rng.integers(lo, hi, size=(L, K, N)).astype(np.int8)
    s = rng.uniform(0.01, 0.1, size=(L, -(-K // G), N)).astype(np.float32)
    if bits == 8:
        stored = q
    else:
        u = (q.astype(np.int32) + 8).astype(np.uint8)
        if K % 2:
            u = np.concatenate([u, np.full((L, 1, N), 8, np.uint8)], axis=1)
        stored = u[:, 0::2] | (u[:, 1::2] << 4)
    def panels(a):
        return np.asarray(cpu_kernels.to_panels(jnp.asarray(a)))

    return q, s, panels(stored), panels(s)


def oracle(x, q, s, G: int, layer: int) -> np.ndarray:
    w = q[layer].astype(np.float64) * np.repeat(s[layer], G, axis=0)[: q.shape[1]].astype(np.float64)
    return x.astype(np.float64) @ w


# One row takes panels several at a time (int8: 4, int4: 3) and the rest one by one: N = 112 is 7 panels.
CASES = [(8, 32, 96, 1), (8, 20, 101, 1), (8, 20, 100, 3), (8, 96, 96, 9), (4, 32, 172, 1), (4, 32, 33, 1),
         (4, 64, 128, 5), (4, 128, 768, 2), (4, 32, 33, 4)]


@pytest.mark.parametrize("bits,G,K,R", CASES)
def test_kernel_against_float64(bits, G, K, R):
    rng = np.random.default_rng(bits * 100 + K)
    L, N = 3, 112
    q, s, qp, sp = make(rng, L, K, N, bits, G)
    x = rng.normal(size=(R, K)).astype(np.float32)
    run = jax.jit(lambda x, a, b, layer: cpu_kernels.quant_matmul(x, a, b, bits=bits, group_size=G, layer=layer))
    for layer in range(L):
        expected = oracle(x, q, s, G, layer)
        tol = 2e-6 * np.abs(x).sum(1, keepdims=True) * np.abs(expected).max()
        for y in (run(x, qp, sp, layer), qm._xla(jnp.asarray(x), jnp.asarray(qp), jnp.asarray(sp),
                                                 jnp.asarray(layer, jnp.int32), bits=bits, group_size=G)):
            assert np.all(np.abs(np.asarray(y) - expected) <= tol + 1e-5)
    # Without a stack: the same numbers.
    y0 = cpu_kernels.quant_matmul(jnp.asarray(x), jnp.asarray(qp[0]), jnp.asarray(sp[0]), bits=bits, group_size=G)
    np.testing.assert_array_equal(np.asarray(y0), np.asarray(run(x, qp, sp, 0)))


@pytest.mark.parametrize("bits,G,K,R", [(8, 16, 96, 1), (8, 32, 101, 3), (4, 32, 172, 1), (4, 16, 64, 5),
                                         (4, 32, 33, 4)])
def test_offsets_against_float64(bits, G, K, R):
    """With an offset per group and column: W = s · q + o, each group's offset times its sum of x."""
    rng = np.random.default_rng(bits * 100 + K + 7)
    L, N = 2, 112
    q, s, qp, sp = make(rng, L, K, N, bits, G)
    o = rng.normal(scale=0.1, size=s.shape).astype(np.float32)
    op = np.asarray(cpu_kernels.to_panels(jnp.asarray(o)))
    x = rng.normal(size=(R, K)).astype(np.float32)
    run = jax.jit(lambda x, a, b, c, layer: cpu_kernels.quant_matmul(x, a, b, bits=bits, group_size=G, layer=layer,
                                                                     offsets=c))
    for layer in range(L):
        w = (q[layer].astype(np.float64) * np.repeat(s[layer], G, axis=0)[:K]
             + np.repeat(o[layer], G, axis=0)[:K].astype(np.float64))
        expected = x.astype(np.float64) @ w
        tol = 2e-6 * np.abs(x).sum(1, keepdims=True) * np.abs(w).max() * 8
        for y in (run(x, qp, sp, op, layer), qm._xla(jnp.asarray(x), jnp.asarray(qp), jnp.asarray(sp),
                                                     jnp.asarray(layer, jnp.int32), jnp.asarray(op), bits=bits,
                                                     group_size=G)):
            assert np.all(np.abs(np.asarray(y) - expected) <= tol + 1e-5)
    y0 = cpu_kernels.quant_matmul(jnp.asarray(x), jnp.asarray(qp[1]), jnp.asarray(sp[1]), bits=bits, group_size=G,
                                  offsets=jnp.asarray(op[1]))
    np.testing.assert_array_equal(np.asarray(y0), np.asarray(run(x, qp, sp, op, 1)))


def test_bad_shapes_are_named():
    rng = np.random.default_rng(0)
    _, _, qp, sp = make(rng, 1, 64, 16, 4, 32)
    x = jnp.ones((1, 64), jnp.float32)
    with pytest.raises(ValueError, match=r"quant_matmul\(bits=4, group_size=31\)"):
        cpu_kernels.quant_matmul(x, jnp.asarray(qp[0]), jnp.asarray(sp[0]), bits=4, group_size=31)
    with pytest.raises(ValueError, match="got x"):
        cpu_kernels.quant_matmul(x, jnp.asarray(qp[0]).astype(jnp.int8), jnp.asarray(sp[0]), bits=4, group_size=32)
    with pytest.raises(ValueError, match=r"offsets float32 \(4, 2, 16\)"):
        cpu_kernels.quant_matmul(x, jnp.asarray(qp[0]), jnp.asarray(sp[0]), bits=4, group_size=32,
                                 offsets=jnp.zeros((4, 2, 16), jnp.float32))
