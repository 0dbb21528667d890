"""Speculative decoding in the serving engine (n-gram proposals made between steps, or a draft model's
drawn inside the step; verified inside the step): greedy requests — processors, stops, logprobs included
— get exactly ``generate``'s tokens whatever runs beside them, with preemptions, chunked prompts and the
prefix cache, k = 1..8, on stories260K and a random model of every family; sampled requests keep the
model's distribution exactly (chi-square against its own probabilities, and against the engine's plain
sampling when penalties read the history); the counters; backing off. (No compilation after warm-up:
``test_guided_speculative``, with guided and unguided requests together.)"""

import dataclasses
import random

import numpy as np
import pytest
import scipy.stats

import llm_jax
from llm_jax.serving.engine import Engine

from distribution import FALSE_FAILURE_RATE, chi_square_p_value, exact_distribution, tiny_model
from family_switches import FAMILIES, random_model
from test_engine import alone, run_all

REPEATING = "Keep repeating: " + " ".join(["One, two, three, four, five."] * 4)
# Deterministic settings: their tokens must be generate's exactly. Penalties and bias read the history
# as it stands at each verified position; min_new_tokens bans the end ids there.
GREEDY_SETTINGS = [dict(), dict(sampling=llm_jax.Sampling(temperature=0.0, repetition_penalty=1.3)),
                   dict(sampling=llm_jax.Sampling(temperature=0.0, presence_penalty=0.8, frequency_penalty=0.4,
                                                  logit_bias={13: 3.0})),
                   dict(min_new_tokens=30, ignore_eos=False)]


def ngram(k: int, **kwargs) -> llm_jax.Speculative:
    return llm_jax.Speculative(method="ngram", num_tokens=k, **kwargs)


def tokens_of(outputs) -> list[int]:
    return [t for o in outputs for t in o.token_ids]


@pytest.mark.parametrize("k", [1, 3, 8])
def test_a_random_workload_gives_generates_tokens(stories, k):
    rng = random.Random(k)
    shared = stories.tokenizer.encode(REPEATING)[:40]
    arrivals, expected = {}, {}
    for i in range(10):
        if i % 3 == 0:
            prompt = REPEATING[:rng.randrange(40, len(REPEATING))]
        elif i % 3 == 1:  # a shared prefix (the prefix cache), then its own tail
            prompt = shared + [rng.randrange(3, 512) for _ in range(rng.randrange(1, 30))]
        else:
            prompt = [1] + [rng.randrange(3, 512) for _ in range(rng.randrange(0, 80))]
        kwargs = dict(max_new_tokens=rng.randrange(1, 70), ignore_eos=True) | GREEDY_SETTINGS[i % len(GREEDY_SETTINGS)]
        arrivals.setdefault(rng.randrange(0, 20), []).append((f"r{i}", prompt, kwargs))
        expected[f"r{i}"] = alone(stories, prompt, **kwargs)
    # A small pool (preemptions) and a small budget (chunked prompts, proposals cut to what it leaves).
    engine = Engine(stories, max_num_seqs=4, max_num_batched_tokens=24, block_size=8, num_blocks=30,
                    max_model_len=256, speculative=ngram(k))
    outputs = run_all(engine, arrivals)
    for rid, outs in outputs.items():
        assert tokens_of(outs) == expected[rid].output_ids, rid
        assert outs[-1].finish_reason == expected[rid].finish_reason, rid
    stats = engine.stats()
    assert stats.num_preemptions > 0 and stats.prefix_hit_tokens > 0
    assert 0 < stats.spec_accepted_tokens < stats.spec_proposed_tokens <= k * stats.spec_steps
    assert sum(stats.spec_accepted_per_position) == stats.spec_accepted_tokens
    assert stats.blocks_in_use == 0 and not engine.has_unfinished


