"""Every supported Hugging Face family against ``transformers`` (torch, CPU, float32, eager attention).

Each case is a tiny random model built locally, with weights made non-trivial where a default would hide
a bug: norm weights perturbed (a wrong Gemma (1 + w) offset shows), biases non-zero, soft-caps small
enough to bite, windows shorter than the test sequence. Per family: full-sequence logits, greedy
32-token continuations (prefill + cached decode vs generate(do_sample=False)), each decode step's logits
vs the full forward, HF → convert → load giving identical params, and in bfloat16 logits (full forward
and cached decode) as close to the float32 computation on the same bfloat16 weights as transformers'
own bfloat16 logits are. ``llm_jax.generate`` itself runs on
the family with the most switches (each family compiles the whole pipeline anew).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

import llm_jax
from llm_jax.kv_cache import init_cache
from llm_jax.model import forward, forward_extend, forward_prefill, unembed
from llm_jax.weights.checkpoint import load_checkpoint
from llm_jax.weights.convert import convert
from llm_jax.weights.placement import leaves_by_path

ATOL = 1e-4  # float32 max |Δlogit| against transformers
PROMPT_LEN, NEW_TOKENS = 12, 32
SEQ_LEN = PROMPT_LEN + NEW_TOKENS  # the full-forward length; every window below is shorter

LLAMA3_ROPE = dict(rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0,
                   high_freq_factor=4.0, original_max_position_embeddings=16)
# Gemma 3's two RoPEs, bases far apart (transformers 5's spelling; the local one plain, as Gemma 3's always is).
GEMMA3_ROPE = dict(full_attention=dict(rope_type="linear", rope_theta=50000.0, factor=8.0),
                   sliding_attention=dict(rope_type="default", rope_theta=100.0))
# Phi-4-mini's LongRoPE on 3/4 of each head (3 frequencies of 6 rotating dimensions), its original context short
# of every prompt: the long factors throughout, and the attention factor sqrt(1 + log(128 / 8) / log(8)).
PHI3_ROPE = dict(rope_type="longrope", rope_theta=10000.0, partial_rotary_factor=0.75,
                 short_factor=[1.1, 0.8, 1.7], long_factor=[2.5, 7.0, 19.0])
PHI3_LONGROPE = llm_jax.LongRope(short_factor=(1.1, 0.8, 1.7), long_factor=(2.5, 7.0, 19.0),
                                 original_max_position_embeddings=8,
                                 attention_factor=math.sqrt(1 + math.log(128 / 8) / math.log(8)))
# OLMo 3's two RoPEs (as transformers 5 writes them): the global layer's linearly scaled, the local one's plain,
# bases far apart.
OLMO3_ROPE = dict(full_attention=dict(rope_type="linear", rope_theta=50000.0, factor=8.0),
                  sliding_attention=dict(rope_type="default", rope_theta=100.0))
# Qwen3's long-context YaRN (factor 4), from an original context of 1024 so that the ramp between the correction
# dimensions lies inside the 8 rotary frequencies (YaRN is static: the sequence length does not pick it).
QWEN3_YARN = dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=1024)
# No special tokens: greedy continuations must run the full 32 tokens on both sides.
COMMON = dict(vocab_size=160, hidden_size=32, intermediate_size=64, num_hidden_layers=2, max_position_embeddings=128,
              rms_norm_eps=1e-6, initializer_range=0.15, bos_token_id=None, eos_token_id=None, pad_token_id=None)


@dataclasses.dataclass(frozen=True)
class Family:
    config_class: type
    fields: dict
    expect: dict  # ModelConfig fields the converter must produce (guards against a switch read as default)


FAMILIES = {
    "llama2_mha": Family(transformers.LlamaConfig, dict(num_attention_heads=4, num_key_value_heads=4),
                         dict(n_kv_heads=4)),
    "llama3_gqa_rope_scaling": Family(
        transformers.LlamaConfig, dict(num_attention_heads=4, num_key_value_heads=2, rope_parameters=LLAMA3_ROPE),
        dict(rope_scaling=llm_jax.Llama3Rope(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                             original_max_position_embeddings=16), rope_theta=500000.0)),
    "llama32_mqa_tied": Family(
        transformers.LlamaConfig, dict(num_attention_heads=4, num_key_value_heads=1, tie_word_embeddings=True,
                                       rope_parameters=dict(LLAMA3_ROPE, factor=32.0)),
        dict(n_kv_heads=1, tie_embeddings=True)),
    "mistral_sliding_window": Family(
        transformers.MistralConfig, dict(num_attention_heads=4, num_key_value_heads=2, sliding_window=7),
        dict(sliding_window=7, sliding_layers=None)),
    "qwen2_bias_tied": Family(
        transformers.Qwen2Config, dict(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True),
        dict(qkv_bias=True, tie_embeddings=True)),
    "qwen3_qk_norm": Family(
        transformers.Qwen3Config, dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16),
        dict(qk_norm=True, head_dim=16)),
    "qwen3_yarn": Family(
        transformers.Qwen3Config, dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                       rope_parameters=QWEN3_YARN),
        dict(qk_norm=True, rope_scaling=llm_jax.YarnRope(factor=4.0, original_max_position_embeddings=1024))),
    "gemma_mqa": Family(
        transformers.GemmaConfig, dict(num_attention_heads=4, num_key_value_heads=1, head_dim=16),
        dict(norm_weight_offset=1.0, embed_scale=True, activation=llm_jax.Activation.GELU_TANH, head_dim=16,
             tie_embeddings=True)),
    "gemma2_softcap_local_global": Family(
        transformers.Gemma2Config,
        dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=24,
             attn_logit_softcapping=1.5, final_logit_softcapping=4.0, sliding_window=6),
        dict(sandwich_norm=True, sliding_window=6, sliding_layers=(True, False), query_pre_attn_scalar=24.0,
             attn_logit_softcap=1.5, final_logit_softcap=4.0)),
    # As the 4B-27B models: the global layer's RoPE linearly scaled, the local layer's plain with its own base.
    "gemma3_qk_norm_local_global": Family(
        transformers.Gemma3TextConfig,
        dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=24, sliding_window=6,
             layer_types=["sliding_attention", "full_attention"], rope_parameters=GEMMA3_ROPE),
        dict(qk_norm=True, sandwich_norm=True, sliding_window=6, sliding_layers=(True, False),
             query_pre_attn_scalar=24.0, rope_theta=50000.0, rope_scaling=llm_jax.LinearRope(factor=8.0),
             sliding_rope_theta=100.0, attn_logit_softcap=None, final_logit_softcap=None)),
    # Fused qkv_proj and gate_up_proj, split at load; a sliding window (Phi-3-mini-4k); LongRoPE and partial rotary.
    "phi3_longrope_partial_window": Family(
        transformers.Phi3Config,
        dict(num_attention_heads=4, num_key_value_heads=2, sliding_window=9, partial_rotary_factor=0.75,
             original_max_position_embeddings=8, rope_parameters=PHI3_ROPE),
        dict(rotary_dim=6, sliding_window=9, sliding_layers=None, rope_scaling=PHI3_LONGROPE)),
    # Norms after attention and the MLP only; q/k norms over all heads at once.
    "olmo2_post_norm_qk_all_heads": Family(
        transformers.Olmo2Config, dict(num_attention_heads=4, num_key_value_heads=2),
        dict(pre_norm=False, sandwich_norm=True, qk_norm=True, qk_norm_scope=llm_jax.QKNormScope.ALL_HEADS,
             norm_eps=1e-6, sliding_window=None)),
    # OLMo 2's layers, a local one (its own plain RoPE) before a global one.
    "olmo3_local_global": Family(
        transformers.Olmo3Config,
        dict(num_attention_heads=4, num_key_value_heads=2, sliding_window=6,
             layer_types=["sliding_attention", "full_attention"], rope_parameters=OLMO3_ROPE),
        dict(pre_norm=False, qk_norm_scope=llm_jax.QKNormScope.ALL_HEADS, sliding_window=6,
             sliding_layers=(True, False), rope_theta=50000.0, rope_scaling=llm_jax.LinearRope(factor=8.0),
             sliding_rope_theta=100.0)),
}


def build(family: Family, folder, seed: int = 0):
    config = family.config_class(**{**COMMON, **family.fields})
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:  # away from the init value, so the (1 + w) offset and every norm count
                param.add_(0.4 * torch.randn_like(param))
            elif name.endswith("bias"):
                param.copy_(0.5 * torch.randn_like(param))
    model.save_pretrained(folder)
    return model


def tokens(vocab_size: int, seed: int, length: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, vocab_size, size=(2, length))


jit_forward = jax.jit(forward, static_argnums=1)


@functools.partial(jax.jit, static_argnames=("config", "steps"))
def greedy_decode(params, config, prompt_BP, steps):
    """Prefill, then ``steps`` cached greedy decode steps: tokens [B, steps] and the logits each was
    chosen from [B, steps, V] (one compiled program; ``llm_jax.generate`` is checked separately)."""
    B, P = prompt_BP.shape
    cache = init_cache(config, B, P + steps)
    x_BPD, cache = forward_prefill(params, config, prompt_BP, jnp.full((B,), P), cache)
    first_BV = unembed(params, config, x_BPD[:, -1:])[:, 0]

    def step(carry, _):
        cache, logits_BV = carry
        token_B = jnp.argmax(logits_BV, axis=-1).astype(jnp.int32)
        x_B1D, cache = forward_extend(params, config, token_B[:, None], cache, jnp.ones((B,), bool))
        return (cache, unembed(params, config, x_B1D)[:, 0]), (token_B, logits_BV)

    _, (tokens_SB, logits_SBV) = jax.lax.scan(step, (cache, first_BV), None, length=steps)
    return tokens_SB.T, logits_SBV.transpose(1, 0, 2)


def torch_greedy(torch_model, prompts: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        out = torch_model.generate(torch.tensor(prompts), attention_mask=torch.ones(prompts.shape, dtype=torch.long),
                                   max_new_tokens=NEW_TOKENS, do_sample=False)
    return out[:, prompts.shape[1]:].numpy()


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    folder: object
    torch_model: object
    model: llm_jax.Model
    prompts: np.ndarray  # [2, PROMPT_LEN]
    reference_greedy: np.ndarray  # transformers' greedy continuation [2, NEW_TOKENS]


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def case(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    torch_model = build(FAMILIES[request.param], folder / "hf")
    model = llm_jax.load(folder / "hf", dtype="float32")
    prompts = tokens(model.config.vocab_size, 1, PROMPT_LEN)
    return Case(request.param, folder, torch_model, model, prompts, torch_greedy(torch_model, prompts))


def test_config_switches_are_read(case):
    for field, value in FAMILIES[case.name].expect.items():
        assert getattr(case.model.config, field) == value, field


def test_logits_match_transformers(case):
    ids = tokens(case.model.config.vocab_size, 0, SEQ_LEN)
    ours = np.asarray(jit_forward(case.model.params, case.model.config, jnp.asarray(ids)))
    with torch.no_grad():
        theirs = case.torch_model(torch.tensor(ids)).logits.numpy()
    delta = float(np.abs(ours - theirs).max())
    print(f"{case.name}: max |Δlogit| {delta:.2e} (logits up to {np.abs(theirs).max():.1f})")
    assert delta <= ATOL, f"{case.name}: max |Δlogit| {delta:.2e} > {ATOL}"


def test_greedy_decode_matches_transformers_and_full_forward(case):
    """32 greedy tokens equal transformers'; every decode step's logits equal the full forward's."""
    model = case.model
    ours, step_logits = greedy_decode(model.params, model.config, jnp.asarray(case.prompts), NEW_TOKENS)
    np.testing.assert_array_equal(np.asarray(ours), case.reference_greedy, err_msg=case.name)
    sequence = np.concatenate([case.prompts, np.asarray(ours)], axis=1)  # SEQ_LEN tokens: past every window
    full = np.asarray(jit_forward(model.params, model.config, jnp.asarray(sequence)))
    np.testing.assert_allclose(np.asarray(step_logits), full[:, PROMPT_LEN - 1:SEQ_LEN - 1], atol=ATOL, rtol=0,
                               err_msg=case.name)


