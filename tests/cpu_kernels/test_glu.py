"""cpu_kernels.glu against the activations in float64 and against XLA's (the model's formula before the
kernel): SiLU and tanh-GELU, rows shorter than a vector, one thread's share and many; NaN; gradients."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import cpu_kernels

# Relative to max(|exact|, |gate · up| · 2⁻²⁴): where act(gate) underflows (a very negative gate) only the
# error against the inputs' own scale means anything. The kernel's e^x is within 2 ulp; tanh-GELU's
# exponent (2 √(2/π) (g + 0.044715 g³), up to ~90) amplifies float32's rounding of it.
RTOL = {"silu": 1e-6, "gelu_tanh": 1e-5}


def _exact(y: np.ndarray, activation: str) -> np.ndarray:
    g, u = np.split(y.astype(np.float64), 2, axis=-1)
    if activation == "silu":
        return g / (1 + np.exp(-g)) * u
    return 0.5 * g * (1 + np.tanh(np.sqrt(2 / np.pi) * (g + 0.044715 * g ** 3))) * u


def _relative_error(ours: np.ndarray, y: np.ndarray, activation: str) -> float:
    exact = _exact(y, activation)
    g, u = np.split(y.astype(np.float64), 2, axis=-1)
    scale = np.maximum(np.abs(exact), np.abs(g * u) * 2.0 ** -24) + 1e-300
    return float(np.max(np.abs(ours.astype(np.float64) - exact) / scale, initial=0.0))


GLU = jax.jit(cpu_kernels.glu, static_argnums=1)


@pytest.mark.parametrize("activation", cpu_kernels.GLU_ACTIVATIONS)
@pytest.mark.parametrize("R,F", [(32, 768), (3, 17), (1, 5), (9, 1), (700, 96), (0, 8)])
def test_matches_the_activation_in_float64(activation, R, F):
    """Vectors of 16 (or 8) and a scalar tail (F = 17, 5, 1); one unit of rows and, from 16,384 outputs on,
    rows shared among the threads (700 × 96); no rows at all."""
    y = np.random.default_rng(R * F + 1).normal(scale=4.0, size=(R, 2 * F)).astype(np.float32)
    ours = GLU(jnp.asarray(y), activation)
    assert ours.dtype == jnp.float32 and ours.shape == (R, F)
    assert _relative_error(np.asarray(ours), y, activation) <= RTOL[activation]


@pytest.mark.parametrize("activation", cpu_kernels.GLU_ACTIVATIONS)
def test_the_same_as_xla_within_float32_rounding(activation):
    """What the model computed before the kernel: XLA's. Its tanh-GELU, 0.5 g (1 + tanh(·)), loses the
    relative precision of 1 + tanh where tanh is near -1 (an absolute error of about |g u| · 10⁻⁷ there);
    the kernel's g / (1 + e^-z) keeps it (the test above)."""
    y = jnp.asarray(np.random.default_rng(5).normal(scale=3.0, size=(40, 2 * 300)), jnp.float32)
    ours, xla = np.asarray(GLU(y, activation)), np.asarray(cpu_kernels._glu_xla(y, activation))
    np.testing.assert_allclose(ours, xla, rtol=2e-6 if activation == "silu" else 1e-5, atol=1e-5)


@pytest.mark.parametrize("activation", cpu_kernels.GLU_ACTIVATIONS)
def test_large_gates_and_nan(activation):
    """Gates far in either tail (e^-g saturates or vanishes) and NaN in the gate or in up, in the vector part
    and the tail."""
    F = 19
    y = np.ones((3, 2 * F), np.float32)
    y[0, :F] = np.linspace(-120, 120, F)
    y[1, 2] = y[1, 17] = np.nan           # gates
    y[2, F + 3] = y[2, F + 18] = np.nan   # ups
    ours = np.asarray(GLU(jnp.asarray(y), activation))
    assert _relative_error(ours[0], y[0], activation) <= RTOL[activation]
    np.testing.assert_array_equal(np.isnan(ours[1:]), np.isnan(np.asarray(cpu_kernels._glu_xla(y[1:], activation))))
    assert np.isnan(ours[1, [2, 17]]).all() and np.isnan(ours[2, [3, 18]]).all() and np.isnan(ours).sum() == 4


@pytest.mark.parametrize("activation", cpu_kernels.GLU_ACTIVATIONS)
def test_gradient_is_xlas(activation):
    y = jnp.asarray(np.random.default_rng(7).normal(size=(6, 2 * 21)), jnp.float32)
    weights = jnp.asarray(np.random.default_rng(8).normal(size=(6, 21)), jnp.float32)
    ours = jax.grad(lambda y: jnp.sum(cpu_kernels.glu(y, activation) * weights))(y)
    xla = jax.grad(lambda y: jnp.sum(cpu_kernels._glu_xla(y, activation) * weights))(y)
    np.testing.assert_allclose(np.asarray(ours), np.asarray(xla), rtol=1e-6, atol=1e-6)


def test_the_kernel_runs_on_cpu():
    for activation in cpu_kernels.GLU_ACTIVATIONS:
        lowered = GLU.lower(jnp.ones((4, 6)), activation).as_text()
        assert (f"llm_jax_glu_{activation}_f32" in lowered) == cpu_kernels.available()


def test_bad_operands():
    with pytest.raises(ValueError, match="activation must be one of"):
        cpu_kernels.glu(jnp.ones((2, 4)), "relu")
    with pytest.raises(ValueError, match="activation must be one of"):
        cpu_kernels.gated(jnp.ones((2, 2)), jnp.ones((2, 2)), "relu")
    with pytest.raises(ValueError, match="E even"):
        cpu_kernels.glu(jnp.ones((2, 5)), "silu")
    with pytest.raises(ValueError, match="float32 y"):
        cpu_kernels.glu(jnp.ones((2, 4), jnp.bfloat16), "silu")
    with pytest.raises(ValueError, match=r"\[R, E\]"):
        cpu_kernels.glu(jnp.ones((2, 2, 4)), "silu")