def test_a_repeated_passage_is_accepted(stories):
    plain = alone(stories, REPEATING, max_new_tokens=128, ignore_eos=True)
    engine = Engine(stories, max_num_seqs=2, max_num_batched_tokens=64, max_model_len=256, speculative=ngram(6))
    outputs = run_all(engine, {0: [("a", REPEATING, dict(max_new_tokens=128, ignore_eos=True))]})
    assert tokens_of(outputs["a"]) == plain.output_ids
    stats = engine.stats()
    assert stats.acceptance_rate >= 0.85, stats
    assert stats.mean_accepted_length > 4 and len(outputs["a"]) < 128 / 2  # several tokens a step


def test_stops_text_and_logprobs_inside_accepted_runs(stories):
    """A stop id, a stop string and a budget, each falling where proposals are being accepted, and
    greedy log-probabilities: each request ends at plain decoding's token with its text, reason and
    log-probabilities."""
    output = alone(stories, REPEATING, max_new_tokens=128, ignore_eos=True).output_ids
    position = next(i for i in range(40, len(output)) if output[i] not in output[:i])
    text_before = stories.tokenizer.decode(output[:position])
    stop_string = stories.tokenizer.decode(output[:position + 1])[len(text_before) - 3:]
    cases = [dict(stop_token_ids=[output[position]]), dict(stop=[stop_string]),
             dict(max_new_tokens=position - 3), dict(logprobs=3, max_new_tokens=90)]
    engine = Engine(stories, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=256, speculative=ngram(6))
    outputs = run_all(engine, {0: [(f"c{i}", REPEATING, dict(max_new_tokens=128) | kw) for i, kw in enumerate(cases)]})
    for i, kw in enumerate(cases):
        ours, theirs = outputs[f"c{i}"], alone(stories, REPEATING, **(dict(max_new_tokens=128) | kw))
        assert len(theirs.output_ids) > 30
        assert tokens_of(ours) == theirs.output_ids, kw
        assert "".join(o.text for o in ours) == theirs.text, kw
        assert ours[-1].finish_reason == theirs.finish_reason, kw
        if "logprobs" in kw:
            np.testing.assert_allclose([p for o in ours for p in o.logprobs], theirs.logprobs, atol=1e-5)
            assert [d.keys() for o in ours for d in o.top_logprobs] == [d.keys() for d in theirs.top_logprobs]
    assert [outputs[f"c{i}"][-1].finish_reason for i in range(3)] == ["stop", "stop", "length"]
    assert engine.stats().spec_accepted_tokens > 150


@pytest.mark.parametrize("family", list(FAMILIES))
def test_every_family(family):
    model = random_model(family, seed=1)
    rng = np.random.default_rng(1)
    prompts = [(rng.integers(0, 96, n).tolist() * 3)[:m] for n, m in ((5, 13), (7, 19), (3, 9))]
    engine = Engine(model, max_num_seqs=2, max_num_batched_tokens=12, block_size=4, max_model_len=96,
                    speculative=ngram(4, prompt_lookup_min=1))
    kwargs = dict(max_new_tokens=40)
    outputs = run_all(engine, {0: [("a", prompts[0], kwargs), ("b", prompts[1], kwargs)], 3: [("c", prompts[2], kwargs)]})
    for rid, prompt in zip("abc", prompts):
        assert tokens_of(outputs[rid]) == alone(model, prompt, **kwargs).output_ids, rid
    assert engine.stats().spec_steps > 0


def test_backing_off_verifies_less_for_the_same_tokens(stories):
    """Proposals from single-token matches mostly fail on a story; backing off proposes less often and
    changes no token."""
    prompts = ["Once upon a time, there was a little girl", "Tom had a red ball. He", "The sun was hot and"]
    kwargs = dict(max_new_tokens=80, ignore_eos=True)
    runs = {}
    for max_backoff in (0, 16):
        engine = Engine(stories, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=256,
                        speculative=ngram(4, prompt_lookup_min=1, max_backoff=max_backoff))
        outputs = run_all(engine, {0: [(p, p, kwargs) for p in prompts]})
        for p in prompts:
            assert tokens_of(outputs[p]) == alone(stories, p, **kwargs).output_ids
        runs[max_backoff] = engine.stats()
    assert runs[0].acceptance_rate < 0.5  # mostly failing: worth backing off
    assert runs[16].spec_steps < 0.7 * runs[0].spec_steps


