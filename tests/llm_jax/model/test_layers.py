"""dense(): which products run the CPU kernels, and that every route computes the same einsum."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import cpu_kernels
from llm_jax.config import MatmulImpl
from llm_jax.model.layers import dense, dense_many

KERNEL_TARGET = "llm_jax_matmul"

# (equation, x shape, w shape): the model's products — leading and trailing contracted weight axes, two
# contracted axes (o_proj), and one the kernels do not take (a contracted axis in the middle of x).
CASES = [("BTD,DNH->BTNH", (2, 3, 16), (16, 4, 8)), ("BTNH,NHD->BTD", (1, 1, 4, 8), (4, 8, 16)),
         ("BTD,VD->BTV", (1, 2, 16), (40, 16)), ("BDT,DF->BTF", (1, 16, 2), (16, 24))]


def _bf16_values(rng, shape) -> jnp.ndarray:
    """float32 inputs that bfloat16 holds exactly: the kernels read x in float32, XLA's route casts it to
    the weights' dtype; on such inputs both compute the same products."""
    return jnp.asarray(rng.normal(size=shape), jnp.bfloat16).astype(jnp.float32)


def _lowered(f, *args) -> str:
    return jax.jit(f).lower(*args).as_text()


@pytest.mark.parametrize("equation,x_shape,w_shape", CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("impl", list(MatmulImpl), ids=[m.value for m in MatmulImpl])
def test_every_route_is_the_einsum(equation, x_shape, w_shape, impl):
    rng = np.random.default_rng(0)
    x = _bf16_values(rng, x_shape)
    w = jnp.asarray(rng.normal(size=w_shape), jnp.bfloat16)
    f = lambda x, w: dense(equation, x, w, jnp.float32, impl)
    expected = np.einsum(equation, np.asarray(x.astype(jnp.bfloat16), np.float64), np.asarray(w, np.float64))
    np.testing.assert_allclose(np.asarray(jax.jit(f)(x, w)), expected, rtol=1e-5, atol=1e-4)
    kernel = impl is MatmulImpl.AUTO and not equation.startswith("BDT") and cpu_kernels.available()
    assert (KERNEL_TARGET in _lowered(f, x, w)) == kernel


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_decode_and_prefill_products_use_the_kernels(dtype):
    """One row (decode), batched decode and a long prompt all run the kernels (streaming or tiled, chosen
    inside by the number of rows), for both weight dtypes; a float16 weight goes to XLA."""
    f = lambda x, w: dense("BTD,DF->BTF", x, w, jnp.float32)
    w = jnp.ones((16, 24), dtype)
    for x_shape in [(1, 1, 16), (64, 1, 16), (1, 300, 16)]:
        assert (KERNEL_TARGET in _lowered(f, jnp.ones(x_shape), w)) == cpu_kernels.available()
    assert KERNEL_TARGET not in _lowered(f, jnp.ones((1, 1, 16)), jnp.ones((16, 24), jnp.float16))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("impl", list(MatmulImpl), ids=[m.value for m in MatmulImpl])
def test_a_layer_of_stacked_weights(dtype, impl):
    """With ``layer``, every route computes the einsum with that layer of the stack [L, ...]; the kernels
    get the whole stack (no dynamic slice of the weights in the program)."""
    rng = np.random.default_rng(2)
    x = _bf16_values(rng, (1, 1, 16))
    ws = [jnp.asarray(rng.normal(size=(3, 16, 4, 8)), dtype), jnp.asarray(rng.normal(size=(3, 4, 8, 16)), dtype)]
    equations = ["BTD,DNH->BTNH", "BTNH,NHD->BTD"]
    f = jax.jit(lambda x, ws, layer: [dense(equations[0], x, ws[0], jnp.float32, impl, layer),
                                      dense(equations[1], x.reshape(1, 1, 4, 4).repeat(2, -1), ws[1], jnp.float32,
                                            impl, layer)])
    for layer in (0, 2):
        ys = f(x, ws, jnp.int32(layer))
        xs = [x, x.reshape(1, 1, 4, 4).repeat(2, -1)]
        for y, eq, xi, w in zip(ys, equations, xs, ws):
            expected = np.einsum(eq, np.asarray(xi.astype(dtype), np.float64), np.asarray(w[layer], np.float64))
            np.testing.assert_allclose(np.asarray(y), expected, rtol=1e-5, atol=1e-4)
    hlo = f.lower(x, ws, jnp.int32(0)).compile().as_text()
    kernel = impl is MatmulImpl.AUTO and cpu_kernels.available()
    assert (KERNEL_TARGET in hlo) == kernel
    if kernel:
        assert "dynamic-slice" not in hlo


def test_several_weights_in_one_kernel_call():
    rng = np.random.default_rng(1)
    x = _bf16_values(rng, (1, 1, 16))
    ws = [jnp.asarray(rng.normal(size=(16, n, 8)), jnp.bfloat16) for n in (4, 2, 2)]
    equations = ["BTD,DNH->BTNH", "BTD,DKH->BTKH", "BTD,DKH->BTKH"]
    f = lambda x, ws: dense_many(equations, x, ws, jnp.float32)
    assert _lowered(f, x, ws).count(KERNEL_TARGET) == (1 if cpu_kernels.available() else 0)
    for y, eq, w in zip(jax.jit(f)(x, ws), equations, ws):
        np.testing.assert_allclose(np.asarray(y), np.asarray(dense(eq, x, w, jnp.float32, MatmulImpl.XLA)),
                                   rtol=1e-5, atol=1e-4)
