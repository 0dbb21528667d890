"""YaRN RoPE scaling (``rope_type: yarn``; :class:`llm_jax.YarnRope`) against ``transformers``: its inverse
frequencies and attention factor over the settings ``_compute_yarn_parameters`` reads (the ramp truncated or not,
other betas, DeepSeek's mscale ratio, an ``attention_factor`` override, a null ``factor``, partial rotary, the
original context's fallback), tiny checkpoints' float32 logits and greedy tokens on both backends, the config's
round trip, GGUF read and written as llama.cpp's converter writes it, and the refusals.

Four tiny checkpoints (head dim 16, so 8 rotary frequencies): "qwen2" as Qwen2.5's long-context recipe (factor 4,
transformers 4's ``rope_scaling`` spelling) with an original context of 16 that the test sequences cross,
"llama_deepseek" (a null factor, so max_position_embeddings / 16 = 4, and the attention factor from ``mscale`` /
``mscale_all_dim``), "llama_gpt_oss" (factor 32 from 4096, the ramp not truncated, betas 16 / 2, an
``attention_factor`` given) and "olmo3" (YaRN from 1024 on the global layer only, its attention factor spelled out
as OLMo 3's release does; a local layer beside it with plain RoPE). The last two put the ramp between the
correction dimensions inside the rotary dimensions, where betas and truncation change the frequencies."""

from __future__ import annotations

import dataclasses
import json
import math

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

import llm_jax
from llm_jax.config import ConfigError, ModelConfig, YarnRope
from llm_jax.model import forward
from llm_jax.model.rope import inverse_frequencies
from llm_jax.weights.hf_config import config_from_hf
from llm_jax.weights.to_gguf import save_gguf
from tests.hf_models import save_random_model
from tests.llm_jax.model.test_families import ATOL

ORIG = 16
VOCAB = 97
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=72, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-6, initializer_range=0.15,
              bos_token_id=None, eos_token_id=None, pad_token_id=None)
QWEN25_YARN = dict(type="yarn", factor=4.0, original_max_position_embeddings=ORIG)
OLMO3_YARN = dict(rope_type="yarn", factor=8.0, original_max_position_embeddings=1024,
                  attention_factor=1.2079441541679836, beta_fast=32, beta_slow=1)
CHECKPOINTS = {
    "qwen2": (transformers.Qwen2Config, dict(rope_theta=1e6, rope_scaling=QWEN25_YARN),
              YarnRope(factor=4.0, original_max_position_embeddings=ORIG)),
    "llama_deepseek": (transformers.LlamaConfig,
                       dict(rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=None,
                                                 original_max_position_embeddings=ORIG, mscale=1.0,
                                                 mscale_all_dim=0.5)),
                       YarnRope(factor=4.0, original_max_position_embeddings=ORIG,
                                attention_factor=(1 + 0.1 * math.log(4)) / (1 + 0.05 * math.log(4)))),
    "llama_gpt_oss": (transformers.LlamaConfig,
                      dict(rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=32.0,
                                                original_max_position_embeddings=4096, beta_fast=16.0, beta_slow=2.0,
                                                attention_factor=1.3, truncate=False)),
                      YarnRope(factor=32.0, original_max_position_embeddings=4096, beta_fast=16.0, beta_slow=2.0,
                               attention_factor=1.3, truncate=False)),
    "olmo3": (transformers.Olmo3Config,
              dict(sliding_window=6, layer_types=["sliding_attention", "full_attention"], rope_theta=50000.0,
                   rope_scaling=OLMO3_YARN),
              YarnRope(factor=8.0, original_max_position_embeddings=1024, attention_factor=1.2079441541679836)),
}
BACKENDS = ["cpu", "xla"]
SEQ_LEN, PROMPT_LEN, NEW_TOKENS = 40, 12, 24  # past the original context of 16



