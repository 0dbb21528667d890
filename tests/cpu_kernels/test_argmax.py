"""cpu_kernels.argmax against jnp.argmax: first index of the maximum, NaN first, ties, infinities, rows
shorter than a vector and longer than one thread's share."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import cpu_kernels
from tests.cpu_kernels.paths import ON, paths

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


# cpu_kernels.screened_argmax: the argmax of x · W from logits screened through a narrower copy of W, the
# token of the unscreened path (the head's own float32 product, then argmax); test_greedy_ties.py holds the
# cases where that differs from the exact (float64) argmax. The head's options (amx, bf16_dot) choose its
# product's path: the screened heads take them too (``options``: all of them, as tests/cpu_kernels/paths.py
# gives them).

def _head_paths(options) -> dict:
    return dict(amx=options["amx"], bf16_dot=options["bf16_dot"])


def _unscreened(x, panels, options=ON) -> np.ndarray:
    """The unscreened path's tokens: the first largest of the head's float32 product x · W with ``options``,
    row by row."""
    return np.asarray(cpu_kernels.argmax(cpu_kernels.matmul(x, panels, panels=True, **options)))


def _screened_case(D, V, B, seed, screen="bfloat16", head_dtype=jnp.float32, options=ON):
    """x [B, D] (rounded as W's product rounds it), W [D, V] as panels, the screen's logits, the arguments
    that go with them, and the unscreened path's tokens with ``options`` (here also the exact float64 argmax:
    these rows have no float32 near-ties, which is checked). The int8 screen in quads needs D a multiple of
    4 (D is rounded up to one) and AVX-512 VNNI (where the kernels quantize x as the bound assumes)."""
    from llm_jax.backends.cpu import greedy_head

    quads = screen == "int8_quads"
    if quads:
        if not (options["int8_dot"] and cpu_kernels.quads_available()):
            pytest.skip("the int8 screen in quads runs on AVX-512 VNNI, which this CPU lacks (or is off)")
        D += -D % 4
    rng = np.random.default_rng(seed)
    W = rng.normal(0, 0.02, (D, V)).astype(np.float32)
    x = rng.normal(0, 1, (B, D)).astype(np.float32)
    # Near-ties: column 5 equals column 7 (the first must win), column 11 is column 7 raised by 1e-5 (for
    # a bfloat16 W, by 1/64: a few units in its last place), and row 0 points along column 7, so all three
    # lead it.
    W[:, 5] = W[:, 7]
    W[:, 11] = W[:, 7] * np.float32(1 + (1e-5 if head_dtype == jnp.float32 else 1 / 64))
    x[0] = 40 * W[:, 7]
    panels = cpu_kernels.to_panels(jnp.asarray(W)).astype(head_dtype)
    screens = greedy_head._screens(panels, quads, options["bf16_dot"] and cpu_kernels.pairs_available())
    x = jnp.asarray(x).astype(head_dtype).astype(jnp.float32)
    if screen == "bfloat16" and screens.bfloat16_pairs is not None:  # stored in pairs of rows (AVX512_BF16)
        y = cpu_kernels.matmul(x, screens.bfloat16_pairs, panels=True, pairs=True, **options)
    else:
        y = cpu_kernels.matmul(x, getattr(screens, screen), panels=True, quads=quads, **options)
    scales = screens.scales_V if screen in ("int8", "int8_quads") else None
    errors = screens.errors_V if quads else None
    expected = _unscreened(x, panels, options)
    exact = np.argmax(np.asarray(x, np.float64) @ np.asarray(cpu_kernels.from_panels(panels), np.float64), axis=-1)
    np.testing.assert_array_equal(expected, exact)
    return (y, x, panels, scales, screens.norms_V, *greedy_head.bounds(D, screen), errors), expected


SCREENS = [("bfloat16", jnp.float32), ("int8", jnp.float32), ("int8", jnp.bfloat16), ("int8_quads", jnp.float32),
           ("int8_quads", jnp.bfloat16)]
IDS = ["bf16-of-f32", "int8-of-f32", "int8-of-bf16", "quads-of-f32", "quads-of-bf16"]


@pytest.mark.parametrize("options", paths())
@pytest.mark.parametrize("screen,head_dtype", SCREENS, ids=IDS)
@pytest.mark.parametrize("D,V,B", [(288, 32000, 32), (37, 160, 9), (64, 48, 3), (768, 4096, 5)])
def test_screened_argmax_is_the_unscreened_argmax(D, V, B, screen, head_dtype, options):
    args, expected = _screened_case(D, V, B, D + V, screen, head_dtype, options)
    screened = jax.jit(functools.partial(cpu_kernels.screened_argmax, **_head_paths(options)), static_argnums=(5, 6))
    ours = np.asarray(screened(*args))
    np.testing.assert_array_equal(ours, expected)  # the head's own product's argmax, and the exact one
    assert ours[0] == 11  # the raised copy, not the first of the two equal columns before it


@pytest.mark.parametrize("screen,head_dtype", SCREENS, ids=IDS)
def test_the_screen_alone_would_be_wrong_and_a_bound_of_zero_is_caught(screen, head_dtype):
    """The screened logits' own argmax misses the head's in some rows (the test data can tell); with
    c1 = c2 = 0 the kernel computes only the screen's winners from the head and misses them too."""
    rows = 2048 if screen == "bfloat16" else 256  # bfloat16's screen misorders about one row in 150
    args, expected = _screened_case(288, 8000, rows, 3, screen, head_dtype)
    y, x, panels, scales, norms, c1, c2, errors = args
    screened = np.asarray(y) * (1 if scales is None else np.asarray(scales))
    assert (np.argmax(screened, axis=-1) != expected).any()
    unbounded = np.asarray(cpu_kernels.screened_argmax(y, x, panels, scales, norms, 0.0, 0.0, errors))
    assert (unbounded != expected).any()
    np.testing.assert_array_equal(np.asarray(cpu_kernels.screened_argmax(*args)), expected)


