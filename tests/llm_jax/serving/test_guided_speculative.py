"""Speculative decoding of guided requests in the serving engine: each verified position under its own
mask. Greedy: with n-gram proposals (k = 1, 3) and with a draft's (k = 2, 4), a JSON schema, a regular expression,
choices and a grammar give the tokens of plain guided decoding (which ``test_guided`` checks against
``transformers`` under llguidance's masks), with proposals accepted; so does a constraint that starts
after a token. Sampled: outputs follow their constraints, and a constrained continuation's distribution
is the model's under the masks exactly (chi-square against probabilities from full forward passes). The
masks' layout; no step compiles after warm-up with guided and unguided requests arriving over time
(greedy and sampled, top and prompt log-probabilities, chunked prompts)."""

import collections
import random

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import llm_jax
from llm_jax.guided import Choice, Matcher, allowed_tokens, all_allowed, vocabulary
from llm_jax.model import forward
from llm_jax.serving.engine import Engine
from llm_jax.serving.step import draft_step, step

from distribution import FALSE_FAILURE_RATE, chi_square_p_value
from test_engine import run_all
from test_guided import CHOICES, CONSTRAINTS, follows, run
from test_speculative_engine import REPEATING

# Prompts whose n-grams the constrained output repeats: n-gram proposals the constraint allows.
PROMPTS = {"json": 'Tom is 3 and happy. {"name": "Tom", "age": 3, "happy": true}. Sue is 5 and sad.',
           "regex": "Once, she saw a big dog. One day, he went to the park.",
           "choice": None,  # the choices as the constraint spells them, the one chosen first (below)
           "grammar": "Tom saw the ball. Tom liked the cat. Tom found the big tree."}


def prompts(stories) -> dict[str, str | list[int]]:
    vocab = vocabulary(stories.tokenizer, tuple(stories.eos_ids), stories.config.vocab_size)
    spelled = [1] + [t for choice in (CHOICES[2], *CHOICES[:2]) for t in vocab.encode(choice)]
    return {kind: spelled if prompt is None else prompt for kind, prompt in PROMPTS.items()}


def speculative(method: str, k: int, draft, **kwargs) -> llm_jax.Speculative:
    if method == "ngram":
        return llm_jax.Speculative(method="ngram", num_tokens=k, prompt_lookup_min=1, **kwargs)
    return llm_jax.Speculative(method="draft", draft_model=draft, num_tokens=k, **kwargs)


def guided_requests(stories, **kwargs) -> dict[str, tuple]:
    return {kind: (prompt, dict(guided=CONSTRAINTS[kind], max_new_tokens=60) | kwargs)
            for kind, prompt in prompts(stories).items()}


@pytest.fixture(scope="module")
def plain(stories) -> dict[str, tuple[list[int], str, str]]:
    """Each constraint's greedy tokens, text and finish reason without speculation."""
    engine = Engine(stories, max_num_seqs=4, max_num_batched_tokens=64, block_size=8, max_model_len=256)
    return run(engine, guided_requests(stories))


@pytest.mark.parametrize("method,k", [("ngram", 1), ("ngram", 3), ("draft", 2), ("draft", 4)])
def test_greedy_guided_tokens_with_speculation_are_plain_decodings(stories, near_draft, plain, method, k):
    engine = Engine(stories, max_num_seqs=4, max_num_batched_tokens=64, block_size=8, max_model_len=256,
                    speculative=speculative(method, k, near_draft))
    outputs = run(engine, guided_requests(stories))
    for kind, (ids, text, reason) in outputs.items():
        assert (ids, text, reason) == plain[kind], kind
        assert reason == "stop" and follows(kind, text), (kind, text)
    stats = engine.stats()
    assert stats.spec_accepted_tokens > 0, stats


def test_a_constraint_ends_inside_an_accepted_run(stories, plain):
    """The choice spelled in the prompt: n-gram proposals run to the constraint's end, accepted, and
    the request ends at the token that completes it, not at the model's token after it."""
    engine = Engine(stories, max_num_seqs=2, max_num_batched_tokens=64, block_size=8, max_model_len=256,
                    speculative=speculative("ngram", 8, None, max_backoff=0))
    engine.add_request("choice", prompts(stories)["choice"], guided=CONSTRAINTS["choice"], max_new_tokens=60)
    outputs = []
    while engine.has_unfinished:
        outputs += engine.step()
    assert [t for o in outputs for t in o.token_ids] == plain["choice"][0]
    assert outputs[-1].finish_reason == "stop" and len(outputs[-1].token_ids) > 1
    assert engine.stats().spec_accepted_tokens > 0


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_a_constraint_after_a_token_with_speculation(stories, near_draft, method):
    """guided_after_token: free up to the token, masked after it, the same tokens with speculation as
    without (proposals accepted on both sides of the token)."""
    prompt = "Once, she saw a big dog. One day, she saw a big cat. One day,"
    free = llm_jax.generate(stories, [prompt], max_new_tokens=12)[0].output_ids
    marker = free[3]
    kwargs = dict(guided=CONSTRAINTS["regex"], guided_after_token=marker, max_new_tokens=80)
    expected = run(Engine(stories, max_num_seqs=2, max_num_batched_tokens=64, block_size=8, max_model_len=256),
                   {"r": (prompt, kwargs)})["r"]
    engine = Engine(stories, max_num_seqs=2, max_num_batched_tokens=64, block_size=8, max_model_len=256,
                    speculative=speculative(method, 3, near_draft, max_backoff=0))
    ids, text, reason = run(engine, {"r": (prompt, kwargs)})["r"]
    assert (ids, text, reason) == expected and reason == "stop"
    after = stories.tokenizer.decode(ids[ids.index(marker) + 1:])
    assert follows("regex", after.lstrip()) and ids[:ids.index(marker) + 1] == free[:free.index(marker) + 1]
    assert engine.stats().spec_accepted_tokens > 0


