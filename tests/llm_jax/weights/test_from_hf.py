"""Hugging Face folders: family configs, safetensors reading (bf16, sharded), and every bad input."""

import json
import struct

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from llm_jax.config import Activation, ConfigError, DefaultRope, LinearRope
from llm_jax.weights.from_hf import load_hf
from llm_jax.weights.hf_config import ARCHITECTURES, config_from_hf
from llm_jax.weights.layout import WeightsError
from llm_jax.weights.placement import leaves_by_path
from tests.hf_models import save_tiny_llama

TINY = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2)


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("hf")
    save_tiny_llama(folder, **TINY)
    return folder


@pytest.fixture
def broken(hf_folder, tmp_path):
    """A private copy of the tiny model whose tensors and config can be edited."""
    for file in hf_folder.iterdir():
        (tmp_path / file.name).write_bytes(file.read_bytes())
    return tmp_path


def edit_tensors(folder, edit):
    tensors = load_file(folder / "model.safetensors")
    edit(tensors)
    save_file(tensors, folder / "model.safetensors")


def edit_config(folder, **changes):
    config = json.loads((folder / "config.json").read_text())
    config.update(changes)
    (folder / "config.json").write_text(json.dumps(config))


def hf_config(architecture, **fields):
    return {"architectures": [architecture], **TINY, **fields}


# --- configs ---------------------------------------------------------------------------------------------


def test_unsupported_architecture_names_the_supported_ones():
    with pytest.raises(ConfigError, match=r"unsupported architectures \['FalconForCausalLM'\]; supported: .*"
                                          r"'Gemma2ForCausalLM'.*'LlamaForCausalLM'.*'Qwen3ForCausalLM'"):
        config_from_hf(hf_config("FalconForCausalLM"))
    assert len(ARCHITECTURES) == 14


def test_qwen_sliding_window_fields():
    off = config_from_hf(hf_config("Qwen2ForCausalLM", sliding_window=4096, use_sliding_window=False))
    assert off.sliding_window is None
    legacy = config_from_hf(hf_config("Qwen2ForCausalLM", sliding_window=8, use_sliding_window=True,
                                      max_window_layers=1))
    assert legacy.layer_windows() == (None, 8)  # layers from max_window_layers on slide
    typed = config_from_hf(hf_config("Qwen3ForCausalLM", sliding_window=8, use_sliding_window=True,
                                     layer_types=["sliding_attention", "full_attention"]))
    assert typed.layer_windows() == (8, None)
    with pytest.raises(ConfigError, match="layer_types"):
        config_from_hf(hf_config("MistralForCausalLM", sliding_window=8, layer_types=["local", "global"]))


def test_gemma_defaults_and_legacy_activation():
    gemma = config_from_hf(hf_config("GemmaForCausalLM", hidden_act="gelu"))  # as the original releases say
    assert gemma.activation is Activation.GELU_TANH and gemma.head_dim == 256 and gemma.tie_embeddings
    gemma2 = config_from_hf(hf_config("Gemma2ForCausalLM"))
    assert (gemma2.attn_logit_softcap, gemma2.final_logit_softcap, gemma2.attn_scale) == (50.0, 30.0, 256 ** -0.5)
    assert gemma2.layer_windows() == (4096, None)


def test_gemma3_transformers_4_config():
    """As the released 1B's config.json spells it: the layer pattern as a period, the two RoPE bases apart,
    the global layers' scaling in rope_scaling (the 4B+ models')."""
    config = config_from_hf(hf_config("Gemma3ForCausalLM", num_hidden_layers=8, head_dim=16, sliding_window=512,
                                      sliding_window_pattern=6, rope_theta=1_000_000.0, rope_local_base_freq=10_000.0,
                                      rope_scaling={"factor": 8.0, "rope_type": "linear"}, query_pre_attn_scalar=16))
    assert config.layer_windows() == (512,) * 5 + (None,) + (512,) * 2
    assert (config.rope_theta, config.rope_scaling, config.sliding_rope_theta) == (1e6, LinearRope(factor=8.0), 1e4)
    assert config.layer_rope(True) == (1e4, DefaultRope()) and config.layer_rope(False) == (1e6, LinearRope(factor=8.0))
    switches = (config.qk_norm, config.sandwich_norm, config.embed_scale, config.norm_weight_offset)
    assert switches == (True, True, True, 1.0)
    assert (config.attn_logit_softcap, config.final_logit_softcap, config.attn_scale) == (None, None, 0.25)
    assert config.activation is Activation.GELU_TANH and config.tie_embeddings


def test_gemma3_multimodal_config_reads_its_text_config():
    """google/gemma-3-4b-it's config.json: a text_config that spells out only what differs from Gemma3TextConfig."""
    text = {"hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text", "num_attention_heads": 8,
            "num_hidden_layers": 34, "num_key_value_heads": 4, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
            "sliding_window": 1024}
    config = config_from_hf({"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
                             "text_config": text, "vision_config": {"model_type": "siglip_vision_model"}})
    assert (config.vocab_size, config.d_model, config.n_layers, config.head_dim, config.max_seq_len) == (
        262_208, 2560, 34, 256, 131_072)
    assert (config.rope_theta, config.rope_scaling, config.sliding_rope_theta) == (1e6, LinearRope(factor=8.0), 1e4)
    assert config.layer_windows() == tuple(None if i % 6 == 5 else 1024 for i in range(34))
    assert config.attn_scale == 256 ** -0.5 and config.tie_embeddings


def test_gemma3_without_local_layers_has_no_local_rope():
    rope = {"full_attention": {"rope_type": "default", "rope_theta": 1e6},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}
    config = config_from_hf(hf_config("Gemma3ForCausalLM", rope_parameters=rope,
                                      layer_types=["full_attention"] * 2))
    assert (config.layer_windows(), config.sliding_rope_theta, config.rope_theta) == ((None, None), None, 1e6)


