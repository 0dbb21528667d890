"""cpu_kernels.matmul on the panel layout [N / 16, K, 16] against NumPy in float64, bfloat16 on every
instruction path this CPU has (tests/cpu_kernels/paths.py)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import cpu_kernels
from tests.cpu_kernels.paths import int8_paths, panel_dtypes, paths
from tests.cpu_kernels.stacks import assert_one_call_on_whole_stacks

RTOL, ATOL = 1e-5, 1e-4  # float32 sums of K products of standard normals, in another order than NumPy's


def case(R, K, N, dtype, L=None, seed=0):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.normal(size=(R, K)), dtype).astype(jnp.float32)  # x as the product reads it
    w = jnp.asarray(rng.normal(size=(K, N) if L is None else (L, K, N)), dtype)
    return x, w


def reference(x, w):
    return np.asarray(x, np.float64) @ np.asarray(w.astype(jnp.float32), np.float64)


def test_to_panels_and_back():
    w = jnp.arange(3 * 5 * 48.0).reshape(3, 5, 48)
    p = cpu_kernels.to_panels(w)
    assert p.shape == (3, 3, 5, 16)
    np.testing.assert_array_equal(p[1, 2, 4], w[1, 4, 32:48])  # panel 2 is columns 32..47, row after row
    np.testing.assert_array_equal(cpu_kernels.from_panels(p), w)
    with pytest.raises(ValueError, match="multiple of 16 columns"):
        cpu_kernels.to_panels(jnp.ones((4, 40)))


@pytest.mark.parametrize("dtype,options", panel_dtypes())
@pytest.mark.parametrize("R,K,N", [
    # one row, panels of up to 48 KiB: each thread's share in four long streams (54 panels: 27 a thread,
    # quarters of 7, the last 6; 13: 6 and 7 a thread, quarters of 2); longer panels (float32 K = 800):
    # groups of four panels and a ragged last group; few panels: K split among the threads (the sums of
    # the slices added at the end), down to fewer rows of K than slices
    (1, 288, 864), (1, 50, 208), (1, 800, 208), (1, 37, 80), (1, 600, 16), (1, 1, 32),
    # 2 to 7 rows: register tiles of up to 6 rows (8-wide vectors: 7 = 6 + 1) or 12 (16-wide), over one
    # panel at a time (8-wide) or two (16-wide; an odd panel left over)
    (2, 33, 48), (7, 129, 112),
    # 8 rows and more: the tiled products on the panels as they lie (K in several blocks, uneven tiles
    # of rows, whole tiles of 8 rows, units of up to 8 panels, a narrow unit at the end)
    (8, 20, 4112), (12, 40, 80), (13, 1030, 48), (32, 288, 768), (45, 9, 160),
    # up to 32 rows with outputs of 2 MiB and more (an LM head's logits): written past the caches, in one
    # block of K or (K = 600) on its last
    (16, 37, 32768), (21, 600, 25008),
    # bfloat16, 32 rows or more, K a multiple of 32: the AMX tile unit where the CPU has one (blocks of
    # 32 rows, the last one part padding; pairs of panels and an odd one; 32 rows of 2 MiB written past
    # the caches)
    (33, 64, 48), (64, 96, 32), (70, 320, 112), (32, 96, 16400)])
def test_matches_numpy(R, K, N, dtype, options):
    x, w = case(R, K, N, dtype, seed=R * K + N)
    ours = jax.jit(functools.partial(cpu_kernels.matmul, panels=True, **options))(x, cpu_kernels.to_panels(w))
    assert ours.dtype == jnp.float32 and ours.shape == (R, N)
    np.testing.assert_allclose(np.asarray(ours), reference(x, w), rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("dtype,options", panel_dtypes())
@pytest.mark.parametrize("R", [1, 3, 9])
def test_a_layer_of_stacked_panels_several_weights(dtype, options, R):
    """Every layer of stacks [L, N / 16, K, 16], several weights in one call: each product equals its
    own, the stacks are the kernel's operands (no slice), and the result is the plain layout's."""
    L, K = 4, 41  # L unlike any R: the stacks are the operands whose shapes start with it
    x, _ = case(R, K, 16, dtype, seed=7)
    ws = [case(R, K, n, dtype, L=L, seed=n)[1] for n in (48, 16, 1040)]
    ps = [cpu_kernels.to_panels(w) for w in ws]
    f = jax.jit(lambda x, ps, layer: cpu_kernels.matmuls(x, ps, panels=True, layer=layer, **options))
    for layer in range(L):
        for w, y in zip(ws, f(x, ps, layer)):
            np.testing.assert_allclose(np.asarray(y), reference(x, w[layer]), rtol=RTOL, atol=ATOL)
    assert_one_call_on_whole_stacks(f.lower(x, ps, 0), "llm_jax_matmul_panels", dtype, L, stacks=3)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_stacks_too_large_for_the_caches_give_the_same_sums(dtype):
    """Stacks of at least 32 MiB (matmul.cc's kStreamedBytes) take few-rows tiles that ask for their panels
    ahead: every row count below the register tiles gives, bit for bit, what the same layer gives as a small
    stack (the sums panel_row_product repeats for the greedy heads), and NumPy's product."""
    L, K, N = 8, 520, 2064  # 8 · 520 · 2064 · 4 bytes ≥ 32 MiB in float32; bfloat16 half (not streamed)
    _, w = case(1, K, N, dtype, L=L, seed=5)
    stack = cpu_kernels.to_panels(w)
    assert dtype != jnp.float32 or stack.nbytes >= 32 << 20
    f = jax.jit(lambda x, p, layer: cpu_kernels.matmul(x, p, panels=True, layer=layer))
    for R in range(1, 8):
        x, _ = case(R, K, 16, dtype, seed=R)
        ours = np.asarray(f(x, stack, L - 1))
        alone = np.asarray(f(x, stack[L - 1:], 0))
        np.testing.assert_array_equal(ours.view(np.uint32), alone.view(np.uint32), err_msg=f"{R} rows")
        np.testing.assert_allclose(ours, reference(x, w[L - 1]), rtol=RTOL, atol=ATOL)


def test_gradients_are_those_of_the_plain_layout():
    x, w = case(2, 12, 32, jnp.float32, L=2)
    loss = lambda f: lambda x, w: jnp.sum(jnp.sin(f(x, w)))
    ours = jax.grad(loss(lambda x, p: cpu_kernels.matmul(x, p, panels=True, layer=1)), argnums=(0, 1))(
        x, cpu_kernels.to_panels(w))
    theirs = jax.grad(loss(lambda x, w: x @ w[1]), argnums=(0, 1))(x, w)
    np.testing.assert_allclose(np.asarray(ours[0]), np.asarray(theirs[0]), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(cpu_kernels.from_panels(ours[1])), np.asarray(theirs[1]), rtol=1e-5,
                               atol=1e-5)


def test_shape_errors():
    with pytest.raises(ValueError, match=r"w \[N / 16, K, 16\].*x \(2, 3\) and w \(4, 5, 16\)"):
        cpu_kernels.matmul(jnp.ones((2, 3)), jnp.ones((4, 5, 16)), panels=True)
    with pytest.raises(ValueError, match=r"x \(2, 5\) and w \(4, 5, 8\)"):
        cpu_kernels.matmul(jnp.ones((2, 5)), jnp.ones((4, 5, 8)), panels=True)
    with pytest.raises(ValueError, match="not transposed"):
        cpu_kernels.matmul(jnp.ones((2, 5)), jnp.ones((4, 5, 16)), panels=True, transposed=True)
    if cpu_kernels.available():
        f = jax.jit(lambda x, p, layer: cpu_kernels.matmul(x, p, panels=True, layer=layer))
        with pytest.raises(Exception, match="layer index outside the stack of weights"):
            f(jnp.ones((1, 5)), jnp.ones((3, 2, 5, 16)), 3).block_until_ready()


def test_falls_back_to_xla_off_the_kernels(monkeypatch):
    x, w = case(3, 10, 32, jnp.float32)
    monkeypatch.setattr(cpu_kernels, "available", lambda: False)
    ours = cpu_kernels.matmul(x, cpu_kernels.to_panels(w), panels=True)
    np.testing.assert_allclose(np.asarray(ours), reference(x, w), rtol=RTOL, atol=ATOL)


# int8 panels (the LM head's screen, llm_jax/backends/cpu/greedy_head.py): the integers as they are, x not
# rounded.

@pytest.mark.parametrize("R,K,N", [(1, 288, 32000), (1, 37, 80), (1, 800, 208), (3, 33, 48), (7, 129, 112),
                                   (9, 40, 80), (32, 288, 768)])
def test_int8_panels_match_numpy(R, K, N):
    rng = np.random.default_rng(R + K + N)
    x = jnp.asarray(rng.normal(size=(R, K)), jnp.float32)
    q = jnp.asarray(rng.integers(-127, 128, size=(K, N)), jnp.int8)
    ours = jax.jit(functools.partial(cpu_kernels.matmul, panels=True))(x, cpu_kernels.to_panels(q))
    assert ours.dtype == jnp.float32 and ours.shape == (R, N)
    expected = np.asarray(x, np.float64) @ np.asarray(q, np.float64)
    np.testing.assert_allclose(np.asarray(ours), expected, rtol=RTOL, atol=ATOL * 127)


def test_int8_panels_of_a_stack_and_only_in_panels():
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(2, 40)), jnp.float32)
    q = jnp.asarray(rng.integers(-127, 128, size=(3, 40, 64)), jnp.int8)
    ours = cpu_kernels.matmul(x, cpu_kernels.to_panels(q), panels=True, layer=2)
    np.testing.assert_allclose(np.asarray(ours), np.asarray(x, np.float64) @ np.asarray(q[2], np.float64),
                               rtol=RTOL, atol=ATOL * 127)
    with pytest.raises(ValueError, match="int8 weights only in the panel layout"):
        cpu_kernels.matmul(x, q[0])
    with pytest.raises(ValueError, match="int8 weights only in the panel layout"):
        cpu_kernels.matmuls(x, [cpu_kernels.to_panels(q[0]), cpu_kernels.to_panels(q[1].astype(jnp.float32))],
                            panels=True)
    lowered = jax.jit(functools.partial(cpu_kernels.matmul, panels=True)).lower(x, cpu_kernels.to_panels(q[0])).as_text()
    assert ("llm_jax_matmul_panels_i8" in lowered) == cpu_kernels.available()


