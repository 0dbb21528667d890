"""Sampling inside jit: greedy limit, filter sets over many draws, seeds; warpers and processors against
``transformers``' classes (same order, per-row settings)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from transformers.generation import logits_process as tlp

import cpu_kernels
from llm_jax.backends import CpuKernels
from llm_jax.sampling import (GREEDY, NUCLEUS_PREFIX, SHORT_NUCLEUS_PREFIX, Sampling, SamplingParams, filter_logits,
                              process_logits, sample)

V = 50
VOCAB = 300  # for the comparisons with transformers
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


ROWS = [
    Sampling(temperature=1.0),
    Sampling(temperature=0.7, top_k=20),
    Sampling(temperature=1.3, top_p=0.8),
    Sampling(temperature=1.0, min_p=0.05),
    Sampling(temperature=0.9, typical_p=0.6),
    Sampling(temperature=1.1, top_k=50, top_p=0.9, min_p=0.02, typical_p=0.8),
    Sampling(temperature=2.0, top_k=1),
    Sampling(temperature=0.5, typical_p=0.2, min_p=0.1),
]


def transformers_warpers(row: Sampling) -> tlp.LogitsProcessorList:
    """The warper list ``GenerationMixin._get_logits_processor`` builds for ``do_sample=True``."""
    warpers = tlp.LogitsProcessorList()
    if row.temperature != 1.0:
        warpers.append(tlp.TemperatureLogitsWarper(row.temperature))
    if row.top_k:
        warpers.append(tlp.TopKLogitsWarper(row.top_k))
    if row.top_p < 1:
        warpers.append(tlp.TopPLogitsWarper(row.top_p))
    if row.min_p:
        warpers.append(tlp.MinPLogitsWarper(row.min_p))
    if row.typical_p < 1:
        warpers.append(tlp.TypicalLogitsWarper(row.typical_p))
    return warpers


def filtered_like_transformers(logits: np.ndarray, rows: list[Sampling]) -> np.ndarray:
    """``filter_logits`` of the rows, checked against transformers' warpers row by row: the same tokens
    removed, the kept ones within 1e-6 or a float32 ulp (temperature-scaled logits past 16)."""
    ours = np.asarray(jax.jit(filter_logits)(jnp.asarray(logits), SamplingParams.stack(rows)))
    for b, row in enumerate(rows):
        expected = transformers_warpers(row)(torch.zeros((1, 1), dtype=torch.long), torch.tensor(logits[b:b + 1]))
        expected = expected.numpy()[0]
        np.testing.assert_array_equal(np.isneginf(ours[b]), np.isneginf(expected), err_msg=f"row {b}: {row}")
        finite = np.isfinite(expected)
        np.testing.assert_allclose(ours[b][finite], expected[finite], atol=1e-6, rtol=2**-23, err_msg=f"row {b}")
    return ours


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_filter_logits_matches_transformers_warpers(seed):
    logits = np.random.default_rng(seed).normal(0, 2.5, (len(ROWS), VOCAB)).astype(np.float32)
    ours = filtered_like_transformers(logits, ROWS)
    assert np.isneginf(ours).sum(axis=1).min() >= 0 and np.isneginf(ours[6]).sum() == VOCAB - 1


@pytest.mark.parametrize("scale", [6.0, 3.0, 0.05])
def test_top_k_and_top_p_over_a_large_vocabulary_match_transformers(scale):
    """Past NUCLEUS_PREFIX tokens: very peaked logits (scale 6) have their nuclei inside the short prefix,
    peaked ones (3) inside the long one, flat ones (0.05) in neither, nor does a top-k above it: every way
    gives transformers' filtered logits."""
    V = 3 * NUCLEUS_PREFIX + 17
    rows = [Sampling(temperature=1.0, top_p=0.9), Sampling(temperature=0.8, top_k=40, top_p=0.95),
            Sampling(temperature=1.2, top_k=NUCLEUS_PREFIX + 100), Sampling(temperature=1.0, top_k=NUCLEUS_PREFIX),
            Sampling(temperature=1.0, top_p=0.5, min_p=0.01)]
    logits = np.random.default_rng(11).normal(0, scale, (len(rows), V)).astype(np.float32)
    ours = filtered_like_transformers(logits, rows)
    kept = np.isfinite(ours).sum(axis=1)
    # Every regime is exercised: the nucleus of the first row inside the short prefix, the long one, neither.
    inside = {6.0: (0, SHORT_NUCLEUS_PREFIX), 3.0: (SHORT_NUCLEUS_PREFIX, NUCLEUS_PREFIX), 0.05: (NUCLEUS_PREFIX, V)}
    low, high = inside[scale]
    assert low < kept[0] <= high
    for b, row in enumerate(rows):  # alone: each row its own way (a batch takes the longest any row needs)
        filtered_like_transformers(logits[b:b + 1], [row])


