"""cpu_kernels.matmul against NumPy in float64: both weight layouts, float32 and bfloat16, ragged shapes."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import cpu_kernels
from cpu_kernels import build
from tests.cpu_kernels.stacks import assert_one_call_on_whole_stacks

# float32 sums of K products of standard normals, in another order than NumPy's.
RTOL, ATOL = 1e-5, 1e-4


def test_kernels_are_built_where_a_compiler_exists():
    """With a C++ compiler the kernels must build; without one, loading says why in one line and every
    product below is XLA's (the same tests then check the fallback)."""
    if build.find_compiler() is not None:
        assert cpu_kernels.available()
    else:
        with pytest.warns(RuntimeWarning, match=r"no C\+\+ compiler found") as caught:
            assert build.library.__wrapped__() is None
        assert "\n" not in str(caught[0].message)


def case(R, K, N, dtype, transposed, seed=0):
    rng = np.random.default_rng(seed)
    x = np.asarray(jnp.asarray(rng.normal(size=(R, K)), dtype).astype(jnp.float32))  # x as the product reads it
    w = jnp.asarray(rng.normal(size=(N, K) if transposed else (K, N)), dtype)
    w64 = np.asarray(w.astype(jnp.float32), np.float64)  # what the kernel reads, exactly
    expected = x.astype(np.float64) @ (w64.T if transposed else w64)
    return jnp.asarray(x), w, expected


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("transposed", [False, True], ids=["kn", "nk"])
@pytest.mark.parametrize("R,K,N", [(1, 64, 3000), (1, 7, 5), (3, 40, 1030), (5, 33, 17), (2, 770, 64),
                                   # one row, kn: rows of W longer than 16 KiB in float32 (cut into
                                   # column tiles, the last one short), whole-row tiles in bfloat16
                                   (1, 24, 4500),
                                   # 8 rows and more: packed panels and register tiles (uneven tiles of
                                   # rows, a last panel narrower than 16 columns, K in several blocks)
                                   (9, 16, 2100), (8, 20, 4100), (32, 288, 100), (13, 1030, 37), (45, 9, 3),
                                   # nk up to 32 rows (W's rows broadcast): 17 rows in two panels, the
                                   # last tile of W's rows short, K in two blocks, units of 48 rows
                                   (17, 600, 1001), (32, 5, 50), (33, 40, 70)])