def build(folder, name: str):
    """A random checkpoint of ``name`` saved to ``folder``; its norms perturbed away from 1, its biases non-zero."""
    config_class, fields, _ = CHECKPOINTS[name]
    return save_random_model(folder, config_class(**{**COMMON, **fields}), bias_scale=0.5)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """name → (folder, torch model)."""
    out = {}
    for name in CHECKPOINTS:
        folder = tmp_path_factory.mktemp(name)
        out[name] = folder, build(folder, name)
    return out


def tokens(seed: int, length: int, rows: int = 1) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, VOCAB, size=(rows, length))


def max_delta(ours, theirs) -> float:
    return float(np.abs(np.asarray(ours) - np.asarray(theirs)).max())


run_forward = jax.jit(forward, static_argnums=1, static_argnames="backend")


# --- frequencies and attention factor -----------------------------------------------------------------------

# (rope_parameters, head_dim, partial_rotary_factor): Qwen2.5's and Qwen3's long-context recipe at full size,
# gpt-oss's untruncated ramp, DeepSeek's mscale ratio with a null factor, an attention_factor override, a ramp
# that collapses to one dimension (low == high: transformers' + 0.001), a factor below 1, partial rotary.
FREQUENCY_CASES = [
    (dict(factor=4.0, original_max_position_embeddings=32768, rope_theta=1e6), 128, 1.0),
    (dict(factor=4.0, original_max_position_embeddings=ORIG), 16, 1.0),
    (dict(factor=32.0, original_max_position_embeddings=4096, rope_theta=150000.0, beta_fast=32.0, beta_slow=1.0,
          truncate=False), 64, 1.0),
    (dict(factor=None, original_max_position_embeddings=ORIG, mscale=0.707, mscale_all_dim=1.0), 64, 1.0),
    (dict(factor=4.0, original_max_position_embeddings=ORIG, mscale=0.707), 64, 1.0),  # mscale alone: not read
    (dict(factor=8.0, original_max_position_embeddings=8192, attention_factor=1.5, beta_fast=8, beta_slow=4), 64, 1.0),
    (dict(factor=2.0, original_max_position_embeddings=ORIG, beta_fast=3.0, beta_slow=3.0), 16, 1.0),
    (dict(factor=0.5, original_max_position_embeddings=ORIG), 16, 1.0),
    (dict(factor=4.0, original_max_position_embeddings=ORIG), 16, 0.75),
    (dict(factor=4.0, original_max_position_embeddings=1024, truncate=False), 96, 0.5),
]


@pytest.mark.parametrize("rope, head_dim, partial", FREQUENCY_CASES)
def test_frequencies_and_attention_factor_are_transformers(rope, head_dim, partial):
    rope = {"rope_type": "yarn", "rope_theta": 10000.0, **rope}
    hf = dict(architectures=["LlamaForCausalLM"], vocab_size=8, hidden_size=4 * head_dim, intermediate_size=8,
              num_hidden_layers=1, num_attention_heads=4, head_dim=head_dim, max_position_embeddings=64)
    theirs_config = transformers.LlamaConfig(**{k: v for k, v in hf.items() if k != "architectures"},
                                             rope_parameters={**rope, "partial_rotary_factor": partial})
    inv_freq, attention_factor = ROPE_INIT_FUNCTIONS["yarn"](theirs_config)
    scaling = config_from_hf({**hf, "rope_parameters": rope}).rope_scaling
    ours = inverse_frequencies(int(head_dim * partial), rope["rope_theta"], scaling)
    np.testing.assert_allclose(ours, inv_freq.numpy(), rtol=1e-6, atol=0)
    assert scaling.cos_sin_scale == pytest.approx(attention_factor, rel=1e-12)


