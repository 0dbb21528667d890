"""OLMo 2 and OLMo 3 (``Olmo2ForCausalLM``, ``Olmo3ForCausalLM``) beyond the family parity tests
(``test_families.py``): norms after attention and the MLP only (``pre_norm=False``), q/k norms over each token's
whole projection (``QKNormScope.ALL_HEADS``), OLMo 3's local layers with their own RoPE; both backends; the serving
engine; meshes that split the heads the q/k norms reduce over (and repeat the K/V heads); int8 weights; the
refusals. (Their classifiers are ``test_classify.py``'s, their LoRA adapters ``test_lora.py``'s.) Expected values
come from ``transformers`` (float32, eager attention).

Two tiny checkpoints: "olmo2" (3 layers, 6 query heads over 2 kv heads) and "olmo3" (5 layers in OLMo 3's default
pattern, three local to one global and a local one of a partial period; 8 query heads over 2 kv heads; the global
layers' RoPE linearly scaled, the local ones' plain with another base; tied embeddings)."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

import llm_jax
from llm_jax.config import ConfigError, ModelConfig, QKNormScope
from llm_jax.model import forward, param_shapes
from llm_jax.quantization import is_quantized
from llm_jax.serving.engine import Engine
from llm_jax.weights.hf_config import config_from_hf
from llm_jax.weights.placement import leaves_by_path
from llm_jax.weights.to_gguf import save_gguf
from multi_device import sharded_greedy
from tests.hf_models import save_random_model
from tests.llm_jax.model.test_families import ATOL

VOCAB = 97
COMMON = dict(vocab_size=VOCAB, hidden_size=48, intermediate_size=72, max_position_embeddings=64, rms_norm_eps=1e-6,
              initializer_range=0.15, bos_token_id=None, eos_token_id=None, pad_token_id=None)
OLMO3_ROPE = dict(full_attention=dict(rope_type="linear", rope_theta=50000.0, factor=4.0),
                  sliding_attention=dict(rope_type="default", rope_theta=100.0))
CHECKPOINTS = {
    "olmo2": (transformers.Olmo2Config, transformers.Olmo2ForCausalLM,
              dict(num_hidden_layers=3, num_attention_heads=6, num_key_value_heads=2)),
    "olmo3": (transformers.Olmo3Config, transformers.Olmo3ForCausalLM,
              dict(num_hidden_layers=5, hidden_size=64, num_attention_heads=8, num_key_value_heads=2, sliding_window=6,
                   tie_word_embeddings=True, rope_parameters=OLMO3_ROPE)),
}
BACKENDS = ["cpu", "xla"]
PROMPT_LEN, NEW_TOKENS = 12, 24



def build(folder, name: str):
    """A random checkpoint of ``name`` saved to ``folder``; its norms (q/k norms too) perturbed away from 1."""
    config_class, causal_lm, fields = CHECKPOINTS[name]
    return save_random_model(folder, config_class(**{**COMMON, **fields}), make=causal_lm)


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


def torch_greedy(torch_model, prompt: list[int], new_tokens: int = NEW_TOKENS) -> list[int]:
    with torch.no_grad():
        ids = torch.tensor([prompt])
        out = torch_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, do_sample=False)
    return out[0, len(prompt):].tolist()


run_forward = jax.jit(forward, static_argnums=1, static_argnames="backend")


def test_config_and_params_are_read(checkpoints):
    """The switches, OLMo 3's layer pattern and RoPEs; params without pre-norms, q/k norm scales [L, N, H] and
    [L, K, H], as many as transformers' in all; the new switches in the config's JSON (and only there)."""
    olmo2 = llm_jax.load(checkpoints["olmo2"][0], dtype="float32", backend="xla")
    c = olmo2.config
    assert (c.pre_norm, c.sandwich_norm, c.qk_norm, c.qk_norm_scope) == (False, True, True, QKNormScope.ALL_HEADS)
    assert (c.layer_windows(), c.rope_scaling, c.norm_eps, c.tie_embeddings) == (
        (None,) * 3, llm_jax.DefaultRope(), 1e-6, False)
    layers = olmo2.params["layers"]
    assert sorted(layers) == ["attn", "mlp", "post_attn_norm", "post_mlp_norm"]
    assert (layers["attn"]["q_proj_norm"]["scale"].shape, layers["attn"]["k_proj_norm"]["scale"].shape) == (
        (3, 6, 8), (3, 2, 8))
    attn = checkpoints["olmo2"][1].model.layers[1].self_attn
    np.testing.assert_array_equal(np.asarray(layers["attn"]["q_proj_norm"]["scale"][1]).reshape(-1),
                                  attn.q_norm.weight.detach().numpy())
    olmo3 = llm_jax.load(checkpoints["olmo3"][0], dtype="float32").config
    assert olmo3.layer_windows() == (6, 6, 6, None, 6)
    assert (olmo3.rope_theta, olmo3.rope_scaling, olmo3.sliding_rope_theta) == (
        50000.0, llm_jax.LinearRope(factor=4.0), 100.0)
    for config, (_, torch_model) in ((c, checkpoints["olmo2"]), (olmo3, checkpoints["olmo3"])):
        assert config.num_params() == sum(p.numel() for p in torch_model.parameters())
        assert ModelConfig.from_dict(json.loads(json.dumps(config.to_dict()))) == config
        assert {k: config.to_dict()[k] for k in ("pre_norm", "qk_norm_scope")} == dict(pre_norm=False,
                                                                                       qk_norm_scope="all_heads")
    llama = ModelConfig(vocab_size=8, d_model=8, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=4, d_ff=8,
                        max_seq_len=8, qk_norm=True)
    assert not {"pre_norm", "qk_norm_scope"} & set(llama.to_dict())  # configs read (and hash) as before
    assert leaves_by_path(param_shapes(llama))[("layers", "attn", "q_norm", "scale")].shape == (1, 4)


@pytest.mark.parametrize("backend", BACKENDS)
def test_logits_match_transformers(checkpoints, backend):
    """30 tokens: past OLMo 3's window of 6, through its global layer and the local one after it."""
    for name, (folder, torch_model) in checkpoints.items():
        model = llm_jax.load(folder, dtype="float32", backend=backend)
        ids = tokens(1, 30, rows=2)
        with torch.no_grad():
            theirs = torch_model(torch.tensor(ids)).logits.numpy()
        delta = max_delta(run_forward(model.weights, model.config, jnp.asarray(ids), backend=model.backend), theirs)
        print(f"{name} {backend}: max |Δlogit| {delta:.2e} (logits up to {np.abs(theirs).max():.1f})")
        assert delta <= ATOL, (name, delta)


