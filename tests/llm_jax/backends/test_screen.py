"""The LM head's screens for greedy decoding on the CPU kernels (``llm_jax.backends.cpu.greedy_head``): the
bounds hold, where the screens are built, which one a step reads, and greedy decode gives the same tokens
with and without them (random float32 and bfloat16 weights at 3 and 9 rows, and the real stories260K),
while steps that read the logits skip them."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import cpu_kernels
import llm_jax
from llm_jax.backends import CpuKernels, Xla
from llm_jax.backends.cpu import greedy_head
from llm_jax.backends.cpu.forms import head_panels
from llm_jax.config import ModelConfig
from llm_jax.decoding import DecodeControls, Logprobs, decode, start
from llm_jax.kv_cache import init_cache
from llm_jax.model import forward, init_params
from llm_jax.prefilling import pad_prompts, prefill
from llm_jax.sampling import GREEDY, Sampling

CONFIG = ModelConfig(vocab_size=160, d_model=48, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=12, d_ff=80,
                     max_seq_len=64)
PROMPTS = [[3, 14, 15, 9, 26], [5, 35, 8], [9, 7, 9, 3, 23, 8, 4]]

needs_kernels = pytest.mark.skipif(not cpu_kernels.available(), reason="the screens run on the CPU kernels")


def inference_params(config: ModelConfig, seed: int = 2):
    # Larger weights than the default init, so greedy continuations vary instead of repeating one token.
    plain = jax.tree.map(lambda a: a * 8 if a.ndim > 1 else a, init_params(config, seed=seed))
    return CpuKernels().prepare(plain, config)


def without_screen(weights):
    return {k: v for k, v in weights.items() if k != greedy_head.SCREEN}


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def model(request):
    config = CONFIG.replace(param_dtype=request.param)
    return config, inference_params(config)


def _screened(x, screens, screen):
    """The screened logits, as greedy_tokens computes them (the bfloat16 screen in pairs where stored so)."""
    if screen == "bfloat16" and screens.bfloat16_pairs is not None:
        return cpu_kernels.matmul(x, screens.bfloat16_pairs, panels=True, pairs=True)
    if screen == "int8_quads":
        return cpu_kernels.matmul(x, screens.int8_quads, panels=True, quads=True)
    return cpu_kernels.matmul(x, getattr(screens, screen), panels=True)


def with_screens(params, config, quads: bool):
    """``params`` with the screens built with or without the quads (whichever this CPU would build)."""
    head = head_panels(params, config)
    return {**params, greedy_head.SCREEN: greedy_head._screens(head.data, quads)}


@pytest.mark.parametrize("head_dtype", [jnp.float32, jnp.bfloat16])
def test_the_bounds_hold_with_room_to_spare(head_dtype):
    """|screened − head's logit| ≤ c₁ ‖x‖₁ s + c₂ ‖x‖₂ ‖w‖ (through the quads: c₁ (‖x‖₂ + ‖δ‖₂) E + (c₁ ‖δ‖₂
    + c₂ ‖x‖₂) ‖w‖) for random columns, for x along a column (where Cauchy–Schwarz is tight) and for x
    with an outlier (a large step t for the quads); the worst ratio is printed by -s."""
    rng = np.random.default_rng(0)
    for D in (48, 288, 768):
        W = rng.normal(0, 0.02, (D, 512)).astype(np.float32)
        x = rng.normal(0, 1, (8, D)).astype(np.float32)
        x[:3] = 30 * W[:, :3].T  # along columns 0, 1, 2
        x[3, 5] = 40.0
        panels = cpu_kernels.to_panels(jnp.asarray(W)).astype(head_dtype)
        x = jnp.asarray(x).astype(head_dtype).astype(jnp.float32)
        screens = greedy_head._screens(panels, True)
        exact = np.asarray(cpu_kernels.matmul(x, panels, panels=True), np.float64)
        xs = np.asarray(x, np.float64)
        W = np.asarray(cpu_kernels.from_panels(panels), np.float64)
        norms, scales = np.asarray(screens.norms_V, np.float64), np.asarray(screens.scales_V, np.float64)
        assert np.all(norms >= np.linalg.norm(W, axis=0))
        errors = np.asarray(screens.errors_V, np.float64)
        q = np.asarray(cpu_kernels.from_panels(cpu_kernels.from_quads(screens.int8_quads)), np.float64)
        assert np.all(errors >= np.linalg.norm(W - scales * q, axis=0))
        bf16 = greedy_head._screens(panels, False)
        for screen in ("int8", "int8_quads") + (("bfloat16",) if head_dtype == jnp.float32 else ()):
            c1, c2 = greedy_head.bounds(D, screen)
            screened = np.asarray(_screened(x, bf16 if screen == "bfloat16" else screens, screen), np.float64)
            x1, x2 = np.abs(xs).sum(1)[:, None], np.linalg.norm(xs, axis=1)[:, None]
            if screen == "int8_quads":
                n, t = (np.asarray(a, np.float64) for a in cpu_kernels.quantize_rows(x))
                d2 = np.linalg.norm(xs - t[:, None] * n, axis=1)[:, None]
                bound = c1 * (x2 + d2) * errors + (c1 * d2 + c2 * x2) * norms
            else:
                bound = c1 * x1 * scales + c2 * x2 * norms
            if screen != "bfloat16":
                screened = screened * scales
            ratio = np.abs(screened - exact) / bound
            assert ratio.max() < 1, (D, screen, ratio.max())
            print(f"D={D} {screen} of {jnp.dtype(head_dtype).name}: worst |Δ| / bound {ratio.max():.3f}")


def test_bounds_are_the_documented_constants():
    u, u32, n = 2.0 ** -8, 2.0 ** -24, 288 * 2.0 ** -24
    gamma = n / (1 - n)
    assert greedy_head.bounds(288, "bfloat16") == pytest.approx((0.0, 1.01 * (2 * u + u * u + 2.1 * gamma)), rel=1e-12)
    assert greedy_head.bounds(288, "int8") == pytest.approx(
        (1.01 * 0.5 * (1 + 2.0 ** -12) * (1 + gamma + u32), 1.01 * 2.1 * (gamma + u32)), rel=1e-12)
    assert greedy_head.bounds(288, "int8_quads") == pytest.approx(
        (1.01 * (1 + 3.01 * u32), 1.01 * 2 * (gamma + 3.01 * u32)), rel=1e-12)
    with pytest.raises(ValueError, match="unknown screen"):
        greedy_head.bounds(288, "int4")


def test_the_screens_of_a_head_in_panels(model):
    config, params = model
    screens = params[greedy_head.SCREEN]
    head = head_panels(params, config).data
    V, D = config.vocab_size, config.d_model
    assert head.shape == screens.int8.shape == (V // 16, D, 16) and screens.int8.dtype == jnp.int8
    w = np.asarray(head, np.float32)
    scales = np.abs(w).max(axis=1) / 127  # [V / 16, 16]
    np.testing.assert_allclose(np.asarray(screens.scales_V), scales.reshape(-1), rtol=1e-6)
    q = np.asarray(screens.int8, np.float64)
    s = np.asarray(screens.scales_V, np.float64).reshape(scales.shape)[:, None, :]
    # what the bound assumes: each weight within half a step (and the rounding of w / s) of its integer
    assert np.all(np.abs(w - s * q) <= s / 2 * (1 + 2.0 ** -12)) and np.abs(q).max() <= 127
    assert np.abs(q - np.round(w / scales[:, None, :])).max() <= 1  # w / s at .5 may round either way
    assert screens.norms_V.shape == (V,)
    quads = greedy_head.quads_apply(D)
    assert (screens.int8_quads is not None, screens.errors_V is not None) == (quads, quads)
    if quads:  # the int8 screen again, in quads of rows, and each column's ‖w − s q‖₂ (or more)
        np.testing.assert_array_equal(np.asarray(cpu_kernels.from_quads(screens.int8_quads)), q)
        errors = np.linalg.norm(w - s * q, axis=1).reshape(-1)
        assert np.all(np.asarray(screens.errors_V) >= errors)
        assert np.all(np.asarray(screens.errors_V) <= errors * 1.01 + 1e-6 * np.asarray(screens.norms_V))
    if config.param_dtype == "float32" and not quads:  # a bfloat16 copy, in pairs where the dot products read them
        paired = cpu_kernels.pairs_available() and D % 2 == 0
        assert (screens.bfloat16_pairs is not None, screens.bfloat16 is not None) == (paired, not paired)
        screen = cpu_kernels.from_pairs(screens.bfloat16_pairs) if paired else screens.bfloat16
        np.testing.assert_array_equal(np.asarray(screen), np.asarray(head.astype(jnp.bfloat16)))
    else:  # the head itself is bfloat16, or the quads serve many rows
        assert screens.bfloat16 is None and screens.bfloat16_pairs is None
    assert greedy_head.SCREEN not in CpuKernels(greedy_screen=False).prepare(init_params(config), config)


def test_which_models_and_steps_get_a_screen(model):
    config, params = model
    capped = config.replace(final_logit_softcap=30.0)  # tanh makes distinct logits equal: not screened
    assert greedy_head.SCREEN not in CpuKernels().prepare(init_params(capped), capped)
    screens = params[greedy_head.SCREEN]
    assert greedy_head.screen_for(screens, 1) == greedy_head.screen_for(screens, 7) == "int8"
    many = "int8_quads" if greedy_head.quads_apply(config.d_model) else (
        "bfloat16" if config.param_dtype == "float32" else None)
    assert greedy_head.screen_for(screens, 8) == greedy_head.screen_for(screens, 32) == many
    if cpu_kernels.quads_available():  # built either way, each is read where it is
        assert greedy_head.screen_for(with_screens(params, config, True)[greedy_head.SCREEN], 8) == "int8_quads"
        assert greedy_head.screen_for(with_screens(params, config, False)[greedy_head.SCREEN], 8) == (
            "bfloat16" if config.param_dtype == "float32" else None)
    x = jnp.ones((1, config.d_model), jnp.float32)
    assert greedy_head.greedy_tokens(without_screen(params), config, x) is None
    assert Xla().greedy_tokens(params, config, x) is None


def test_the_quads_serve_narrow_rows_where_vnni_runs_and_amx_does_not(monkeypatch):
    monkeypatch.setattr(cpu_kernels, "quads_available", lambda: True)
    monkeypatch.setattr(cpu_kernels.build, "amx", lambda: False)
    assert greedy_head.quads_apply(288) and greedy_head.quads_apply(greedy_head.QUADS_MAX_D)
    assert not greedy_head.quads_apply(2048) and not greedy_head.quads_apply(290)
    monkeypatch.setattr(cpu_kernels.build, "amx", lambda: True)  # AMX's bfloat16 tiles read the pairs instead
    assert not greedy_head.quads_apply(288)
    monkeypatch.setattr(cpu_kernels.build, "amx", lambda: False)
    monkeypatch.setattr(cpu_kernels, "quads_available", lambda: False)
    assert not greedy_head.quads_apply(288)


def _decode(params, config, controls, prompts=PROMPTS, steps=12, backend=CpuKernels()):
    tokens, lengths = pad_prompts(prompts, 16)
    logits, cache = prefill(params, config, tokens, lengths, init_cache(config, len(prompts), 32), backend=backend)
    state, first = start(logits, tokens, cache, controls, backend=backend)
    cache, state, out = decode(params, config, cache, state, controls, num_steps=steps, backend=backend)
    return np.concatenate([first.tokens_BS, out.tokens_BS], axis=1)


def _controls(n=len(PROMPTS), sampling=GREEDY, **kwargs):
    return DecodeControls.create([sampling] * n, eos_ids=[()] * n, stop_ids=[()] * n, max_new_tokens=[100] * n,
                                 **kwargs)


@needs_kernels
@pytest.mark.parametrize("rows, quads", [(3, None), (9, True), (9, False)])
def test_greedy_decode_through_the_screen_gives_the_same_tokens(model, rows, quads):
    config, params = model
    if quads is not None:
        if quads and not cpu_kernels.quads_available():
            pytest.skip("the int8 screen in quads runs on AVX-512 VNNI, which this CPU lacks")
        params = with_screens(params, config, quads)
        assert greedy_head.screen_for(params[greedy_head.SCREEN], rows) == ("int8_quads" if quads else (
            "bfloat16" if config.param_dtype == "float32" else None))
    prompts = (PROMPTS * 3)[:rows]
    screened = _decode(params, config, _controls(rows), prompts)
    full = _decode(without_screen(params), config, _controls(rows), prompts)
    np.testing.assert_array_equal(screened, full)
    forward_ = jax.jit(forward, static_argnums=1, static_argnames="backend")
    for prompt, generated in zip(prompts[:3], screened):  # and the teacher-forced argmax of the full forward
        logits = np.asarray(forward_(params, config, jnp.asarray([prompt + list(generated)]), backend=CpuKernels()))
        np.testing.assert_array_equal(generated, logits[0, len(prompt) - 1:-1].argmax(-1))
    assert len(set(screened[0].tolist())) > 2, "degenerate continuation; the test would prove little"


def _decode_program(params, config, controls, backend=CpuKernels()) -> str:
    tokens, lengths = pad_prompts(PROMPTS, 16)
    cache = init_cache(config, len(PROMPTS), 32)
    logits, cache = prefill(params, config, tokens, lengths, cache, backend=backend)
    state, _ = start(logits, tokens, cache, controls, backend=backend)
    return decode.lower(params, config, cache, state, controls, num_steps=2, backend=backend).as_text()


@needs_kernels
def test_only_steps_that_need_just_the_argmax_use_the_screen(model):
    config, params = model
    target = "llm_jax_screened_argmax_" + ("f32" if config.param_dtype == "float32" else "bf16")
    program = _decode_program(params, config, _controls())
    assert target in program and "llm_jax_matmul_panels_i8" in program
    for controls in (_controls(sampling=Sampling(temperature=0.7, seed=1)), _controls(logprobs=Logprobs(top_n=2)),
                     _controls(sampling=Sampling(repetition_penalty=1.3)), _controls(min_new_tokens=[2] * 3)):
        assert target not in _decode_program(params, config, controls), controls
    assert target not in _decode_program(init_params(config), config, _controls(), backend=Xla())


@needs_kernels
@pytest.mark.parametrize("rows", [5, 9])  # the int8 screen; at 9 rows the quads where VNNI runs, else bfloat16
def test_stories260k_greedy_is_the_same_through_the_screen(stories260k_dir, rows):
    model = llm_jax.load(stories260k_dir / "stories260K.bin")
    screens = model.weights[greedy_head.SCREEN]
    many = "int8_quads" if greedy_head.quads_apply(model.config.d_model) else "bfloat16"
    assert greedy_head.screen_for(screens, rows) == ("int8" if rows < 8 else many)
    prompts = [[1] + np.random.default_rng(i).integers(3, 512, 4 + 3 * i).tolist() for i in range(rows)]
    screened = llm_jax.generate(model, prompts, max_new_tokens=40, ignore_eos=True)
    unscreened = model.with_backend(CpuKernels(greedy_screen=False))
    assert greedy_head.SCREEN not in unscreened.weights
    full = llm_jax.generate(unscreened, prompts, max_new_tokens=40, ignore_eos=True)
    assert [r.output_ids for r in screened] == [r.output_ids for r in full]
    assert all(len(r.output_ids) == 40 for r in screened)


def _tied_head_params(config: ModelConfig, nudge: int):
    """Params whose LM head repeats each even column in the odd one after it: ``nudge`` 0, exact ties at
    every step; ±1, the copy's first weight moved by one float32 ulp up or down (near-ties, which float32
    sums may keep apart or make equal)."""
    params = jax.tree.map(lambda a: a * 8 if a.ndim > 1 else a, init_params(config, seed=4))
    head = np.asarray(params["lm_head"], np.float32).copy()  # [D, V]
    head[:, 1::2] = head[:, 0::2]
    if nudge:
        head[0, 1::2] = np.nextafter(head[0, 1::2], np.float32(np.inf) * nudge)
    return {**params, "lm_head": jnp.asarray(head, params["lm_head"].dtype)}


@needs_kernels
@pytest.mark.parametrize("nudge", [0, 1, -1], ids=["exact", "up", "down"])
@pytest.mark.parametrize("rows", [3, 9])
def test_greedy_ties_and_near_ties_decode_as_the_unscreened_path(nudge, rows):
    """One greedy: every token, the first included, is the largest float32 logit of the unscreened path of
    the same backend, the first on ties: through the screen, without it, and (exact ties) through XLA."""
    config = CONFIG.replace(tie_embeddings=False)
    params = _tied_head_params(config, nudge)
    prompts = (PROMPTS * 3)[:rows]
    screened_weights = CpuKernels().prepare(params, config)
    assert greedy_head.screen_for(screened_weights[greedy_head.SCREEN], rows) is not None
    screened = _decode(screened_weights, config, _controls(rows), prompts, steps=20)
    unscreened = _decode(CpuKernels(greedy_screen=False).prepare(params, config), config, _controls(rows), prompts,
                         steps=20)
    np.testing.assert_array_equal(screened, unscreened)
    if nudge == 0:
        assert (screened % 2 == 0).all()  # the first of each tied pair
        np.testing.assert_array_equal(_decode(params, config, _controls(rows), prompts, steps=20, backend=Xla()),
                                      screened)
    assert len(set(screened.ravel().tolist())) > 4, "degenerate continuations; the test would prove little"
