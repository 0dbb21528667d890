"""Mixture-of-experts decoders against ``transformers`` (float32, eager attention): Mixtral (top-2 of 8
experts renormalised, a sliding window across the engine's blocks) and Qwen3-MoE (q/k norm, top-2 of 8 not
renormalised, ``norm_topk_prob=False``). Tiny random models with their routers scaled up, so that each token
prefers a few experts and a routing bug moves the logits: logits of the full forward, greedy tokens of
batched prompts of different lengths (default backend and XLA), the logprobs of sampled tokens, the serving
engine, speculative decoding, a mesh of 4 CPU devices, the checkpoint round trip; and what is refused.
Expected values come from ``transformers`` only."""

from __future__ import annotations

import copy
import dataclasses
import json

import gguf
import jax
import numpy as np
import pytest
import torch
import transformers

import llm_jax
from llm_jax.config import ConfigError, Experts
from llm_jax.lora import LoraAdapter, merge_lora
from llm_jax.model import forward
from llm_jax.serving.engine import Engine
from llm_jax.weights.checkpoint import load_checkpoint
from llm_jax.weights.convert import convert
from llm_jax.weights.from_gguf import read_gguf_config
from llm_jax.weights.hf_config import config_from_hf
from llm_jax.weights.placement import leaves_by_path
from llm_jax.weights.to_gguf import save_gguf
from multi_device import sharded_greedy

ATOL = 1e-4  # float32 max |Δlogit| against transformers
NEW_TOKENS = 16
COMMON = dict(vocab_size=112, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=128, rms_norm_eps=1e-6, initializer_range=0.15, num_experts_per_tok=2,
              bos_token_id=None, eos_token_id=None, pad_token_id=None)
FAMILIES = {
    "mixtral": (transformers.MixtralConfig,
                dict(COMMON, num_local_experts=8, intermediate_size=48, head_dim=8, sliding_window=6),
                dict(experts=Experts(num_experts=8, top_k=2, normalize_top_k=True), d_ff=48, sliding_window=6)),
    "qwen3_moe": (transformers.Qwen3MoeConfig,
                  dict(COMMON, num_experts=8, moe_intermediate_size=24, intermediate_size=64, head_dim=16,
                       norm_topk_prob=False),
                  dict(experts=Experts(num_experts=8, top_k=2, normalize_top_k=False), d_ff=24, qk_norm=True)),
}
ROUTER_SCALE = 4.0

pytestmark = pytest.mark.usefixtures("single_threaded_torch")  # tests/llm_jax/conftest.py


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    folder: object
    torch_model: object
    model: llm_jax.Model  # loaded on the default backend


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def case(request, tmp_path_factory) -> Case:
    config_class, fields, _ = FAMILIES[request.param]
    config = config_class(**fields)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    torch_model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for name, param in torch_model.named_parameters():
            if "norm" in name:
                param.add_(0.4 * torch.randn_like(param))
            elif name.endswith("mlp.gate.weight"):  # the router: peaked choices, far from uniform
                param.mul_(ROUTER_SCALE)
    folder = tmp_path_factory.mktemp(request.param)
    torch_model.save_pretrained(folder)
    return Case(request.param, folder, torch_model, llm_jax.load(folder, dtype="float32"))


def tokens(seed: int, shape) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, COMMON["vocab_size"], size=shape)


def torch_logits(torch_model, ids: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return torch_model(torch.tensor(ids)).logits.numpy()


def torch_greedy(torch_model, prompt: list[int]) -> list[int]:
    with torch.no_grad():
        ids = torch.tensor([prompt])
        out = torch_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS, do_sample=False)
    return out[0, len(prompt):].tolist()


def max_delta(ours, theirs) -> float:
    return float(np.abs(np.asarray(ours) - np.asarray(theirs)).max())


PROMPTS = [tokens(1, 12).tolist(), tokens(2, 5).tolist()]  # batched, of different lengths


def test_config_and_params_are_read(case):
    _, _, expect = FAMILIES[case.name]
    for field, value in expect.items():
        assert getattr(case.model.config, field) == value, field
    E, D, F, L = 8, COMMON["hidden_size"], case.model.config.d_ff, COMMON["num_hidden_layers"]
    moe = case.model.params["layers"]["moe"]
    assert {k: tuple(v.shape) for k, v in moe.items()} == {
        "router": (L, D, E), "gate_proj": (L, E, D, F), "up_proj": (L, E, D, F), "down_proj": (L, E, F, D)}
    assert case.model.config.num_params() == sum(x.size for x in jax.tree.leaves(case.model.params))
    assert llm_jax.ModelConfig.from_dict(json.loads(json.dumps(case.model.config.to_dict()))) == case.model.config