@pytest.mark.parametrize("screen,head_dtype", SCREENS, ids=IDS)
def test_screened_argmax_of_rows_with_nans_and_infinities(screen, head_dtype):
    """Such rows are computed in full: jnp.argmax's answer for the head's product (the first NaN)."""
    args, _ = _screened_case(37, 160, 4, 5, screen, head_dtype)
    y, x, panels, scales, norms, c1, c2, errors = args
    x = x.at[1, 3].set(NAN).at[2, 0].set(INF)
    y = y.at[3, 17].set(NAN)  # a NaN in the screen only: the head's logits decide
    ours = np.asarray(cpu_kernels.screened_argmax(y, x, panels, scales, norms, c1, c2, errors))
    logits = np.asarray(cpu_kernels.matmul(x, panels, panels=True))
    np.testing.assert_array_equal(ours, np.argmax(logits, axis=-1))
    np.testing.assert_array_equal(ours, _unscreened(x, panels))
    assert ours[1] == 0  # every logit NaN: the first


def test_screened_argmax_checks_its_operands():
    (y, x, panels, scales, norms, c1, c2, _), _ = _screened_case(37, 160, 2, 0, "int8")
    with pytest.raises(ValueError, match="screened_argmax needs"):  # errors only with scales
        cpu_kernels.screened_argmax(y, x, panels, None, norms, c1, c2, norms)
    with pytest.raises(ValueError, match="screened_argmax needs"):
        cpu_kernels.screened_argmax(y, x, panels, scales, norms, c1, c2, norms[:-1])
    with pytest.raises(ValueError, match="screened_argmax needs"):
        cpu_kernels.screened_argmax(y, x[:, :36], panels, scales, norms, c1, c2)
    with pytest.raises(ValueError, match="screened_argmax needs"):
        cpu_kernels.screened_argmax(y, x, panels, scales, norms[:-16], c1, c2)
    with pytest.raises(ValueError, match="screened_argmax needs"):
        cpu_kernels.screened_argmax(y, x, panels, scales[:-1], norms, c1, c2)
    with pytest.raises(ValueError, match="screened_argmax needs"):
        cpu_kernels.screened_argmax(y, x, panels.astype(jnp.int8), scales, norms, c1, c2)


