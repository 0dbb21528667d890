"""Sampling inside jit: greedy limit, filter sets over many draws, seeds."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from llm_jax.sampling import Sampling, SamplingParams, sample

V = 50
DRAWS = 2000


def draws(logits_V: np.ndarray, setting: Sampling, n: int = DRAWS) -> np.ndarray:
    """``n`` tokens for one row: the row's randomness at steps 0..n-1."""
    params = SamplingParams.stack([setting])
    steps = jnp.arange(n, dtype=jnp.int32)
    one = lambda step: sample(jnp.asarray(logits_V)[None], params, step[None])[0]
    return np.asarray(jax.jit(jax.vmap(one))(steps))


@pytest.fixture(scope="module")
def logits_V():
    return np.random.default_rng(0).normal(0, 2.0, V).astype(np.float32)


def probabilities(logits_V, temperature=1.0):
    z = logits_V / temperature
    p = np.exp(z - z.max())
    return p / p.sum()


def test_greedy_is_argmax(logits_V):
    assert set(draws(logits_V, Sampling(temperature=0.0), 50)) == {int(np.argmax(logits_V))}


def test_temperature_to_zero_equals_greedy(logits_V):
    assert set(draws(logits_V, Sampling(temperature=1e-4, seed=3))) == {int(np.argmax(logits_V))}


def test_top_k_stays_in_top_k(logits_V):
    k = 5
    allowed = set(np.argsort(-logits_V)[:k].tolist())
    seen = set(draws(logits_V, Sampling(temperature=1.5, top_k=k, seed=1)).tolist())
    assert seen <= allowed
    assert len(seen) == k  # at temperature 1.5 every member shows up in 2000 draws


def test_top_p_stays_in_nucleus(logits_V):
    top_p = 0.6
    p = probabilities(logits_V)
    order = np.argsort(-p)
    mass_before = np.cumsum(p[order]) - p[order]
    nucleus = set(order[mass_before < top_p].tolist())
    seen = set(draws(logits_V, Sampling(temperature=1.0, top_p=top_p, seed=2)).tolist())
    assert seen <= nucleus
    assert len(seen) >= 2


def test_min_p_stays_above_threshold(logits_V):
    min_p = 0.2
    p = probabilities(logits_V, temperature=0.7)
    allowed = set(np.flatnonzero(p >= min_p * p.max()).tolist())
    seen = set(draws(logits_V, Sampling(temperature=0.7, min_p=min_p, seed=4)).tolist())
    assert seen <= allowed
    assert len(allowed) >= 2 and len(seen) >= 2


def test_filters_combine(logits_V):
    top_k, top_p = 8, 0.5
    p = probabilities(logits_V)
    order = np.argsort(-p)[:top_k]
    q = p[order] / p[order].sum()
    allowed = set(order[(np.cumsum(q) - q) < top_p].tolist())
    seen = set(draws(logits_V, Sampling(temperature=1.0, top_k=top_k, top_p=top_p, seed=5)).tolist())
    assert seen <= allowed


def test_draws_follow_the_distribution(logits_V):
    """Unfiltered sampling at temperature 1 matches softmax frequencies (a 5-sigma band)."""
    p = probabilities(logits_V)
    counts = np.bincount(draws(logits_V, Sampling(temperature=1.0, seed=6), 4000), minlength=V)
    sigma = np.sqrt(4000 * p * (1 - p))
    assert np.all(np.abs(counts - 4000 * p) <= 5 * sigma + 1)


def test_same_seed_same_tokens_different_seed_differs(logits_V):
    a = draws(logits_V, Sampling(temperature=1.0, seed=7), 200)
    b = draws(logits_V, Sampling(temperature=1.0, seed=7), 200)
    c = draws(logits_V, Sampling(temperature=1.0, seed=8), 200)
    np.testing.assert_array_equal(a, b)
    assert (a != c).mean() > 0.3


def test_mixed_batch_rows_match_rows_alone(logits_V):
    rows = [Sampling(), Sampling(temperature=0.9, top_k=10, seed=1), Sampling(temperature=1.2, top_p=0.8, seed=2),
            Sampling(temperature=0.8, min_p=0.1, seed=3)]
    logits_BV = jnp.asarray(np.stack([np.roll(logits_V, i) for i in range(len(rows))]))
    steps_B = jnp.array([0, 3, 5, 9], jnp.int32)
    batch = np.asarray(jax.jit(sample)(logits_BV, SamplingParams.stack(rows), steps_B))
    for i, row in enumerate(rows):
        alone = jax.jit(sample)(logits_BV[i:i + 1], SamplingParams.stack([row]), steps_B[i:i + 1])
        assert batch[i] == int(alone[0])


@pytest.mark.parametrize("kwargs, message", [
    (dict(temperature=-1.0), "temperature must be >= 0"),
    (dict(top_k=-2), "top_k must be >= 0"),
    (dict(top_p=0.0), "top_p must be in"),
    (dict(min_p=1.5), "min_p must be in"),
    (dict(seed=-1), "seed must be in"),
])
def test_invalid_settings_are_rejected(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Sampling(**kwargs)
