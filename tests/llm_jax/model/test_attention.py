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
