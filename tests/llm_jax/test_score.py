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
from llm_jax.score import continuation_logprobs

CONFIG = ModelConfig(vocab_size=53, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, d_ff=48,
                     max_seq_len=64, tie_embeddings=True)
PROMPTS = [[1, 7, 9], [1, 30], [1, 4, 4, 8, 15, 16]]
CONTINUATIONS = [[11, 12, 13, 2], [50], [23, 42, 3]]


@pytest.fixture(scope="module")
def model():
    params = jax.tree.map(lambda a: a * 5 if a.ndim > 1 else a, init_params(CONFIG, seed=2))
    return llm_jax.Model(config=CONFIG, params=params, tokenizer=None, eos_ids=())


def reference_logprobs(params, prompt, continuation):
    tokens = prompt + continuation
    logits = jax.jit(forward, static_argnums=1)(params, CONFIG, jnp.asarray([tokens]))[0]
    logp = np.asarray(jax.nn.log_softmax(logits, axis=-1))
    return [float(logp[t - 1, tokens[t]]) for t in range(len(prompt), len(tokens))], logp


def test_score_equals_summed_forward_log_softmax(model):
    scores = llm_jax.score(model, PROMPTS, CONTINUATIONS)
    for prompt, continuation, result in zip(PROMPTS, CONTINUATIONS, scores):
        expected, _ = reference_logprobs(model.params, prompt, continuation)
        np.testing.assert_allclose(result.token_logprobs, expected, atol=1e-5, rtol=0)
        np.testing.assert_allclose(result.logprob, sum(expected), atol=1e-4, rtol=0)
        assert result.continuation_ids == continuation


def test_is_greedy(model):
    prompt = PROMPTS[0]
    greedy = llm_jax.generate(model, [prompt], max_new_tokens=4)[0].output_ids
    other = greedy[:3] + [(greedy[3] + 1) % CONFIG.vocab_size]
    on_path, off_path = llm_jax.score(model, [prompt, prompt], [greedy, other])
    assert on_path.is_greedy and not off_path.is_greedy
    assert on_path.logprob > off_path.logprob


def test_chunked_logprobs_equal_unchunked(model, monkeypatch):
    tokens = jnp.asarray([PROMPTS[2] + CONTINUATIONS[2]])
    x_BTD = forward_hidden(model.params, CONFIG, tokens)
    whole = logprobs_module.token_logprobs(model.params, CONFIG, x_BTD, tokens, top_n=3)
    monkeypatch.setattr(logprobs_module, "CHUNK", 4)  # 9 positions: 3 chunks, the last padded
    chunked = jax.jit(functools.partial(logprobs_module.token_logprobs, top_n=3), static_argnums=1)(
        model.params, CONFIG, x_BTD, tokens)
    for a, b in zip(jax.tree.leaves(whole), jax.tree.leaves(chunked)):
        np.testing.assert_allclose(a, b, atol=1e-6, rtol=0)


def batch():
    sequences = [p + c for p, c in zip(PROMPTS, CONTINUATIONS)]
    T = max(map(len, sequences))
    tokens = np.zeros((len(sequences), T), np.int32)
    for b, s in enumerate(sequences):
        tokens[b, :len(s)] = s
    return (jnp.asarray(tokens), jnp.asarray([len(s) for s in sequences]),
            jnp.asarray([len(p) for p in PROMPTS]))


def unit(tree):
    norm = np.sqrt(sum(float(jnp.vdot(a, a)) for a in jax.tree.leaves(tree)))
    return jax.tree.map(lambda a: a / norm, tree)


def central_difference(f, x, direction, eps):
    plus = jax.tree.map(lambda a, d: a + eps * d, x, direction)
    minus = jax.tree.map(lambda a, d: a - eps * d, x, direction)
    return (float(f(plus)) - float(f(minus))) / (2 * eps)


def test_gradient_wrt_params_matches_finite_differences(model):
    tokens, lengths, starts = batch()

    def loglik(params):
        return continuation_logprobs(params, CONFIG, tokens, lengths, starts)[0].sum()

    def loglik_of_logits(params):  # the same quantity from the full [B, T, V] logits
        logp_BTV = jax.nn.log_softmax(forward(params, CONFIG, tokens, lengths), axis=-1)
        picked_BT = jnp.take_along_axis(logp_BTV[:, :-1], tokens[:, 1:, None], axis=-1)[..., 0]
        t_T = jnp.arange(1, tokens.shape[1])
        return jnp.where((t_T >= starts[:, None]) & (t_T < lengths[:, None]), picked_BT, 0.0).sum()

    grads = jax.jit(jax.grad(loglik))(model.params)
    assert all(np.isfinite(g).all() for g in jax.tree.leaves(grads))
    for g, expected in zip(jax.tree.leaves(grads), jax.tree.leaves(jax.jit(jax.grad(loglik_of_logits))(model.params))):
        np.testing.assert_allclose(g, expected, atol=1e-4 * float(jnp.abs(expected).max()), rtol=0)
    rng = np.random.default_rng(0)
    direction = unit(jax.tree.map(lambda a: jnp.asarray(rng.normal(size=a.shape), a.dtype), model.params))
    analytic = sum(float(jnp.vdot(g, d)) for g, d in zip(jax.tree.leaves(grads), jax.tree.leaves(direction)))
    numeric = central_difference(jax.jit(loglik), model.params, direction, eps=1e-2)
    np.testing.assert_allclose(numeric, analytic, rtol=1e-2)
    assert abs(analytic) > 1e-2


def test_gradient_wrt_steering_matches_finite_differences(model):
    tokens, lengths, starts = batch()

    def loglik(steering_BLD):
        hooks = LayerHooks(steering_BLD=steering_BLD)
        return continuation_logprobs(model.params, CONFIG, tokens, lengths, starts, hooks)[0].sum()

    steering = jnp.zeros((3, CONFIG.n_layers, CONFIG.d_model))
    grad = jax.grad(loglik)(steering)
    assert np.isfinite(grad).all() and np.abs(grad).max() > 0
    direction = unit(jnp.asarray(np.random.default_rng(1).normal(size=steering.shape), jnp.float32))
    numeric = central_difference(jax.jit(loglik), steering, direction, eps=1e-2)
    np.testing.assert_allclose(numeric, float(jnp.vdot(grad, direction)), rtol=1e-2)


def test_score_input_errors(model):
    with pytest.raises(ValueError, match="2 prompts but 1 continuations"):
        llm_jax.score(model, PROMPTS[:2], CONTINUATIONS[:1])
    with pytest.raises(ValueError, match="at least one token"):
        llm_jax.score(model, [[1]], [[]])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm_jax.score(model, [[1]], [[99]])
    with pytest.raises(ValueError, match="has no tokenizer"):
        llm_jax.score(model, ["text"], [[1]])
