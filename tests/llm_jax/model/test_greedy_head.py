"""The LM head's bfloat16 screen for greedy float32 decoding (``llm_jax.model.greedy_head``): the bound
holds, where the screen is built and dropped, and greedy decode gives the same tokens with and without it
(random weights at batch 3, and the real stories260K), while steps that read the logits skip it."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import cpu_kernels
import llm_jax
from llm_jax.config import MatmulImpl, ModelConfig
from llm_jax.decode import DecodeControls, Logprobs, decode, start
from llm_jax.kv_cache import init_cache
from llm_jax.model import for_inference, forward, fuse_projections, init_params, unfuse_projections
from llm_jax.model import greedy_head
from llm_jax.prefill import pad_prompts, prefill
from llm_jax.sampling import GREEDY, Sampling

CONFIG = ModelConfig(vocab_size=160, d_model=48, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=12, d_ff=80,
                     max_seq_len=64)
PROMPTS = [[3, 14, 15, 9, 26], [5, 35, 8], [9, 7, 9, 3, 23, 8, 4]]

needs_kernels = pytest.mark.skipif(not cpu_kernels.available(), reason="the screen runs on the CPU kernels")


@pytest.fixture(scope="module")
def params():
    # Larger weights than the default init, so greedy continuations vary instead of repeating one token.
    plain = jax.tree.map(lambda a: a * 8 if a.ndim > 1 else a, init_params(CONFIG, seed=2))
    return fuse_projections(plain, CONFIG, panels=True)


def test_the_bound_holds_with_room_to_spare():
    """|screened − float32 logit| ≤ c · ‖x‖ · ‖w‖ for random columns and for x along a column (where the
    logit is the largest it can be for those norms); the worst ratio is printed by -s."""
    rng = np.random.default_rng(0)
    for D in (48, 288, 768):
        W = rng.normal(0, 0.02, (D, 512)).astype(np.float32)
        x = rng.normal(0, 1, (6, D)).astype(np.float32)
        x[:3] = 30 * W[:, :3].T  # along columns 0, 1, 2
        panels = cpu_kernels.to_panels(jnp.asarray(W))
        screen, norms = greedy_head._screen(panels)
        screened = np.asarray(cpu_kernels.matmul(jnp.asarray(x), screen, panels=True), np.float64)
        exact = np.asarray(cpu_kernels.matmul(jnp.asarray(x), panels, panels=True), np.float64)
        bound = greedy_head.bound_factor(D) * np.linalg.norm(x.astype(np.float64), axis=1)[:, None] * np.asarray(norms)
        ratio = np.abs(screened - exact) / bound
        assert ratio.max() < 1, (D, ratio.max())
        assert np.all(np.asarray(norms) >= np.linalg.norm(W.astype(np.float64), axis=0))
        print(f"D={D}: worst |Δ| / bound {ratio.max():.3f}")


def test_bound_factor_is_the_documented_constant():
    u, n = 2.0 ** -8, 288 * 2.0 ** -24
    assert greedy_head.bound_factor(288) == pytest.approx(1.01 * (2 * u + u * u + 2.1 * n / (1 - n)), rel=1e-12)


def test_the_screen_is_built_for_float32_heads_in_panels_only(params):
    screen = params[greedy_head.SCREEN]
    head = greedy_head.head_panels(params, CONFIG)
    assert screen["panels"].dtype == jnp.bfloat16 and screen["panels"].shape == head.shape == (10, 48, 16)
    np.testing.assert_array_equal(np.asarray(screen["panels"]), np.asarray(head.astype(jnp.bfloat16)))
    assert screen["norms_V"].shape == (160,) and screen["norms_V"].dtype == jnp.float32
    plain = unfuse_projections(params, CONFIG)  # checkpoints and sharding: no screen
    assert not greedy_head.has_screen(plain)
    assert not greedy_head.has_screen(fuse_projections(plain, CONFIG))  # fused, not in panels
    bf16 = CONFIG.replace(param_dtype="bfloat16")
    assert not greedy_head.has_screen(fuse_projections(init_params(bf16), bf16, panels=True))
    capped = CONFIG.replace(final_logit_softcap=30.0)  # tanh makes distinct logits equal: not screened
    assert not greedy_head.has_screen(fuse_projections(init_params(capped), capped, panels=True))
    assert not greedy_head.applies(CONFIG.replace(matmul_impl=MatmulImpl.XLA))
    assert greedy_head.without_screen(plain) is plain


def _decode(params, config, controls, steps=12):
    tokens, lengths = pad_prompts(PROMPTS, 16)
    logits, cache = prefill(params, config, tokens, lengths, init_cache(config, len(PROMPTS), 32))
    state, first = start(logits, tokens, cache, controls)
    cache, state, out = decode(params, config, cache, state, controls, num_steps=steps)
    return np.concatenate([first.tokens_BS, out.tokens_BS], axis=1), out


def _controls(sampling=GREEDY, **kwargs):
    n = len(PROMPTS)
    return DecodeControls.create([sampling] * n, eos_ids=[()] * n, stop_ids=[()] * n, max_new_tokens=[100] * n,
                                 **kwargs)


@needs_kernels
def test_greedy_decode_through_the_screen_gives_the_same_tokens(params):
    screened, _ = _decode(params, CONFIG, _controls())
    full, _ = _decode(greedy_head.without_screen(params), CONFIG, _controls())
    np.testing.assert_array_equal(screened, full)
    for prompt, generated in zip(PROMPTS, screened):  # and the teacher-forced argmax of the full forward
        logits = np.asarray(jax.jit(forward, static_argnums=1)(params, CONFIG, jnp.asarray([prompt + list(generated)])))
        np.testing.assert_array_equal(generated, logits[0, len(prompt) - 1:-1].argmax(-1))
    assert len(set(screened[0].tolist())) > 2, "degenerate continuation; the test would prove little"


def _decode_program(params, controls) -> str:
    tokens, lengths = pad_prompts(PROMPTS, 16)
    cache = init_cache(CONFIG, len(PROMPTS), 32)
    logits, cache = prefill(params, CONFIG, tokens, lengths, cache)
    state, _ = start(logits, tokens, cache, controls)
    return decode.lower(params, CONFIG, cache, state, controls, num_steps=2).as_text()


@needs_kernels
def test_only_steps_that_need_just_the_argmax_use_the_screen(params):
    assert "llm_jax_screened_argmax_f32" in _decode_program(params, _controls())
    for controls in (_controls(Sampling(temperature=0.7, seed=1)), _controls(logprobs=Logprobs(top_n=2)),
                     _controls(Sampling(repetition_penalty=1.3)), _controls(min_new_tokens=[2] * 3)):
        assert "llm_jax_screened_argmax_f32" not in _decode_program(params, controls), controls
    xla = dataclasses.replace(CONFIG, matmul_impl=MatmulImpl.XLA)
    tokens, lengths = pad_prompts(PROMPTS, 16)
    cache = init_cache(xla, len(PROMPTS), 32)
    logits, cache = prefill(params, xla, tokens, lengths, cache)
    state, _ = start(logits, tokens, cache, _controls())
    assert "llm_jax_screened_argmax_f32" not in decode.lower(params, xla, cache, state, _controls(),
                                                             num_steps=2).as_text()


@needs_kernels
def test_stories260k_greedy_is_the_same_through_the_screen(stories260k_dir):
    model = llm_jax.load(stories260k_dir / "stories260K.bin")
    assert greedy_head.has_screen(model.params)
    prompts = [[1] + np.random.default_rng(i).integers(3, 512, 4 + 3 * i).tolist() for i in range(5)]
    screened = llm_jax.generate(model, prompts, max_new_tokens=40, ignore_eos=True)
    full = llm_jax.generate(dataclasses.replace(model, params=greedy_head.without_screen(model.params)), prompts,
                            max_new_tokens=40, ignore_eos=True)
    assert [r.output_ids for r in screened] == [r.output_ids for r in full]
    assert all(len(r.output_ids) == 40 for r in screened)


def test_for_inference_adds_the_screen_where_the_kernels_run():
    config = CONFIG
    params = for_inference(init_params(config), config)
    assert greedy_head.has_screen(params) == cpu_kernels.available()