@pytest.mark.parametrize("backend", ["default", "xla", "pallas"])
def test_logits_match_transformers(case, backend):
    """On each backend (Pallas' kernels interpreted off an accelerator). And with the top-k renormalisation
    flipped, the logits are far off: the test sees the routing."""
    model = case.model if backend == "default" else llm_jax.load(case.folder, dtype="float32", backend=backend)
    ids = tokens(0, (2, 28))
    theirs = torch_logits(case.torch_model, ids)
    run = jax.jit(forward, static_argnums=1, static_argnames="backend")
    delta = max_delta(run(model.weights, model.config, ids, backend=model.backend), theirs)
    print(f"{case.name} {backend}: max |Δlogit| {delta:.2e}")
    assert delta <= ATOL
    if backend == "xla":
        c = model.config
        flipped = c.replace(experts=dataclasses.replace(c.experts, normalize_top_k=not c.experts.normalize_top_k))
        assert max_delta(run(model.weights, flipped, ids, backend=model.backend), theirs) > 100 * ATOL
        if c.sliding_window is not None:  # and the window bites within the sequence
            unwindowed = c.replace(sliding_window=None)
            assert max_delta(run(model.weights, unwindowed, ids, backend=model.backend), theirs) > 100 * ATOL


def test_bfloat16_logits_are_about_as_accurate_as_transformers(case):
    """In bfloat16 (weights and activations), our logits are within twice transformers' own bfloat16 error
    of transformers' float32 logits."""
    model = llm_jax.load(case.folder, dtype="bfloat16")
    ids = tokens(0, (2, 28))
    theirs = torch_logits(case.torch_model, ids)
    with torch.no_grad():
        theirs_bf16 = copy.deepcopy(case.torch_model).to(torch.bfloat16)(torch.tensor(ids)).logits.float().numpy()
    ours = jax.jit(forward, static_argnums=1, static_argnames="backend")(model.weights, model.config, ids,
                                                                         backend=model.backend)
    print(f"{case.name} bfloat16: max |Δlogit| {max_delta(ours, theirs):.3f}, transformers' "
          f"{max_delta(theirs_bf16, theirs):.3f}")
    assert max_delta(ours, theirs) <= 2 * max_delta(theirs_bf16, theirs)


@pytest.mark.parametrize("backend", ["default", "xla"])
def test_generate_greedy_matches_transformers(case, backend):
    model = case.model if backend == "default" else llm_jax.load(case.folder, dtype="float32", backend="xla")
    results = llm_jax.generate(model, PROMPTS, max_new_tokens=NEW_TOKENS, ignore_eos=True)
    for prompt, result in zip(PROMPTS, results):
        assert result.output_ids == torch_greedy(case.torch_model, prompt)


def test_sampled_tokens_have_transformers_logprobs(case):
    """Sampling at temperature 1 draws from the model's distribution: each drawn token's log-probability is
    transformers' for the same text."""
    results = llm_jax.generate(case.model, PROMPTS, max_new_tokens=NEW_TOKENS, ignore_eos=True, logprobs=0,
                               sampling=llm_jax.Sampling(temperature=1.0, seed=3))
    for prompt, result in zip(PROMPTS, results):
        text = np.array([prompt + result.output_ids])
        with torch.no_grad():
            logprobs = torch.log_softmax(torch.tensor(torch_logits(case.torch_model, text)[0]), -1).numpy()
        theirs = [logprobs[len(prompt) - 1 + i, t] for i, t in enumerate(result.output_ids)]
        np.testing.assert_allclose(result.logprobs, theirs, atol=ATOL, rtol=0)
    assert [r.output_ids for r in results] != [torch_greedy(case.torch_model, p) for p in PROMPTS]


def test_engine_and_speculative_give_generate_tokens(case):
    """The serving engine (paged attention in blocks of 4, Mixtral's window of 6 across them) and
    speculative decoding (prompt lookup; the model as its own draft) give transformers' greedy tokens."""
    expected = [torch_greedy(case.torch_model, p) for p in PROMPTS]
    engine = Engine(case.model, max_num_seqs=2, max_num_batched_tokens=8, block_size=4, max_model_len=64)
    outputs = {str(i): [] for i in range(len(PROMPTS))}
    for rid, prompt in enumerate(PROMPTS):
        engine.add_request(str(rid), prompt, max_new_tokens=NEW_TOKENS, ignore_eos=True)
    for _ in range(1000):
        for out in engine.step():
            outputs[out.request_id] += out.token_ids
        if not engine.has_unfinished:
            break
    assert [outputs[str(i)] for i in range(len(PROMPTS))] == expected
    for speculative in (llm_jax.Speculative(num_tokens=3, prompt_lookup_min=1, max_backoff=0),
                        llm_jax.Speculative(method="draft", draft_model=case.model, num_tokens=3, max_backoff=0)):
        results = llm_jax.generate(case.model, PROMPTS, max_new_tokens=NEW_TOKENS, ignore_eos=True,
                                   speculative=speculative)
        assert [r.output_ids for r in results] == expected, speculative.method


