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


# cpu_kernels.screened_argmax: the argmax of x · W from logits screened through W's bfloat16 copy.

def _screened_case(D, V, B, seed):
    """x [B, D], W [D, V] as panels, the screen's logits and norms, and the exact float64 argmax."""
    from llm_jax.model import greedy_head

    rng = np.random.default_rng(seed)
    W = rng.normal(0, 0.02, (D, V)).astype(np.float32)
    x = rng.normal(0, 1, (B, D)).astype(np.float32)
    # Near-ties: column 5 equals column 7 (the first must win), column 11 is column 7 raised by 1e-5, and
    # row 0 points along column 7, so all three lead it.
    W[:, 5] = W[:, 7]
    W[:, 11] = W[:, 7] * np.float32(1 + 1e-5)
    x[0] = 40 * W[:, 7]
    panels = cpu_kernels.to_panels(jnp.asarray(W))
    screen, norms = greedy_head._screen(panels)
    screened = cpu_kernels.matmul(jnp.asarray(x), screen, panels=True)
    exact = np.argmax(x.astype(np.float64) @ W.astype(np.float64), axis=-1)
    return jnp.asarray(x), panels, screened, norms, exact, greedy_head.bound_factor(D)


@pytest.mark.parametrize("D,V,B", [(288, 32000, 32), (37, 160, 9), (64, 48, 3), (768, 4096, 5)])
def test_screened_argmax_is_the_exact_argmax(D, V, B):
    x, panels, screened, norms, exact, c = _screened_case(D, V, B, seed=D + V)
    ours = np.asarray(jax.jit(cpu_kernels.screened_argmax, static_argnums=4)(screened, x, panels, norms, c))
    np.testing.assert_array_equal(ours, exact)
    assert ours[0] == 11  # the raised copy, not the first of the two equal columns before it
    kernel = np.asarray(cpu_kernels.argmax(cpu_kernels.matmul(x, panels, panels=True)))
    np.testing.assert_array_equal(ours, kernel)  # and the full float32 product's argmax


def test_the_screen_alone_would_be_wrong_and_a_bound_of_zero_is_caught():
    """The bfloat16 logits' own argmax misses the exact one in some rows (the test data can tell); with
    c = 0 the kernel computes only the screen's winners exactly and misses them too."""
    x, panels, screened, norms, exact, c = _screened_case(288, 32000, 32, seed=3)
    assert (np.argmax(np.asarray(screened), axis=-1) != exact).any()
    unbounded = np.asarray(cpu_kernels.screened_argmax(screened, x, panels, norms, 0.0))
    assert (unbounded != exact).any()
    np.testing.assert_array_equal(np.asarray(cpu_kernels.screened_argmax(screened, x, panels, norms, c)), exact)


def test_screened_argmax_of_rows_with_nans_and_infinities():
    """Such rows are computed in full: jnp.argmax's answer for the exact logits (the first NaN)."""
    x, panels, screened, norms, _, c = _screened_case(37, 160, 4, seed=5)
    x = x.at[1, 3].set(NAN).at[2, 0].set(INF)
    screened = screened.at[3, 17].set(NAN)  # a NaN in the screen only: the exact logits decide
    ours = np.asarray(cpu_kernels.screened_argmax(screened, x, panels, norms, c))
    logits = np.asarray(x, np.float64) @ np.asarray(cpu_kernels.from_panels(panels), np.float64)
    np.testing.assert_array_equal(ours, np.argmax(logits, axis=-1))
    assert ours[1] == 0  # every logit NaN: the first


def test_screened_argmax_checks_its_operands():
    x, panels, screened, norms, _, c = _screened_case(37, 160, 2, seed=0)
    with pytest.raises(ValueError, match="screened_argmax needs"):
        cpu_kernels.screened_argmax(screened, x[:, :36], panels, norms, c)
    with pytest.raises(ValueError, match="screened_argmax needs"):
        cpu_kernels.screened_argmax(screened, x, panels, norms[:-16], c)
    with pytest.raises(ValueError, match="screened_argmax needs"):
        cpu_kernels.screened_argmax(screened, x, panels.astype(jnp.bfloat16), norms, c)


def test_screened_argmax_runs_the_kernel_on_cpu():
    x, panels, screened, norms, _, c = _screened_case(37, 160, 2, seed=0)
    lowered = jax.jit(cpu_kernels.screened_argmax, static_argnums=4).lower(screened, x, panels, norms, c).as_text()
    assert ("llm_jax_screened_argmax_f32" in lowered) == cpu_kernels.available()