def test_original_context_falls_back_as_transformers_does():
    """Absent from the scaling: ``max_position_embeddings`` (one beside the scaling is not read, but for Phi-3)."""
    hf = dict(architectures=["Qwen2ForCausalLM"], vocab_size=8, hidden_size=32, intermediate_size=8,
              num_hidden_layers=1, num_attention_heads=4, max_position_embeddings=128,
              original_max_position_embeddings=64, rope_scaling=dict(type="yarn", factor=4.0))
    theirs = transformers.Qwen2Config.from_dict({k: v for k, v in hf.items() if k != "architectures"})
    assert theirs.rope_parameters["original_max_position_embeddings"] == 128
    assert config_from_hf(hf).rope_scaling == YarnRope(factor=4.0, original_max_position_embeddings=128)


# --- tiny checkpoints -------------------------------------------------------------------------------------


def test_config_is_read_and_round_trips(checkpoints):
    for name, (folder, _) in checkpoints.items():
        config = llm_jax.load(folder, dtype="float32").config
        assert config.rope_scaling == CHECKPOINTS[name][2], name
        assert ModelConfig.from_dict(json.loads(json.dumps(config.to_dict()))) == config
    olmo3 = llm_jax.load(checkpoints["olmo3"][0], dtype="float32").config
    # Olmo3Config gives rope_theta to the global layers only; the local ones keep its default base
    assert (olmo3.sliding_layers, olmo3.rope_theta, olmo3.sliding_rope_theta) == ((True, False), 50000.0, 500000.0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_logits_match_transformers(checkpoints, backend):
    for name, (folder, torch_model) in checkpoints.items():
        model = llm_jax.load(folder, dtype="float32", backend=backend)
        ids = tokens(1, SEQ_LEN, rows=2)
        with torch.no_grad():
            theirs = torch_model(torch.tensor(ids)).logits.numpy()
        delta = max_delta(run_forward(model.weights, model.config, jnp.asarray(ids), backend=model.backend), theirs)
        print(f"yarn {name} {backend} T={SEQ_LEN}: max |Δlogit| {delta:.2e} (logits up to {np.abs(theirs).max():.1f})")
        assert delta <= ATOL, (name, backend, delta)


@pytest.mark.parametrize("backend", BACKENDS)
def test_generate_matches_transformers(checkpoints, backend):
    """24 greedy tokens after a 12-token prompt: past the original context of 16."""
    for name, (folder, torch_model) in checkpoints.items():
        model = llm_jax.load(folder, dtype="float32", backend=backend)
        prompt = tokens(2, PROMPT_LEN)
        with torch.no_grad():
            ids = torch.tensor(prompt)
            out = torch_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS,
                                       do_sample=False)
        ours = llm_jax.generate(model, prompt.tolist(), max_new_tokens=NEW_TOKENS, ignore_eos=True)[0].output_ids
        assert ours == out[0, PROMPT_LEN:].tolist(), (name, backend)


# Where the ramp lies inside the rotary dimensions (its ends not clamped to the first one): an original context
# of 16 keeps frequency 0 alone and interpolates the others, whatever the betas or truncation.
RAMP_INSIDE = ("llama_gpt_oss", "olmo3")


def test_every_setting_matters(checkpoints):
    """Each checkpoint's forward with one YaRN setting changed (no attention factor, plain RoPE, position
    interpolation; where the ramp lies inside the dimensions, betas 4 times theirs, the ramp truncated or not) is
    far from transformers'."""
    for name, (folder, torch_model) in checkpoints.items():
        model = llm_jax.load(folder, dtype="float32", backend="xla")
        rope = model.config.rope_scaling
        ids = jnp.asarray(tokens(3, SEQ_LEN, rows=2))
        with torch.no_grad():
            theirs = torch_model(torch.tensor(np.asarray(ids))).logits.numpy()
        changes = [dataclasses.replace(rope, attention_factor=1.0), llm_jax.DefaultRope(),
                   llm_jax.LinearRope(factor=rope.factor)]
        if name in RAMP_INSIDE:
            changes += [dataclasses.replace(rope, beta_fast=rope.beta_fast * 4, beta_slow=rope.beta_slow * 4),
                        dataclasses.replace(rope, truncate=not rope.truncate)]
        for other in changes:
            delta = max_delta(run_forward(model.params, model.config.replace(rope_scaling=other), ids), theirs)
            assert delta > 100 * ATOL, (name, other, delta)


