"""cpu_kernels.prefill_attention against llm_jax's pure-JAX attention (xla_attention): odd shapes, blocks of 16
query rows cut across positions and heads, grouped query heads, padding, sliding windows, soft-capping,
queries continuing a cache, a layer of a stack, float32 / bfloat16 / bfloat16-as-bits keys and values."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import cpu_kernels
from llm_jax.backends.base import xla_attention

pytestmark = pytest.mark.skipif(not cpu_kernels.available(), reason="no C++ compiler: the kernels are not built "
                                "(test_matmul's first test checks that a compiler, where present, builds them)")

# B, T, K, G, H, window, softcap. T · G is rarely a multiple of 16 (the rows of a unit); H covers 16-wide,
# 8-wide and single columns of the p·v tiles.
CASES = [(2, 13, 2, 3, 16, None, None), (1, 37, 1, 1, 8, 5, None), (2, 21, 3, 2, 24, None, 30.0),
         (3, 19, 2, 4, 64, None, None), (1, 40, 4, 2, 5, 7, 20.0), (2, 8, 1, 12, 12, None, None),
         (1, 70, 2, 1, 33, 64, None),
         (1, 300, 1, 2, 16, None, None)]  # more keys than one p·v pass takes (256)


def _bits(a):
    return jax.lax.bitcast_convert_type(a, jnp.uint16) if a.dtype == jnp.bfloat16 else a


def _check(ours, expected, dtype):
    assert ours.dtype == jnp.float32 and ours.shape == expected.shape
    # float32: the kernel's exp is within 2 ulp of XLA's and its sums run in another order. bfloat16: both
    # round the probabilities to bfloat16, where one ulp of a probability shows.
    tol = 2e-6 if dtype == jnp.float32 else 1e-2
    np.testing.assert_allclose(np.asarray(ours.astype(dtype).astype(jnp.float32)),
                               np.asarray(expected.astype(jnp.float32)), rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("B,T,K,G,H,window,softcap", CASES)
def test_prompt_matches_xla_attention(B, T, K, G, H, window, softcap, dtype):
    """Queries at positions 0..T-1 over their own keys, rows padded to different lengths (row 0 full,
    row 1 one key, others in between)."""
    rng = np.random.default_rng(T * H + G)
    q = jnp.asarray(rng.normal(size=(B, T, K * G, H)), dtype)
    k, v = (jnp.asarray(rng.normal(size=(B, T, K, H)), dtype) for _ in range(2))
    positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    lengths = jnp.asarray([T, 1, *rng.integers(1, T + 1, B)][:B], jnp.int32)
    expected = xla_attention(q, k, v, positions, lengths, scale=0.3, window=window, softcap=softcap)
    f = jax.jit(lambda q, k, v: cpu_kernels.prefill_attention(q, k[None], v[None], 0, positions, lengths, scale=0.3,
                                                              window=window, softcap=softcap))
    ours = f(q, k, v)
    _check(ours, expected, dtype)
    np.testing.assert_array_equal(np.asarray(f(q, _bits(k), _bits(v))), np.asarray(ours))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_queries_continuing_a_stacked_cache(dtype):
    """T new queries per row at positions start_b.. over layer l of a cache [L, B, S, K, H] holding more
    slots than are filled: only slots below each row's length count."""
    L, B, S, K, G, H, T = 3, 3, 29, 2, 3, 16, 5
    rng = np.random.default_rng(7)
    k, v = (jnp.asarray(rng.normal(size=(L, B, S, K, H)), dtype) for _ in range(2))
    q = jnp.asarray(rng.normal(size=(B, T, K * G, H)), dtype)
    starts = jnp.array([0, 9, 24], jnp.int32)
    positions = starts[:, None] + jnp.arange(T, dtype=jnp.int32)
    lengths = starts + T
    f = jax.jit(lambda q, k, v, layer: cpu_kernels.prefill_attention(q, k, v, layer, positions, lengths, scale=0.25,
                                                                     window=6, softcap=None))
    for layer in range(L):
        expected = xla_attention(q, k[layer], v[layer], positions, lengths, scale=0.25, window=6, softcap=None)
        _check(f(q, k, v, layer), expected, dtype)


def test_rows_without_visible_keys_are_zero():
    k = v = jnp.ones((1, 2, 6, 1, 8))
    q = jnp.ones((2, 3, 2, 8))
    positions = jnp.broadcast_to(jnp.arange(3, dtype=jnp.int32), (2, 3))
    o = cpu_kernels.prefill_attention(q, k, v, 0, positions, jnp.array([0, 6]), scale=1.0, window=None, softcap=None)
    np.testing.assert_array_equal(np.asarray(o[0]), 0.0)
    np.testing.assert_allclose(np.asarray(o[1]), 1.0, rtol=1e-6)


def test_large_scores_do_not_overflow():
    """Scores far beyond exp's range: the softmax subtracts the row's maximum first, as XLA's does."""
    rng = np.random.default_rng(5)
    q, k, v = (jnp.asarray(rng.normal(size=(1, 9, 2, 8)) * 30, jnp.float32) for _ in range(3))
    positions = jnp.arange(9, dtype=jnp.int32)[None]
    lengths = jnp.array([9])
    o = cpu_kernels.prefill_attention(q, k[None], v[None], 0, positions, lengths, scale=1.0, window=None, softcap=None)
    assert np.all(np.isfinite(np.asarray(o)))
    # Against float64: scores here reach 8,400, where one float32 ulp is 1e-3, so float32 softmaxes (this
    # kernel's, XLA's) differ from the exact one by up to that share of |v| — XLA's by 6e-4 on one CPU, 1e-6
    # on another. Within one ulp of the largest score times the largest value; a wrong mask or a missing
    # maximum is off by far more.
    q64, k64, v64 = (np.asarray(a, np.float64) for a in (q, k, v))
    s = np.einsum("bqnh,bknh->bnqk", q64, k64)
    s = np.where(np.tril(np.ones((9, 9), bool)), s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    exact = np.einsum("bnqk,bknh->bqnh", p / p.sum(-1, keepdims=True), v64)
    tol = np.spacing(np.float32(np.abs(s[np.isfinite(s)]).max())) * np.abs(v64).max()
    np.testing.assert_allclose(np.asarray(o), exact, rtol=0, atol=tol)


def test_bad_inputs_are_named():
    k = jnp.ones((1, 2, 5, 2, 8))
    positions = jnp.zeros((2, 3), jnp.int32)
    with pytest.raises(ValueError, match=r"q \(2, 3, 3, 8\)"):
        cpu_kernels.prefill_attention(jnp.ones((2, 3, 3, 8)), k, k, 0, positions, jnp.ones(2), scale=1.0,
                                      window=None, softcap=None)
    with pytest.raises(ValueError, match=r"positions \(2, 4\)"):
        cpu_kernels.prefill_attention(jnp.ones((2, 3, 4, 8)), k, k, 0, jnp.zeros((2, 4)), jnp.ones(2), scale=1.0,
                                      window=None, softcap=None)
    with pytest.raises(ValueError, match="float16"):
        cpu_kernels.prefill_attention(jnp.ones((2, 3, 4, 8)), k.astype(jnp.float16), k.astype(jnp.float16), 0,
                                      positions, jnp.ones(2), scale=1.0, window=None, softcap=None)
    with pytest.raises(Exception, match="layer index outside the cache"):
        cpu_kernels.prefill_attention(jnp.ones((2, 3, 4, 8)), k, k, 1, positions, jnp.ones(2), scale=1.0,
                                      window=None, softcap=None).block_until_ready()
