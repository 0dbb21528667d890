"""Gemma 3 beyond the family parity tests (``test_families.py``): the text model of a multimodal folder
(``Gemma3ForConditionalGeneration``, its vision tower ignored) with a partial last period of layers, and of
its classifier; the XLA backend beside the default one; a mesh of 4 CPU devices; the serving engine (paged
attention, windows across blocks) giving ``generate``'s and ``transformers``' greedy tokens. Expected values
come from ``transformers`` (float32, eager attention)."""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest
import torch
import transformers
from safetensors.numpy import load_file, save_file

import llm_jax
from llm_jax.model import LayerHooks, forward
from llm_jax.serving.engine import Engine
from llm_jax.weights.placement import leaves_by_path
from multi_device import sharded_greedy
from tests.llm_jax.model.test_families import (ATOL, COMMON, FAMILIES, NEW_TOKENS, PROMPT_LEN, build, tokens,
                                               torch_greedy)

GEMMA3 = FAMILIES["gemma3_qk_norm_local_global"]
GEMMA3_VOCAB = COMMON["vocab_size"]
TINY_VISION = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                   patch_size=14)


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    """(folder, torch model) of the family's tiny Gemma3ForCausalLM."""
    folder = tmp_path_factory.mktemp("gemma3")
    return folder, build(GEMMA3, folder)


def max_delta(ours, theirs) -> float:
    return float(np.abs(np.asarray(ours) - np.asarray(theirs)).max())


@pytest.fixture(scope="module")
def multimodal(tmp_path_factory):
    """(folder, torch model) of a tiny Gemma3ForConditionalGeneration as transformers writes it
    ("language_model.model.*", a vision tower and projector beside): 8 text layers in the default pattern
    (5 local, 1 global, 2 local: a partial last period)."""
    folder = tmp_path_factory.mktemp("gemma3_multimodal")
    text = {**COMMON, **{k: v for k, v in GEMMA3.fields.items() if k != "layer_types"}, "num_hidden_layers": 8}
    config = transformers.Gemma3Config(text_config=text, vision_config=TINY_VISION, mm_tokens_per_image=4)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    torch_model = transformers.Gemma3ForConditionalGeneration(config).eval()
    with torch.no_grad():
        for name, param in torch_model.named_parameters():
            if "language_model" in name and "norm" in name:
                param.add_(0.4 * torch.randn_like(param))
    torch_model.save_pretrained(folder)
    return folder, torch_model


def test_multimodal_folder_loads_its_text_model(multimodal, tmp_path):
    """Its text logits; and under the module names ("model.language_model.*") the same params."""
    folder, torch_model = multimodal
    stored = load_file(folder / "model.safetensors")
    assert any(n.startswith("vision_tower.") for n in stored)
    assert any(n.startswith("language_model.model.layers.") for n in stored)
    model = llm_jax.load(folder, dtype="float32")
    assert model.config.layer_windows() == (6,) * 5 + (None,) + (6,) * 2
    assert (model.config.sliding_rope_theta, model.config.rope_scaling) == (100.0, llm_jax.LinearRope(factor=8.0))
    ids = tokens(model.config.vocab_size, 0, 40)
    with torch.no_grad():
        theirs = torch_model(input_ids=torch.tensor(ids)).logits.numpy()
    delta = max_delta(jax.jit(forward, static_argnums=1)(model.params, model.config, ids), theirs)
    print(f"gemma3 multimodal text model: max |Δlogit| {delta:.2e}")
    assert delta <= ATOL

    renamed = tmp_path / "renamed"
    renamed.mkdir()
    (renamed / "config.json").write_text((folder / "config.json").read_text())
    modules = {"language_model.model.": "model.language_model.", "vision_tower.": "model.vision_tower."}
    save_file({next((n.replace(a, b) for a, b in modules.items() if n.startswith(a)), n): x for n, x in stored.items()},
              renamed / "model.safetensors")
    again = llm_jax.load(renamed, dtype="float32")
    ours = leaves_by_path(model.params)
    for path, leaf in leaves_by_path(again.params).items():
        np.testing.assert_array_equal(np.asarray(leaf), np.asarray(ours[path]), err_msg=str(path))


def test_multimodal_classifier_reads_its_text_model(tmp_path):
    """Gemma3ForSequenceClassification: the text model and ``score``, the vision tower left out."""
    config = transformers.Gemma3Config(text_config={**COMMON, **GEMMA3.fields}, vision_config=TINY_VISION,
                                       mm_tokens_per_image=4, num_labels=3)
    config._attn_implementation = "eager"
    torch.manual_seed(1)
    torch_model = transformers.Gemma3ForSequenceClassification(config).eval()
    with torch.no_grad():
        torch_model.score.weight.normal_()
    torch_model.save_pretrained(tmp_path)
    model = llm_jax.load(tmp_path, dtype="float32")
    assert model.config.classifier.labels == ("LABEL_0", "LABEL_1", "LABEL_2")
    texts = [[5, 9, 17, 3, 8, 40, 41, 42], [7, 100]]
    with torch.no_grad():
        theirs = np.stack([torch_model(input_ids=torch.tensor([ids])).logits[0].numpy() for ids in texts])
    assert max_delta(llm_jax.classify(model, texts).logits, theirs) <= ATOL