def test_masks_follow_the_proposals(stories):
    """Row j of a request's masks: what may follow its first j proposals, up to the first proposal the
    constraint forbids (rows after it, and rows before a constraint starts, all ones); the matcher ends
    where it started. N-gram proposals are cut before the first it forbids."""
    vocab = vocabulary(stories.tokenizer, tuple(stories.eos_ids), stories.config.vocab_size)
    V = stories.config.vocab_size
    cat, dog = vocab.encode("the cat"), vocab.encode("the dog")

    def masks(proposals, **kwargs) -> list[list[int] | None]:
        engine = Engine(stories, max_num_seqs=2, max_num_batched_tokens=16, block_size=8, max_model_len=64)
        engine.add_request("r", "Hi", guided=Choice(("the cat", "the dog")), **kwargs)
        rows_JW = all_allowed(len(proposals) + 1, V)
        engine._live["r"].fill_masks(rows_JW, proposals)
        return [None if (row == -1).all() else allowed_tokens(row, V).tolist() for row in rows_JW]

    def after(tokens) -> list[int]:
        matcher = Matcher(vocab, Choice(("the cat", "the dog")))
        row = np.zeros((vocab.words,), np.int32)
        assert matcher.consume(tokens)
        matcher.fill(row)
        return allowed_tokens(row, V).tolist()

    assert masks(cat) == [after(cat[:j]) for j in range(len(cat))] + [None]  # complete: nothing is read after
    assert masks(cat[:2] + dog[2:3] + [5, 6]) == [after(cat[:j]) for j in range(3)] + [after(dog[:3]), None, None]
    assert masks([7] + cat) == [after([]), None, None, None, None, None]
    marker = 9
    assert masks([5, marker] + cat[:2], guided_after_token=marker) == [None, None, after([]), after(cat[:1]),
                                                                       after(cat[:2])]
    assert masks([5, 6], guided_after_token=marker) == [None, None, None]
    engine = Engine(stories, max_num_seqs=2, max_num_batched_tokens=16, block_size=8, max_model_len=64)
    engine.add_request("r", "Hi", guided=Choice(("the cat", "the dog")), guided_after_token=marker)
    live = engine._live["r"]
    assert live.guided_prefix([5, 6]) == 2 and live.guided_prefix([5, marker, *cat[:2], 7]) == 4
    live.guided_after = None
    assert live.guided_prefix(cat[:2] + [7]) == 2 and live.guided_prefix(dog + [7]) == 4
    assert live.matcher.valid_prefix(cat) == len(cat)  # unmoved


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_sampled_outputs_follow_their_constraints(stories, near_draft, method):
    engine = Engine(stories, max_num_seqs=8, max_num_batched_tokens=64, block_size=8, max_model_len=256,
                    speculative=speculative(method, 3, near_draft, max_backoff=0))
    requests = {}
    for i, (kind, (prompt, kwargs)) in enumerate(guided_requests(stories, max_new_tokens=80).items()):
        for j in range(2):
            sampling = llm_jax.Sampling(temperature=1.0, seed=i, top_p=0.95, repetition_penalty=1.1 if j else 1.0)
            requests[f"{kind}.{j}"] = (prompt, kwargs | dict(sampling=sampling, sample_index=j))
    for rid, (ids, text, reason) in run(engine, requests).items():
        assert reason == "stop" and follows(rid.split(".")[0], text), (rid, text)
    assert engine.stats().spec_accepted_tokens > 0


# The sampled distribution: a choice whose token paths are few.

SAMPLES = 4000
SPACED = Choice((" a cat", " a dog", " the end"))
STORY = "Once upon a time, there was a cat. There was a dog. There was"


def token_paths(vocab, guided) -> list[tuple[int, ...]]:
    """Every token sequence ``guided`` allows (a tree walk under its masks)."""
    matcher, row, paths = Matcher(vocab, guided), np.zeros((vocab.words,), np.int32), []

    def walk(prefix: list[int]) -> None:
        if matcher.done:
            paths.append(tuple(prefix))
            return
        matcher.fill(row)
        for token in allowed_tokens(row, vocab.vocab_size).tolist():
            assert matcher.consume([token])
            walk(prefix + [token])
            matcher._matcher.rollback(1)

    walk([])
    return paths


