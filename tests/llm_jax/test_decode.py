"""Decode: greedy tokens equal teacher-forced argmax; stop conditions freeze finished rows."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from llm_jax.config import ModelConfig
from llm_jax.decode import PAD_ID, DecodeControls, FinishReason, decode, start
from llm_jax.kv_cache import init_cache
from llm_jax.model import forward, init_params
from llm_jax.prefill import pad_prompts, prefill
from llm_jax.sampling import GREEDY

CONFIG = ModelConfig(vocab_size=61, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, d_ff=48,
                     max_seq_len=64)
PROMPTS = [[3, 14, 15, 9, 26], [5, 35, 8], [9, 7, 9, 3, 23, 8, 4]]


@pytest.fixture(scope="module")
def params():
    # Larger weights than the default init, so greedy continuations vary instead of repeating one token.
    return jax.tree.map(lambda a: a * 8 if a.ndim > 1 else a, init_params(CONFIG, seed=1))


def run(params, prompts, steps, *, eos=(), stop=(), budget=100, cache_len=32):
    controls = DecodeControls.create([GREEDY] * len(prompts), eos_ids=[eos] * len(prompts),
                                     stop_ids=[stop] * len(prompts), max_new_tokens=[budget] * len(prompts))
    tokens, lengths = pad_prompts(prompts, 16)
    logits, cache = prefill(params, CONFIG, tokens, lengths, init_cache(CONFIG, len(prompts), cache_len))
    state = start(logits, cache, controls)
    first = np.asarray(state.tokens_B)[:, None]
    cache, state, out = decode(params, CONFIG, cache, state, controls, num_steps=steps)
    return np.concatenate([first, np.asarray(out)], axis=1), cache, state


def test_greedy_decode_equals_teacher_forced_argmax(params):
    tokens, _, _ = run(params, PROMPTS, 9)
    for prompt, generated in zip(PROMPTS, tokens):
        full = np.asarray(jax.jit(forward, static_argnums=1)(params, CONFIG, jnp.asarray([prompt + list(generated)])))
        expected = full[0, len(prompt) - 1:-1].argmax(-1)
        np.testing.assert_array_equal(generated, expected)
    assert len(set(tokens[0].tolist())) > 2, "degenerate continuation; the test would prove little"


def test_eos_stops_a_row_and_freezes_it(params):
    free, _, _ = run(params, PROMPTS, 9)
    eos = int(free[0, 3])  # the 4th token row 0 generates
    first_hit = [int(np.argmax(row == eos)) if (row == eos).any() else None for row in free]
    tokens, cache, state = run(params, PROMPTS, 9, eos=(eos,))
    for row, hit in enumerate(first_hit):
        if hit is None:
            np.testing.assert_array_equal(tokens[row], free[row])
            continue
        np.testing.assert_array_equal(tokens[row, :hit + 1], free[row, :hit + 1])
        assert (tokens[row, hit + 1:] == PAD_ID).all()
        assert state.finish_reason_B[row] == FinishReason.EOS
        assert state.num_generated_B[row] == hit + 1
        # Prompt plus every generated token except the last (which is never fed back).
        assert cache.lengths_B[row] == len(PROMPTS[row]) + hit


def test_stop_ids_and_budget(params):
    free, _, _ = run(params, PROMPTS, 9)
    stop = int(free[1, 2])
    tokens, _, state = run(params, PROMPTS, 9, stop=(stop,), budget=6)
    for row in range(len(PROMPTS)):
        hits = np.flatnonzero(free[row, :6] == stop)
        end = hits[0] + 1 if len(hits) else 6
        np.testing.assert_array_equal(tokens[row, :end], free[row, :end])
        assert (tokens[row, end:] == PAD_ID).all()
        assert state.finish_reason_B[row] == (FinishReason.STOP if len(hits) else FinishReason.LENGTH)


def test_full_cache_ends_with_length(params):
    tokens, cache, state = run(params, PROMPTS, 20, cache_len=16)
    # Row 2 has 7 prompt tokens: 16 - 7 = 9 slots left, so the 10th token is its last.
    assert (tokens[2, :10] != PAD_ID).all() and (tokens[2, 10:] == PAD_ID).all()
    assert state.finish_reason_B[2] == FinishReason.LENGTH
    np.testing.assert_array_equal(cache.lengths_B, [16, 16, 16])


def test_finished_rows_do_not_touch_the_cache(params):
    tokens, cache, state = run(params, PROMPTS, 4, budget=3)
    assert (state.finish_reason_B == FinishReason.LENGTH).all()
    before = jax.tree.map(np.asarray, cache)
    controls = DecodeControls.create([GREEDY] * 3, eos_ids=[()] * 3, stop_ids=[()] * 3, max_new_tokens=[3] * 3)
    cache, state, out = decode(params, CONFIG, cache, state, controls, num_steps=4)
    assert (np.asarray(out) == PAD_ID).all()
    for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(cache)):
        np.testing.assert_array_equal(a, b)


def test_controls_validate():
    with pytest.raises(ValueError, match="max_new_tokens must be >= 1"):
        DecodeControls.create([GREEDY], eos_ids=[()], stop_ids=[()], max_new_tokens=[0])
