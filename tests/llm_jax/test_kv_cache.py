"""KV cache writes and reads against NumPy, for float32 caches, bfloat16 caches and bfloat16 held as bits."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from llm_jax import kv_cache as kvc
from llm_jax.config import ModelConfig

CONFIG = ModelConfig(vocab_size=32, d_model=16, n_layers=3, n_heads=4, n_kv_heads=2, head_dim=4, d_ff=24,
                     max_seq_len=16)


def _forms(dtype):
    """The same empty cache as init_cache makes it (bfloat16: as bits) and, for bfloat16, as bfloat16 arrays."""
    cache = kvc.init_cache(CONFIG, batch_size=2, max_len=7, dtype=dtype)
    return [cache] if dtype == jnp.float32 else [cache, kvc.from_bits(cache, dtype)]


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_writes_and_reads_match_numpy(dtype):
    rng = np.random.default_rng(0)
    block_BTKH = rng.normal(size=(2, 3, 2, 4)).astype(np.float32)
    tokens_BTKH = rng.normal(size=(2, 1, 2, 4)).astype(np.float32)
    slots_BT = np.array([[3], [7]], np.int32)  # row 1's slot is out of range: dropped
    rounded = lambda a: np.asarray(jnp.asarray(a, dtype).astype(jnp.float32))
    expected = np.zeros((3, 2, 7, 2, 4), np.float32)
    expected[1, :, :3] = rounded(block_BTKH)
    expected[1, 0, 3] = rounded(tokens_BTKH[0, 0])
    for cache in _forms(dtype):
        k = jax.jit(kvc.write_block)(cache.k_LBSKH, jnp.int32(1), jnp.asarray(block_BTKH))
        k = jax.jit(kvc.write_tokens)(k, jnp.int32(1), jnp.asarray(slots_BT), jnp.asarray(tokens_BTKH))
        assert k.dtype == cache.k_LBSKH.dtype
        whole = kvc.from_bits(kvc.KVCache(k, k, cache.lengths_B), dtype).k_LBSKH
        assert whole.dtype == dtype
        np.testing.assert_array_equal(np.asarray(whole.astype(jnp.float32)), expected)
        layer_BSKH = jax.jit(kvc.read_layer)(k, jnp.int32(1))
        assert layer_BSKH.dtype == dtype and layer_BSKH.shape == (2, 7, 2, 4)
        np.testing.assert_array_equal(np.asarray(layer_BSKH.astype(jnp.float32)), expected[1])


def test_bits_round_trip_exactly():
    values = jnp.asarray(np.random.default_rng(1).normal(size=(3, 2, 7, 2, 4)), jnp.bfloat16)
    cache = kvc.KVCache(values, -values, jnp.zeros((2,), jnp.int32))
    bits = kvc.as_bits(cache)
    assert bits.k_LBSKH.dtype == jnp.uint16
    back = kvc.from_bits(bits, jnp.bfloat16)
    np.testing.assert_array_equal(np.asarray(back.k_LBSKH), np.asarray(values))
    np.testing.assert_array_equal(np.asarray(back.v_LBSKH), np.asarray(-values))


def test_a_bfloat16_cache_is_made_as_bits():
    cache = kvc.init_cache(CONFIG, batch_size=2, max_len=7, dtype=jnp.bfloat16)
    assert cache.k_LBSKH.dtype == cache.v_LBSKH.dtype == jnp.uint16 and cache.dtype == jnp.bfloat16
    values = kvc.from_bits(cache, cache.dtype)
    assert values.k_LBSKH.dtype == jnp.bfloat16 and not np.asarray(values.k_LBSKH.astype(jnp.float32)).any()
    assert kvc.init_cache(CONFIG, batch_size=2, max_len=7).dtype == jnp.float32
