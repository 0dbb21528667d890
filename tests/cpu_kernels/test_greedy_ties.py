"""The greedy head through its screens picks the unscreened path's token: the first largest float32 logit of
``cpu_kernels.matmul(x, panels, panels=True)`` for the same rows, bit for bit, not the largest exact
(float64) logit. Random rows; duplicated columns (exact ties: the first index); and columns whose float32
logit is one unit in the last place from the winner's, or equal to it, built where float64 orders the two
the other way. On every instruction path this CPU has (tests/cpu_kernels/paths.py): the screens and the exact
check take the options of the head's product they stand for."""

import jax.numpy as jnp
import numpy as np
import pytest

import cpu_kernels
from llm_jax.backends.cpu import greedy_head
from tests.cpu_kernels.paths import paths

pytestmark = pytest.mark.skipif(not cpu_kernels.available(), reason="no C++ compiler: the kernels are not built")

ROWS = [1, 3, 7, 8, 13, 32]  # streams (1), small tiles and slices of K (3, 7), register tiles (8 on)
DTYPES = [jnp.float32, jnp.bfloat16]
DTYPE_IDS = ["f32", "bf16"]
QUADS = "int8_quads"


def _screens_here(head_dtype, options) -> list[str]:
    """The screens of a head of ``head_dtype`` this CPU runs with ``options``: int8 (few rows), bfloat16 (a
    float32 head's, many rows; in pairs where the dot products run) and int8 in quads (AVX-512 VNNI)."""
    screens = ["int8"] + (["bfloat16"] if head_dtype == jnp.float32 else [])
    return screens + ([QUADS] if options["int8_dot"] and cpu_kernels.quads_available() else [])


def _screened(x, panels, screen: str, options) -> np.ndarray:
    """The greedy tokens [B] of x [B, D] · W (W as ``panels``) through ``screen``, built and bounded by the
    greedy head (llm_jax/backends/cpu/greedy_head.py) and called as it calls them, with ``options``."""
    s = greedy_head._screens(panels, screen == QUADS, options["bf16_dot"] and cpu_kernels.pairs_available())
    c1, c2 = greedy_head.bounds(panels.shape[1], screen)
    head_paths = dict(amx=options["amx"], bf16_dot=options["bf16_dot"])
    if screen == QUADS:
        return np.asarray(cpu_kernels.quads_argmax(x, s.int8_quads, panels, s.scales_V, s.errors_V, s.norms_V, c1, c2,
                                                   **options))
    if screen == "int8":
        y, scales = cpu_kernels.matmul(x, s.int8, panels=True, **options), s.scales_V
    elif s.bfloat16_pairs is not None:
        y, scales = cpu_kernels.matmul(x, s.bfloat16_pairs, panels=True, pairs=True, **options), None
    else:
        y, scales = cpu_kernels.matmul(x, s.bfloat16, panels=True, **options), None
    return np.asarray(cpu_kernels.screened_argmax(y, x, panels, scales, s.norms_V, c1, c2, **head_paths))


def _unscreened(x, panels, options) -> np.ndarray:
    """The unscreened path's tokens: the head's float32 product with ``options``, then the first index of each
    row's maximum."""
    return np.asarray(cpu_kernels.argmax(cpu_kernels.matmul(x, panels, panels=True, **options)))


def _head(W: np.ndarray, head_dtype):
    """W [D, V] as the head's panels of ``head_dtype`` (W must hold values of that dtype)."""
    panels = cpu_kernels.to_panels(jnp.asarray(W)).astype(head_dtype)
    np.testing.assert_array_equal(np.asarray(cpu_kernels.from_panels(panels), np.float32), W)
    return panels


def _as(a: np.ndarray, dtype) -> np.ndarray:
    """a rounded to ``dtype``, as float32."""
    return np.array(jnp.asarray(a, jnp.float32).astype(dtype).astype(jnp.float32))


