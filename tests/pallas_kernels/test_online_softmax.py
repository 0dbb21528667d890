"""The shared online-softmax arithmetic against a direct softmax, in plain numpy."""

import jax.numpy as jnp
import numpy as np

from pallas_kernels import online_softmax


def _softmax_rows(s, visible, v):
    """Direct masked softmax(s) @ v in float64; rows with nothing visible give 0."""
    e = np.where(visible, np.exp(s - np.max(np.where(visible, s, -np.inf), -1, keepdims=True,
                                            initial=-np.inf)), 0.0)
    e = np.nan_to_num(e)
    total = e.sum(-1, keepdims=True)
    return (e @ v) / np.where(total == 0, 1, total)


def test_blockwise_updates_equal_the_softmax_including_fully_masked_rows():
    rng = np.random.default_rng(0)
    s = rng.standard_normal((6, 40)) * 4
    v = rng.standard_normal((40, 8))
    visible = rng.random((6, 40)) < 0.5
    visible[2] = False  # a row that sees nothing
    visible[3, :30] = False  # a row whose first blocks are fully masked
    state = online_softmax.initial_state(6, 8)
    for start in range(0, 40, 16):
        cols = slice(start, start + 16)
        state = online_softmax.update(
            state, jnp.asarray(s[:, cols] * online_softmax.LOG2_E, jnp.float32),
            jnp.asarray(v[cols], jnp.float32), jnp.asarray(visible[:, cols]))
    out = online_softmax.finalize(state, row_valid=True)
    np.testing.assert_allclose(np.asarray(out), _softmax_rows(s, visible, v), atol=1e-5, rtol=0)
    assert not np.asarray(out)[2].any()


def test_log_sum_exp_is_base_2_and_minus_infinity_when_nothing_was_seen():
    s = np.array([[0.5, -1.0, 2.0], [0.0, 0.0, 0.0]])
    visible = np.array([[True, True, True], [False, False, False]])
    state = online_softmax.update(online_softmax.initial_state(2, 1),
                                  jnp.asarray(s, jnp.float32), jnp.ones((3, 1)),
                                  jnp.asarray(visible))
    lse = np.asarray(online_softmax.log_sum_exp(state))[:, 0]
    np.testing.assert_allclose(lse[0], np.log2(np.sum(np.exp2(s[0]))), rtol=1e-6)
    assert lse[1] == -np.inf


def _split_softmax(s, v):
    """Normalised output and base-2 log-sum-exp of one split (natural-log scores s)."""
    s2 = s * online_softmax.LOG2_E
    lse = np.log2(np.sum(np.exp2(s2), axis=-1))
    return np.exp2(s2 - lse[..., None]) @ v, lse


def test_combine_splits_weighs_splits_by_their_log_sum_exp():
    """Flash-decoding's reduction: splits of a softmax combine into the softmax of the union; a
    split that saw nothing (lse = -inf) weighs 0, and a row no split saw stays 0."""
    rng = np.random.default_rng(1)
    s_BKGS = rng.standard_normal((1, 2, 3, 10)) * 3
    v_SH = rng.standard_normal((10, 4))
    o_a, lse_a = _split_softmax(s_BKGS[..., :6], v_SH[:6])
    o_b, lse_b = _split_softmax(s_BKGS[..., 6:], v_SH[6:])
    o_empty, lse_empty = np.zeros_like(o_a), np.full_like(lse_a, -np.inf)
    o_BKPGH = jnp.asarray(np.stack([o_a, o_empty, o_b], axis=2), jnp.float32)
    lse_BKPG = jnp.asarray(np.stack([lse_a, lse_empty, lse_b], axis=2), jnp.float32)
    combined = online_softmax.combine_splits(o_BKPGH, lse_BKPG)
    softmax = np.exp(s_BKGS) / np.sum(np.exp(s_BKGS), axis=-1, keepdims=True)
    np.testing.assert_allclose(np.asarray(combined), softmax @ v_SH, atol=1e-5, rtol=0)

    nothing = online_softmax.combine_splits(jnp.zeros((1, 1, 2, 3, 4)),
                                            jnp.full((1, 1, 2, 3), -jnp.inf))
    assert np.isfinite(np.asarray(nothing)).all() and not np.asarray(nothing).any()
