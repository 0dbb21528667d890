"""``llm_jax.load``: format detection, dtype, sharding, backend and tokenizer options for every format."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import llm_jax
from llm_jax.backends import BackendError, Pallas
from llm_jax.model import param_shapes
from llm_jax.weights.convert import convert
from llm_jax.weights.placement import leaves_by_path
from tests.hf_models import save_tiny_llama


@pytest.fixture(scope="module")
def paths(stories260k_dir, tmp_path_factory):
    ckpt = tmp_path_factory.mktemp("ckpt") / "stories260K"
    convert(stories260k_dir / "stories260K.bin", ckpt)
    return {"bin": stories260k_dir / "stories260K.bin", "hf": stories260k_dir / "hf", "llm_jax": ckpt}


@pytest.fixture(scope="module")
def reference(paths):
    return llm_jax.load(paths["bin"])


def separate(model: llm_jax.Model) -> dict:
    """The model's params by path (the checkpoint's layout on every platform)."""
    return leaves_by_path(model.params)


@pytest.mark.parametrize("kind", ["bin", "hf", "llm_jax"])
def test_every_format_loads_the_same_model(paths, reference, kind):
    model = llm_jax.load(paths[kind])
    assert model.config == reference.config and model.path == str(paths[kind])
    assert set(separate(model)) == set(leaves_by_path(param_shapes(model.config)))  # the canonical layout
    for path, x in separate(reference).items():
        np.testing.assert_array_equal(np.asarray(separate(model)[path]), np.asarray(x))
    assert model.tokenizer.encode("Once upon a time") == reference.tokenizer.encode("Once upon a time")
    assert model.eos_ids == (2,)
    assert model.stop_ids == ((1,) if kind != "hf" else ())  # llama2.c's BOS stop travels with a conversion


@pytest.mark.parametrize("kind", ["bin", "hf", "llm_jax"])
def test_dtype_sharding_and_backend(paths, reference, kind):
    sharding = jax.sharding.NamedSharding(jax.sharding.Mesh(np.array(jax.devices()[:1]), ("x",)),
                                          jax.sharding.PartitionSpec())
    seen = []
    model = llm_jax.load(paths[kind], dtype=jnp.bfloat16, backend="pallas",
                         sharding=lambda config: seen.append(config.param_dtype) or sharding)
    assert seen == ["bfloat16"]
    assert (model.config.param_dtype, model.config.compute_dtype) == ("bfloat16", "bfloat16")
    assert model.backend == Pallas()
    for path, x in separate(reference).items():
        ours = leaves_by_path(model.params)[path]
        assert ours.sharding == sharding and ours.dtype == jnp.bfloat16
        np.testing.assert_array_equal(np.asarray(ours), np.asarray(x.astype(jnp.bfloat16)))


def test_hugging_face_default_dtype_is_the_checkpoints_own(tmp_path):
    save_tiny_llama(tmp_path, vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2).to(torch.bfloat16).save_pretrained(tmp_path)
    model = llm_jax.load(tmp_path)
    assert model.config.param_dtype == "bfloat16"
    assert {x.dtype for x in jax.tree.leaves(model.params)} == {jnp.dtype(jnp.bfloat16)}
    assert model.tokenizer is None and model.eos_ids == ()


def test_tokenizer_override(paths, stories260k_dir):
    model = llm_jax.load(paths["llm_jax"], tokenizer=stories260k_dir / "hf" / "tokenizer.json")
    assert type(model.tokenizer).__name__ == "HFTokenizer"
    assert model.stop_ids == (1,)  # the checkpoint's generation defaults stay


def test_bad_arguments(paths, tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        llm_jax.load(tmp_path / "nowhere")
    (tmp_path / "weights.txt").write_text("hello")
    with pytest.raises(ValueError, match="weights.txt: unrecognised model file"):
        llm_jax.load(tmp_path / "weights.txt")
    with pytest.raises(ValueError, match="not a model folder"):
        llm_jax.load(tmp_path)
    with pytest.raises(BackendError, match="unknown backend 'cuda'; choose one of 'auto', 'xla', 'cpu', 'pallas'"):
        llm_jax.load(paths["bin"], backend="cuda")