@pytest.mark.parametrize("options", paths())
@pytest.mark.parametrize("head_dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("D,V", [(64, 512), (288, 512), (288, 64)])  # V = 64: K cut into slices below 8 rows
@pytest.mark.parametrize("R", ROWS)
def test_random_rows_take_the_unscreened_token(R, D, V, head_dtype, options):
    rng = np.random.default_rng(R * 1000 + D + V)
    W = _as(rng.normal(0, 0.02, (D, V)), head_dtype)
    x = jnp.asarray(_as(rng.normal(0, 1, (R, D)), head_dtype))
    panels = _head(W, head_dtype)
    expected = _unscreened(x, panels, options)
    for screen in _screens_here(head_dtype, options):
        np.testing.assert_array_equal(_screened(x, panels, screen, options), expected, err_msg=screen)


@pytest.mark.parametrize("options", paths())
@pytest.mark.parametrize("head_dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("D,V", [(64, 512), (288, 512), (288, 64)])
@pytest.mark.parametrize("R", ROWS)
def test_rounding_alone_orders_the_columns(R, D, V, head_dtype, options):
    """Every column a permutation of one vector and every row constant: the exact logits of a row are all
    equal, and the float32 ones differ by the order of their sums alone (a few units in the last place), so
    the token is decided by that order and rounding: any other arithmetic for the candidates (float64, a
    different order, no slices of K) picks another column in most rows."""
    rng = np.random.default_rng(R * 1000 + D + V + 1)
    w = _as(rng.normal(0, 0.02, D) * 2.0 ** rng.integers(-16, 1, D), head_dtype)  # sums that must round
    W = np.stack([rng.permutation(w) for _ in range(V)], axis=1)
    x = jnp.asarray(_as(rng.uniform(0.5, 2, (R, 1)) * np.ones((R, D)), head_dtype))
    panels = _head(W, head_dtype)
    expected = _unscreened(x, panels, options)
    logits = np.asarray(cpu_kernels.matmul(x, panels, panels=True, **options))
    assert all(len(set(row.tolist())) > 1 for row in logits)  # rounding tells the columns apart
    for screen in _screens_here(head_dtype, options):
        np.testing.assert_array_equal(_screened(x, panels, screen, options), expected, err_msg=screen)


@pytest.mark.parametrize("options", paths())
@pytest.mark.parametrize("head_dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("R", ROWS)
def test_duplicated_columns_the_first_wins(R, head_dtype, options):
    """The largest column duplicated later in the vocabulary, earlier, and within its own panel: every copy's
    float32 logit is the same, and the first index wins, in every row."""
    D, V, j = 288, 512, 37
    rng = np.random.default_rng(R)
    W = _as(rng.normal(0, 0.02, (D, V)), head_dtype)
    x = _as(rng.normal(0, 1, (R, D)), head_dtype)
    x[R - 1] = _as(40 * W[:, j], head_dtype)  # the last row points along column j
    for copies, first in [((300,), j), ((5, 300), 5), ((36, 38, 400), 36)]:
        Wd = W.copy()
        Wd[:, list(copies)] = W[:, [j]]
        panels = _head(Wd, head_dtype)
        expected = _unscreened(jnp.asarray(x), panels, options)
        assert expected[R - 1] == first
        for screen in _screens_here(head_dtype, options):
            np.testing.assert_array_equal(_screened(jnp.asarray(x), panels, screen, options), expected,
                                          err_msg=screen)


def _logits(x: np.ndarray, W: np.ndarray, head_dtype, options) -> np.ndarray:
    return np.asarray(cpu_kernels.matmul(jnp.asarray(x), _head(W, head_dtype), panels=True, **options))


def _column(D: int, spots: list[int], values: list[float]) -> np.ndarray:
    column = np.zeros(D, np.float32)
    column[spots[:len(values)]] = values
    return column


def _weight_for(x: np.ndarray, W: np.ndarray, b: int, j: int, spots: list[int], target: np.float32,
                head_dtype, options) -> float:
    """A value t of W's dtype for which the column (1 at spots[0], t at spots[1]) has the head's float32 logit
    ``target`` in row b: t = target − 1 (fl(1 + t) in any order of the sums) and its neighbours, each tried
    in a column of its own (not j) in one product (a column's logit depends on its own values only), the
    nearest to target − 1 that gives it."""
    D, V = W.shape
    first = np.float32(target) - np.float32(1)
    tries = sorted(set(_as(first + np.arange(-16, 17) * 2.0 ** -27, head_dtype).tolist()), key=lambda t: abs(t - first))
    Wt = W.copy()
    columns = [c for c in range(V) if c != j][:len(tries)]
    for c, t in zip(columns, tries):
        Wt[:, c] = _column(D, spots, [1.0, t])
    e = _logits(x, Wt, head_dtype, options)[b]
    found = [t for c, t in zip(columns, tries) if e[c] == target]
    assert found, f"no weight gives the float32 logit {target!r}"
    return found[0]


@pytest.mark.parametrize("options", paths())
@pytest.mark.parametrize("head_dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("D,V", [(288, 512), (64, 64)])  # V = 64: K cut into slices below 8 rows
@pytest.mark.parametrize("R", ROWS)
def test_one_unit_apart_the_float32_product_decides(R, D, V, head_dtype, options):
    """The last row's largest logit is column j's, W[:, j] = 1 plus three terms of 2⁻²⁴ (half a unit of 1)
    in other blocks of K: its exact logit 1 + 1.5 · 2⁻²³ is no float32, so the head's float32 sums round it
    (down to 1, summed in order: each half unit is a tie). Column k (1 and one weight t) is given the float32
    logit nextafter(e_j, +inf), nextafter(e_j, -inf) and e_j itself (t searched until the head's own product
    gives it), before j (in another panel, in the same) and after it: the screened token is the unscreened
    path's every time, also where float64 orders k and j the other way (some of these cases do, in any order
    of the sums: e_j ≠ its exact value, and k's logit is exact)."""
    j, b = 37, R - 1
    rng = np.random.default_rng(R + D)
    W = _as(rng.normal(0, 0.02, (D, V)), head_dtype)
    x = _as(rng.normal(0, 0.05, (R, D)), head_dtype)
    spots = [0, D // 4, D // 2, 3 * D // 4]
    x[b, spots] = 1.0
    W[:, j] = _column(D, spots, [1.0] + [2.0 ** -24] * 3)
    e_j = _logits(x, W, head_dtype, options)[b, j]
    exact_j = np.float64(x[b]) @ np.float64(W[:, j])
    assert exact_j == 1 + 1.5 * 2.0 ** -23 and e_j != exact_j
    disagreements = 0
    for target in (np.nextafter(e_j, np.float32(np.inf)), np.nextafter(e_j, np.float32(-np.inf)), e_j):
        t = _weight_for(x, W, b, j, spots, target, head_dtype, options)
        for k in (5, 36, 38, V - 9):
            Wk = W.copy()
            Wk[:, k] = _column(D, spots, [1.0, t])
            panels = _head(Wk, head_dtype)
            logits = np.asarray(cpu_kernels.matmul(jnp.asarray(x), panels, panels=True, **options))
            assert logits[b, k] == target and logits[b, j] == e_j
            expected = _unscreened(jnp.asarray(x), panels, options)
            assert expected[b] == (min(j, k) if target == e_j else k if target > e_j else j)
            exact = np.argmax(np.float64(x) @ np.float64(Wk), axis=-1)
            disagreements += exact[b] != expected[b]
            for screen in _screens_here(head_dtype, options):
                ours = _screened(jnp.asarray(x), panels, screen, options)
                np.testing.assert_array_equal(ours, expected, err_msg=f"{screen}, k={k}, target={target!r}")
    assert disagreements > 0  # float64 would have picked another token in some of these cases