def test_hooks_reach_the_layers_of_a_partial_last_period(multimodal):
    """Layers 6 and 7 run after the scan over whole periods: recorded as transformers' hidden states, and
    steered as a torch forward hook steers them."""
    folder, torch_model = multimodal
    model = llm_jax.load(folder, dtype="float32")
    ids = tokens(model.config.vocab_size, 3, 20)
    layers = torch_model.model.language_model.layers
    steering = np.random.default_rng(4).normal(0, 0.5, (2, 8, model.config.d_model)).astype(np.float32)
    steering[:, :6] = 0  # only the partial period's layers

    def adder(vector):
        def hook(module, inputs, output):
            added = torch.tensor(vector)[:, None, :]
            return (output[0] + added, *output[1:]) if isinstance(output, tuple) else output + added
        return hook

    with torch.no_grad():
        plain = torch_model(input_ids=torch.tensor(ids), output_hidden_states=True)
        handles = [layers[i].register_forward_hook(adder(steering[:, i])) for i in (6, 7)]
        try:
            steered = torch_model(input_ids=torch.tensor(ids)).logits.numpy()
        finally:
            for handle in handles:
                handle.remove()
    run = jax.jit(forward, static_argnums=1)
    _, hidden = run(model.params, model.config, ids, hooks=LayerHooks(record_layers=(6, 2)))
    np.testing.assert_allclose(hidden[:, :, 0], plain.hidden_states[7].numpy(), atol=ATOL, rtol=0)
    np.testing.assert_allclose(hidden[:, :, 1], plain.hidden_states[3].numpy(), atol=ATOL, rtol=0)
    ours, _ = run(model.params, model.config, ids, hooks=LayerHooks(steering_BLD=steering))
    np.testing.assert_allclose(ours, steered, atol=ATOL, rtol=0)
    assert max_delta(steered, plain.logits.numpy()) > 10 * ATOL  # the steering mattered


def test_xla_backend_matches_transformers(gemma3):
    folder, torch_model = gemma3
    model = llm_jax.load(folder, dtype="float32", backend="xla")
    ids = tokens(model.config.vocab_size, 0, PROMPT_LEN + NEW_TOKENS)
    with torch.no_grad():
        theirs = torch_model(torch.tensor(ids)).logits.numpy()
    delta = max_delta(forward(model.params, model.config, ids, backend="xla"), theirs)
    print(f"gemma3 XLA: max |Δlogit| {delta:.2e}")
    assert delta <= ATOL
    prompts = tokens(model.config.vocab_size, 1, PROMPT_LEN)
    results = llm_jax.generate(model, prompts.tolist(), max_new_tokens=NEW_TOKENS, ignore_eos=True)
    np.testing.assert_array_equal(np.array([r.output_ids for r in results]), torch_greedy(torch_model, prompts))


def test_engine_gives_generate_and_transformers_tokens(gemma3):
    """Paged attention in blocks of 4 under a window of 6 (local layer) and globally: each request's greedy
    tokens are generate's alone and transformers'."""
    folder, torch_model = gemma3
    model = llm_jax.load(folder, dtype="float32")
    V = model.config.vocab_size
    prompts = [tokens(V, 1, PROMPT_LEN)[0].tolist(), tokens(V, 2, 5)[0].tolist()]
    engine = Engine(model, max_num_seqs=2, max_num_batched_tokens=8, block_size=4, max_model_len=64)
    outputs = {}
    for rid, prompt in enumerate(prompts):
        engine.add_request(str(rid), prompt, max_new_tokens=NEW_TOKENS)
        outputs[str(rid)] = []
    for _ in range(1000):
        for out in engine.step():
            outputs[out.request_id] += out.token_ids
        if not engine.has_unfinished:
            break
    for rid, prompt in enumerate(prompts):
        expected = torch_greedy(torch_model, np.array([prompt]))[0].tolist()
        assert llm_jax.generate(model, [prompt], max_new_tokens=NEW_TOKENS)[0].output_ids == expected, rid
        assert outputs[str(rid)] == expected, rid


def test_config_round_trips_through_json(gemma3):
    config = llm_jax.load(gemma3[0], dtype="float32").config
    assert config.sliding_rope_theta == 100.0
    assert llm_jax.ModelConfig.from_dict(json.loads(json.dumps(config.to_dict()))) == config


def test_sharded_generation_gives_transformers_tokens(gemma3):
    """On 4 CPU devices, the K/V heads split over the model axis: transformers' greedy tokens."""
    folder, torch_model = gemma3
    prompts = tokens(GEMMA3_VOCAB, 1, PROMPT_LEN)
    expected = torch_greedy(torch_model, prompts).tolist()
    for spec, ids in sharded_greedy(folder, prompts.tolist(), NEW_TOKENS, ["model=2", "data=2,model=2"]).items():
        assert ids == expected, spec