def test_matmul_matches_numpy(R, K, N, dtype, transposed):
    x, w, expected = case(R, K, N, dtype, transposed, seed=R * K + N)
    ours = jax.jit(functools.partial(cpu_kernels.matmul, transposed=transposed))(x, w)
    assert ours.dtype == jnp.float32 and ours.shape == (R, N)
    np.testing.assert_allclose(np.asarray(ours), expected, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("R", [1, 9])
@pytest.mark.parametrize("transposed", [False, True], ids=["kn", "nk"])
def test_an_empty_contraction_is_zeros(R, transposed):
    x, w = jnp.ones((R, 0)), jnp.ones((5, 0) if transposed else (0, 5))
    y = jax.jit(functools.partial(cpu_kernels.matmul, transposed=transposed))(x, w)
    np.testing.assert_array_equal(np.asarray(y), np.zeros((R, 5), np.float32))


def test_runs_inside_a_decode_like_loop():
    """Called from a while loop many times (the decode scan), results stay exact."""
    x, w, _ = case(1, 48, 96, jnp.bfloat16, False)

    @jax.jit
    def loop(x):
        def step(x, _):
            y = cpu_kernels.matmul(x, w)[:, :48]
            return jnp.tanh(y), y
        return jax.lax.scan(step, x, None, length=20)[1]

    ys = np.asarray(loop(x))
    w64 = np.asarray(w.astype(jnp.float32), np.float64)
    h = np.asarray(x, np.float64)
    for t in range(20):
        h_read = np.asarray(jnp.asarray(h, jnp.float32).astype(jnp.bfloat16).astype(jnp.float32), np.float64)
        y = (h_read @ w64)[:, :48]
        np.testing.assert_allclose(ys[t], y, rtol=1e-4, atol=1e-4)
        h = np.tanh(ys[t])


@pytest.mark.parametrize("layout", ["kn", "nk", "panels"])
# one row (streams), 9 (register tiles), 20 (nk: W's rows broadcast), 70 × 1000 (panels: AMX where the
# CPU has it, which rounds x itself)
@pytest.mark.parametrize("R,K", [(1, 40), (9, 40), (20, 40), (70, 1000)])
def test_bfloat16_weights_read_x_rounded_to_bfloat16(layout, R, K):
    """Against bfloat16 weights every path reads x rounded to bfloat16, as XLA's product rounds it (to
    nearest, ties to even), and a NaN stays a NaN (rounding up a NaN's low bits must not carry it into
    infinity, as the kernels' own rounding once did)."""
    rng = np.random.default_rng(R + K)
    x = rng.normal(size=(R, K)).astype(np.float32)
    w = jnp.asarray(rng.normal(size=(K, 48)), jnp.bfloat16)
    w64 = np.asarray(w.astype(jnp.float32), np.float64)
    operand = {"kn": w, "nk": w.T, "panels": cpu_kernels.to_panels(w)}[layout]
    product = jax.jit(functools.partial(cpu_kernels.matmul, transposed=layout == "nk", panels=layout == "panels"))
    ours = np.asarray(product(jnp.asarray(x), operand))
    x_read = np.asarray(jnp.asarray(x).astype(jnp.bfloat16).astype(jnp.float32), np.float64)
    np.testing.assert_allclose(ours, x_read @ w64, rtol=RTOL, atol=ATOL)
    assert np.abs(ours - x.astype(np.float64) @ w64).max() > 100 * ATOL  # the rounding is seen: this can fail
    x[-1, 0] = np.frombuffer(np.uint32(0x7F80FFFF).tobytes(), np.float32)[0]  # a NaN whose rounding carries
    ours = np.asarray(product(jnp.asarray(x), operand))
    assert np.isnan(ours[-1]).all() and not np.isnan(ours[:-1]).any()


@pytest.mark.parametrize("transposed", [False, True], ids=["kn", "nk"])
def test_gradients_are_xlas(transposed):
    x, w, _ = case(2, 12, 10, jnp.float32, transposed)
    reference = lambda x, w: jnp.einsum("RK,NK->RN" if transposed else "RK,KN->RN", x, w)
    loss = lambda f: lambda x, w: jnp.sum(jnp.sin(f(x, w)))
    ours = jax.grad(loss(functools.partial(cpu_kernels.matmul, transposed=transposed)), argnums=(0, 1))(x, w)
    theirs = jax.grad(loss(reference), argnums=(0, 1))(x, w)
    for a, b in zip(ours, theirs):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)


def test_vmap_over_a_leading_axis():
    x, w, _ = case(4, 8, 6, jnp.float32, False)
    batched = jax.vmap(lambda x: cpu_kernels.matmul(x[None], w)[0])(x)
    np.testing.assert_allclose(np.asarray(batched), np.asarray(x) @ np.asarray(w), rtol=RTOL, atol=ATOL)


def test_shape_errors_name_both_shapes():
    with pytest.raises(ValueError, match=r"x \(2, 3\) and w \(4, 5\)"):
        cpu_kernels.matmul(jnp.ones((2, 3)), jnp.ones((4, 5)))


def test_switched_off_by_the_environment(monkeypatch):
    monkeypatch.setenv(build.ENV, "off")
    assert build.library.__wrapped__() is None


def test_a_broken_compiler_falls_back_with_a_warning(monkeypatch, tmp_path):
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    with pytest.warns(RuntimeWarning, match="failed, using XLA's matrix products") as caught:
        assert build.library.__wrapped__() is None
    assert "\n" not in str(caught[0].message)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("transposed", [False, True], ids=["kn", "nk"])
