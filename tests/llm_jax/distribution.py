"""Checks of sampled distributions shared by the speculative-decoding tests (``generate`` and the serving
engine): a tiny model, its exact distribution over continuations, a chi-square test against it; and a
near copy of a model, a draft that agrees with it often but not always."""

import dataclasses
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import scipy.stats

import llm_jax
from llm_jax.config import ModelConfig
from llm_jax.model import forward, init_params


def tiny_model(seed: int, scale: float) -> llm_jax.Model:
    config = ModelConfig(vocab_size=6, d_model=16, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=8, d_ff=24,
                         max_seq_len=64)
    params = jax.tree.map(lambda a: a * scale if a.ndim > 1 else a, init_params(config, seed=seed))
    return llm_jax.Model(config=config, params=params, tokenizer=None, eos_ids=())


_forward = jax.jit(forward, static_argnums=1, static_argnames="backend")


def exact_distribution(model: llm_jax.Model, prompt: list[int], temperature: float, length: int) -> np.ndarray:
    """The target's probability of every continuation of ``length`` tokens [V ** length], from its full
    forward pass over every prefix (no cache, no sampling code)."""
    V = model.config.vocab_size
    probs = np.ones([V] * length)
    for step in range(length):
        prefixes = np.array(list(itertools.product(range(V), repeat=step)), np.int32).reshape(V ** step, step)
        tokens = np.concatenate([np.tile(prompt, (len(prefixes), 1)), prefixes], axis=1).astype(np.int32)
        logits = np.asarray(_forward(model.params, model.config, jnp.asarray(tokens)))[:, -1]
        p = np.asarray(jax.nn.softmax(logits.astype(np.float64) / temperature, axis=-1))
        probs = probs * p.reshape([V] * (step + 1) + [1] * (length - step - 1))
    return probs.reshape(-1)


SAMPLES = 24_000
# Chi-square p-value below which the sampled distribution is declared wrong: with exact sampling and a
# random seed the test fails once in 10^6 runs; it is run with a fixed seed, so it is deterministic.
FALSE_FAILURE_RATE = 1e-6


def chi_square_p_value(counts: np.ndarray, probs: np.ndarray) -> float:
    # Cells with an expected count below 5 are pooled into one (the test's usual validity condition).
    expected = probs * counts.sum()
    small = expected < 5
    observed = np.append(counts[~small], counts[small].sum())
    expected = np.append(expected[~small], expected[small].sum())
    keep = expected > 0
    return float(scipy.stats.chisquare(observed[keep], expected[keep] * observed.sum() / expected[keep].sum()).pvalue)


def near_copy(model: llm_jax.Model, noise: float = 0.05) -> llm_jax.Model:
    """``model`` with every weight perturbed by ``noise`` of its standard deviation (seeded)."""
    rng = np.random.default_rng(0)
    params = jax.tree.map(lambda a: a + noise * np.std(a) * rng.normal(size=a.shape).astype(a.dtype), model.params)
    return dataclasses.replace(model, params=params)