@pytest.mark.parametrize("head_dtype", [jnp.float32, jnp.bfloat16])
def test_screened_argmax_runs_the_kernel_on_cpu(head_dtype):
    """The kernel, with the head product's options as its attributes (the path its exact check repeats)."""
    args, _ = _screened_case(37, 160, 2, 0, "int8", head_dtype)
    name = "llm_jax_screened_argmax_" + ("f32" if head_dtype == jnp.float32 else "bf16")
    for amx, bf16_dot in [(True, True), (False, True), (True, False)]:
        screened = functools.partial(cpu_kernels.screened_argmax, amx=amx, bf16_dot=bf16_dot)
        lowered = jax.jit(screened, static_argnums=(5, 6)).lower(*args).as_text()
        calls = [line for line in lowered.splitlines() if name in line]
        assert len(calls) == cpu_kernels.available(), lowered
        assert all(f"amx = {str(amx).lower()}, bf16_dot = {str(bf16_dot).lower()}" in c for c in calls), calls


# cpu_kernels.quads_argmax: the int8 screen's product in quads and the screened argmax in one call.

def _quads_case(D, V, B, seed, head_dtype, options=ON):
    """_screened_case's data through the quads, as quads_argmax takes it (x, quads, panels, scales, errors,
    norms, c1, c2), the screened logits and the unscreened path's tokens."""
    from llm_jax.backends.cpu import greedy_head

    (y, x, panels, scales, norms, c1, c2, errors), expected = _screened_case(D, V, B, seed, "int8_quads", head_dtype,
                                                                             options)
    quads = greedy_head._screens(panels, True).int8_quads
    return (x, quads, panels, scales, errors, norms, c1, c2), y, expected


QUADS_ARGMAX = jax.jit(cpu_kernels.quads_argmax, static_argnums=(6, 7), static_argnames=("amx", "bf16_dot"))