def test_off_settings_leave_a_row_bit_identical():
    """A row with every setting off is unchanged by a batch where other rows use every processor."""
    logits = np.random.default_rng(5).normal(0, 2, (2, VOCAB)).astype(np.float32)
    busy = Sampling(temperature=0.8, top_k=5, typical_p=0.5, repetition_penalty=1.3, presence_penalty=0.5,
                    frequency_penalty=0.2, logit_bias={3: 2.0}, suppress_tokens=(4,), bad_words_ids=((1, 2),),
                    no_repeat_ngram_size=2)
    params = SamplingParams.stack([Sampling(temperature=1.0), busy])

    @jax.jit
    def processed_and_filtered(logits_BV):
        prompts = jnp.array([[1, 2, 1, 2], [1, 2, 1, 2]])
        history = params.new_history(prompts, jnp.array([4, 4]), V=VOCAB, capacity=16)
        history = history.append(jnp.array([7, 7]), jnp.array([True, True]))
        processed = process_logits(logits_BV, params, history, num_generated_B=jnp.array([1, 1]))
        return processed, filter_logits(processed, params)

    processed, filtered = processed_and_filtered(jnp.asarray(logits))
    np.testing.assert_array_equal(processed[0], logits[0])
    assert not np.array_equal(processed[1], logits[1])
    np.testing.assert_array_equal(filtered[0], logits[0])


def test_processors_run_in_transformers_order():
    """Bias, repetition penalty, n-grams, bad words: one row against transformers' processor list."""
    rng = np.random.default_rng(7)
    logits = rng.normal(0, 2, (1, VOCAB)).astype(np.float32)
    prompt = [5, 9, 5, 12, 5]
    row = Sampling(repetition_penalty=1.4, logit_bias={5: 3.0, 40: -2.0}, no_repeat_ngram_size=2,
                   suppress_tokens=(41,), bad_words_ids=((5, 12, 77), (12, 5, 78)))
    params = SamplingParams.stack([row])

    @jax.jit
    def processed(logits_BV):
        history = params.new_history(jnp.array([prompt]), jnp.array([len(prompt)]), V=VOCAB, capacity=8)
        return process_logits(logits_BV, params, history, num_generated_B=jnp.array([0]))

    ours = np.asarray(processed(jnp.asarray(logits)))
    reference = tlp.LogitsProcessorList([
        tlp.SequenceBiasLogitsProcessor([[[5], 3.0], [[40], -2.0]]),
        tlp.RepetitionPenaltyLogitsProcessor(1.4),
        tlp.NoRepeatNGramLogitsProcessor(2),
        tlp.NoBadWordsLogitsProcessor([[41], [5, 12, 77], [12, 5, 78]]),
    ])(torch.tensor([prompt]), torch.tensor(logits)).numpy()
    np.testing.assert_array_equal(np.isneginf(ours), np.isneginf(reference))
    assert np.isneginf(ours[0, [9, 12, 41, 78]]).all() and not np.isneginf(ours[0, 77])
    finite = np.isfinite(reference)
    np.testing.assert_allclose(ours[finite], reference[finite], atol=1e-6, rtol=0)


def test_processor_settings_are_validated():
    with pytest.raises(ValueError, match="typical_p"):
        Sampling(typical_p=0.0)
    with pytest.raises(ValueError, match="repetition_penalty"):
        Sampling(repetition_penalty=0.0)
    with pytest.raises(ValueError, match="bad_words_ids"):
        Sampling(bad_words_ids=((),))
    with pytest.raises(ValueError, match=r"row 1 name token ids \[300\]"):
        SamplingParams.stack([GREEDY, Sampling(logit_bias={300: 1.0})], vocab_size=300)
    assert dataclasses.replace(GREEDY, logit_bias={"3": 1}).logit_bias == {3: 1.0}


def test_an_all_greedy_batch_leaves_the_sampling_filters_out_of_the_program():
    """``SamplingParams.sampled`` is static: all-greedy rows compile to an argmax (no sort of the
    vocabulary), and give the same tokens as the same rows in a program that can sample."""
    scores = jnp.asarray(np.random.default_rng(0).normal(size=(3, 50)), jnp.float32)
    greedy = SamplingParams.stack([Sampling()] * 3)
    mixed = SamplingParams.stack([Sampling(), Sampling(temperature=0.7, top_p=0.9, seed=1), Sampling()])
    assert not greedy.sampled and mixed.sampled
    step = jnp.zeros((3,), jnp.int32)
    f = jax.jit(sample)
    assert "sort" not in f.lower(scores, greedy, step).as_text()
    assert "sort" in f.lower(scores, mixed, step).as_text()
    # the argmax is the backend's: the CPU kernels' vectorized one there, jnp.argmax by default
    kernels = jax.jit(sample, static_argnames="backend").lower(scores, greedy, step, backend=CpuKernels()).as_text()
    assert ("llm_jax_argmax_f32" in kernels) == cpu_kernels.available()
    assert "llm_jax_argmax_f32" not in f.lower(scores, greedy, step).as_text()
    np.testing.assert_array_equal(np.asarray(f(scores, greedy, step)), np.argmax(np.asarray(scores), -1))
    np.testing.assert_array_equal(np.asarray(f(scores, mixed, step))[[0, 2]],
                                  np.argmax(np.asarray(scores), -1)[[0, 2]])