# bfloat16 weights and activations: two engines round at different points (transformers rounds every
# op's output to bfloat16, attention scores included; llm_jax keeps scores, softmax and norms in float32),
# so their logits differ by a few bfloat16 units and greedy continuations may part where two logits are
# that close. The reference is the float32 forward on the same bfloat16 weights: llm_jax's error against
# it may be at most these multiples of transformers' bfloat16 error. Measured over the eight families
# (forward and decode): mean 0.70–1.08×, max 0.45–1.24×; OLMo 2 and 3: mean 0.84–0.90×, max 0.92–1.34×.
# Roundings transformers itself makes (RoPE's tables, the norm's rsqrt) stay within them; RMSNorm computed
# wholly in bfloat16 raises the means by 15–25 % and fails one family; errors of a wrong dtype in a product or
# a softmax are far larger.
BF16_MEAN_RATIO, BF16_MAX_RATIO = 1.25, 1.5


def test_bfloat16_logits_are_as_accurate_as_transformers(case):
    """Full forward and cached greedy decode in bfloat16: mean and max |logit − float32 forward on the same
    weights| within BF16_MEAN_RATIO and BF16_MAX_RATIO of transformers' bfloat16 forward's."""
    model = llm_jax.load(case.folder / "hf", dtype="bfloat16")
    assert (model.config.param_dtype, model.config.compute_dtype) == ("bfloat16", "bfloat16")
    theirs_bf16 = copy.deepcopy(case.torch_model).to(torch.bfloat16)
    exact = copy.deepcopy(theirs_bf16).to(torch.float32)  # the bfloat16 weights, computed in float32
    ids = tokens(model.config.vocab_size, 0, SEQ_LEN)
    greedy_BN, step_logits_BNV = greedy_decode(model.params, model.config, jnp.asarray(case.prompts), NEW_TOKENS)
    runs = {  # sequence, our logits, the positions they are at (decode step s predicts token PROMPT_LEN + s)
        "forward": (ids, jit_forward(model.params, model.config, jnp.asarray(ids)), slice(None)),
        "decode": (np.concatenate([case.prompts, np.asarray(greedy_BN)], axis=1), step_logits_BNV,
                   slice(PROMPT_LEN - 1, SEQ_LEN - 1)),
    }
    for what, (sequence, ours, positions) in runs.items():
        with torch.no_grad():
            reference = exact(torch.tensor(sequence)).logits.numpy()[:, positions]
            theirs = theirs_bf16(torch.tensor(sequence)).logits.float().numpy()[:, positions]
        err_ours, err_theirs = np.abs(np.asarray(ours, np.float32) - reference), np.abs(theirs - reference)
        print(f"{case.name} {what}: |Δ| to float32 mean {err_ours.mean():.2e} max {err_ours.max():.2e} (transformers "
              f"bfloat16 {err_theirs.mean():.2e}, {err_theirs.max():.2e})")
        assert err_ours.mean() <= BF16_MEAN_RATIO * err_theirs.mean(), (case.name, what, err_ours.mean(), err_theirs.mean())
        assert err_ours.max() <= BF16_MAX_RATIO * err_theirs.max(), (case.name, what, err_ours.max(), err_theirs.max())


