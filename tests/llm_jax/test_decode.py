"""Decode: greedy tokens equal teacher-forced argmax; stop conditions (ids, strings on device) freeze finished
rows; per-row controls give each row what it gets alone; log-probabilities."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

import llm_jax
from llm_jax.config import ModelConfig
from llm_jax.decoding import PAD_ID, DecodeControls, FinishReason, Logprobs, decode, start
from llm_jax.kv_cache import init_cache
from llm_jax.model import forward, init_params
from llm_jax.prefilling import pad_prompts, prefill
from llm_jax.sampling import GREEDY, Sampling

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
    state, first = start(logits, tokens, cache, controls)
    cache, state, out = decode(params, CONFIG, cache, state, controls, num_steps=steps)
    return np.concatenate([first.tokens_BS, out.tokens_BS], axis=1), cache, state


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
    assert (np.asarray(out.tokens_BS) == PAD_ID).all()
    for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(cache)):
        np.testing.assert_array_equal(a, b)


def test_a_bfloat16_cache_is_updated_in_place():
    """init_cache holds a bfloat16 cache as its bits, which the decode loop updates in place: the cache is
    aliased to the result and no scratch of its size is needed (converting it to bits and back around
    the loop would be two copies of the whole cache per call)."""
    config = dataclasses.replace(CONFIG, head_dim=64, max_seq_len=256, param_dtype="bfloat16",
                                 compute_dtype="bfloat16")
    params = init_params(config, seed=1)
    controls = DecodeControls.create([GREEDY] * 2, eos_ids=[()] * 2, stop_ids=[()] * 2, max_new_tokens=[3] * 2)
    tokens, lengths = pad_prompts(PROMPTS[:2], 16)
    logits, cache = prefill(params, config, tokens, lengths, init_cache(config, 2, 256))
    assert cache.k_LBSKH.dtype == jnp.uint16 and cache.dtype == jnp.bfloat16
    state, _ = start(logits, tokens, cache, controls)
    memory = decode.lower(params, config, cache, state, controls, num_steps=4).compile().memory_analysis()
    cache_bytes = cache.k_LBSKH.nbytes + cache.v_LBSKH.nbytes
    assert memory.alias_size_in_bytes >= cache_bytes
    assert memory.temp_size_in_bytes < cache_bytes / 4, (memory.temp_size_in_bytes, cache_bytes)


def test_controls_validate():
    with pytest.raises(ValueError, match="max_new_tokens must be >= 1"):
        DecodeControls.create([GREEDY], eos_ids=[()], stop_ids=[()], max_new_tokens=[0])


# Per-row controls: each row of a mixed batch gets what it gets alone.

MIXED = [
    Sampling(temperature=0.9, top_p=0.9, presence_penalty=0.8, frequency_penalty=0.3, logit_bias={7: 2.0}, seed=42),
    GREEDY,
    Sampling(repetition_penalty=1.5, no_repeat_ngram_size=2),
    Sampling(temperature=1.2, typical_p=0.7, bad_words_ids=((9, 3), (30,)), seed=7),
]


def generate_rows(params, rows, prompts, *, budgets, minimum):
    model = llm_jax.Model(config=CONFIG, params=params, tokenizer=None, eos_ids=(5,))
    results = llm_jax.generate(model, prompts, sampling=rows, max_new_tokens=budgets, min_new_tokens=minimum,
                               stop_token_ids=[11], chunk_steps=12)
    return [r.output_ids for r in results]


def test_mixed_batch_rows_equal_rows_alone_and_seeds_ignore_position(params):
    """Eight rows with different settings; the seeded row 0 also sits at position 5 (same prompt)."""
    order = [0, 1, 2, 3, 2, 0, 3, 1]
    prompts = [PROMPTS[i % 3] for i in range(8)]
    prompts[5] = prompts[0]
    budgets = [12, 9, 12, 10, 12, 12, 10, 9]
    minimum = [3, 0, 0, 4, 0, 3, 4, 0]
    batch = generate_rows(params, [MIXED[k] for k in order], prompts, budgets=budgets, minimum=minimum)
    assert batch[0] == batch[5]
    for row in (0, 1, 2, 3):  # each distinct setting once alone (batch of 1)
        alone = generate_rows(params, [MIXED[order[row]]], [prompts[row]], budgets=[budgets[row]],
                              minimum=[minimum[row]])
        assert alone[0] == batch[row], f"row {row}"
    assert len({tuple(o) for o in batch}) >= 5, "rows should differ, or the test proves little"


def test_min_new_tokens_and_logprobs_after_processors(params):
    """EOS is banned before min_new_tokens; logprobs are those of the processed distribution (EOS at -inf
    there), with the top alternatives."""
    free, _, _ = run(params, PROMPTS, 9)
    eos = int(free[0, 1])  # row 0 would end at its 2nd token
    minimum = [5, 0, 5]
    controls = DecodeControls.create([GREEDY] * 3, eos_ids=[(eos,)] * 3, stop_ids=[()] * 3, max_new_tokens=[8] * 3,
                                     min_new_tokens=minimum, logprobs=Logprobs(top_n=3))
    tokens, lengths = pad_prompts(PROMPTS, 16)
    logits, cache = prefill(params, CONFIG, tokens, lengths, init_cache(CONFIG, 3, 32))
    state, first = start(logits, tokens, cache, controls)
    cache, state, out = decode(params, CONFIG, cache, state, controls, num_steps=7)
    generated = np.concatenate([first.tokens_BS, out.tokens_BS], axis=1)
    logprobs = np.concatenate([first.logprobs_BS, out.logprobs_BS], axis=1)
    top_ids = np.concatenate([first.top_ids_BSN, out.top_ids_BSN], axis=1)
    top_logprobs = np.concatenate([first.top_logprobs_BSN, out.top_logprobs_BSN], axis=1)
    assert eos not in generated[0, :5].tolist()
    if eos in free[1].tolist():  # row 1 has no minimum: it ends where it did
        assert state.finish_reason_B[1] == FinishReason.EOS
    counts = np.asarray(state.num_generated_B)
    sequences = [prompt + generated[row, :n].tolist() for row, (prompt, n) in enumerate(zip(PROMPTS, counts))]
    padded, lengths = pad_prompts(sequences, 16)
    full = np.array(jax.jit(forward, static_argnums=1)(params, CONFIG, padded, lengths))
    for row, (prompt, n) in enumerate(zip(PROMPTS, counts)):
        scores = full[row, len(prompt) - 1:len(prompt) - 1 + n]
        scores[: minimum[row], eos] = -np.inf  # min_new_tokens' ban is part of the processed distribution
        logp = np.asarray(jax.nn.log_softmax(scores, axis=-1))
        # Decode's products (the CPU kernels, one row) sum in another order than the full forward's: float32
        # log-probabilities agree to 1e-5 relative.
        np.testing.assert_allclose(logprobs[row, :n], logp[np.arange(n), generated[row, :n]], atol=1e-5, rtol=1e-5)
        np.testing.assert_array_equal(top_ids[row, :n, 0], generated[row, :n])
        np.testing.assert_allclose(top_logprobs[row, :n], -np.sort(-logp, axis=1)[:, :3], atol=1e-5, rtol=1e-5)


def test_stop_string_ends_the_row_on_device(stories260k_dir):
    """A stop string spanning two tokens finishes the row at the token completing it, inside the loop."""
    model = llm_jax.load(stories260k_dir / "stories260K.bin")
    tok = model.tokenizer
    prompt = tok.encode("Once upon a time")
    reference = transformers.LlamaForCausalLM.from_pretrained(stories260k_dir / "hf").eval()
    with torch.no_grad():  # the free greedy continuation (equal to ours: see test_generate)
        free = reference.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=40, min_new_tokens=40,
                                  eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
    forms = [tok.decode(prompt + free[:i + 1])[len(tok.decode(prompt + free[:i])):] for i in range(len(free))]
    # A boundary between two tokens of 3+ characters, late enough that the stop string is new there.
    i = next(i for i in range(8, len(free) - 1) if len(forms[i]) >= 3 and len(forms[i + 1]) >= 3
             and (forms[i][-2:] + forms[i + 1][:2]) not in "".join(forms[:i + 1]))
    stop = forms[i][-2:] + forms[i + 1][:2]
    # Row 1 must generate i + 1 tokens first: the stop string starts inside them, so it does not count.
    controls = DecodeControls.create([GREEDY] * 2, eos_ids=[()] * 2, stop_ids=[()] * 2, max_new_tokens=[40] * 2,
                                     min_new_tokens=[0, i + 1], stop_strings=[[stop]] * 2, tokenizer=tok)
    tokens, lengths = pad_prompts([prompt] * 2, 16)
    logits, cache = prefill(model.params, model.config, tokens, lengths, init_cache(model.config, 2, 64))
    state, first = start(logits, tokens, cache, controls)
    cache, state, out = decode(model.params, model.config, cache, state, controls, num_steps=39)
    generated = np.concatenate([first.tokens_BS, out.tokens_BS], axis=1)
    assert state.finish_reason_B[0] == FinishReason.STOP
    np.testing.assert_array_equal(generated[0, :i + 2], free[:i + 2])
    assert (generated[0, i + 2:] == PAD_ID).all()
    np.testing.assert_array_equal(generated[1, :i + 3], free[:i + 3])