# bfloat16 panels in pairs of rows (the LM head's bfloat16 screen, llm_jax/backends/cpu/greedy_head.py): the
# CPU's bfloat16 dot products, or AMX's tiles (32 rows or more, K a multiple of 32), read them as they lie,
# where they run and the call's options allow them; elsewhere XLA's product on the panels.

def test_to_pairs_and_back():
    p = cpu_kernels.to_panels(jnp.arange(2 * 6 * 32.0).reshape(2, 6, 32))  # [2, 2, 6, 16]
    q = cpu_kernels.to_pairs(p)
    assert q.shape == p.shape
    # rows 2i and 2i + 1 of a panel interleaved: pair i, column j at [2 i · 16 + 2 j + e]
    flat = np.asarray(q[1, 1]).reshape(-1)
    np.testing.assert_array_equal(flat[64 + 2 * 5: 64 + 2 * 5 + 2], [p[1, 1, 4, 5], p[1, 1, 5, 5]])
    np.testing.assert_array_equal(cpu_kernels.from_pairs(q), p)
    with pytest.raises(ValueError, match="K even"):
        cpu_kernels.to_pairs(jnp.ones((2, 5, 16)))


def pairs_run(options) -> bool:
    """Whether products on pairs run on the kernels with these options here (else XLA's)."""
    return options["bf16_dot"] and cpu_kernels.pairs_available()


