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


def _config(dtype, **kw):
    from llm_jax.config import ModelConfig

    return ModelConfig(vocab_size=32, d_model=24, n_layers=3, n_heads=6, n_kv_heads=2, head_dim=4, d_ff=8,
                       max_seq_len=16, param_dtype=dtype, compute_dtype=dtype, **kw)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cached_attention_routes_agree(dtype):
    """Attention over the stacked cache: the CPU kernels (MatmulImpl.AUTO, one device) read the layer in
    place — decode's for one query per row, prefill's for several (a prompt continuing a cache) — and equal
    the XLA route (the layer sliced out, xla_attention), which MatmulImpl.XLA takes."""
    import cpu_kernels
    from llm_jax.model.attention import cached_attention

    config = _config(dtype)
    rng = np.random.default_rng(3)
    k, v = (jnp.asarray(rng.normal(size=(3, 2, 11, 2, 4)), dtype) for _ in range(2))
    q = jnp.asarray(rng.normal(size=(2, 1, 6, 4)), dtype)
    positions = jnp.array([[4], [8]], jnp.int32)

    def run(config, q, positions):
        f = lambda q, k, v, layer: cached_attention(q, k, v, layer, positions, positions[:, -1] + 1, config=config,
                                                    window=3)
        return jax.jit(f)(q, k, v, jnp.int32(1)), jax.jit(f).lower(q, k, v, jnp.int32(1)).as_text()

    tol = 1e-6 if dtype == "float32" else 1e-2
    many_q = jnp.concatenate([q, q[:, :, ::-1], q * 2], axis=1)
    many_positions = jnp.concatenate([positions, positions + 1, positions + 2], 1)
    for (q, positions), target in [((q, positions), "llm_jax_decode_attention"),
                                   ((many_q, many_positions), "llm_jax_prefill_attention")]:
        ours, hlo = run(config, q, positions)
        theirs, xla_hlo = run(config.replace(matmul_impl="xla"), q, positions)
        assert (target in hlo) == cpu_kernels.available()
        assert "llm_jax_" not in xla_hlo
        np.testing.assert_allclose(np.asarray(ours, np.float32), np.asarray(theirs, np.float32), rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_append_and_attend_routes_agree(dtype):
    """A decode step's cache write and attention: one kernel on one CPU device (the caches updated in place,
    no XLA scatter), equal to the XLA route's write_tokens and xla_attention; several queries per row take
    the write and prefill kernel."""
    import cpu_kernels
    from llm_jax.model.attention import append_and_attend

    config = _config(dtype)
    rng = np.random.default_rng(5)
    stored = jnp.uint16 if dtype == "bfloat16" else jnp.float32  # decode carries a bfloat16 cache as its bits
    k, v = (jax.lax.bitcast_convert_type(jnp.asarray(rng.normal(size=(3, 2, 11, 2, 4)), dtype), stored)
            if dtype == "bfloat16" else jnp.asarray(rng.normal(size=(3, 2, 11, 2, 4)), dtype) for _ in range(2))

    def run(config, T):
        rng = np.random.default_rng(T)
        q = jnp.asarray(rng.normal(size=(2, T, 6, 4)), dtype)
        k_new, v_new = (jnp.asarray(rng.normal(size=(2, T, 2, 4)), dtype) for _ in range(2))
        positions = jnp.array([[4], [8]], jnp.int32) + jnp.arange(T, dtype=jnp.int32)
        slots = positions.at[1].set(11)  # row 1 has finished: nothing written

        def f(q, k_new, v_new, k, v):
            return append_and_attend(q, k_new, v_new, k, v, jnp.int32(1), slots, positions, config=config, window=3)

        return jax.jit(f)(q, k_new, v_new, k, v), jax.jit(f).lower(q, k_new, v_new, k, v).as_text()

    tol = 1e-6 if dtype == "float32" else 1e-2
    for T, target in [(1, "llm_jax_decode_attention_append"), (3, "llm_jax_prefill_attention")]:
        ours, hlo = run(config, T)
        theirs, xla_hlo = run(config.replace(matmul_impl="xla"), T)
        assert (target in hlo) == cpu_kernels.available()
        assert ("scatter" not in hlo) == (T == 1 and cpu_kernels.available())
        assert "llm_jax_" not in xla_hlo
        np.testing.assert_allclose(np.asarray(ours[0], np.float32), np.asarray(theirs[0], np.float32), rtol=tol,
                                   atol=tol)
        for a, b in zip(ours[1:], theirs[1:]):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_prompt_attention_runs_the_kernel_with_xla_gradients():
    """Queries over their own keys (prefill, forward, training): on one CPU device the prefill kernel
    computes them (equal to xla_attention) and gradients are xla_attention's; MatmulImpl.XLA keeps XLA."""
    import cpu_kernels
    from llm_jax.model.attention import attention

    rng = np.random.default_rng(4)
    B, T = 2, 7
    q = jnp.asarray(rng.normal(size=(B, T, 6, 4)), jnp.float32)
    k, v = (jnp.asarray(rng.normal(size=(B, T, 2, 4)), jnp.float32) for _ in range(2))
    positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    lengths = jnp.array([T, 4], jnp.int32)
    config = _config("float32", attn_logit_softcap=9.0)

    def loss(config):
        def f(q, k, v):
            o = attention(q, k, v, positions, lengths, config=config, window=5, queries_from_zero=True)
            return jnp.sum(jnp.sin(o)), o
        return jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2), has_aux=True))

    (ours, o), grads = loss(config)(q, k, v)
    (theirs, o_xla), xla_grads = loss(config.replace(matmul_impl="xla"))(q, k, v)
    hlo = jax.jit(lambda q, k, v: attention(q, k, v, positions, lengths, config=config, window=5,
                                            queries_from_zero=True)).lower(q, k, v).as_text()
    assert ("llm_jax_prefill_attention" in hlo) == cpu_kernels.available()
    np.testing.assert_allclose(np.asarray(o), np.asarray(o_xla), rtol=2e-6, atol=2e-6)
    for g, g_xla in zip(grads, xla_grads):
        np.testing.assert_allclose(np.asarray(g), np.asarray(g_xla), rtol=1e-5, atol=1e-5)
