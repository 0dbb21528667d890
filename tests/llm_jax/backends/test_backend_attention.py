"""The backends' attention agrees: XLA's einsums (the reference), the CPU kernels, the Pallas kernels
(interpret mode on CPU), and the Pallas kernels' own oracle."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import cpu_kernels
import llm_jax
from llm_jax.backends import CpuKernels, Pallas, Xla
from llm_jax.backends.base import xla_attention
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


def test_stories260k_greedy_is_identical_on_every_backend(stories260k_dir):
    model = llm_jax.load(stories260k_dir / "stories260K.bin", backend="xla")
    prompts = ["Once upon a time", "The dog ran"]
    xla = llm_jax.generate(model, prompts, max_new_tokens=16, chunk_steps=15)
    for backend in (Pallas(), "cpu" if cpu_kernels.available() else "xla"):
        other = llm_jax.generate(model.with_backend(backend), prompts, max_new_tokens=16, chunk_steps=15)
        assert [r.output_ids for r in other] == [r.output_ids for r in xla], backend
    assert llm_jax.load(stories260k_dir / "stories260K.bin", backend="pallas").backend == Pallas()


def _config(dtype, **kw):
    from llm_jax.config import ModelConfig

    return ModelConfig(vocab_size=32, d_model=24, n_layers=3, n_heads=6, n_kv_heads=2, head_dim=4, d_ff=8,
                       max_seq_len=16, param_dtype=dtype, compute_dtype=dtype, **kw)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_append_and_attend_routes_agree(dtype):
    """A decode step's cache write and attention over layer 1 of the stacked cache: one kernel on the CPU
    (the caches updated in place, no XLA scatter, the layer read where it lies), equal to XLA's
    write_tokens and xla_attention, and to the Pallas decode kernel's; several queries per row take the
    write and the prefill kernel (a prompt continuing a cache)."""
    config = _config(dtype)
    rng = np.random.default_rng(5)
    stored = jnp.uint16 if dtype == "bfloat16" else jnp.float32  # decode carries a bfloat16 cache as its bits
    k, v = (jax.lax.bitcast_convert_type(jnp.asarray(rng.normal(size=(3, 2, 11, 2, 4)), dtype), stored)
            if dtype == "bfloat16" else jnp.asarray(rng.normal(size=(3, 2, 11, 2, 4)), dtype) for _ in range(2))

    def run(backend, T):
        rng = np.random.default_rng(T)
        q = jnp.asarray(rng.normal(size=(2, T, 6, 4)), dtype)
        k_new, v_new = (jnp.asarray(rng.normal(size=(2, T, 2, 4)), dtype) for _ in range(2))
        positions = jnp.array([[4], [8]], jnp.int32) + jnp.arange(T, dtype=jnp.int32)
        slots = positions.at[1].set(11)  # row 1 has finished: nothing written

        def f(q, k_new, v_new, k, v):
            return backend.append_and_attend(q, k_new, v_new, k, v, jnp.int32(1), slots, positions, config=config,
                                             window=3)

        return jax.jit(f)(q, k_new, v_new, k, v), jax.jit(f).lower(q, k_new, v_new, k, v).as_text()

    tol = 1e-6 if dtype == "float32" else 1e-2
    for T, target in [(1, "llm_jax_decode_attention_append"), (3, "llm_jax_prefill_attention")]:
        ours, hlo = run(CpuKernels(), T)
        theirs, xla_hlo = run(Xla(), T)
        assert (target in hlo) == cpu_kernels.available()
        assert ("scatter" not in hlo) == (T == 1 and cpu_kernels.available())
        assert "llm_jax_" not in xla_hlo
        others = [ours] + ([run(Pallas(interpret=True), T)[0]] if T == 1 else [])
        for other in others:
            np.testing.assert_allclose(np.asarray(other[0], np.float32), np.asarray(theirs[0], np.float32), rtol=tol,
                                       atol=tol)
            for a, b in zip(other[1:], theirs[1:]):
                np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("T, window, softcap", [(1, None, None), (1, 3, 20.0), (4, None, None), (4, 5, 20.0)])
def test_append_and_attend_over_an_int8_cache(T, window, softcap):
    """An int8 cache (``kv_cache.Int8KV``: values and a scale per token and head) read in place by the CPU
    backend's paged kernel and Pallas' ragged paged kernel, each row of the cache one page: the same cache
    and, for the rows still running,
    the same attention as XLA's (write_tokens, then the layer dequantized). GQA, odd sizes, T = 1 (decode)
    and T = 4 (speculative verification, also past the cache's end), windows, soft-capping."""
    from llm_jax import kv_cache as kvc

    config = _config("float32", attn_logit_softcap=softcap)
    rng = np.random.default_rng(T)
    B, S = 3, 13
    k, v = (kvc.Int8KV(*kvc.quantize_kv(jnp.asarray(rng.normal(size=(3, B, S, 2, 4)), jnp.float32)))
            for _ in range(2))
    q = jnp.asarray(rng.normal(size=(B, T, 6, 4)), jnp.float32)
    k_new, v_new = (jnp.asarray(rng.normal(size=(B, T, 2, 4)), jnp.float32) for _ in range(2))
    # Row 1 runs past the cache's end (speculative verification there): those tokens write nothing.
    positions = jnp.array([[4], [S - min(T, 2)], [6]], jnp.int32) + jnp.arange(T, dtype=jnp.int32)
    slots = positions.at[2].set(S)  # row 2 has finished: nothing written, its output unused

    def run(backend):
        def f(q, k_new, v_new, k, v):
            return backend.append_and_attend(q, k_new, v_new, k, v, jnp.int32(1), slots, positions, config=config,
                                             window=window)

        return jax.jit(f)(q, k_new, v_new, k, v), jax.jit(f).lower(q, k_new, v_new, k, v).as_text()

    (o_xla, k_xla, v_xla), _ = run(Xla())
    (o, k_out, v_out), hlo = run(CpuKernels())
    assert ("llm_jax_paged_attention" in hlo) == cpu_kernels.available()
    in_cache = min(T, 2)  # row 1's tokens past the cache are no sequence's: their outputs are 0, not compared
    for o, k_out, v_out in ((o, k_out, v_out), run(Pallas(interpret=True))[0]):
        np.testing.assert_allclose(np.asarray(o[0]), np.asarray(o_xla[0]), rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(np.asarray(o[1, :in_cache]), np.asarray(o_xla[1, :in_cache]), rtol=1e-5, atol=1e-5)
        for ours, theirs in ((k_out, k_xla), (v_out, v_xla)):
            np.testing.assert_array_equal(np.asarray(ours.q_LBSKH), np.asarray(theirs.q_LBSKH))
            np.testing.assert_array_equal(np.asarray(ours.s_LBSK), np.asarray(theirs.s_LBSK))
        assert not np.array_equal(np.asarray(k_out.q_LBSKH), np.asarray(k.q_LBSKH))  # the step wrote its keys


def test_prompt_attention_runs_the_kernel_with_xla_gradients():
    """Queries over their own keys (prefill, forward, training): on the CPU backend the prefill kernel
    computes them (equal to xla_attention) and gradients are xla_attention's; the XLA backend keeps XLA."""
    rng = np.random.default_rng(4)
    B, T = 2, 7
    q = jnp.asarray(rng.normal(size=(B, T, 6, 4)), jnp.float32)
    k, v = (jnp.asarray(rng.normal(size=(B, T, 2, 4)), jnp.float32) for _ in range(2))
    lengths = jnp.array([T, 4], jnp.int32)
    config = _config("float32", attn_logit_softcap=9.0)

    def loss(backend):
        def f(q, k, v):
            o = backend.attention(q, k, v, lengths, config=config, window=5)
            return jnp.sum(jnp.sin(o)), o
        return jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2), has_aux=True))

    (ours, o), grads = loss(CpuKernels())(q, k, v)
    (theirs, o_xla), xla_grads = loss(Xla())(q, k, v)
    hlo = jax.jit(lambda q, k, v: CpuKernels().attention(q, k, v, lengths, config=config, window=5)).lower(
        q, k, v).as_text()
    assert ("llm_jax_prefill_attention" in hlo) == cpu_kernels.available()
    np.testing.assert_allclose(np.asarray(o), np.asarray(o_xla), rtol=2e-6, atol=2e-6)
    for g, g_xla in zip(grads, xla_grads):
        np.testing.assert_allclose(np.asarray(g), np.asarray(g_xla), rtol=1e-5, atol=1e-5)