def test_no_proposals_beyond_max_batch(stories):
    """Two requests running side by side from start to end: with ``max_batch`` 1 nobody proposes."""
    kwargs = dict(max_new_tokens=40, ignore_eos=True)
    stats = {}
    for max_batch in (1, 2):
        engine = Engine(stories, max_num_seqs=2, max_num_batched_tokens=256, max_model_len=256,
                        speculative=ngram(4, max_batch=max_batch))
        outputs = run_all(engine, {0: [("a", REPEATING, kwargs), ("b", REPEATING[:-3], kwargs)]})
        for rid, prompt in (("a", REPEATING), ("b", REPEATING[:-3])):
            assert tokens_of(outputs[rid]) == alone(stories, prompt, **kwargs).output_ids
        stats[max_batch] = engine.stats()
    assert stats[1].spec_steps == 0 and stats[2].spec_accepted_tokens > 20


def test_sampling_is_reproducible_whatever_runs_beside(stories):
    sampling = llm_jax.Sampling(temperature=0.4, top_p=0.95, seed=4)
    kwargs = dict(max_new_tokens=60, ignore_eos=True, sampling=sampling)

    def run(others: int):
        engine = Engine(stories, max_num_seqs=4, max_num_batched_tokens=32, max_model_len=256, speculative=ngram(4))
        arrivals = {0: [("a", REPEATING, kwargs)]}
        arrivals.update({2 * i + 1: [(f"o{i}", REPEATING[:60 + i], kwargs)] for i in range(others)})
        outputs = run_all(engine, arrivals)
        return tokens_of(outputs["a"]), engine.stats()

    (alone_tokens, stats), (beside_tokens, _) = run(0), run(3)
    assert alone_tokens == beside_tokens and stats.spec_accepted_tokens > 0


# The sampled distribution.

SAMPLES = 12_000
PROMPT, LENGTH = [1, 2, 3, 1, 2, 3, 1, 2], 4


def sample_sequences(model, sampling: llm_jax.Sampling, speculative) -> tuple[np.ndarray, object]:
    """SAMPLES continuations of PROMPT, LENGTH tokens each, as indices of their cell [V ** LENGTH]."""
    engine = Engine(model, max_num_seqs=256, max_num_batched_tokens=2048, block_size=4, max_model_len=16,
                    speculative=speculative)
    for i in range(SAMPLES):
        engine.add_request(str(i), PROMPT, sampling=sampling, max_new_tokens=LENGTH, sample_index=i)
    tokens = {str(i): [] for i in range(SAMPLES)}
    while engine.has_unfinished:
        for out in engine.step():
            tokens[out.request_id].extend(out.token_ids)
    V = model.config.vocab_size
    sequences = np.array([tokens[str(i)] for i in range(SAMPLES)])
    return np.bincount(np.ravel_multi_index(sequences.T, [V] * LENGTH), minlength=V ** LENGTH), engine.stats()


def test_sampled_distribution_is_the_models():
    """With proposals verified at two positions and the bonus token (k = 2), every continuation comes
    with the model's own probability."""
    target = tiny_model(seed=0, scale=8.0)
    counts, stats = sample_sequences(target, llm_jax.Sampling(temperature=0.9, seed=11),
                                     ngram(2, prompt_lookup_min=1, max_backoff=0))
    assert stats.spec_accepted_tokens > 0.1 * SAMPLES and stats.spec_accepted_per_position[1] > 0.004 * SAMPLES
    assert chi_square_p_value(counts, exact_distribution(target, PROMPT, 0.9, LENGTH)) > FALSE_FAILURE_RATE
    # The test tells distributions apart at this sample size.
    assert chi_square_p_value(counts, exact_distribution(target, PROMPT, 1.1, LENGTH)) < FALSE_FAILURE_RATE


