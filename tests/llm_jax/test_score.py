"""score: continuation log-likelihoods equal summed log-softmax of the full forward pass; gradients
through them are finite and match finite differences."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import llm_jax
from llm_jax import logprobs as logprobs_module
from llm_jax.config import ModelConfig
from llm_jax.model import LayerHooks, forward, forward_hidden, init_params
from llm_jax.scoring import continuation_logprobs

CONFIG = ModelConfig(vocab_size=53, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, d_ff=48,
                     max_seq_len=64, tie_embeddings=True)
PROMPTS = [[1, 7, 9], [1, 30], [1, 4, 4, 8, 15, 16], [1, 7, 9]]
CONTINUATIONS = [[11, 12, 13, 2], [50], [23, 42, 3], [None, None]]  # the last: the model's greedy choices
T = 16  # every pair fits one padded forward pass


@pytest.fixture(scope="module")
def model():
    params = jax.tree.map(lambda a: a * 5 if a.ndim > 1 else a, init_params(CONFIG, seed=2))
    return llm_jax.Model(config=CONFIG, params=params, tokenizer=None, eos_ids=())


def padded(sequences):
    tokens = np.zeros((len(sequences), T), np.int32)
    for b, s in enumerate(sequences):
        tokens[b, :len(s)] = s
    return jnp.asarray(tokens), jnp.asarray([len(s) for s in sequences])


@pytest.fixture(scope="module")
def pairs(model):
    """The pairs, with the greedy continuation filled in, and log-softmax of the forward pass over each."""
    full = jax.jit(forward, static_argnums=1)
    continuations = [list(c) for c in CONTINUATIONS]
    greedy = continuations[-1]
    for i in range(len(greedy)):  # the argmax after the prompt, then after prompt + that token
        tokens, lengths = padded([PROMPTS[-1] + greedy[:i]])
        greedy[i] = int(np.argmax(full(model.params, CONFIG, tokens, lengths)[0, len(PROMPTS[-1]) + i - 1]))
    tokens, lengths = padded([p + c for p, c in zip(PROMPTS, continuations)])
    logp = np.asarray(jax.nn.log_softmax(full(model.params, CONFIG, tokens, lengths), axis=-1))
    return continuations, logp


def test_score_equals_summed_forward_log_softmax(model, pairs):
    continuations, logp = pairs
    scores = llm_jax.score(model, PROMPTS, continuations)
    for b, (prompt, continuation, result) in enumerate(zip(PROMPTS, continuations, scores)):
        sequence = prompt + continuation
        positions = np.arange(len(prompt), len(sequence))
        expected = logp[b, positions - 1, np.array(sequence)[positions]]
        np.testing.assert_allclose(result.token_logprobs, expected, atol=1e-5, rtol=0)
        np.testing.assert_allclose(result.logprob, expected.sum(), atol=1e-4, rtol=0)
        assert result.continuation_ids == continuation
        assert result.is_greedy == all(logp[b, t - 1].argmax() == sequence[t] for t in positions)
    assert scores[-1].is_greedy and not scores[0].is_greedy


def test_chunked_logprobs_equal_unchunked(model, monkeypatch):
    tokens = jnp.asarray([PROMPTS[2] + CONTINUATIONS[2]])
    x_BTD = jax.jit(forward_hidden, static_argnums=1)(model.params, CONFIG, tokens)
    logprobs = functools.partial(logprobs_module.token_logprobs, top_n=3)
    whole = jax.jit(logprobs, static_argnums=1)(model.params, CONFIG, x_BTD, tokens)
    monkeypatch.setattr(logprobs_module, "CHUNK", 4)  # 9 positions: 3 chunks, the last padded
    chunked = jax.jit(logprobs, static_argnums=1)(model.params, CONFIG, x_BTD, tokens)
    for a, b in zip(jax.tree.leaves(whole), jax.tree.leaves(chunked)):
        np.testing.assert_allclose(a, b, atol=1e-6, rtol=0)


def unit(tree):
    norm = np.sqrt(sum(float(jnp.vdot(a, a)) for a in jax.tree.leaves(tree)))
    return jax.tree.map(lambda a: a / norm, tree)


def test_gradients_match_finite_differences(model):
    """d log-likelihood / d (params, steering vectors): finite, and equal to central differences along
    random unit directions of each."""
    sequences = [p + c for p, c in zip(PROMPTS[:3], CONTINUATIONS[:3])]
    tokens, lengths = padded(sequences)
    starts = jnp.asarray([len(p) for p in PROMPTS[:3]])

    @jax.jit
    def loglik(params, steering_BLD):
        hooks = LayerHooks(steering_BLD=steering_BLD)
        return continuation_logprobs(params, CONFIG, tokens, lengths, starts, hooks)[0].sum()

    steering = jnp.zeros((3, CONFIG.n_layers, CONFIG.d_model))
    grads = jax.jit(jax.grad(loglik, argnums=(0, 1)))(model.params, steering)
    assert all(np.isfinite(g).all() for g in jax.tree.leaves(grads))
    rng = np.random.default_rng(0)
    directions = unit(jax.tree.map(lambda a: jnp.asarray(rng.normal(size=a.shape), a.dtype), (model.params, steering)))
    eps = 1e-2
    for which in (0, 1):  # the params, then the steering vectors
        direction = tuple(d if i == which else jax.tree.map(jnp.zeros_like, d) for i, d in enumerate(directions))
        direction = unit(direction)
        analytic = sum(float(jnp.vdot(g, d)) for g, d in zip(jax.tree.leaves(grads), jax.tree.leaves(direction)))
        shifted = [jax.tree.map(lambda a, d: a + sign * eps * d, (model.params, steering), direction)
                   for sign in (1, -1)]
        numeric = (float(loglik(*shifted[0])) - float(loglik(*shifted[1]))) / (2 * eps)
        np.testing.assert_allclose(numeric, analytic, rtol=1e-2)
        assert abs(analytic) > 1e-2


def test_score_input_errors(model):
    with pytest.raises(ValueError, match="2 prompts but 1 continuations"):
        llm_jax.score(model, PROMPTS[:2], CONTINUATIONS[:1])
    with pytest.raises(ValueError, match="at least one token"):
        llm_jax.score(model, [[1]], [[]])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm_jax.score(model, [[1]], [[99]])
    with pytest.raises(ValueError, match="has no tokenizer"):
        llm_jax.score(model, ["text"], [[1]])