def test_convert_round_trip_is_exact(case, tmp_path):
    convert(case.folder, tmp_path / "llm_jax", dtype="float32")
    config, params, _ = load_checkpoint(tmp_path / "llm_jax")
    assert config == case.model.config
    ours = leaves_by_path(case.model.params)
    theirs = leaves_by_path(params)
    assert set(ours) == set(theirs)
    for path, leaf in theirs.items():
        np.testing.assert_array_equal(np.asarray(leaf), np.asarray(ours[path]), err_msg=str(path))


def test_classifier_matches_transformers(case, tmp_path):
    """The family's ``*ForSequenceClassification``: the same decoder, ``score`` for its head."""
    config_class, fields, _ = FAMILIES[case.name]
    config = config_class(**fields, num_labels=3)
    config._attn_implementation = "eager"
    torch.manual_seed(1)
    torch_model = transformers.AutoModelForSequenceClassification.from_config(config).eval()
    with torch.no_grad():
        torch_model.score.weight.normal_()
    torch_model.save_pretrained(tmp_path)
    model = llm_jax.load(tmp_path, dtype="float32")
    texts = [tokens(5, 8).tolist(), tokens(6, 3).tolist()]
    with torch.no_grad():
        theirs = np.stack([torch_model(input_ids=torch.tensor([ids])).logits[0].numpy() for ids in texts])
    assert max_delta(llm_jax.classify(model, texts).logits, theirs) <= ATOL


def test_sharded_generation_gives_transformers_tokens(case):
    """On 4 CPU devices, every expert split by its hidden width over the model axis: transformers' tokens."""
    expected = [torch_greedy(case.torch_model, p) for p in PROMPTS]
    for spec, ids in sharded_greedy(case.folder, PROMPTS, NEW_TOKENS, ["model=4", "data=2,model=2"]).items():
        assert ids == expected, spec


def test_unsupported_uses_are_refused(case, tmp_path):
    model = case.model
    with pytest.raises(ConfigError, match="quantization of mixture-of-experts weights is not supported"):
        llm_jax.load(case.folder, dtype="float32", quantize="int8")
    adapter = LoraAdapter(name="a", weights={"q_proj": (np.zeros((2, 32, 4), np.float32),
                                                        np.zeros((2, 4, 32), np.float32))})
    with pytest.raises(ValueError, match="LoRA adapters on mixture-of-experts models are not supported"):
        merge_lora(model.params, model.config, adapter)
    with pytest.raises(ConfigError, match="mixture-of-experts model .* as GGUF is not supported"):
        save_gguf(tmp_path / "m.gguf", model.config, model.params, "F32")


def test_gguf_mixture_of_experts_is_refused(tmp_path):
    """llama.cpp's Mixtral files: ``llama`` with ``expert_count``."""
    path = tmp_path / "moe.gguf"
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_block_count(1)
    writer.add_embedding_length(8)
    writer.add_head_count(2)
    writer.add_feed_forward_length(16)
    writer.add_expert_count(4)
    writer.add_expert_used_count(2)
    writer.add_tensor("token_embd.weight", np.zeros((10, 8), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ConfigError, match="expert_count=4: reading a mixture-of-experts model .* not supported"):
        read_gguf_config(path)


def test_qwen3_moe_dense_layers_are_refused():
    hf = {**FAMILIES["qwen3_moe"][1], "architectures": ["Qwen3MoeForCausalLM"]}
    assert config_from_hf(hf).experts == Experts(num_experts=8, top_k=2, normalize_top_k=False)
    with pytest.raises(ConfigError, match=r"mlp_only_layers=\[1\]"):
        config_from_hf({**hf, "mlp_only_layers": [1]})
    with pytest.raises(ConfigError, match="decoder_sparse_step=2"):
        config_from_hf({**hf, "decoder_sparse_step": 2})
    with pytest.raises(ConfigError, match="top_k must be an integer from 1 to num_experts=8"):
        config_from_hf({**hf, "num_experts_per_tok": 9})
