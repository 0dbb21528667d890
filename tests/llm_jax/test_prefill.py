"""Prefill: last-token logits, cache contents, and one compilation per prompt bucket."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import llm_jax
from llm_jax import buckets
from llm_jax.config import ModelConfig
from llm_jax.kv_cache import init_cache
from llm_jax.model import forward, init_params
from llm_jax.prefilling import pad_prompts, prefill

CONFIG = ModelConfig(vocab_size=61, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, d_ff=48,
                     max_seq_len=128)


@pytest.fixture(scope="module")
def params():
    return init_params(CONFIG, seed=0)


def test_last_logits_and_cache_match_forward(params):
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 61, n).tolist() for n in (7, 12, 1)]
    tokens, lengths = pad_prompts(prompts, 16)
    logits, cache = prefill(params, CONFIG, tokens, lengths, init_cache(CONFIG, 3, 32))
    np.testing.assert_array_equal(cache.lengths_B, [7, 12, 1])
    for row, prompt in enumerate(prompts):
        alone = jax.jit(forward, static_argnums=1)(params, CONFIG, jnp.asarray([prompt]))
        np.testing.assert_allclose(logits[row], alone[0, -1], atol=1e-5, rtol=0)


def test_one_compilation_per_bucket(params):
    compiled_before = prefill._cache_size()
    for n in (5, 9, 16):  # all in the 16 bucket
        tokens, lengths = pad_prompts([list(range(1, n + 1))], buckets.prompt_bucket(n, context=CONFIG.max_seq_len))
        prefill(params, CONFIG, tokens, lengths, init_cache(CONFIG, 1, 64))
    assert prefill._cache_size() == compiled_before + 1
    tokens, lengths = pad_prompts([list(range(1, 18))], buckets.prompt_bucket(17, context=CONFIG.max_seq_len))
    prefill(params, CONFIG, tokens, lengths, init_cache(CONFIG, 1, 64))
    assert prefill._cache_size() == compiled_before + 2


def test_generate_does_not_recompile_within_a_bucket(params):
    model = llm_jax.Model(config=CONFIG, params=params, tokenizer=None, eos_ids=())
    llm_jax.generate(model, [[1, 2, 3]], max_new_tokens=4)
    sizes = prefill._cache_size(), llm_jax.decode._cache_size()
    result = llm_jax.generate(model, [[4, 5, 6, 7, 8, 9, 10]], max_new_tokens=4)
    assert (prefill._cache_size(), llm_jax.decode._cache_size()) == sizes
    assert result[0].metrics.compile_s == 0.0


def test_buckets():
    assert [buckets.prompt_bucket(n, context=128) for n in (1, 16, 17, 100)] == [16, 16, 32, 128]
    assert buckets.prompt_bucket(100, context=100) == 100
    assert buckets.cache_bucket(10, 20, context=1024) == 64
    with pytest.raises(ValueError, match="exceeds the limit"):
        buckets.bucket(300, limit=256)


def test_pad_prompts_validates():
    tokens, lengths = pad_prompts([[3, 4], [5]], 4)
    np.testing.assert_array_equal(tokens, [[3, 4, 0, 0], [5, 0, 0, 0]])
    np.testing.assert_array_equal(lengths, [2, 1])
    with pytest.raises(ValueError, match="at least one token"):
        pad_prompts([[]], 4)
    with pytest.raises(ValueError, match="does not fit the padded length 4"):
        pad_prompts([[1] * 5], 4)