@pytest.mark.parametrize("R", [1, 3, 11])
def test_several_weights_sharing_the_input(dtype, transposed, R):
    """q/k/v-like products of one input in one call: each equals its own product (work units of the
    tiled kernels, R >= 8, run across the matrices)."""
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.normal(size=(R, 40)), dtype).astype(jnp.float32)
    ns = (48, 16, 1040)
    ws = [jnp.asarray(rng.normal(size=(n, 40) if transposed else (40, n)), dtype) for n in ns]
    ys = jax.jit(functools.partial(cpu_kernels.matmuls, transposed=transposed))(x, ws)
    for w, y in zip(ws, ys):
        w64 = np.asarray(w.astype(jnp.float32), np.float64)
        expected = np.asarray(x, np.float64) @ (w64.T if transposed else w64)
        np.testing.assert_allclose(np.asarray(y), expected, rtol=RTOL, atol=ATOL)
    grads = jax.grad(lambda x, ws: sum(jnp.sum(jnp.cos(y)) for y in cpu_kernels.matmuls(x, ws, transposed=transposed)),
                     argnums=(0, 1))(x, ws)
    spec = "RK,NK->RN" if transposed else "RK,KN->RN"
    product = lambda x, w: jnp.einsum(spec, x.astype(w.dtype), w, preferred_element_type=jnp.float32)
    expected = jax.grad(lambda x, ws: sum(jnp.sum(jnp.cos(product(x, w))) for w in ws), argnums=(0, 1))(x, ws)
    # With bfloat16 weights each dx term is rounded to bfloat16: sums in another order may differ by an ulp.
    tol = 1e-4 if dtype == jnp.float32 else 2e-2
    np.testing.assert_allclose(np.asarray(grads[0]), np.asarray(expected[0]), rtol=tol, atol=tol)
    for a, b in zip(grads[1], expected[1]):
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("transposed", [False, True], ids=["kn", "nk"])
@pytest.mark.parametrize("R", [2, 9])
def test_a_layer_of_stacked_weights(dtype, transposed, R):
    """With ``layer``, W is a stack [L, ...]: every layer (a traced index, as in a scan over layers) gives
    that layer's product, reading the stack as it is (the stack, not a slice, is the kernel's operand)."""
    rng = np.random.default_rng(4)
    L, K, N = 3, 33, 70
    x = jnp.asarray(rng.normal(size=(R, K)), dtype).astype(jnp.float32)
    ws = [jnp.asarray(rng.normal(size=(L, N, K) if transposed else (L, K, N)), dtype) for _ in range(2)]
    f = jax.jit(lambda x, ws, layer: cpu_kernels.matmuls(x, ws, transposed=transposed, layer=layer))
    for layer in range(L):
        for w, y in zip(ws, f(x, ws, layer)):
            w64 = np.asarray(w[layer].astype(jnp.float32), np.float64)
            expected = np.asarray(x, np.float64) @ (w64.T if transposed else w64)
            np.testing.assert_allclose(np.asarray(y), expected, rtol=RTOL, atol=ATOL)
    assert_one_call_on_whole_stacks(f.lower(x, ws, 0), "llm_jax_matmul", dtype, L, stacks=2)


def test_gradient_of_a_stacked_layer_is_xlas():
    rng = np.random.default_rng(5)
    x, w = jnp.asarray(rng.normal(size=(2, 12)), jnp.float32), jnp.asarray(rng.normal(size=(3, 12, 10)), jnp.float32)
    loss = lambda f: lambda x, w: jnp.sum(jnp.sin(f(x, w)))
    ours = jax.grad(loss(lambda x, w: cpu_kernels.matmul(x, w, layer=1)), argnums=(0, 1))(x, w)
    theirs = jax.grad(loss(lambda x, w: x @ w[1]), argnums=(0, 1))(x, w)
    for a, b in zip(ours, theirs):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)


def test_a_layer_outside_the_stack_is_an_error():
    x, w = jnp.ones((1, 8)), jnp.ones((3, 8, 4))
    f = jax.jit(lambda x, w, layer: cpu_kernels.matmul(x, w, layer=layer))
    if cpu_kernels.available():
        with pytest.raises(Exception, match="layer index outside the stack of weights"):
            f(x, w, 3).block_until_ready()
    with pytest.raises(ValueError, match=r"w \[L, K, N\]"):
        cpu_kernels.matmul(x, jnp.ones((8, 4)), layer=0)