# --- GGUF -------------------------------------------------------------------------------------------------


def yarn_keys(factor, orig, **more):
    """The metadata convert_hf_to_gguf.py writes for a YaRN config (its optional keys as ``more``)."""
    def add(w: gguf.GGUFWriter) -> None:
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(factor)
        if orig is not None:
            w.add_rope_scaling_orig_ctx_len(orig)
        for name, value in more.items():
            getattr(w, f"add_rope_scaling_{name}")(value)
    return add


def test_qwen2_gguf_runs_as_transformers(checkpoints, tmp_path):
    from tests.llm_jax.weights.test_gguf import write_gguf

    folder, torch_model = checkpoints["qwen2"]
    path = write_gguf(tmp_path / "qwen2.gguf", folder, extra=yarn_keys(4.0, ORIG, yarn_beta_fast=32.0,
                                                                         yarn_beta_slow=1.0))
    model = llm_jax.load(path, dtype="float32")
    assert model.config.rope_scaling == YarnRope(factor=4.0, original_max_position_embeddings=ORIG)
    ids = tokens(4, SEQ_LEN, rows=2)
    with torch.no_grad():
        theirs = torch_model(torch.tensor(ids)).logits.numpy()
    delta = max_delta(run_forward(model.weights, model.config, jnp.asarray(ids), backend=model.backend), theirs)
    print(f"yarn qwen2 gguf: max |Δlogit| {delta:.2e}")
    assert delta <= ATOL
    # no original_context_length: llama.cpp's context_length (transformers' max_position_embeddings)
    fallback = write_gguf(tmp_path / "fallback.gguf", folder, extra=yarn_keys(4.0, None))
    assert llm_jax.load(fallback).config.rope_scaling == YarnRope(factor=4.0, original_max_position_embeddings=64)


@pytest.mark.parametrize("key, value", [("yarn_ext_factor", 0.5), ("yarn_log_mul", 0.0707),
                                        ("yarn_attn_factor", 1.3), ("attn_factors", 0.8)])
def test_gguf_yarn_llama_cpp_reads_otherwise_is_refused_by_key(checkpoints, tmp_path, key, value):
    from tests.llm_jax.weights.test_gguf import write_gguf

    path = write_gguf(tmp_path / "m.gguf", checkpoints["qwen2"][0], extra=yarn_keys(4.0, ORIG, **{key: value}))
    written = {"yarn_log_mul": "yarn_log_multiplier", "attn_factors": "attn_factor"}.get(key, key)
    with pytest.raises(ConfigError, match=rf"qwen2\.rope\.scaling\.{written}=.* is not supported"):
        llm_jax.load(path)


def test_gguf_default_attention_factor_is_read(checkpoints, tmp_path):
    """convert_hf_to_gguf.py writes a config's attention_factor as yarn_attn_factor: YaRN's own is read."""
    from tests.llm_jax.weights.test_gguf import write_gguf

    path = write_gguf(tmp_path / "m.gguf", checkpoints["qwen2"][0],
                      extra=yarn_keys(8.0, ORIG, yarn_attn_factor=1.2079441541679836))
    assert llm_jax.load(path).config.rope_scaling == YarnRope(factor=8.0, original_max_position_embeddings=ORIG)


