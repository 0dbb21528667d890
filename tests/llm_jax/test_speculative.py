"""Speculative decoding (``llm_jax.Speculative``): greedy ids identical to plain greedy decoding (and to
transformers on stories260K) with either proposer, batch 1 and batched, k = 1..8, on stories260K and a
random model of every family; the sampled distribution exactly the target's (chi-square against the
model's own probabilities); log-probabilities, hidden states, steering and the final cache as plain
decoding gives them; n-gram acceptance on a
repeating prompt; stop ids, stop strings and budgets
ending inside an accepted run at exactly plain decoding's token; the proposers and the acceptance rule
on their own; bad settings refused by name."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

import llm_jax
from llm_jax.sampling import Sampling, SamplingParams
from llm_jax.speculative import PROBE_STEPS, ngram_proposals, propose_ngram, verify
from distribution import (FALSE_FAILURE_RATE, SAMPLES, chi_square_p_value, exact_distribution, tiny_model)
from family_switches import FAMILIES, random_model

PROMPTS = ["Once upon a time", "Tom and Sue went to the park. They", "One day, a big bird", "The little dog wanted to"]
REPEATING = "Keep repeating: " + " ".join(["One, two, three, four, five."] * 4)


@pytest.fixture(scope="module")
def plain(stories):
    """Plain greedy decoding of PROMPTS, 128 tokens each (batched: alone gives the same, test_generate)."""
    return [r.output_ids for r in llm_jax.generate(stories, PROMPTS, max_new_tokens=128, ignore_eos=True)]


def ids(model, prompts, **kwargs) -> list[list[int]]:
    return [r.output_ids for r in llm_jax.generate(model, prompts, ignore_eos=True, **kwargs)]


def test_plain_greedy_is_transformers_greedy(stories260k_dir, plain):
    """The reference the speculative runs are held to, itself held to transformers."""
    reference = transformers.LlamaForCausalLM.from_pretrained(stories260k_dir / "hf").eval()
    tokenizer = llm_jax.load(stories260k_dir / "stories260K.bin").tokenizer
    for prompt, output in zip(PROMPTS[:2], plain[:2]):
        prompt_ids = tokenizer.encode(prompt)
        with torch.no_grad():
            out = reference.generate(torch.tensor([prompt_ids]), max_new_tokens=128, min_new_tokens=128,
                                     do_sample=False, eos_token_id=None, pad_token_id=0)
        assert out[0, len(prompt_ids):].tolist() == output


@pytest.mark.parametrize("k", range(1, 9))
def test_ngram_greedy_equals_plain_batched(stories, plain, k):
    # max_backoff=0: every step with a match verifies, whatever the acceptance.
    speculative = llm_jax.Speculative(num_tokens=k, prompt_lookup_min=1, max_backoff=0)
    assert ids(stories, PROMPTS, max_new_tokens=128, speculative=speculative) == plain


@pytest.mark.parametrize("k", [1, 3, 8])
def test_draft_greedy_equals_plain_batched(stories, near_draft, plain, k):
    speculative = llm_jax.Speculative(method="draft", draft_model=near_draft, num_tokens=k, max_backoff=0)
    results = llm_jax.generate(stories, PROMPTS, max_new_tokens=128, ignore_eos=True, speculative=speculative)
    assert [r.output_ids for r in results] == plain
    metrics = results[0].metrics
    assert 0.3 < metrics.acceptance_rate < 1  # partly accepted: both the accept and the reject paths ran
    assert metrics.proposed_tokens == k * metrics.speculative_steps


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_batch_1_equals_plain(stories, near_draft, plain, method):
    draft = near_draft if method == "draft" else None
    speculative = llm_jax.Speculative(method=method, draft_model=draft, num_tokens=5)
    for prompt, expected in zip(PROMPTS[:2], plain[:2]):
        assert ids(stories, [prompt], max_new_tokens=128, speculative=speculative) == [expected]


def test_ngram_accepts_a_repeated_passage(stories):
    expected = ids(stories, [REPEATING], max_new_tokens=128)
    result = llm_jax.generate(stories, [REPEATING], max_new_tokens=128, ignore_eos=True,
                              speculative=llm_jax.Speculative(num_tokens=4))[0]
    assert result.output_ids == expected[0]
    assert result.metrics.acceptance_rate >= 0.85
    assert result.metrics.mean_accepted_length > 3


def test_a_draft_equal_to_the_target_is_always_accepted(stories, plain):
    result = llm_jax.generate(stories, PROMPTS[:1], max_new_tokens=128, ignore_eos=True,
                              speculative=llm_jax.Speculative(method="draft", draft_model=stories, num_tokens=5))[0]
    assert result.output_ids == plain[0]
    assert result.metrics.acceptance_rate > 0.95


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_backing_off_and_resuming_keeps_plain_output(stories, plain, method):
    """Chunks that accept too little are followed by plain chunks (decode's own program), after which
    the sequences and the draft's cache catch up and speculation resumes."""
    rng = np.random.default_rng(1)
    far = dataclasses.replace(stories, params=jax.tree.map(
        lambda a: a + 0.3 * np.std(a) * rng.normal(size=a.shape).astype(a.dtype), stories.params))
    speculative = llm_jax.Speculative(method=method, draft_model=far if method == "draft" else None, num_tokens=3,
                                      min_accepted=2.5, max_backoff=2)
    results = llm_jax.generate(stories, PROMPTS, max_new_tokens=128, ignore_eos=True, chunk_steps=4,
                               speculative=speculative)
    assert [r.output_ids for r in results] == plain
    metrics = results[0].metrics
    all_steps = 4 * 127  # every row runs the whole budget
    assert 0 < metrics.speculative_steps < all_steps - metrics.accepted_tokens
    assert metrics.accepted_tokens > 0


def test_a_failing_chunk_ends_after_its_probe_steps(stories, plain):
    """A speculative chunk that accepts too little stops after PROBE_STEPS steps, not at its end: with
    every chunk failing (min_accepted = k: only all-accepted steps pass) and one plain chunk of 16 after
    each, a cycle emits at least 16 + PROBE_STEPS tokens per row, so at most 7 cycles of 128 tokens and at
    most 7 · PROBE_STEPS verification steps per row (running whole chunks: 16 per cycle, 256 in all). The
    draft proposes at every step, so each step counts (prompt lookup verifies only where it matched)."""
    rng = np.random.default_rng(1)
    far = dataclasses.replace(stories, params=jax.tree.map(
        lambda a: a + 0.3 * np.std(a) * rng.normal(size=a.shape).astype(a.dtype), stories.params))
    speculative = llm_jax.Speculative(method="draft", draft_model=far, num_tokens=3, min_accepted=3, max_backoff=1)
    results = llm_jax.generate(stories, PROMPTS, max_new_tokens=128, ignore_eos=True, chunk_steps=16,
                               speculative=speculative)
    assert [r.output_ids for r in results] == plain
    metrics = results[0].metrics
    assert 0 < metrics.speculative_steps <= len(PROMPTS) * 7 * PROBE_STEPS, metrics


# Every family's switches, on random models (as the serving tests build them).
@pytest.mark.parametrize("family", list(FAMILIES))
def test_every_family_greedy_equals_plain(family):
    """The target's family decides the extend pass that verifies (windows, soft-caps, norms); the
    proposer is the same code for all, so the draft runs on the family with the most switches."""
    model = random_model(family, seed=1)
    rng = np.random.default_rng(2)
    prompts = [rng.integers(0, 96, n).tolist() for n in (3, 17, 9)]
    expected = ids(model, prompts, max_new_tokens=128)
    ngram = llm_jax.Speculative(num_tokens=3, prompt_lookup_min=1, max_backoff=0)
    assert ids(model, prompts, max_new_tokens=128, speculative=ngram) == expected
    if family == "gemma2":  # a draft of another family (llama) sharing the vocabulary
        draft = llm_jax.Speculative(method="draft", draft_model=random_model("llama", seed=3), num_tokens=4,
                                    max_backoff=0)
        assert ids(model, prompts, max_new_tokens=128, speculative=draft) == expected


def test_processors_and_budgets_as_plain(stories):
    """Processors that read the history see each accepted token before the next position; rows of
    different budgets end where plain decoding ends them."""
    sampling = Sampling(repetition_penalty=1.3, logit_bias={13: 2.0}, suppress_tokens=(29,))
    budgets = [7, 128, 33, 1]
    kwargs = dict(max_new_tokens=budgets, sampling=sampling, min_new_tokens=5)
    speculative = llm_jax.Speculative(num_tokens=6, prompt_lookup_min=1, max_backoff=0)
    assert ids(stories, PROMPTS, speculative=speculative, **kwargs) == ids(stories, PROMPTS, **kwargs)


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_research_outputs_are_plain_decodings(stories, near_draft, method):
    """Steering vectors, recorded hidden states and the final KV cache: with speculation, the same tokens,
    the same hidden states at every position the model processed (≤ 1e-4: verification runs k + 1
    positions in one extend call), and a cache of the same lengths holding the same keys and values
    below them (rejected proposals' slots lie past the lengths)."""
    speculative = (llm_jax.Speculative(num_tokens=4, prompt_lookup_min=1, max_backoff=0) if method == "ngram" else
                   llm_jax.Speculative(method="draft", draft_model=near_draft, num_tokens=3, max_backoff=0))
    config = stories.config
    prompts = [REPEATING, PROMPTS[1]]
    steering = np.random.default_rng(3).normal(0, 0.05, (2, config.n_layers, config.d_model)).astype(np.float32)
    steering[1] = 0.0
    layers = (0, config.n_layers - 1)
    kwargs = dict(max_new_tokens=[40, 23], ignore_eos=True, hidden_layers=layers, steering=steering,
                  return_kv_cache=True, chunk_steps=8)
    runs = []
    for spec in (None, speculative):
        stream = llm_jax.generate_stream(stories, prompts, speculative=spec, **kwargs)
        list(stream)
        runs.append(stream)
    plain, spec = runs
    assert spec.metrics.accepted_tokens > 0
    lengths = np.asarray(spec.kv_cache.lengths_B)
    np.testing.assert_array_equal(lengths, np.asarray(plain.kv_cache.lengths_B))
    for row, (a, b) in enumerate(zip(plain.results, spec.results)):
        assert b.output_ids == a.output_ids
        assert b.hidden_states.shape == a.hidden_states.shape == (len(a.prompt_ids) + len(a.output_ids) - 1,
                                                                  len(layers), config.d_model)
        np.testing.assert_allclose(b.hidden_states, a.hidden_states, atol=1e-4, rtol=0)
        assert lengths[row] == len(a.prompt_ids) + len(a.output_ids) - 1
        for cache_a, cache_b in ((plain.kv_cache.k_LBSKH, spec.kv_cache.k_LBSKH),
                                 (plain.kv_cache.v_LBSKH, spec.kv_cache.v_LBSKH)):
            np.testing.assert_allclose(np.asarray(cache_b)[:, row, :lengths[row]],
                                       np.asarray(cache_a)[:, row, :lengths[row]], atol=1e-4, rtol=0)


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_logprobs_are_plain_decodings(stories, near_draft, method):
    """Greedy rows: the same tokens and the same log-probabilities (and top 3) as plain decoding, ≤ 1e-4
    (verification scores k + 1 positions in one extend call, plain decoding one by one; stories260K's
    logits reach 13, where float32 sums in another order differ by ~1e-5). Sampled rows at temperature 1:
    each token's log-probability is the model's own at its position, as scoring the finished sequence
    (``prompt_logprobs``) gives it."""
    speculative = (llm_jax.Speculative(num_tokens=4, prompt_lookup_min=1, max_backoff=0) if method == "ngram" else
                   llm_jax.Speculative(method="draft", draft_model=near_draft, num_tokens=3, max_backoff=0))
    prompts = [REPEATING, *PROMPTS[:2]]
    kwargs = dict(max_new_tokens=40, logprobs=3)
    plain = llm_jax.generate(stories, prompts, ignore_eos=True, **kwargs)
    spec = llm_jax.generate(stories, prompts, ignore_eos=True, speculative=speculative, **kwargs)
    assert spec[0].metrics.accepted_tokens > 0
    for a, b in zip(plain, spec):
        assert b.output_ids == a.output_ids
        np.testing.assert_allclose(b.logprobs, a.logprobs, atol=1e-4)
        assert [list(t) for t in b.top_logprobs] == [list(t) for t in a.top_logprobs]  # the same ids, in order
        np.testing.assert_allclose([list(t.values()) for t in b.top_logprobs],
                                   [list(t.values()) for t in a.top_logprobs], atol=1e-4)
    sampling = [Sampling(temperature=1.0, seed=s) for s in range(3)]
    sampled = llm_jax.generate(stories, prompts, ignore_eos=True, speculative=speculative, sampling=sampling,
                               max_new_tokens=40, logprobs=0)
    assert sampled[0].metrics.accepted_tokens > 0
    for r in sampled:
        scored = llm_jax.generate(stories, [r.prompt_ids + r.output_ids], max_new_tokens=1, prompt_logprobs=0)[0]
        np.testing.assert_allclose(r.logprobs, scored.prompt_logprobs[len(r.prompt_ids):], atol=1e-4)
        assert r.top_logprobs is None


def test_stop_ids_and_strings_inside_an_accepted_run(stories):
    """Three rows of one batch: a stop id, a stop string, a budget, each falling where proposals are
    being accepted; each row ends at plain decoding's token, with its text and reason."""
    plain_result = llm_jax.generate(stories, [REPEATING], max_new_tokens=128, ignore_eos=True)[0]
    output = plain_result.output_ids
    # A token that first appears well into the output (a loop the n-gram proposer has been predicting).
    position = next(i for i in range(40, len(output)) if output[i] not in output[:i])
    tokenizer = stories.tokenizer
    text_before = tokenizer.decode(output[:position])
    stop_string = tokenizer.decode(output[:position + 1])[len(text_before) - 3:]
    assert stop_string not in text_before and len(stop_string) >= 4
    kwargs = dict(stop_token_ids=[[output[position]], [], []], stop=[[], [stop_string], []],
                  max_new_tokens=[128, 128, position - 3])
    expected = llm_jax.generate(stories, [REPEATING] * 3, **kwargs)
    results = llm_jax.generate(stories, [REPEATING] * 3, speculative=llm_jax.Speculative(num_tokens=6), **kwargs)
    assert results[0].metrics.accepted_tokens > 60
    for row, (result, reference) in enumerate(zip(results, expected)):
        assert len(result.output_ids) > 30, row
        assert (result.output_ids, result.text, result.finish_reason) == (
            reference.output_ids, reference.text, reference.finish_reason), row
    assert [r.finish_reason for r in results] == ["stop", "stop", "length"]


# The sampled distribution.

@pytest.mark.parametrize("proposer", ["ngram", "draft_far", "draft_close"])
def test_sampled_distribution_is_the_targets(proposer):
    target = tiny_model(seed=0, scale=8.0)
    drafts = {"ngram": None, "draft_far": tiny_model(seed=5, scale=8.0),
              "draft_close": dataclasses.replace(target, params=jax.tree.map(lambda a: a * 0.9, target.params))}
    prompt, length, temperature = [1, 2, 3, 1, 2, 3, 1, 2], 3, 0.9
    method = "ngram" if proposer == "ngram" else "draft"
    speculative = llm_jax.Speculative(method=method, draft_model=drafts[proposer], num_tokens=2, prompt_lookup_min=1,
                                      max_backoff=0)
    results = llm_jax.generate(target, [prompt], n=SAMPLES, max_new_tokens=length, ignore_eos=True,
                               sampling=Sampling(temperature=temperature, seed=11), speculative=speculative)
    assert results[0].metrics.accepted_tokens > 0.1 * SAMPLES
    V = target.config.vocab_size
    sequences = np.array([r.output_ids for r in results])
    counts = np.bincount(np.ravel_multi_index(sequences.T, [V] * length), minlength=V ** length)
    probs = exact_distribution(target, prompt, temperature, length)
    assert chi_square_p_value(counts, probs) > FALSE_FAILURE_RATE
    # The test can tell distributions apart at this sample size: the counts are not the target's at
    # another temperature, nor (for a draft) the draft's.
    assert chi_square_p_value(counts, exact_distribution(target, prompt, 1.1, length)) < FALSE_FAILURE_RATE
    if drafts[proposer] is not None:
        draft_probs = exact_distribution(drafts[proposer], prompt, temperature, length)
        assert chi_square_p_value(counts, draft_probs) < FALSE_FAILURE_RATE


# The pieces on their own.

def test_ngram_proposals():
    seq = np.array([[5, 6, 7, 8, 5, 6, 0, 0, 0, 0], [1, 2, 3, 4, 9, 9, 9, 0, 0, 0], [4, 4, 4, 4, 4, 4, 4, 4, 4, 4]])
    lengths = np.array([6, 4, 3])
    proposals, found = propose_ngram(jnp.asarray(seq), jnp.asarray(lengths), k=3, lookup_min=1, lookup_max=3)
    # Row 0: "5 6" matched at 0 → 7 8 5. Row 1: nothing repeats. Row 2: "4 4" matched at 0 (the most recent
    # earlier window is at 0), its continuation "4" repeats.
    np.testing.assert_array_equal(np.asarray(found)[:, 0], [True, False, True])
    np.testing.assert_array_equal(np.asarray(proposals)[[0, 2]], [[7, 8, 5], [4, 4, 4]])


def test_host_proposals_are_the_devices():
    """The serving engine's prompt lookup (numpy, between steps) proposes what generate's does on device."""
    rng = np.random.default_rng(3)
    for _ in range(300):
        length, vocab = int(rng.integers(1, 40)), int(rng.integers(2, 6))
        k, low = int(rng.integers(1, 9)), int(rng.integers(1, 4))
        high = low + int(rng.integers(0, 3))
        sequence = rng.integers(0, vocab, length).astype(np.int32)
        host = ngram_proposals(sequence, k=k, lookup_min=low, lookup_max=high)
        padded = np.zeros((1, 48), np.int32)
        padded[0, :length] = sequence
        proposals, found = propose_ngram(jnp.asarray(padded), jnp.asarray([length]), k=k, lookup_min=low,
                                         lookup_max=high)
        expected = np.asarray(proposals[0]) if bool(found[0, 0]) else np.zeros((0,), np.int32)
        np.testing.assert_array_equal(host, expected, err_msg=f"{sequence} {k=} {low=} {high=}")


def test_verify_greedy_counts_the_agreeing_prefix():
    V = 5
    argmax_BT = np.array([[1, 2, 3, 4], [1, 0, 3, 4], [0, 2, 3, 4]])
    scores = jax.nn.one_hot(argmax_BT, V) * 3.0
    proposals = jnp.array([[1, 2, 3], [1, 2, 3], [1, 2, 3]])
    params = SamplingParams.stack([Sampling()] * 3)
    count, next_token, emitted = verify(scores, proposals, params, jnp.zeros(3, jnp.int32))
    np.testing.assert_array_equal(count, [3, 1, 0])
    np.testing.assert_array_equal(next_token, [4, 0, 0])
    np.testing.assert_array_equal(emitted, [[1, 2, 3, 4], [1, 0, -1, -1], [0, -1, -1, -1]])


def test_verify_sampling_first_token_is_p():
    """The acceptance rule alone: the first emitted token has the target's distribution for any q."""
    B, V = 20_000, 4
    p = np.array([0.1, 0.2, 0.3, 0.4])
    q = np.array([0.7, 0.1, 0.1, 0.1])
    scores = jnp.broadcast_to(jnp.log(jnp.asarray(p, jnp.float32)), (B, 2, V))
    proposals = jax.random.categorical(jax.random.key(0), jnp.log(jnp.asarray(q)), shape=(B, 1)).astype(jnp.int32)
    params = SamplingParams.stack([Sampling(temperature=1.0, seed=s) for s in range(B)])
    _, _, emitted = jax.jit(verify)(scores, proposals, params, jnp.zeros(B, jnp.int32),
                                    q_BKV=jnp.broadcast_to(jnp.asarray(q, jnp.float32), (B, 1, V)))
    counts = np.bincount(np.asarray(emitted[:, 0]), minlength=V)
    assert chi_square_p_value(counts, p) > FALSE_FAILURE_RATE


def test_bad_settings_are_refused_by_name(stories):
    with pytest.raises(ValueError, match="unknown speculative method 'medusa'"):
        llm_jax.Speculative(method="medusa")
    with pytest.raises(ValueError, match="needs a draft_model"):
        llm_jax.Speculative(method="draft")
    with pytest.raises(ValueError, match="num_tokens"):
        llm_jax.Speculative(num_tokens=0)
    with pytest.raises(ValueError, match="min_accepted"):
        llm_jax.Speculative(num_tokens=2, min_accepted=3)
    with pytest.raises(ValueError, match="prompt_lookup_min"):
        llm_jax.Speculative(prompt_lookup_min=3, prompt_lookup_max=2)
    with pytest.raises(ValueError, match="max_batch must be >= 1 or None, got 0"):
        llm_jax.Speculative(max_batch=0)
    with pytest.raises(ValueError, match="does not support beam search"):
        llm_jax.generate(stories, PROMPTS[:1], num_beams=2, speculative=llm_jax.Speculative())
    other = random_model("llama", seed=0)
    with pytest.raises(ValueError, match="vocabulary of 96 tokens, the target 512"):
        llm_jax.generate(stories, PROMPTS[:1], speculative=llm_jax.Speculative(method="draft", draft_model=other))


def test_the_shipped_draft_speeds_the_shipped_model_exactly():
    """checkpoints/stories-1m-draft: stories-1m's tokenizer, and greedy output identical with it as the draft."""
    import pathlib

    root = pathlib.Path(__file__).resolve().parents[2] / "checkpoints"
    target, draft = llm_jax.load(root / "stories-1m"), llm_jax.load(root / "stories-1m-draft")
    assert (root / "stories-1m" / "tokenizer.model").read_bytes() == (root / "stories-1m-draft" /
                                                                      "tokenizer.model").read_bytes()
    prompts = ["Once upon a time", "There once was a little dog named Spot."]
    speculative = llm_jax.Speculative(method="draft", draft_model=draft, num_tokens=4)
    results = llm_jax.generate(target, prompts, max_new_tokens=96, speculative=speculative)
    assert [r.output_ids for r in results] == [r.output_ids for r in llm_jax.generate(target, prompts,
                                                                                       max_new_tokens=96)]
    assert results[0].metrics.acceptance_rate > 0.5
