"""Attention over a KV cache (decode, extend) against attention over the written cache, and the layout
of the cache writes: ``xla_cached_attention`` reads the old cache plus the new keys, which must equal
plain masked attention (``xla_attention``) over the cache after the write."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from llm_jax.config import AttentionImpl, ModelConfig
from llm_jax.kv_cache import init_cache, write_tokens
from llm_jax.model.attention import cached_attention, xla_attention

ATOL = 1e-5  # float32, same arithmetic in a different order


def random_case(*, B=3, T=1, N=4, K=2, H=8, S=16, seed=0):
    rng = np.random.default_rng(seed)
    q_BTNH, k_BTKH, v_BTKH = (jnp.asarray(rng.normal(size=shape), jnp.float32)
                              for shape in ((B, T, N, H), (B, T, K, H), (B, T, K, H)))
    k_BKHS = jnp.asarray(rng.normal(size=(B, K, H, S)), jnp.float32)
    v_BKSH = jnp.asarray(rng.normal(size=(B, K, S, H)), jnp.float32)
    lengths_B = jnp.asarray(rng.integers(0, S - T + 1, size=B), jnp.int32)
    return q_BTNH, k_BTKH, v_BTKH, k_BKHS, v_BKSH, lengths_B


def reference(q_BTNH, k_BTKH, v_BTKH, k_BKHS, v_BKSH, lengths_B, *, window, softcap, scale):
    """Write the new tokens at slots lengths + t, then attend over the whole cache (the old way)."""
    B, T = q_BTNH.shape[:2]
    slots_BT = lengths_B[:, None] + jnp.arange(T)
    k_BKHS, v_BKSH = write_tokens(k_BKHS, v_BKSH, slots_BT, k_BTKH, v_BTKH)
    return xla_attention(q_BTNH, k_BKHS.transpose(0, 3, 1, 2), v_BKSH.transpose(0, 2, 1, 3), slots_BT,
                         lengths_B + T, scale=scale, window=window, softcap=softcap), k_BKHS, v_BKSH


@pytest.mark.parametrize("T", [1, 3])
@pytest.mark.parametrize("window,softcap", [(None, None), (4, None), (None, 5.0)])
@pytest.mark.parametrize("N,K", [(4, 4), (4, 2), (4, 1)])
def test_cached_attention_equals_attention_over_the_written_cache(T, window, softcap, N, K):
    case = random_case(T=T, N=N, K=K, seed=T * 7 + N + K)
    config = ModelConfig(vocab_size=8, d_model=N * 8, n_layers=1, n_heads=N, n_kv_heads=K, head_dim=8, d_ff=8,
                         max_seq_len=16, attn_logit_softcap=softcap)
    q_BTNH, k_BTKH, v_BTKH, k_BKHS, v_BKSH, lengths_B = case
    slots_BT = lengths_B[:, None] + jnp.arange(T)
    write = lambda k, v: write_tokens(k, v, slots_BT, k_BTKH, v_BTKH)
    ours = cached_attention(q_BTNH, k_BTKH, v_BTKH, k_BKHS, v_BKSH, lengths_B, write, config=config, window=window)
    expected = reference(*case, window=window, softcap=softcap, scale=config.attn_scale)
    for a, b in zip(ours, expected):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=ATOL, rtol=0)


def test_finished_rows_write_nothing():
    q_BTNH, k_BTKH, v_BTKH, k_BKHS, v_BKSH, lengths_B = random_case(B=2, S=8)
    slots_BT = jnp.asarray([[3], [8]])  # row 1 is finished: its slot is out of range
    k_new, v_new = write_tokens(k_BKHS, v_BKSH, slots_BT, k_BTKH, v_BTKH)
    np.testing.assert_array_equal(k_new[1], k_BKHS[1])
    np.testing.assert_array_equal(v_new[1], v_BKSH[1])
    np.testing.assert_array_equal(k_new[0, :, :, 3], k_BTKH[0, 0])
    np.testing.assert_array_equal(v_new[0, :, 3], v_BTKH[0, 0])
    untouched = lambda k_BKHS: np.delete(np.asarray(k_BKHS[0]), 3, axis=-1)
    np.testing.assert_array_equal(untouched(k_new), untouched(k_BKHS))


def test_fused_decode_kernel_matches_xla():
    """The Pallas path (interpreted on CPU) reads the written cache through the kernels' [B, S, K, H] view."""
    q_BTNH, k_BTKH, v_BTKH, k_BKHS, v_BKSH, lengths_B = random_case(B=2, T=1, N=4, K=2, S=16)
    config = ModelConfig(vocab_size=8, d_model=32, n_layers=1, n_heads=4, n_kv_heads=2, head_dim=8, d_ff=8,
                         max_seq_len=16)
    write = lambda k, v: write_tokens(k, v, lengths_B[:, None], k_BTKH, v_BTKH)
    run = functools.partial(cached_attention, q_BTNH, k_BTKH, v_BTKH, k_BKHS, v_BKSH, lengths_B, write, window=None)
    xla = run(config=config)
    pallas = run(config=config.replace(attention_impl=AttentionImpl.PALLAS))
    for a, b in zip(pallas, xla):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=ATOL, rtol=0)


def test_cache_layout_and_size():
    config = ModelConfig(vocab_size=8, d_model=32, n_layers=3, n_heads=4, n_kv_heads=2, head_dim=8, d_ff=8,
                         max_seq_len=64)
    cache = init_cache(config, 5, 32)
    assert [a.shape for a in cache.k_BKHS] == [(5, 2, 8, 32)] * 3
    assert [a.shape for a in cache.v_BKSH] == [(5, 2, 32, 8)] * 3
    assert (cache.batch_size, cache.max_len) == (5, 32)
    assert cache.nbytes == 2 * 3 * 5 * 2 * 8 * 32 * 4 + 5 * 4
    assert all(isinstance(a, jax.Array) for a in jax.tree.leaves(cache))