@pytest.mark.parametrize("options", paths())
@pytest.mark.parametrize("R,K,N", [(1, 10, 32), (5, 48, 80), (8, 20, 4112), (13, 1030, 48), (32, 288, 768),
                                   (21, 600, 25008), (33, 64, 48), (70, 320, 112),
                                   # 32 rows of 2 MiB and more (written past the caches), an odd panel
                                   (32, 96, 16400)])
def test_bf16_pairs_match_numpy_and_the_panels(R, K, N, options):
    """The product on pairs equals NumPy's within float32 sums, and, where the kernels run it, the same
    product on the panels as they are (which rearranges them into pairs per call) with the same options,
    bit for bit."""
    x, w = case(R, K, N, jnp.bfloat16, seed=R + K + N)
    p = cpu_kernels.to_panels(w)
    ours = jax.jit(functools.partial(cpu_kernels.matmul, panels=True, pairs=True, **options))(
        x, cpu_kernels.to_pairs(p))
    assert ours.dtype == jnp.float32 and ours.shape == (R, N)
    np.testing.assert_allclose(np.asarray(ours), reference(x, w), rtol=RTOL, atol=ATOL)
    if pairs_run(options) and R >= 8:
        np.testing.assert_array_equal(np.asarray(ours), np.asarray(cpu_kernels.matmul(x, p, panels=True, **options)))


