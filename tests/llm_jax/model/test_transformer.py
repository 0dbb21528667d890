"""The decoder against Hugging Face ``transformers`` (torch, CPU, float32): logits and cache consistency."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

import llm_jax
from llm_jax.kv_cache import init_cache
from llm_jax.model import LayerHooks, forward, forward_extend, forward_prefill, unembed
from tests.hf_models import save_tiny_llama

ATOL = 1e-4  # float32 max |Δlogit| against transformers

jit_forward = jax.jit(forward, static_argnums=1)


def torch_logits(model, tokens: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor(tokens)).logits.numpy()


LLAMA3_ROPE = dict(rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0,
                   high_freq_factor=4.0, original_max_position_embeddings=16)

CONFIGS = {
    "mha": dict(num_attention_heads=4, num_key_value_heads=4),
    "gqa": dict(num_attention_heads=4, num_key_value_heads=2),
    "mqa_tied": dict(num_attention_heads=4, num_key_value_heads=1, tie_word_embeddings=True),
    "gqa_llama3_rope": dict(num_attention_heads=6, num_key_value_heads=2, hidden_size=48,
                            rope_parameters=LLAMA3_ROPE),
    "linear_rope_head_dim": dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                 rope_parameters=dict(rope_type="linear", rope_theta=10000.0, factor=2.0)),
}


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def tiny_llama(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    torch_model = save_tiny_llama(folder, **CONFIGS[request.param])
    return torch_model, llm_jax.load(folder, dtype="float32")


def test_random_llama_logits_match_transformers(tiny_llama):
    torch_model, model = tiny_llama
    tokens = np.random.default_rng(0).integers(0, model.config.vocab_size, size=(2, 40))
    ours = np.asarray(jit_forward(model.params, model.config, jnp.asarray(tokens)))
    np.testing.assert_allclose(ours, torch_logits(torch_model, tokens), atol=ATOL, rtol=0)


def test_llama3_rope_scaling_is_read_and_matters(tmp_path):
    """Guard against a rope-scaling config silently read as default RoPE."""
    save_tiny_llama(tmp_path, **CONFIGS["gqa_llama3_rope"])
    model = llm_jax.load(tmp_path)
    assert model.config.rope_scaling == llm_jax.Llama3Rope(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                                           original_max_position_embeddings=16)
    assert model.config.rope_theta == 500000.0
    tokens = jnp.asarray(np.arange(40)[None] % model.config.vocab_size)
    plain = model.config.replace(rope_scaling=llm_jax.DefaultRope())
    scaled = np.asarray(jit_forward(model.params, model.config, tokens))
    unscaled = np.asarray(jit_forward(model.params, plain, tokens))
    assert np.abs(scaled - unscaled).max() > 10 * ATOL  # far above the parity tolerance


@functools.partial(jax.jit, static_argnames=("config", "prompt_len", "max_len"))
def prefill_then_extend(params, config, tokens_BT, prompt_len, max_len):
    """Logits of positions [prompt_len-1, T-1): prefill the prompt, then append one token per step."""
    B, T = tokens_BT.shape
    cache = init_cache(config, B, max_len)
    lengths_B = jnp.full((B,), prompt_len, jnp.int32)
    x_BTD, cache = forward_prefill(params, config, tokens_BT[:, :prompt_len], lengths_B, cache)
    logits = [unembed(params, config, x_BTD[:, -1:])]
    active_B = jnp.ones((B,), bool)
    for t in range(prompt_len, T - 1):
        x_B1D, cache = forward_extend(params, config, tokens_BT[:, t:t + 1], cache, active_B)
        logits.append(unembed(params, config, x_B1D))
    return jnp.concatenate(logits, axis=1), cache.lengths_B


def test_prefill_then_decode_steps_match_full_forward(tiny_llama):
    _, model = tiny_llama
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, model.config.vocab_size, size=(2, 24)))
    full = np.asarray(jit_forward(model.params, model.config, tokens))
    stepped, lengths = prefill_then_extend(model.params, model.config, tokens, prompt_len=20, max_len=32)
    np.testing.assert_allclose(np.asarray(stepped), full[:, 19:23], atol=ATOL, rtol=0)
    np.testing.assert_array_equal(lengths, [23, 23])


def test_right_padding_does_not_change_real_positions(tiny_llama):
    _, model = tiny_llama
    rng = np.random.default_rng(2)
    tokens = rng.integers(0, model.config.vocab_size, size=(1, 11))
    padded = np.concatenate([tokens, rng.integers(0, model.config.vocab_size, size=(1, 5))], axis=1)
    alone = np.asarray(jit_forward(model.params, model.config, jnp.asarray(tokens)))
    masked = np.asarray(jax.jit(forward, static_argnums=1)(model.params, model.config, jnp.asarray(padded),
                                                            jnp.array([11])))
    np.testing.assert_allclose(masked[:, :11], alone, atol=1e-5, rtol=0)


@pytest.mark.parametrize("source", ["bin", "hf"])
def test_stories260k_logits_match_transformers(stories260k_dir, source):
    path = stories260k_dir / ("stories260K.bin" if source == "bin" else "hf")
    model = llm_jax.load(path)
    reference = transformers.LlamaForCausalLM.from_pretrained(stories260k_dir / "hf").eval()
    prompts = ["Once upon a time, there was a little girl named Lily.",
               "The dog ran to the park. He saw a big red ball and",
               "Tom and Sue were friends. One day"]
    worst = 0.0
    for prompt in prompts:
        ids = np.array([model.tokenizer.encode(prompt)])
        ours = np.asarray(jit_forward(model.params, model.config, jnp.asarray(ids)))
        worst = max(worst, float(np.abs(ours - torch_logits(reference, ids)).max()))
    assert worst <= ATOL, f"max |Δlogit| {worst:.2e} > {ATOL}"


@pytest.fixture(scope="module")
def gqa_llama(tmp_path_factory):
    folder = tmp_path_factory.mktemp("hooks")
    torch_model = save_tiny_llama(folder, **CONFIGS["gqa"])
    return torch_model, llm_jax.load(folder, dtype="float32")


def test_recorded_layers_equal_transformers_hidden_states(gqa_llama):
    torch_model, model = gqa_llama
    tokens = np.random.default_rng(3).integers(0, model.config.vocab_size, size=(2, 12))
    hooks = LayerHooks(record_layers=(1, 0))
    logits, hidden = jax.jit(forward, static_argnums=1)(model.params, model.config, jnp.asarray(tokens), hooks=hooks)
    with torch.no_grad():
        out = torch_model(torch.tensor(tokens), output_hidden_states=True)
    assert hidden.shape == (2, 12, 2, model.config.d_model)
    # transformers' hidden_states[l + 1] is layer l's output (all but the last layer, which it norms).
    np.testing.assert_allclose(hidden[:, :, 0], out.hidden_states[2].numpy(), atol=ATOL, rtol=0)
    np.testing.assert_allclose(hidden[:, :, 1], out.hidden_states[1].numpy(), atol=ATOL, rtol=0)
    np.testing.assert_allclose(logits, out.logits.numpy(), atol=ATOL, rtol=0)


def test_steering_equals_a_torch_forward_hook(gqa_llama):
    """Adding vector l after layer l equals a forward hook adding it to the layer's output in torch."""
    torch_model, model = gqa_llama
    rng = np.random.default_rng(4)
    tokens = rng.integers(0, model.config.vocab_size, size=(2, 10))
    steering = rng.normal(0, 0.5, (2, model.config.n_layers, model.config.d_model)).astype(np.float32)

    def adder(vector):
        def hook(module, inputs, output):
            added = torch.tensor(vector)[:, None, :]
            return (output[0] + added, *output[1:]) if isinstance(output, tuple) else output + added
        return hook

    handles = [layer.register_forward_hook(adder(steering[:, l])) for l, layer in enumerate(torch_model.model.layers)]
    try:
        expected = torch_logits(torch_model, tokens)
    finally:
        for handle in handles:
            handle.remove()
    steered, _ = jax.jit(forward, static_argnums=1)(model.params, model.config, jnp.asarray(tokens),
                                                    hooks=LayerHooks(steering_BLD=jnp.asarray(steering)))
    np.testing.assert_allclose(steered, expected, atol=ATOL, rtol=0)
    assert np.abs(expected - torch_logits(torch_model, tokens)).max() > 10 * ATOL  # the steering mattered


def test_hooks_reject_bad_shapes(gqa_llama):
    _, model = gqa_llama
    tokens = jnp.zeros((1, 4), jnp.int32)
    with pytest.raises(ValueError, match="record_layers \\[7\\] outside"):
        forward(model.params, model.config, tokens, hooks=LayerHooks(record_layers=(7,)))
    with pytest.raises(ValueError, match="steering_BLD has shape"):
        forward(model.params, model.config, tokens, hooks=LayerHooks(steering_BLD=jnp.zeros((1, 2, 5))))
