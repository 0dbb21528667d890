"""Each logits processor against the ``transformers`` processor class it reimplements (random scores and
histories, every row with its own setting), and presence/frequency penalties against OpenAI's formula."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from transformers.generation import logits_process as tlp

from llm_jax import logits_processors as lp
from llm_jax.logits_processors import PAD_ID, History

B, V, S = 6, 40, 24  # a small vocabulary, so histories repeat tokens and n-grams


def random_case(seed: int):
    rng = np.random.default_rng(seed)
    scores = rng.normal(0, 3, (B, V)).astype(np.float32)
    lengths = rng.integers(1, S + 1, B).astype(np.int32)
    lengths[0] = 1  # a history shorter than any n-gram
    tokens = rng.integers(0, 8, (B, S)).astype(np.int32)  # few distinct ids: n-grams do repeat
    tokens[np.arange(S)[None] >= lengths[:, None]] = PAD_ID
    return scores, tokens, lengths


def reference(processor, tokens_row, length, scores_row):
    ids = torch.tensor(tokens_row[None, :length], dtype=torch.long)
    return processor(ids, torch.tensor(scores_row[None])).numpy()[0]


def assert_rows_match(ours, expected):
    np.testing.assert_array_equal(np.isneginf(ours), np.isneginf(expected))
    finite = np.isfinite(expected)
    np.testing.assert_allclose(ours[finite], expected[finite], atol=1e-6, rtol=0)


@pytest.mark.parametrize("seed", [0, 1])
def test_repetition_penalty_matches_transformers(seed):
    scores, tokens, lengths = random_case(seed)
    penalty = np.array([1.0, 1.3, 0.7, 2.0, 1.1, 0.5], np.float32)
    seen = jax.jit(lambda t, n: History.create(t, n, V=V, capacity=None, seen=True, counts=False).seen_BV)
    ours = np.asarray(jax.jit(lp.repetition_penalty)(jnp.asarray(scores), jnp.asarray(penalty),
                                                     seen(jnp.asarray(tokens), jnp.asarray(lengths))))
    for b in range(B):
        if penalty[b] == 1.0:
            np.testing.assert_array_equal(ours[b], scores[b])  # off: bit-identical
            continue
        expected = reference(tlp.RepetitionPenaltyLogitsProcessor(float(penalty[b])), tokens[b], lengths[b], scores[b])
        assert_rows_match(ours[b], expected)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_no_repeat_ngram_matches_transformers(seed):
    scores, tokens, lengths = random_case(seed)
    sizes = np.array([2, 0, 1, 2, 3, 4], np.int32)
    mask = jax.jit(functools.partial(lp.no_repeat_ngram_mask, max_ngram_size=int(sizes.max()), V=V))
    ours = np.asarray(lp.ban(jnp.asarray(scores), mask(jnp.asarray(tokens), jnp.asarray(lengths), jnp.asarray(sizes))))
    assert np.isneginf(ours).any()
    for b in range(B):
        if sizes[b] == 0:
            np.testing.assert_array_equal(ours[b], scores[b])
            continue
        expected = reference(tlp.NoRepeatNGramLogitsProcessor(int(sizes[b])), tokens[b], lengths[b], scores[b])
        assert_rows_match(ours[b], expected)


def test_bad_words_match_transformers():
    scores, tokens, lengths = random_case(3)
    rng = np.random.default_rng(3)
    rows = []
    for b in range(B):
        # Sequences ending the history (so they fire), random ones, and single tokens.
        L = lengths[b]
        words = [[int(t) for t in tokens[b, max(0, L - 2):L]] + [int(rng.integers(V))],
                 [int(rng.integers(V)) for _ in range(3)], [int(rng.integers(V))]]
        rows.append(words[: 1 + b % 3])
    J = max(len(w) for ws in rows for w in ws)
    table = np.full((B, 3, J), PAD_ID, np.int32)
    for b, ws in enumerate(rows):
        for q, w in enumerate(ws):
            table[b, q, J - len(w):] = w
    mask = jax.jit(functools.partial(lp.bad_words_mask, V=V))
    ours = np.asarray(lp.ban(jnp.asarray(scores), mask(jnp.asarray(tokens), jnp.asarray(lengths), jnp.asarray(table))))
    for b in range(B):
        expected = reference(tlp.NoBadWordsLogitsProcessor(rows[b]), tokens[b], lengths[b], scores[b])
        assert_rows_match(ours[b], expected)


def test_logit_bias_matches_sequence_bias():
    scores, _, _ = random_case(4)
    ids = np.array([[3, 7, PAD_ID], [0, 39, 5], [PAD_ID] * 3, [11, PAD_ID, PAD_ID], [1, 2, 3], [9, 8, 7]], np.int32)
    values = np.random.default_rng(4).normal(0, 5, ids.shape).astype(np.float32)
    ours = np.asarray(jax.jit(lp.logit_bias)(jnp.asarray(scores), jnp.asarray(ids), jnp.asarray(values)))
    for b in range(B):
        bias = [[[int(t)], float(v)] for t, v in zip(ids[b], values[b]) if t != PAD_ID]
        if not bias:
            np.testing.assert_array_equal(ours[b], scores[b])
            continue
        expected = tlp.SequenceBiasLogitsProcessor(bias)(torch.zeros((1, 1), dtype=torch.long),
                                                         torch.tensor(scores[b][None])).numpy()[0]
        assert_rows_match(ours[b], expected)


def test_min_new_tokens_matches_transformers():
    scores, _, _ = random_case(5)
    end_ids = np.array([[2, PAD_ID]] * B, np.int32)
    end_ids[1] = [2, 7]
    generated = np.array([0, 1, 2, 3, 4, 5], np.int32)
    minimum = np.array([0, 3, 3, 3, 6, 1], np.int32)
    mask = jax.jit(functools.partial(lp.min_new_tokens_mask, V=V))
    ours = np.asarray(lp.ban(jnp.asarray(scores), mask(jnp.asarray(end_ids), jnp.asarray(generated),
                                                       jnp.asarray(minimum))))
    for b in range(B):
        eos = [int(t) for t in end_ids[b] if t != PAD_ID]
        processor = tlp.MinNewTokensLengthLogitsProcessor(prompt_length_to_skip=4, min_new_tokens=int(minimum[b]),
                                                          eos_token_id=eos)
        expected = processor(torch.zeros((1, 4 + generated[b]), dtype=torch.long), torch.tensor(scores[b][None]))
        assert_rows_match(ours[b], expected.numpy()[0])


def test_presence_frequency_follow_openai_formula():
    scores, tokens, lengths = random_case(6)
    presence = np.array([0.0, 0.5, -0.3, 2.0, 0.0, 1.0], np.float32)
    frequency = np.array([0.0, 0.0, 0.4, -1.0, 1.5, 0.2], np.float32)
    # Counts are of output tokens: build them by appending each row's "output" to an empty prompt.
    @jax.jit
    def penalized(scores_BV, outputs_BS, lengths_B):
        history = History.create(jnp.zeros((B, 1), jnp.int32), jnp.ones(B, jnp.int32), V=V, capacity=None,
                                 seen=False, counts=True)
        for step in range(S):
            history = history.append(jnp.maximum(outputs_BS[:, step], 0), step < lengths_B)
        return lp.presence_frequency_penalty(scores_BV, jnp.asarray(presence), jnp.asarray(frequency),
                                             history.counts_BV)

    ours = np.asarray(penalized(jnp.asarray(scores), jnp.asarray(tokens), jnp.asarray(lengths)))
    for b in range(B):
        counts = np.bincount(tokens[b, :lengths[b]], minlength=V).astype(np.float64)
        expected = scores[b] - counts * frequency[b] - (counts > 0) * presence[b]  # OpenAI's formula
        np.testing.assert_allclose(ours[b], expected, atol=1e-6, rtol=0)
    np.testing.assert_array_equal(ours[0], scores[0])


def test_history_append_tracks_tokens_and_skips_inactive_rows():
    @jax.jit
    def appended():
        history = History.create(jnp.array([[5, 6, 0], [7, 0, 0]]), jnp.array([2, 1]), V=10, capacity=5, seen=True,
                                 counts=True)
        return history.append(jnp.array([8, 9]), jnp.array([True, False]))

    history = appended()
    np.testing.assert_array_equal(history.tokens_BS, [[5, 6, 8, PAD_ID, PAD_ID], [7, PAD_ID, PAD_ID, PAD_ID, PAD_ID]])
    np.testing.assert_array_equal(history.length_B, [3, 1])
    np.testing.assert_array_equal(np.flatnonzero(history.seen_BV[0]), [5, 6, 8])
    np.testing.assert_array_equal(np.flatnonzero(history.seen_BV[1]), [7])
    np.testing.assert_array_equal(np.flatnonzero(history.counts_BV[0]), [8])
    assert int(history.counts_BV[1].sum()) == 0