def test_gguf_written_and_read_back(checkpoints, tmp_path):
    """Llama with Qwen2.5's YaRN settings is written as llama.cpp runs it; one with a ramp not truncated, or
    another attention factor, is refused by field."""
    model = llm_jax.load(checkpoints["llama_deepseek"][0], dtype="float32")
    config = model.config.replace(rope_scaling=YarnRope(factor=4.0, original_max_position_embeddings=ORIG,
                                                        beta_fast=16.0))
    back = llm_jax.load(save_gguf(tmp_path / "m.gguf", config, model.params, "F32"), dtype="float32")
    assert back.config.rope_scaling == config.rope_scaling
    with pytest.raises(ConfigError, match=r"rope_scaling=YarnRope\(.*\(llama\.cpp scales YaRN's cos and sin by "
                                          r"0\.1 ln\(factor\) \+ 1 = 1\.13863, not 1\.06482\)"):
        save_gguf(tmp_path / "n.gguf", model.config, model.params, "F32")
    with pytest.raises(ConfigError, match=r"truncate=False.*\(llama\.cpp truncates YaRN's ramp\)"):
        save_gguf(tmp_path / "n.gguf", config.replace(rope_scaling=dataclasses.replace(config.rope_scaling,
                                                                                       truncate=False)),
                  model.params, "F32")


# --- refusals ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fields, message", [
    (dict(factor=0.0), "yarn factor must be a positive number, got 0.0"),
    (dict(factor="4"), "yarn factor must be a positive number, got '4'"),
    (dict(beta_fast=1.0, beta_slow=32.0), "yarn beta_fast=1.0 must be at least beta_slow=32.0"),
    (dict(original_max_position_embeddings=16.5), "yarn original_max_position_embeddings must be a positive integer"),
    (dict(attention_factor=-1.0), "yarn attention_factor must be a positive number or None, got -1.0"),
    (dict(truncate="no"), "yarn truncate must be true or false, got 'no'"),
])
def test_bad_yarn_is_refused_by_field(fields, message):
    with pytest.raises(ConfigError, match=message):
        YarnRope(**{"factor": 4.0, "original_max_position_embeddings": ORIG, **fields})


HF = dict(vocab_size=8, hidden_size=32, intermediate_size=8, num_hidden_layers=2, num_attention_heads=4,
          max_position_embeddings=64)


@pytest.mark.parametrize("architecture, fields, message", [
    ("LlamaForCausalLM", dict(rope_parameters=dict(rope_type="yarn", original_max_position_embeddings=16)),
     "rope scaling yarn .* has no factor"),
    ("Qwen2ForCausalLM", dict(rope_scaling=dict(type="yarn", factor=4.0, beta_fast=1, beta_slow=8)),
     "beta_fast=1.0 must be at least beta_slow=8.0"),
    ("Olmo3ForCausalLM", dict(rope_scaling=dict(OLMO3_YARN, truncate=False)),
     "truncate=False is not supported per layer type; transformers 5 reads truncate from the top level"),
    ("Olmo3ForCausalLM", dict(rope_scaling=dict(type="yarn", factor=4.0)),
     "names its type as 'type' only; transformers 5 then runs plain RoPE"),
    ("Gemma3ForCausalLM", dict(rope_parameters=dict(full_attention=dict(OLMO3_YARN, truncate=False),
                                                    sliding_attention=dict(rope_type="default"))),
     "truncate=False is not supported per layer type"),
])
def test_hf_configs_transformers_reads_otherwise_are_refused(architecture, fields, message):
    with pytest.raises(ConfigError, match=message):
        config_from_hf({"architectures": [architecture], **HF, **fields})


def test_from_dict_refuses_unknown_yarn_fields():
    config = ModelConfig(vocab_size=8, d_model=32, n_layers=1, n_heads=4, n_kv_heads=2, head_dim=8, d_ff=8,
                         max_seq_len=64, rope_scaling=YarnRope(factor=4.0, original_max_position_embeddings=ORIG))
    data = config.to_dict()
    assert data["rope_scaling"] == dict(type="YarnRope", factor=4.0, original_max_position_embeddings=ORIG,
                                        beta_fast=32.0, beta_slow=1.0, attention_factor=None, truncate=True)
    data["rope_scaling"]["mscale"] = 0.7  # resolved into attention_factor by the converter, never stored
    with pytest.raises(ConfigError, match="invalid rope_scaling YarnRope .*mscale"):
        ModelConfig.from_dict(data)
