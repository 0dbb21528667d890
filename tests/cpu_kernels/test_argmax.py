"""cpu_kernels.argmax against jnp.argmax: first index of the maximum, NaN first, ties, infinities, rows
shorter than a vector and longer than one thread's share."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import cpu_kernels

NAN, INF = float("nan"), float("inf")


def _both(x):
    x = jnp.asarray(x, jnp.float32)
    ours = jax.jit(cpu_kernels.argmax)(x)
    assert ours.dtype == jnp.int32 and ours.shape == x.shape[:1]
    return np.asarray(ours), np.asarray(jnp.argmax(x, axis=-1))


@pytest.mark.parametrize("B,V", [(1, 32000), (32, 32000), (3, 7), (5, 33), (40, 17), (2, 100003)])
def test_random_rows(B, V):
    x = np.random.default_rng(B * V).normal(size=(B, V)).astype(np.float32)
    ours, theirs = _both(x)
    np.testing.assert_array_equal(ours, theirs)


@pytest.mark.parametrize("B,V", [(4, 1000), (3, 37)])
def test_rows_of_many_ties(B, V):
    """Few distinct values: the maximum recurs within a lane (index i and i + 8) and across lanes."""
    x = np.random.default_rng(V).integers(0, 4, size=(B, V)).astype(np.float32)
    ours, theirs = _both(x)
    np.testing.assert_array_equal(ours, theirs)


def test_ties_nans_and_infinities():
    rows = [
        [1, NAN, 3, NAN, 0, 0, 0, 0, 9],      # a NaN wins, the first one
        [2, 5, 5, 1, 0, 0, 0, 0, 5],          # ties: the first maximum
        [-INF] * 9,                           # nothing above -inf: index 0
        [INF, 1, INF, 0, 0, 0, 0, 0, 0],
        [0] * 8 + [NAN],                      # a NaN past the last full vector
        [0] * 8 + [1],                        # the maximum past the last full vector
        [-1, -2, -3, -0.5, -7, -8, -9, -4, -0.5],
    ]
    ours, theirs = _both(rows)
    np.testing.assert_array_equal(ours, theirs)
    np.testing.assert_array_equal(ours, [1, 1, 0, 0, 8, 8, 3])
    ours, theirs = _both([[0, 7, 0, 0, 0, 0, 0, 0, 0, 7] + [0.0] * 7])  # a tie within one lane (1 and 9)
    np.testing.assert_array_equal(ours, [1])
    np.testing.assert_array_equal(theirs, [1])


def test_only_float32_matrices():
    with pytest.raises(ValueError, match="float32 x"):
        cpu_kernels.argmax(jnp.ones((2, 3), jnp.bfloat16))
    with pytest.raises(ValueError, match=r"\[B, V\]"):
        cpu_kernels.argmax(jnp.ones((3,)))


def test_runs_the_kernel_on_cpu():
    lowered = jax.jit(cpu_kernels.argmax).lower(jnp.ones((2, 40))).as_text()
    assert ("llm_jax_argmax_f32" in lowered) == cpu_kernels.available()