@pytest.mark.parametrize("backend", BACKENDS)
def test_generate_matches_transformers(checkpoints, backend):
    for name, (folder, torch_model) in checkpoints.items():
        model = llm_jax.load(folder, dtype="float32", backend=backend)
        prompts = tokens(2, PROMPT_LEN, rows=2).tolist()
        ours = [r.output_ids for r in llm_jax.generate(model, prompts, max_new_tokens=NEW_TOKENS, ignore_eos=True)]
        assert ours == [torch_greedy(torch_model, p) for p in prompts], name


def test_engine_gives_transformers_tokens(checkpoints):
    """Paged attention in blocks of 4 under OLMo 3's window of 6 and globally: two requests of different lengths,
    batched, each given transformers' greedy tokens."""
    folder, torch_model = checkpoints["olmo3"]
    model = llm_jax.load(folder, dtype="float32")
    prompts = {"long": tokens(3, PROMPT_LEN)[0].tolist(), "short": tokens(4, 5)[0].tolist()}
    engine = Engine(model, max_num_seqs=2, max_num_batched_tokens=8, block_size=4, max_model_len=64)
    outputs = {}
    for rid, prompt in prompts.items():
        engine.add_request(rid, prompt, max_new_tokens=NEW_TOKENS)
        outputs[rid] = []
    for _ in range(500):
        for out in engine.step():
            outputs[out.request_id] += out.token_ids
        if not engine.has_unfinished:
            break
    for rid, prompt in prompts.items():
        assert outputs[rid] == torch_greedy(torch_model, prompt), rid


def test_sharded_generation_gives_transformers_tokens(checkpoints):
    """On 4 CPU devices: the 8 query heads split in 2 and in 4 (the q/k norms' mean squares then summed across the
    shards), the 2 K/V heads each repeated twice on model=4 (their norm's scale with them)."""
    folder, torch_model = checkpoints["olmo3"]
    prompts = tokens(5, PROMPT_LEN, rows=2).tolist()
    expected = [torch_greedy(torch_model, p) for p in prompts]
    for spec, ids in sharded_greedy(folder, prompts, NEW_TOKENS, ["model=2", "model=4"]).items():
        assert ids == expected, spec


