"""The model's attention implementations agree: XLA einsums, the Pallas kernels (interpret mode on CPU),
and the kernels' own reference oracle."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import llm_jax
from llm_jax.model.attention import xla_attention
from pallas_kernels import reference


@pytest.mark.parametrize("window, softcap", [(None, None), (5, None), (None, 20.0)])
def test_xla_attention_matches_the_kernel_oracle(window, softcap):
    rng = np.random.default_rng(0)
    B, T, N, K, H = 2, 9, 4, 2, 8
    q, k, v = (jnp.asarray(rng.normal(size=s), jnp.float32) for s in ((B, T, N, H), (B, T, K, H), (B, T, K, H)))
    lengths = jnp.array([9, 6])
    positions = jnp.broadcast_to(jnp.arange(T), (B, T))
    ours = xla_attention(q, k, v, positions, lengths, scale=0.3, window=window, softcap=softcap)
    oracle = reference.attention_reference(q, k, v, lengths, sm_scale=0.3, sliding_window=window,
                                           logit_softcap=softcap)
    # Rows past a sequence's length are padding: only real rows are compared.
    for b, n in enumerate(lengths.tolist()):
        np.testing.assert_allclose(ours[b, :n], oracle[b, :n], atol=1e-6, rtol=1e-6)


def test_stories260k_greedy_is_identical_with_pallas_attention(stories260k_dir):
    model = llm_jax.load(stories260k_dir / "stories260K.bin")
    prompts = ["Once upon a time", "The dog ran"]
    xla = llm_jax.generate(model, prompts, max_new_tokens=16, chunk_steps=15)
    pallas = llm_jax.generate(model.with_attention("pallas"), prompts, max_new_tokens=16, chunk_steps=15)
    assert [r.output_ids for r in pallas] == [r.output_ids for r in xla]
    assert llm_jax.load(stories260k_dir / "stories260K.bin", attention="pallas").config.attention_impl \
        is llm_jax.AttentionImpl.PALLAS


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cached_attention_routes_agree(dtype):
    """Decode attention over the stacked cache: the CPU kernel (MatmulImpl.AUTO, one device) reads the layer
    in place and equals the XLA route (the layer sliced out, xla_attention); prefill-sized queries and
    MatmulImpl.XLA take the XLA route."""
    import cpu_kernels
    from llm_jax.config import ModelConfig
    from llm_jax.model.attention import cached_attention

    config = ModelConfig(vocab_size=32, d_model=24, n_layers=3, n_heads=6, n_kv_heads=2, head_dim=4, d_ff=8,
                         max_seq_len=16, param_dtype=dtype, compute_dtype=dtype)
    rng = np.random.default_rng(3)
    k, v = (jnp.asarray(rng.normal(size=(3, 2, 11, 2, 4)), dtype) for _ in range(2))
    q = jnp.asarray(rng.normal(size=(2, 1, 6, 4)), dtype)
    positions = jnp.array([[4], [10]], jnp.int32)

    def run(config, q, positions):
        f = lambda q, k, v, layer: cached_attention(q, k, v, layer, positions, positions[:, -1] + 1, config=config,
                                                    window=3)
        return jax.jit(f)(q, k, v, jnp.int32(1)), jax.jit(f).lower(q, k, v, jnp.int32(1)).as_text()

    ours, hlo = run(config, q, positions)
    theirs, xla_hlo = run(config.replace(matmul_impl="xla"), q, positions)
    assert ("llm_jax_decode_attention" in hlo) == cpu_kernels.available()
    assert "llm_jax_decode_attention" not in xla_hlo
    tol = 1e-6 if dtype == "float32" else 1e-2
    np.testing.assert_allclose(np.asarray(ours, np.float32), np.asarray(theirs, np.float32), rtol=tol, atol=tol)
    _, prefill_hlo = run(config, jnp.concatenate([q, q], axis=1), jnp.concatenate([positions, positions + 1], 1))
    assert "llm_jax_decode_attention" not in prefill_hlo