@pytest.mark.parametrize("options", paths())
@pytest.mark.parametrize("head_dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("D,V,B", [(288, 32000, 32), (37, 160, 9), (64, 48, 3), (768, 4096, 5), (96, 5008, 33)])
def test_quads_argmax_is_the_two_calls_and_the_unscreened_argmax(D, V, B, head_dtype, options):
    args, y, expected = _quads_case(D, V, B, D + V, head_dtype, options)
    ours = np.asarray(QUADS_ARGMAX(*args, **_head_paths(options)))
    assert ours.dtype == np.int32 and ours.shape == (B,)
    np.testing.assert_array_equal(ours, expected)
    assert ours[0] == 11  # the raised copy, not the first of the two equal columns before it
    x, quads, panels, scales, errors, norms, c1, c2 = args
    two_calls = cpu_kernels.screened_argmax(y, x, panels, scales, norms, c1, c2, errors, **_head_paths(options))
    np.testing.assert_array_equal(ours, np.asarray(two_calls))


@pytest.mark.parametrize("head_dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_quads_argmax_with_a_bound_of_zero_is_wrong(head_dtype):
    """With c1 = c2 = 0 only the screen's own winners are computed from the head, and some rows miss: the
    bound is what makes the token the head's."""
    args, _, expected = _quads_case(288, 8000, 256, 3, head_dtype)
    unbounded = np.asarray(cpu_kernels.quads_argmax(*args[:6], 0.0, 0.0))
    assert (unbounded != expected).any()
    np.testing.assert_array_equal(np.asarray(cpu_kernels.quads_argmax(*args)), expected)


@pytest.mark.parametrize("V", [160, 4112])  # at most kKeptPerRow columns, and more (a row of zeros keeps all)
def test_quads_argmax_of_rows_with_nans_infinities_and_zeros(V):
    """Rows with a NaN or an infinity, and rows where every column ties (x = 0: each column kept), are
    computed in full: jnp.argmax's answer for the head's product (the first NaN; the first of equal ones)."""
    args, _, _ = _quads_case(37, V, 5, 5, jnp.float32)
    x = args[0].at[1, 3].set(NAN).at[2, 0].set(INF).at[3].set(0.0).at[4, 7].set(-INF)
    ours = np.asarray(cpu_kernels.quads_argmax(x, *args[1:]))
    logits = np.asarray(cpu_kernels.matmul(x, args[2], panels=True))
    np.testing.assert_array_equal(ours, np.argmax(logits, axis=-1))
    np.testing.assert_array_equal(ours, _unscreened(x, args[2]))
    assert ours[1] == 0 and ours[3] == 0  # every logit NaN, every logit 0: the first


@pytest.mark.parametrize("quads_here", [True, False], ids=["option-off", "no-vnni"])
def test_quads_argmax_without_the_quads_is_the_unscreened_argmax(monkeypatch, quads_here):
    """Where the quads do not run (``int8_dot`` off, or a CPU without VNNI), every logit through the head's
    own product and argmax: the unscreened path itself (and here the exact token)."""
    from llm_jax.backends.cpu import greedy_head

    if not quads_here:
        monkeypatch.setattr(cpu_kernels, "quads_available", lambda: False)
    options = dict(int8_dot=False) if quads_here else {}
    rng = np.random.default_rng(7)
    W = rng.normal(0, 0.02, (40, 160)).astype(np.float32)
    x = jnp.asarray(rng.normal(0, 1, (9, 40)).astype(np.float32))
    panels = cpu_kernels.to_panels(jnp.asarray(W))
    screens = greedy_head._screens(panels, True)
    args = (x, screens.int8_quads, panels, screens.scales_V, screens.errors_V, screens.norms_V,
            *greedy_head.bounds(40, "int8_quads"))
    lowered = jax.jit(lambda *a: cpu_kernels.quads_argmax(*a, *args[6:], **options)).lower(*args[:6]).as_text()
    assert "llm_jax_quads_argmax" not in lowered
    ours = np.asarray(cpu_kernels.quads_argmax(*args, **options))
    np.testing.assert_array_equal(ours, _unscreened(x, panels))
    np.testing.assert_array_equal(ours, np.argmax(np.asarray(x, np.float64) @ W.astype(np.float64), axis=-1))


def test_quads_argmax_checks_its_operands():
    args, _, _ = _quads_case(36, 160, 2, 0, jnp.float32)
    x, quads, panels, scales, errors, norms, c1, c2 = args
    bad = [(x[:, :32], quads, panels, scales, errors, norms),  # D differs
           (x, quads[:-1], panels, scales, errors, norms),  # screen and head differ
           (x, quads.astype(jnp.float32), panels, scales, errors, norms),
           (x, quads, panels.astype(jnp.int8), scales, errors, norms),
           (x, quads, panels, scales[:-1], errors, norms),
           (x, quads, panels, scales, errors[:-16], norms),
           (x, quads, panels, scales, errors, norms.astype(jnp.bfloat16)),
           (x.astype(jnp.bfloat16), quads, panels, scales, errors, norms)]
    D = cpu_kernels.QUADS_MAX_K  # rows too long for the int32 sums
    bad.append((jnp.zeros((1, D)), jnp.zeros((1, D, 16), jnp.int8), jnp.zeros((1, D, 16)), *(jnp.ones(16),) * 3))
    for operands in bad:
        with pytest.raises(ValueError, match="quads_argmax needs"):
            cpu_kernels.quads_argmax(*operands, c1, c2)


@pytest.mark.parametrize("head_dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_quads_argmax_runs_the_kernel_on_cpu(head_dtype):
    """The kernel, with the head product's options as its attributes (the path its exact check repeats)."""
    args, _, _ = _quads_case(36, 160, 9, 0, head_dtype)
    name = "llm_jax_quads_argmax_" + ("f32" if head_dtype == jnp.float32 else "bf16")
    for amx, bf16_dot in [(True, True), (False, True), (True, False)]:
        calls = [line for line in QUADS_ARGMAX.lower(*args, amx=amx, bf16_dot=bf16_dot).as_text().splitlines()
                 if name in line]
        assert len(calls) == 1 and f"amx = {str(amx).lower()}, bf16_dot = {str(bf16_dot).lower()}" in calls[0], calls