@pytest.mark.parametrize("name", ["gemma2_softcap_local_global", "gemma3_qk_norm_local_global"])
def test_generate_matches_transformers(name, tmp_path):
    """The whole pipeline (buckets, prefill, start, chunked decode) on the families with the most switches."""
    torch_model = build(FAMILIES[name], tmp_path)
    model = llm_jax.load(tmp_path, dtype="float32")
    prompts = tokens(model.config.vocab_size, 1, PROMPT_LEN)
    results = llm_jax.generate(model, prompts.tolist(), max_new_tokens=NEW_TOKENS, ignore_eos=True)
    np.testing.assert_array_equal(np.array([r.output_ids for r in results]), torch_greedy(torch_model, prompts))


def test_convert_round_trip_is_exact(case):
    name, folder, model = case.name, case.folder, case.model
    convert(folder / "hf", folder / "llm_jax", dtype="float32")
    config, params, _ = load_checkpoint(folder / "llm_jax")
    assert config == model.config
    ours, restored = leaves_by_path(model.params), leaves_by_path(params)
    assert ours.keys() == restored.keys()
    for path in ours:
        np.testing.assert_array_equal(np.asarray(restored[path]), np.asarray(ours[path]), err_msg=f"{name} {path}")


# Switches whose effect tiny random weights could hide, each turned off: the logits must then differ.
SWITCHES_OFF = {
    "mistral_sliding_window": [dict(sliding_window=None)],
    "gemma2_softcap_local_global": [dict(sliding_window=None, sliding_layers=None),
                                    dict(sliding_layers=None),  # every layer local
                                    dict(attn_logit_softcap=None), dict(final_logit_softcap=None),
                                    dict(query_pre_attn_scalar=None)],
    "phi3_longrope_partial_window": [dict(rope_scaling=dataclasses.replace(PHI3_LONGROPE, attention_factor=1.0)),
                                     dict(rope_scaling=dataclasses.replace(PHI3_LONGROPE,
                                                                           long_factor=PHI3_LONGROPE.short_factor)),
                                     dict(rotary_dim=None, rope_scaling=llm_jax.DefaultRope()),  # every dimension
                                     dict(sliding_window=None)],
    "gemma3_qk_norm_local_global": [dict(sliding_window=None, sliding_layers=None, sliding_rope_theta=None),
                                    dict(sliding_rope_theta=None),  # the local layer rotating as the global one
                                    dict(rope_scaling=llm_jax.DefaultRope()),
                                    dict(qk_norm=False), dict(query_pre_attn_scalar=None)],
    "qwen3_yarn": [dict(rope_scaling=dataclasses.replace(FAMILIES["qwen3_yarn"].expect["rope_scaling"],
                                                         attention_factor=1.0)),
                   dict(rope_scaling=dataclasses.replace(FAMILIES["qwen3_yarn"].expect["rope_scaling"],
                                                         truncate=False)),
                   dict(rope_scaling=llm_jax.LinearRope(factor=4.0))],
    "olmo3_local_global": [dict(sliding_window=None, sliding_layers=None, sliding_rope_theta=None),
                           dict(sliding_rope_theta=None), dict(rope_scaling=llm_jax.DefaultRope())],
}


@pytest.mark.parametrize("name", sorted(SWITCHES_OFF))
def test_switches_matter_within_the_test_sequence(name, tmp_path):
    """The parity tests above really exercise local and global attention, soft-caps and the query scale."""
    build(FAMILIES[name], tmp_path)
    model = llm_jax.load(tmp_path, dtype="float32")
    ids = jnp.asarray(tokens(model.config.vocab_size, 0, SEQ_LEN))
    reference = np.asarray(jit_forward(model.params, model.config, ids))
    for changes in SWITCHES_OFF[name]:
        changed = np.asarray(jit_forward(model.params, model.config.replace(**changes), ids))
        assert np.abs(changed - reference).max() > 10 * ATOL, changes