@pytest.mark.parametrize("fields, message", [
    (dict(rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                           "sliding_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}}),
     "sliding_attention RoPE .* is not supported; Gemma 3's local layers use plain RoPE"),
    (dict(use_bidirectional_attention=True), "use_bidirectional_attention=true is not supported"),
])
def test_gemma3_refusals(fields, message):
    with pytest.raises(ConfigError, match=message):
        config_from_hf(hf_config("Gemma3ForCausalLM", **fields))


@pytest.mark.parametrize("architecture, fields, message", [
    ("LlamaForCausalLM", dict(hidden_act="relu"), "hidden_act='relu' is not supported"),
    ("LlamaForCausalLM", dict(attention_bias=True), "attention_bias=true is not supported"),
    ("Qwen3ForCausalLM", dict(attention_bias=True), "attention_bias=true is not supported"),
    ("LlamaForCausalLM", dict(rope_parameters=dict(rope_type="dynamic", factor=4.0)), "rope scaling type 'dynamic'"),
    ("MistralForCausalLM", dict(num_attention_heads=None), "missing field|num_attention_heads"),
])
def test_unsupported_config_values(architecture, fields, message):
    config = hf_config(architecture, **fields)
    config = {k: v for k, v in config.items() if v is not None}
    with pytest.raises(ConfigError, match=message):
        config_from_hf(config)


# --- tensors ---------------------------------------------------------------------------------------------


def test_bfloat16_and_sharded_checkpoints_load_exactly(hf_folder, tmp_path):
    config, reference = load_hf(hf_folder)
    model = save_tiny_llama(tmp_path / "bf16", **TINY)  # the same seed: the same weights
    model.save_pretrained(tmp_path / "sharded", max_shard_size="20KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    _, sharded = load_hf(tmp_path / "sharded")
    for path, x in leaves_by_path(reference).items():
        np.testing.assert_array_equal(leaves_by_path(sharded)[path], x)
    model.to(torch.bfloat16).save_pretrained(tmp_path / "bf16")
    _, bf16 = load_hf(tmp_path / "bf16", dtype=np.float32)
    for path, x in leaves_by_path(reference).items():
        np.testing.assert_array_equal(leaves_by_path(bf16)[path], x.astype("bfloat16").astype(np.float32))


def test_missing_tensor(broken):
    edit_tensors(broken, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(WeightsError, match=r"missing tensors \['model.layers.1.mlp.up_proj.weight'\]"):
        load_hf(broken)


def test_extra_tensor(broken):
    edit_tensors(broken, lambda t: t.update({"model.layers.0.self_attn.o_proj.bias": torch.zeros(32)}))
    with pytest.raises(WeightsError, match=r"unexpected tensors \['model.layers.0.self_attn.o_proj.bias'\]"):
        load_hf(broken)


def test_config_that_contradicts_the_weights(broken):
    edit_config(broken, intermediate_size=40)
    with pytest.raises(WeightsError, match=r"model.safetensors: tensor 'model.layers.0.mlp.gate_proj.weight' has "
                                           r"shape \(48, 32\), expected \(40, 32\)"):
        load_hf(broken)
    edit_config(broken, intermediate_size=48, num_hidden_layers=3)
    with pytest.raises(WeightsError, match=r"missing tensors \['model.layers.2"):
        load_hf(broken)


def test_tensor_of_the_wrong_dtype(broken):
    edit_tensors(broken, lambda t: t.update({"model.norm.weight": torch.ones(32, dtype=torch.int32)}))
    with pytest.raises(WeightsError, match=r"tensor 'model.norm.weight' has dtype int32, expected one of"):
        load_hf(broken)


def test_truncated_safetensors(broken):
    file = broken / "model.safetensors"
    file.write_bytes(file.read_bytes()[:-1000])
    with pytest.raises(WeightsError, match=r"model.safetensors: truncated: tensor '[a-z_.0-9]+' needs bytes"):
        load_hf(broken)


def test_corrupt_safetensors_header(broken):
    file = broken / "model.safetensors"
    raw = bytearray(file.read_bytes())
    (header_len,) = struct.unpack("<Q", raw[:8])
    raw[8 + header_len // 2] = 0x01  # a control character: invalid JSON anywhere
    file.write_bytes(bytes(raw))
    with pytest.raises(WeightsError, match="model.safetensors: corrupt safetensors header"):
        load_hf(broken)
    file.write_bytes(struct.pack("<Q", 1 << 40) + bytes(raw[8:]))
    with pytest.raises(WeightsError, match="header length 1099511627776 does not fit"):
        load_hf(broken)


def test_header_offsets_that_disagree_with_the_shape(broken):
    file = broken / "model.safetensors"
    raw = file.read_bytes()
    (header_len,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + header_len])
    header["model.norm.weight"]["shape"] = [16]
    text = json.dumps(header, separators=(",", ":")).encode().ljust(header_len)
    assert len(text) == header_len
    file.write_bytes(raw[:8] + text + raw[8 + header_len:])
    with pytest.raises(WeightsError, match=r"tensor 'model.norm.weight' F32\[16\] needs 64 bytes but its offsets span 128"):
        load_hf(broken)


def test_sharded_index_naming_a_missing_file(broken):
    weight_map = {name: "model-00001-of-00002.safetensors" for name in load_file(broken / "model.safetensors")}
    (broken / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(FileNotFoundError, match="model-00001-of-00002.safetensors .listed in "
                                                "model.safetensors.index.json. does not exist"):
        load_hf(broken)