@pytest.mark.parametrize("options", paths())
@pytest.mark.parametrize("R,K", [(2, 40), (9, 40), (40, 64)])
def test_bf16_pairs_of_a_stack_several_weights(R, K, options):
    L = 3
    x, _ = case(R, K, 16, jnp.bfloat16, seed=3)
    ws = [case(R, K, n, jnp.bfloat16, L=L, seed=n)[1] for n in (48, 1040)]
    ps = [cpu_kernels.to_pairs(cpu_kernels.to_panels(w)) for w in ws]
    f = jax.jit(lambda x, ps, layer: cpu_kernels.matmuls(x, ps, panels=True, pairs=True, layer=layer, **options))
    for layer in range(L):
        for w, y in zip(ws, f(x, ps, layer)):
            np.testing.assert_allclose(np.asarray(y), reference(x, w[layer]), rtol=RTOL, atol=ATOL)
    if pairs_run(options):
        assert_one_call_on_whole_stacks(f.lower(x, ps, 0), "llm_jax_matmul_pairs", jnp.bfloat16, L, stacks=2)


def test_bf16_pairs_errors_and_fallback():
    x, w = case(9, 10, 32, jnp.bfloat16)
    p = cpu_kernels.to_pairs(cpu_kernels.to_panels(w))
    with pytest.raises(ValueError, match="panel layout"):
        cpu_kernels.matmul(x, p, pairs=True)
    with pytest.raises(ValueError, match="bfloat16 weights with K even"):
        cpu_kernels.matmul(x, p.astype(jnp.float32), panels=True, pairs=True)
    with pytest.raises(ValueError, match="bfloat16 weights with K even"):
        cpu_kernels.matmul(x[:, :9], jnp.ones((2, 9, 16), jnp.bfloat16), panels=True, pairs=True)
    empty = cpu_kernels.matmul(x[:, :0], jnp.ones((2, 0, 16), jnp.bfloat16), panels=True, pairs=True)
    np.testing.assert_array_equal(np.asarray(empty), np.zeros((9, 32), np.float32))  # K = 0: an empty sum
    lowered = jax.jit(functools.partial(cpu_kernels.matmul, panels=True, pairs=True)).lower(x, p).as_text()
    assert ("llm_jax_matmul_pairs_bf16" in lowered) == cpu_kernels.pairs_available()
    # without the dot products (the option off, as on a CPU without them): XLA's product on the panels
    off = jax.jit(functools.partial(cpu_kernels.matmul, panels=True, pairs=True, bf16_dot=False))
    assert "llm_jax_matmul_pairs" not in off.lower(x, p).as_text()
    np.testing.assert_allclose(np.asarray(off(x, p)), reference(x, w), rtol=RTOL, atol=ATOL)