def test_sampled_distribution_with_penalties_is_plain_samplings():
    """Penalties read the history, proposals included, position by position: the continuations with
    speculation are distributed as the engine's plain sampling's (a chi-square test of homogeneity)."""
    target = tiny_model(seed=0, scale=8.0)
    sampling = llm_jax.Sampling(temperature=0.9, repetition_penalty=1.6, presence_penalty=0.7, seed=5)
    speculated, stats = sample_sequences(target, sampling, ngram(2, prompt_lookup_min=1, max_backoff=0))
    plain, _ = sample_sequences(target, dataclasses.replace(sampling, seed=6), None)
    assert stats.spec_accepted_tokens > 0.05 * SAMPLES
    assert homogeneity_p_value(speculated, plain) > FALSE_FAILURE_RATE
    unpenalized, _ = sample_sequences(target, llm_jax.Sampling(temperature=0.9, seed=7), None)
    assert homogeneity_p_value(speculated, unpenalized) < FALSE_FAILURE_RATE


def homogeneity_p_value(a: np.ndarray, b: np.ndarray) -> float:
    """Chi-square test that two samples' counts come from one distribution; cells seen fewer than 10
    times in both together are pooled."""
    small = a + b < 10
    table = np.array([np.append(a[~small], a[small].sum()), np.append(b[~small], b[small].sum())])
    table = table[:, table.sum(axis=0) > 0]
    return float(scipy.stats.chi2_contingency(table).pvalue)


# A draft model.

def test_a_draft_gives_generates_tokens(stories, near_draft):
    """The draft keeps its own pages under the model's block tables: through chunked prompts, the prefix
    cache and preemptions its proposals stay good, and every token is generate's."""
    rng = random.Random(5)
    shared = [1] + [rng.randrange(3, 512) for _ in range(30)]
    arrivals, expected = {}, {}
    for i in range(9):
        prompt = ["Once upon a time", shared + [rng.randrange(3, 512) for _ in range(rng.randrange(1, 20))],
                  [1] + [rng.randrange(3, 512) for _ in range(rng.randrange(0, 70))]][i % 3]
        kwargs = dict(max_new_tokens=rng.randrange(1, 70), ignore_eos=True) | GREEDY_SETTINGS[i % len(GREEDY_SETTINGS)]
        arrivals.setdefault(rng.randrange(0, 20), []).append((f"r{i}", prompt, kwargs))
        expected[f"r{i}"] = alone(stories, prompt, **kwargs)
    engine = Engine(stories, max_num_seqs=4, max_num_batched_tokens=24, block_size=8, num_blocks=18,
                    max_model_len=256, speculative=llm_jax.Speculative(method="draft", draft_model=near_draft,
                                                                       num_tokens=3))
    outputs = run_all(engine, arrivals)
    for rid, outs in outputs.items():
        assert tokens_of(outs) == expected[rid].output_ids, rid
    stats = engine.stats()
    assert stats.num_preemptions > 0 and stats.prefix_hit_tokens > 0
    assert stats.acceptance_rate > 0.6, stats  # the draft's cache holds what the model's does


def test_sampled_distribution_with_a_draft_is_the_models():
    target, draft = tiny_model(seed=0, scale=8.0), tiny_model(seed=5, scale=8.0)
    counts, stats = sample_sequences(target, llm_jax.Sampling(temperature=0.9, seed=13),
                                     llm_jax.Speculative(method="draft", draft_model=draft, num_tokens=2,
                                                         max_backoff=0))
    assert stats.spec_accepted_tokens > 0.1 * SAMPLES and stats.spec_accepted_per_position[1] > 0.01 * SAMPLES
    assert chi_square_p_value(counts, exact_distribution(target, PROMPT, 0.9, LENGTH)) > FALSE_FAILURE_RATE
    assert chi_square_p_value(counts, exact_distribution(draft, PROMPT, 0.9, LENGTH)) < FALSE_FAILURE_RATE


def test_a_draft_must_share_the_vocabulary(stories):
    other = tiny_model(seed=0, scale=1.0)
    with pytest.raises(ValueError, match=r"draft model's vocabulary \(6 tokens\) is not the model's \(512\)"):
        Engine(stories, speculative=llm_jax.Speculative(method="draft", draft_model=other))
