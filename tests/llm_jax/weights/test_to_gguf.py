"""llm_jax → GGUF (``weights/to_gguf.py``): the file reads back as the model it was written from.

Llama and Gemma 3 (llama.cpp's ``gemma3``, its fixed layer pattern and local RoPE) are written. Float files
give back the params exactly; Q8_0 / Q4_0 files hold the blocks ``gguf.quants`` rounds (the
rounding of llama.cpp's converter), which our reader and ``gguf.quants.dequantize`` decode bit for bit;
and every tensor equals the one of ``test_gguf.py``'s independent writer (the rules of
``convert_hf_to_gguf.py`` applied to the Hugging Face files), so llama.cpp reads the same model.
"""

from __future__ import annotations

import gguf
import jax
import numpy as np
import pytest
import torch

import llm_jax
from llm_jax.config import ConfigError, ModelConfig
from llm_jax.model import forward, init_params
from llm_jax.quantization import parse_quantization, quantize_params
from llm_jax.weights.from_gguf import dequantize_rows, load_gguf, open_gguf
from llm_jax.weights.placement import leaves_by_path
from llm_jax.weights.to_gguf import save_gguf
from tests.llm_jax.model.test_families import FAMILIES, build
from tests.llm_jax.weights.test_gguf import GGUF_FAMILIES, write_gguf

# Grouped-query attention and an untied head: every tensor llama.cpp's llama architecture has.
CONFIG = ModelConfig(vocab_size=96, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, d_ff=96,
                     max_seq_len=64, rope_theta=5000.0, norm_eps=1e-6)
Q = gguf.GGMLQuantizationType


def random_model(config: ModelConfig = CONFIG) -> dict:
    """Random params with norms away from 1, so that a norm written in the wrong place shows."""
    params = jax.tree_util.tree_map(np.array, init_params(config, seed=3))
    rng = np.random.default_rng(4)
    for path, leaf in leaves_by_path(params).items():
        if path[-1] == "scale":
            leaf += rng.normal(0, 0.3, leaf.shape).astype(leaf.dtype)
    return params


@pytest.mark.parametrize("type_name", ["F32", "F16", "BF16"])
def test_a_float_file_gives_back_the_params_and_logits(tmp_path, type_name):
    params = random_model()
    path = save_gguf(tmp_path / "m.gguf", CONFIG, params, type_name)
    config, loaded = load_gguf(path)
    assert config.replace(param_dtype="float32", compute_dtype="float32") == CONFIG
    ours, theirs = leaves_by_path(params), leaves_by_path(loaded)
    assert ours.keys() == theirs.keys()
    for key in ours:
        norm = key[-1] == "scale"  # F32 in every file, as llama.cpp writes norms
        rounded = (ours[key] if type_name == "F32" or norm else
                   ours[key].astype(np.float16 if type_name == "F16" else jax.numpy.bfloat16))
        np.testing.assert_array_equal(theirs[key], rounded.astype(np.float32), err_msg=str(key))
    if type_name == "F32":
        tokens = np.random.default_rng(0).integers(0, CONFIG.vocab_size, (2, 11))
        np.testing.assert_allclose(np.asarray(forward(loaded, CONFIG, tokens)),
                                   np.asarray(forward(params, CONFIG, tokens)), atol=1e-4, rtol=0)


@pytest.mark.parametrize("type_name", ["Q8_0", "Q4_0"])
def test_block_files_decode_as_gguf_does_and_near_the_params(tmp_path, type_name):
    params = random_model()
    path = save_gguf(tmp_path / "m.gguf", CONFIG, params, type_name)
    f = open_gguf(path)
    reader = gguf.GGUFReader(path)
    matrices = [t for t in reader.tensors if len(t.shape) == 2]
    assert {t.tensor_type.name for t in matrices} == {type_name}
    for t in matrices:
        theirs = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        np.testing.assert_array_equal(dequantize_rows(f.tensors[t.name]), theirs, err_msg=t.name)
    # Read back as floats (the permutation undone), each value lies within a step (max |w| / 127 or / 8) of ours.
    _, loaded = load_gguf(path, dequantize=True)
    levels = {"Q8_0": 127, "Q4_0": 8}[type_name]
    for key, ours in leaves_by_path(params).items():
        back = leaves_by_path(loaded)[key]
        step = np.abs(ours).max() / levels
        assert np.abs(back - ours).max() <= step, key


def test_quantized_leaves_load_from_a_q8_0_file(tmp_path):
    path = save_gguf(tmp_path / "m.gguf", CONFIG, random_model(), "Q8_0")
    model = llm_jax.load(path, backend="xla")
    blocks = llm_jax.QuantScheme(bits=8, group_size=32)  # every matrix in Q8_0, the tables too
    assert model.config.quantization == llm_jax.Quantization(
        bits=8, group_size=32, embedding=blocks, lm_head=None if CONFIG.tie_embeddings else blocks)


def test_every_tensor_is_the_converters(tmp_path, llama2_tokenizer_path):
    """The same model through llm_jax's writer and through convert_hf_to_gguf's rules (test_gguf's writer):
    the same tensors, bit for bit, and the same metadata llama.cpp reads."""
    hf = tmp_path / "hf"
    build(FAMILIES["llama2_mha"], hf)
    (hf / "tokenizer.model").write_bytes(llama2_tokenizer_path.read_bytes())
    reference = gguf.GGUFReader(write_gguf(tmp_path / "reference.gguf", hf, Q.Q8_0, vocab=hf))
    model = llm_jax.load(hf, dtype="float32", backend="xla")
    ours = gguf.GGUFReader(save_gguf(tmp_path / "ours.gguf", model.config, model.params, "Q8_0", tokenizer=hf))
    theirs = {t.name: t for t in reference.tensors}
    assert sorted(t.name for t in ours.tensors) == sorted(theirs)
    for t in ours.tensors:
        assert t.tensor_type == theirs[t.name].tensor_type, t.name
        np.testing.assert_array_equal(t.data, theirs[t.name].data, err_msg=t.name)
    for key in [k for k in reference.fields if k.startswith(("llama.", "tokenizer."))]:
        assert ours.get_field(key) is not None, key
        assert ours.get_field(key).contents() == reference.get_field(key).contents(), key