def test_int8_weights_run_the_olmo_layers(checkpoints):
    """int8 projections under OLMo 2's norms (which stay in floats): near transformers' float logits."""
    folder, torch_model = checkpoints["olmo2"]
    model = llm_jax.load(folder, dtype="float32", quantize="int8")
    layers = model.params["layers"]
    assert is_quantized(layers["attn"]["q_proj"]) and not is_quantized(layers["attn"]["q_proj_norm"]["scale"])
    ids = tokens(6, 30, rows=2)
    with torch.no_grad():
        theirs = torch_model(torch.tensor(ids)).logits.numpy()
    delta = max_delta(run_forward(model.weights, model.config, jnp.asarray(ids), backend=model.backend), theirs)
    print(f"olmo2 int8: max |Δlogit| {delta:.2e}")
    assert ATOL < delta < 0.05 * np.abs(theirs).max()


OLMO2_JSON = dict(architectures=["Olmo2ForCausalLM"], vocab_size=97, hidden_size=48, intermediate_size=72,
                  num_hidden_layers=2, num_attention_heads=6, num_key_value_heads=2)


def test_transformers_4_configs_and_defaults_are_read():
    """transformers 4's OLMo 3 config (one rope_theta, its rope_scaling the global layers'), OLMo 3's default
    layer pattern and window, and the config classes' defaults where a config leaves a field out."""
    olmo2 = config_from_hf(OLMO2_JSON)
    assert (olmo2.norm_eps, olmo2.rope_theta, olmo2.max_seq_len, olmo2.tie_embeddings) == (1e-5, 10000.0, 2048, False)
    olmo3 = config_from_hf({**OLMO2_JSON, "architectures": ["Olmo3ForCausalLM"], "num_hidden_layers": 8,
                            "rope_theta": 500000.0, "rope_scaling": {"rope_type": "linear", "factor": 2.0}})
    assert olmo3.layer_windows() == (4096, 4096, 4096, None) * 2
    assert (olmo3.rope_theta, olmo3.rope_scaling, olmo3.sliding_rope_theta) == (
        500000.0, llm_jax.LinearRope(factor=2.0), 500000.0)
    plain = config_from_hf({**OLMO2_JSON, "architectures": ["Olmo3ForCausalLM"], "rope_theta": 500000.0})
    assert (plain.rope_theta, plain.rope_scaling, plain.sliding_rope_theta) == (500000.0, llm_jax.DefaultRope(), None)
    all_global = config_from_hf({**OLMO2_JSON, "architectures": ["Olmo3ForCausalLM"],
                                 "layer_types": ["full_attention"] * 2})
    assert (all_global.layer_windows(), all_global.sliding_rope_theta) == ((None, None), None)


def test_bad_configs_are_refused_by_name(checkpoints, tmp_path):
    base = dict(vocab_size=97, d_model=48, n_layers=2, n_heads=6, n_kv_heads=2, head_dim=8, d_ff=72, max_seq_len=64)
    with pytest.raises(ConfigError, match="qk_norm_scope='all_heads' needs qk_norm=True"):
        ModelConfig(**base, qk_norm_scope=QKNormScope.ALL_HEADS)
    with pytest.raises(ConfigError, match=r"qk_norm_scope must be one of \['head', 'all_heads'\], got 'heads'"):
        ModelConfig(**base, qk_norm=True, qk_norm_scope="heads")
    with pytest.raises(ConfigError, match="pre_norm=False needs sandwich_norm=True"):
        ModelConfig(**base, pre_norm=False)
    with pytest.raises(ConfigError, match="Olmo2ForCausalLM with attention_bias=true is not supported"):
        config_from_hf({**OLMO2_JSON, "attention_bias": True})
    olmo3 = {**OLMO2_JSON, "architectures": ["Olmo3ForCausalLM"]}
    with pytest.raises(ConfigError, match="names its type as 'type' only; transformers 5 then runs plain RoPE"):
        config_from_hf({**olmo3, "rope_scaling": {"type": "yarn", "factor": 8.0,
                                                  "original_max_position_embeddings": 8192}})
    with pytest.raises(ConfigError, match="sliding_attention RoPE .* only plain RoPE on the sliding layers"):
        config_from_hf({**olmo3, "rope_parameters": {"full_attention": {"rope_type": "default"},
                                                     "sliding_attention": {"rope_type": "linear", "factor": 2.0}}})
    model = llm_jax.load(checkpoints["olmo2"][0], dtype="float32", backend="xla")
    with pytest.raises(ConfigError, match=r"OLMo 2's layers \(pre_norm=False, qk_norm_scope=.*not written as GGUF"):
        save_gguf(tmp_path / "olmo2.gguf", model.config, model.params, "F32")


def test_gguf_olmo2_files_are_refused_by_name(tmp_path):
    import gguf

    writer = gguf.GGUFWriter(tmp_path / "olmo2.gguf", "olmo2")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ConfigError, match="unsupported GGUF architecture 'olmo2'"):
        llm_jax.load(tmp_path / "olmo2.gguf")