# int8 panels in quads of rows (the LM head's int8 screen at many rows, llm_jax/backends/cpu/greedy_head.py):
# x quantized per row (common.h's quantize_row), exact integer sums, then the row's step; AVX-512 VNNI's dot
# products read the quads as they lie, where they run and the call's int8_dot allows; elsewhere XLA's product.

def quantized(x):
    """x [R, K] as the kernel quantizes it, in NumPy (whose float32 division is correctly rounded, as the
    kernel's is): n [R, K] (int64) and t [R] (float32)."""
    x = np.asarray(x, np.float32)
    m = np.abs(x).max(axis=1)
    t = np.where(m <= np.finfo(np.float32).max, m / np.float32(127), np.float32(np.nan)).astype(np.float32)
    ok = t > 0
    with np.errstate(invalid="ignore"):
        n = np.where(ok[:, None], np.clip(np.round(x / np.where(ok, t, 1)[:, None]), -127, 127), 0)
    return n.astype(np.int64), t


def quads_case(R, K, N, L=None, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(R, K)).astype(np.float32) * np.exp(rng.normal(size=(R, 1))).astype(np.float32)
    x[0, K // 2] = 9 * np.abs(x[0]).max()  # an outlier: a large step for row 0
    q = rng.integers(-127, 128, size=(K, N) if L is None else (L, K, N)).astype(np.int8)
    return jnp.asarray(x), jnp.asarray(q)


def quads_reference(x, q):
    """What the kernel computes, bit for bit: float32(n · q) · t."""
    n, t = quantized(x)
    return (n @ np.asarray(q, np.int64)).astype(np.float32) * t[:, None]


def test_to_quads_and_back():
    p = cpu_kernels.to_panels(jnp.arange(2 * 8 * 32).reshape(2, 8, 32).astype(jnp.int8))  # [2, 2, 8, 16]
    q = cpu_kernels.to_quads(p)
    assert q.shape == p.shape and q.dtype == jnp.int8
    # rows 4i … 4i + 3 of a panel interleaved: quad i, column j at [4 i · 16 + 4 j + e]
    flat = np.asarray(q[1, 1]).reshape(-1)
    np.testing.assert_array_equal(flat[64 + 4 * 5: 64 + 4 * 5 + 4], np.asarray(p[1, 1, 4:8, 5]))
    np.testing.assert_array_equal(cpu_kernels.from_quads(q), p)
    with pytest.raises(ValueError, match="multiple of 4"):
        cpu_kernels.to_quads(jnp.ones((2, 6, 16), jnp.int8))
    with pytest.raises(ValueError, match="int8 panels"):
        cpu_kernels.to_quads(jnp.ones((2, 8, 16), jnp.float32))


def quads_run(options) -> bool:
    """Whether products on quads run on the kernels with these options here (else XLA's)."""
    return options["int8_dot"] and cpu_kernels.quads_available()


@pytest.mark.parametrize("options", int8_paths())
@pytest.mark.parametrize("R,K,N", [(1, 4, 16), (5, 36, 48), (8, 288, 4112), (9, 516, 80), (13, 1028, 48),
                                   (32, 288, 32000), (33, 64, 112), (70, 120, 32)])
def test_int8_quads_are_exact(R, K, N, options):
    """Where VNNI runs them: float32(n · q) · t bit for bit (K across blocks of 512 rows, tiles of up to 8
    rows, pairs of panels and an odd one); and within the quantization's bound of x · q either way."""
    x, q = quads_case(R, K, N, seed=R + K + N)
    ours = np.asarray(jax.jit(functools.partial(cpu_kernels.matmul, panels=True, quads=True, **options))(
        x, cpu_kernels.to_quads(cpu_kernels.to_panels(q))))
    assert ours.dtype == np.float32 and ours.shape == (R, N)
    if quads_run(options):
        np.testing.assert_array_equal(ours, quads_reference(x, q))
    _, t = quantized(x)
    exact = np.asarray(x, np.float64) @ np.asarray(q, np.float64)
    bound = t[:, None] / 2 * np.abs(np.asarray(q, np.float64)).sum(0) * (1 + 2.0 ** -12) + 1e-6 * np.abs(exact)
    assert np.all(np.abs(ours - exact) <= bound)


def test_int8_quads_of_rows_of_zeros_nans_and_infinities():
    x, q = quads_case(4, 40, 32, seed=4)
    x = x.at[1].set(0.0).at[2, 7].set(jnp.nan).at[3, 0].set(-jnp.inf)
    ours = np.asarray(cpu_kernels.matmul(x, cpu_kernels.to_quads(cpu_kernels.to_panels(q)), panels=True, quads=True))
    np.testing.assert_array_equal(ours[1], np.zeros(32, np.float32))  # t = 0, n = 0
    assert np.isnan(ours[2:]).all() and np.isfinite(ours[0]).all()  # t = NaN: the row's screen says so
    n, t = (np.asarray(a) for a in cpu_kernels.quantize_rows(x))
    assert t[1] == 0 and np.isnan(t[2:]).all() and not n[1:].any()


@pytest.mark.parametrize("options", int8_paths())
@pytest.mark.parametrize("R", [3, 17])
def test_int8_quads_of_a_stack_several_weights(R, options):
    L, K = 3, 96
    x, _ = quads_case(R, K, 16, seed=5)
    qs = [quads_case(R, K, n, L=L, seed=n)[1] for n in (48, 1040)]
    ps = [cpu_kernels.to_quads(cpu_kernels.to_panels(q)) for q in qs]
    f = jax.jit(lambda x, ps, layer: cpu_kernels.matmuls(x, ps, panels=True, quads=True, layer=layer, **options))
    for layer in range(L):
        for q, y in zip(qs, f(x, ps, layer)):
            expected = quads_reference(x, q[layer])
            if quads_run(options):
                np.testing.assert_array_equal(np.asarray(y), expected)
            else:
                np.testing.assert_allclose(np.asarray(y), expected, rtol=1e-3, atol=1e-3 * np.abs(expected).max())
    if quads_run(options):
        assert_one_call_on_whole_stacks(f.lower(x, ps, 0), "llm_jax_matmul_quads", jnp.int8, L, stacks=2)


def test_int8_quads_errors_and_fallback():
    x, q = quads_case(9, 40, 32)
    p = cpu_kernels.to_quads(cpu_kernels.to_panels(q))
    with pytest.raises(ValueError, match="panel layout"):
        cpu_kernels.matmul(x, p, quads=True)
    with pytest.raises(ValueError, match="pairs or in quads"):
        cpu_kernels.matmul(x, p, panels=True, pairs=True, quads=True)
    with pytest.raises(ValueError, match="int8 weights with K a multiple of 4"):
        cpu_kernels.matmul(x, p.astype(jnp.float32), panels=True, quads=True)
    with pytest.raises(ValueError, match="int8 weights with K a multiple of 4"):
        cpu_kernels.matmul(x[:, :38], jnp.ones((2, 38, 16), jnp.int8), panels=True, quads=True)
    lowered = jax.jit(functools.partial(cpu_kernels.matmul, panels=True, quads=True)).lower(x, p).as_text()
    assert ("llm_jax_matmul_quads_i8" in lowered) == cpu_kernels.quads_available()
    # Without VNNI (the option off, as on a CPU without it), XLA's product on the quads: its division is not
    # correctly rounded on CPU, so t (and rarely an n) may differ in the last place from the kernel's
    off = jax.jit(functools.partial(cpu_kernels.matmul, panels=True, quads=True, int8_dot=False))
    assert "llm_jax_matmul_quads" not in off.lower(x, p).as_text()
    expected = quads_reference(x, q)
    np.testing.assert_allclose(np.asarray(off(x, p)), expected, rtol=1e-5, atol=2e-3 * np.abs(expected).max())