_forward = jax.jit(forward, static_argnums=1)


def path_probabilities(model, vocab, guided, prompt: list[int], paths, temperature: float) -> np.ndarray:
    """Each path's probability: the model's full forward pass over it, softmax over what the masks allow."""
    probs = []
    for path in paths:
        tokens = jnp.asarray([prompt + list(path)], jnp.int32)
        logits = np.asarray(_forward(model.params, model.config, tokens))[0, len(prompt) - 1:-1].astype(np.float64)
        matcher, row, p = Matcher(vocab, guided), np.zeros((vocab.words,), np.int32), 1.0
        for j, token in enumerate(path):
            matcher.fill(row)
            allowed = allowed_tokens(row, vocab.vocab_size)
            scores = logits[j, allowed] / temperature
            q = np.exp(scores - scores.max())
            p *= q[allowed.tolist().index(token)] / q.sum()
            assert matcher.consume([token])
        probs.append(p)
    return np.array(probs)


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_sampled_distribution_under_masks_is_the_models(stories, near_draft, method):
    """k = 2, never backing off: proposals accepted at both positions (the second under the mask that
    follows the first), rejected ones redrawn from the masked distribution; every one of SAMPLES
    continuations is one of the choice's token paths, with its probability."""
    vocab = vocabulary(stories.tokenizer, tuple(stories.eos_ids), stories.config.vocab_size)
    prompt = [1] + stories.tokenizer.encode(STORY, add_bos=False)
    paths = token_paths(vocab, SPACED)
    engine = Engine(stories, max_num_seqs=256, max_num_batched_tokens=2048, block_size=8, max_model_len=64,
                    speculative=speculative(method, 2, near_draft, max_backoff=0))
    for i in range(SAMPLES):
        engine.add_request(str(i), prompt, guided=SPACED, sampling=llm_jax.Sampling(temperature=1.0, seed=5),
                           sample_index=i, max_new_tokens=8)
    outputs = collections.defaultdict(list)
    while engine.has_unfinished:
        for out in engine.step():
            outputs[out.request_id] += out.token_ids
    counts = collections.Counter(tuple(ids) for ids in outputs.values())
    assert set(counts) <= set(paths)
    observed = np.array([counts[path] for path in paths])
    stats = engine.stats()
    assert min(stats.spec_accepted_per_position[:2]) > 0.05 * SAMPLES, stats
    probs = path_probabilities(stories, vocab, SPACED, prompt, paths, 1.0)
    assert chi_square_p_value(observed, probs) > FALSE_FAILURE_RATE
    # The test tells distributions apart at this sample size.
    hotter = path_probabilities(stories, vocab, SPACED, prompt, paths, 1.3)
    assert chi_square_p_value(observed, hotter) < FALSE_FAILURE_RATE


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_no_step_compiles_with_guided_and_unguided_requests(stories, near_draft, method):
    engine = Engine(stories, max_num_seqs=2, max_num_batched_tokens=16, block_size=8, max_model_len=128,
                    speculative=speculative(method, 3, near_draft))
    assert engine.warm_up() == len(engine.shapes())
    programs = step._cache_size(), draft_step._cache_size()
    drafted = []
    if method == "draft":  # count the steps whose draft runs first
        draft_first = engine._draft_first
        engine._draft_first = lambda inputs: drafted.append(1) or draft_first(inputs)
    rng = random.Random(2)
    arrivals = {}
    for i, (kind, (prompt, kwargs)) in enumerate(guided_requests(stories).items()):
        kwargs = kwargs | dict(logprobs=2 if i == 0 else None)
        arrivals.setdefault(rng.randrange(0, 20), []).append((kind, prompt, kwargs))
    for i in range(8):  # unguided: prompts that repeat themselves (n-gram proposals) and random ones
        prompt = REPEATING[:rng.randrange(30, 120)] if i % 2 else [1] + [rng.randrange(3, 512) for _ in range(40)]
        kwargs = dict(sampling=[llm_jax.GREEDY, llm_jax.Sampling(temperature=0.7, seed=i)][i % 3 == 0],
                      max_new_tokens=rng.randrange(1, 40), ignore_eos=True, logprobs=2 if i % 4 == 1 else None,
                      prompt_logprobs=1 if i % 5 == 3 else None)
        arrivals.setdefault(rng.randrange(0, 20), []).append((f"r{i}", prompt, kwargs))
    outputs = run_all(engine, arrivals)
    for kind in PROMPTS:
        assert outputs[kind][-1].finish_reason == "stop" and follows(kind, "".join(o.text for o in outputs[kind]))
    assert (step._cache_size(), draft_step._cache_size()) == programs
    assert engine.stats().spec_accepted_tokens > 0 and (method == "ngram" or drafted)