def test_what_llama_cpp_would_not_run_as_we_do_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="qk_norm=True"):
        save_gguf(tmp_path / "m.gguf", CONFIG.replace(qk_norm=True), {}, "F32")
    config, params = quantize_params(random_model(), CONFIG, parse_quantization("int8"))
    with pytest.raises(ConfigError, match="float weights"):
        save_gguf(tmp_path / "m.gguf", config, params, "Q8_0")
    with pytest.raises(ValueError, match="Q4_K"):
        save_gguf(tmp_path / "m.gguf", CONFIG, random_model(), "Q4_K")
    assert not list(tmp_path.iterdir())


# --- Gemma 3 (llama.cpp's gemma3 architecture) -------------------------------------------------------------


@pytest.fixture(scope="module")
def gemma3_hf(tmp_path_factory):
    """A tiny Gemma 3 as llama.cpp runs it (test_gguf's GGUF family): (folder, torch model)."""
    folder = tmp_path_factory.mktemp("gemma3") / "hf"
    return folder, build(GGUF_FAMILIES["gemma3_six_layers"], folder)


def test_gemma3_tensors_and_metadata_are_the_converters(gemma3_hf, tmp_path):
    """Norms stored as 1 + w, q/k rows as they are, the global layers' RoPE and the window: every tensor and
    ``gemma3.*`` key as the converter's rules write them; the file runs as transformers does."""
    hf, torch_model = gemma3_hf
    reference = gguf.GGUFReader(write_gguf(tmp_path / "reference.gguf", hf, Q.Q8_0))
    model = llm_jax.load(hf, dtype="float32", backend="xla")
    ours = gguf.GGUFReader(save_gguf(tmp_path / "ours.gguf", model.config, model.params, "Q8_0"))
    assert ours.get_field("general.architecture").contents() == "gemma3"
    theirs = {t.name: t for t in reference.tensors}
    assert sorted(t.name for t in ours.tensors) == sorted(theirs)
    for t in ours.tensors:
        assert t.tensor_type == theirs[t.name].tensor_type, t.name
        np.testing.assert_array_equal(t.data, theirs[t.name].data, err_msg=t.name)
    keys = [k for k in reference.fields if k.startswith("gemma3.")]
    assert {"gemma3.rope.freq_base", "gemma3.rope.scaling.factor", "gemma3.attention.sliding_window"} <= set(keys)
    for key in keys:
        assert ours.get_field(key) is not None, key
        assert ours.get_field(key).contents() == reference.get_field(key).contents(), key


def test_gemma3_f32_round_trip_gives_transformers_logits(gemma3_hf, tmp_path):
    """HF → GGUF → llm_jax → GGUF again: the params come back (norms as 1 + w), the logits are transformers'."""
    hf, torch_model = gemma3_hf
    model = llm_jax.load(hf, dtype="float32", backend="xla")
    first = save_gguf(tmp_path / "first.gguf", model.config, model.params, "F32")
    config, params = load_gguf(first)
    assert (config.sliding_rope_theta, config.layer_windows()) == (10000.0, (6,) * 5 + (None,))
    second = save_gguf(tmp_path / "second.gguf", config, params, "F32")  # norms already 1 + w: offset 0
    _, again = load_gguf(second)
    for path, leaf in leaves_by_path(params).items():
        np.testing.assert_array_equal(leaves_by_path(again)[path], leaf, err_msg=str(path))
    ids = np.random.default_rng(0).integers(0, config.vocab_size, (2, 20))
    with torch.no_grad():
        theirs = torch_model(torch.tensor(ids)).logits.numpy()
    ours = np.asarray(forward(params, config, ids, backend="xla"))
    np.testing.assert_allclose(ours, theirs, atol=1e-4, rtol=0)


def test_what_llama_cpp_gemma3_would_not_run_as_we_do_is_refused(tmp_path):
    """A Gemma 3 whose layer pattern, local RoPE or attention scale llama.cpp would not reproduce."""
    config = ModelConfig(vocab_size=96, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, d_ff=96,
                         max_seq_len=64, activation="gelu_tanh", norm_weight_offset=1.0, embed_scale=True,
                         sandwich_norm=True, qk_norm=True, tie_embeddings=True, query_pre_attn_scalar=16.0,
                         sliding_window=8, sliding_layers=(True, True), sliding_rope_theta=10000.0)
    save_gguf(tmp_path / "fine.gguf", config, init_params(config), "F32")
    refusals = {"sliding layers": dict(sliding_layers=(True, False)),
                "sliding_rope_theta=100.0": dict(sliding_rope_theta=100.0),
                "query_pre_attn_scalar=24.0": dict(query_pre_attn_scalar=24.0),
                "attn_logit_softcap=50.0": dict(attn_logit_softcap=50.0),
                "qk_norm=False": dict(qk_norm=False)}
    for message, changes in refusals.items():
        with pytest.raises(ConfigError, match=rf"gemma3 architecture would not run this model.*{message}"):
            save_gguf(tmp_path / "m.gguf", config.replace(**changes), {}, "F32")
    assert [p.name for p in tmp_path.iterdir()] == ["fine.gguf"]
