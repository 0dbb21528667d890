"""Mixture-of-experts decoders against ``transformers`` (float32, eager attention): Mixtral (top-2 of 8
experts renormalised, a sliding window across the engine's blocks), Qwen3-MoE (q/k norm, top-2 of 8 not
renormalised, ``norm_topk_prob=False``) and Qwen2-MoE (q/k/v biases, and a shared expert whose output a sigmoid
gate scales). Tiny random models with their routers scaled up, so that each token prefers a few experts and a
routing bug moves the logits: logits of the full forward, greedy tokens of batched prompts of different lengths
(default backend and XLA), the logprobs of sampled tokens, the serving engine, speculative decoding, a mesh of 4
CPU devices, the checkpoint round trip; decode's path (each (token, expert) pair's expert read alone) against
the ragged_dot path, and that decode takes it; quantized experts (int8, int4) loaded, converted, sharded, run
by the CPU kernels as by XLA, and close to float; and what is refused. Expected values come from ``transformers``
only."""

from __future__ import annotations

import copy
import dataclasses
import json

import cpu_kernels
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from jax.sharding import AbstractMesh, PartitionSpec

import llm_jax
from llm_jax.backends import CpuKernels, Xla
from llm_jax.backends.base import route, sparse_experts
from llm_jax.backends.cpu.forms import Panels
from llm_jax.cli.convert import main as convert_main
from llm_jax.config import Activation, ConfigError, Experts, Quantization
from llm_jax.decoding import DecodeControls, decode, start
from llm_jax.kv_cache import init_cache
from llm_jax.lora import LoraAdapter, merge_lora
from llm_jax.model import forward
from llm_jax.prefilling import pad_prompts, prefill
from llm_jax.quantization import QuantizedArray
from llm_jax.sampling import GREEDY
from llm_jax.serving.engine import Engine
from llm_jax.sharding import param_specs
from llm_jax.weights.checkpoint import load_checkpoint
from llm_jax.weights.convert import convert
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
    "qwen2_moe": (transformers.Qwen2MoeConfig,
                  dict(COMMON, num_experts=8, moe_intermediate_size=24, shared_expert_intermediate_size=40,
                       intermediate_size=64, norm_topk_prob=False),
                  dict(experts=Experts(num_experts=8, top_k=2, normalize_top_k=False, shared_d_ff=40), d_ff=24,
                       qkv_bias=True)),
}
ROUTER_SCALE = 4.0


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
            elif name.endswith("bias"):  # Qwen2-MoE's q/k/v biases, zeros as initialised
                param.normal_(0.0, 0.3)
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
    shapes = {"router": (L, D, E), "gate_proj": (L, E, D, F), "up_proj": (L, E, D, F), "down_proj": (L, E, F, D)}
    F_shared = case.model.config.experts.shared_d_ff
    if F_shared is not None:
        shapes |= {"shared_gate_proj": (L, D, F_shared), "shared_up_proj": (L, D, F_shared),
                   "shared_down_proj": (L, F_shared, D), "shared_expert_gate": (L, D)}
    assert {k: tuple(v.shape) for k, v in moe.items()} == shapes
    assert case.model.config.num_params() == sum(x.size for x in jax.tree.leaves(case.model.params))
    written = case.model.config.to_dict()
    assert llm_jax.ModelConfig.from_dict(json.loads(json.dumps(written))) == case.model.config
    assert ("shared_d_ff" in written["experts"]) == (F_shared is not None)  # configs without one read as before


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
        if c.experts.shared_d_ff is not None:  # and so do the shared expert, its gate, and the q/k/v biases
            for path in (("moe", "shared_down_proj"), ("moe", "shared_expert_gate"), ("attn", "q_bias")):
                changed = jax.tree.map(lambda a: a, model.weights)
                changed["layers"][path[0]][path[1]] = 0 * changed["layers"][path[0]][path[1]]
                assert max_delta(run(changed, c, ids, backend=model.backend), theirs) > 100 * ATOL, path


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


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("backend", [Xla(), CpuKernels()], ids=lambda b: b.name)
def test_chosen_experts_equal_the_ragged_dot_path(backend, dtype):
    """Decode's path, each (token, expert) pair's product on its own with only the chosen experts read (XLA's
    gather; the CPU kernels read them in the stack, canonical or as prepared panels), is the ragged_dot path's
    function: for the same routing, equal to float32 rounding (bfloat16: to an ulp of the output)."""
    L, E, U, D, F = 3, 8, 2, 64, 96
    rng = np.random.default_rng(0)

    def draw(*shape, scale=0.1):
        return jnp.asarray(rng.normal(0.0, scale, shape), dtype)

    canonical = draw(L, E, D, F), draw(L, E, D, F), draw(L, E, F, D)
    forms = {"canonical": canonical}
    if backend.name == "cpu":
        forms["panels"] = tuple(Panels(cpu_kernels.to_panels(w), w.shape[-2:-1], w.shape[-1:]) for w in canonical)
    experts = Experts(num_experts=E, top_k=U)
    chosen = jax.jit(backend.chosen_experts, static_argnums=6)
    for B, T in ((1, 1), (4, 1), (2, 2), (1, 3)):  # 2 to 8 (token, expert) pairs of 8 experts
        x_BTD = draw(B, T, D, scale=1.0)
        weights_BTU, chosen_BTU = route(jnp.asarray(rng.normal(0.0, 2.0, (B, T, E)), jnp.float32), experts)
        theirs = np.asarray(sparse_experts(x_BTD, weights_BTU, chosen_BTU, *(w[1] for w in canonical),
                                           Activation.SILU), np.float32)
        scale = float(np.abs(theirs).max())
        for form, ws in forms.items():
            stacked = chosen(x_BTD, weights_BTU, chosen_BTU, *ws, Activation.SILU, jnp.int32(1))
            alone = chosen(x_BTD, weights_BTU, chosen_BTU, *jax.tree.map(lambda a: a[1], ws), Activation.SILU)
            for ours in (stacked, alone):
                delta = max_delta(np.asarray(ours, np.float32), theirs)
                print(f"{backend.name} {form} {dtype} B={B} T={T}: max |Δ| {delta:.2e} of outputs up to {scale:.2f}")
                assert delta <= (1e-6 if dtype == "float32" else 2.0 ** -7) * scale  # bfloat16: an ulp at the largest
                assert ours.shape == x_BTD.shape and ours.dtype == x_BTD.dtype


def _decode_and_prefill_programs(model, backend):
    """The jaxprs of decoding ``PROMPTS`` (2 rows, 4 (token, expert) pairs per step) and of prefilling them
    (16 positions each)."""
    tokens, lengths = pad_prompts(PROMPTS, 16)
    cache = init_cache(model.config, len(PROMPTS), 32)
    controls = DecodeControls.create([GREEDY] * 2, eos_ids=[()] * 2, stop_ids=[()] * 2, max_new_tokens=[8] * 2)
    logits, cache = prefill(model.weights, model.config, tokens, lengths, cache, backend=backend)
    state, _ = start(logits, tokens, cache, controls, backend=backend)
    decoding = decode.trace(model.weights, model.config, cache, state, controls, num_steps=2, backend=backend)
    prefilling = prefill.trace(model.weights, model.config, tokens, lengths, cache, backend=backend)
    return str(decoding.jaxpr), str(prefilling.jaxpr)


@pytest.mark.parametrize("backend", ["default", "xla"])
def test_decode_reads_only_the_chosen_experts(case, backend):
    """A decode step's few (token, expert) pairs run on their own (no ragged_dot; on the CPU kernels, their
    matrix products), a prefill's many sorted by expert through ragged_dot."""
    model = case.model if backend == "default" else llm_jax.load(case.folder, dtype="float32", backend="xla")
    decoding, prefilling = _decode_and_prefill_programs(model, model.backend)
    assert "ragged_dot" not in decoding and "ragged_dot" in prefilling
    assert ("llm_jax_matmul" in decoding) == (model.backend.name == "cpu" and cpu_kernels.available())


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


def mean_kl(logits_p, logits_q) -> float:
    """The mean over positions of KL(p || q) of the next-token distributions of two sets of logits [..., V]."""
    log_p, log_q = jax.nn.log_softmax(jnp.asarray(logits_p), -1), jax.nn.log_softmax(jnp.asarray(logits_q), -1)
    return float(jnp.mean(jnp.sum(jnp.exp(log_p) * (log_p - log_q), axis=-1)))


# Mean KL(float || quantized) of the next-token distributions over 56 positions of each family's tiny random
# model (transformers' float32 logits for reference; d_model 32, routers scaled up, so a rounding moves some
# tokens' choice of experts): measured 2.3e-4 to 6.1e-4 (int8), 2.1e-2 to 7.3e-2 (int4, groups of 32).
KL_BOUNDS = {"int8": 2e-3, "int4": 0.2}


@pytest.mark.parametrize("scheme", sorted(KL_BOUNDS))
def test_quantized_experts_load_run_and_stay_close(case, scheme):
    """``load(..., quantize=)``: every projection an integer leaf (the experts [L, E, ...] expert by expert, the
    shared expert's as the dense MLP's), the router in floats. Greedy tokens on the CPU kernels (the experts'
    integers read in the stack) equal XLA's (the chosen experts' integers gathered); a decode step reads only
    its chosen experts through the quantized kernels; the next-token distributions stay close to float's."""
    model = llm_jax.load(case.folder, dtype="float32", quantize=scheme)
    L, E = COMMON["num_hidden_layers"], 8
    moe = model.params["layers"]["moe"]
    assert isinstance(moe["router"], jax.Array)
    for name in ("gate_proj", "up_proj", "down_proj"):
        assert isinstance(moe[name], QuantizedArray) and moe[name].lead == (L, E), name
        assert model.config.experts.shared_d_ff is None or isinstance(moe[f"shared_{name}"], QuantizedArray)
    xla = model.with_backend("xla")
    outputs = {b: [r.output_ids for r in llm_jax.generate(m, PROMPTS, max_new_tokens=NEW_TOKENS, ignore_eos=True)]
               for b, m in (("cpu", model), ("xla", xla))}
    assert outputs["cpu"] == outputs["xla"]
    decoding, prefilling = _decode_and_prefill_programs(model, model.backend)
    assert "ragged_dot" not in decoding and "ragged_dot" in prefilling
    if cpu_kernels.available():
        assert ("llm_jax_quant_matmul" if scheme == "int4" else "llm_jax_matmul") in decoding
    ids = tokens(0, (2, 28))
    run = jax.jit(forward, static_argnums=1, static_argnames="backend")
    kl = mean_kl(torch_logits(case.torch_model, ids), run(xla.weights, xla.config, ids, backend=xla.backend))
    print(f"{case.name} {scheme}: mean KL(float || quantized) {kl:.2e}")
    assert kl <= KL_BOUNDS[scheme]


def test_quantized_checkpoint_round_trip_and_sharded(case, tmp_path):
    """The converter's ``--quantize int4`` stores the experts' integer leaves, which load back as the leaves
    ``load(..., quantize=)`` makes; laid out on 4 CPU devices (each expert's hidden width split over the model
    axis, its integers and scales alike), they give one device's greedy tokens."""
    quantization = Quantization(bits=4, group_size=32)
    assert convert_main([str(case.folder), str(tmp_path / "q"), "--dtype", "float32", "--quantize", "int4",
                         "--quiet"]) == 0
    config, params, _ = load_checkpoint(tmp_path / "q")
    direct = llm_jax.load(case.folder, dtype="float32", quantize=quantization, backend="xla")
    assert config == direct.config and config.quantization == quantization
    ours = leaves_by_path(direct.params)
    assert set(leaves_by_path(params)) == set(ours)
    for path, leaf in leaves_by_path(params).items():
        np.testing.assert_array_equal(np.asarray(leaf), np.asarray(ours[path]), err_msg=str(path))
    if case.name != "mixtral":  # one family suffices for the layout
        return
    gate = param_specs(params, AbstractMesh((1, 4), ("data", "model")))["layers"]["moe"]["gate_proj"]
    assert gate.values == gate.scales == PartitionSpec(None, None, None, "model")  # [L, E, D / 2, F]: F split
    expected = [r.output_ids for r in llm_jax.generate(direct, PROMPTS, max_new_tokens=NEW_TOKENS, ignore_eos=True)]
    assert sharded_greedy(tmp_path / "q", PROMPTS, NEW_TOKENS, ["model=4"]) == {"model=4": expected}


def test_unsupported_uses_are_refused(case, tmp_path):
    model = case.model
    adapter = LoraAdapter(name="a", weights={"q_proj": (np.zeros((2, 32, 4), np.float32),
                                                        np.zeros((2, 4, 32), np.float32))})
    with pytest.raises(ValueError, match="LoRA adapters on mixture-of-experts models are not supported"):
        merge_lora(model.params, model.config, adapter)
    if model.config.experts.shared_d_ff is not None:  # llama.cpp's llama and qwen3moe have no shared expert
        with pytest.raises(ConfigError, match="would not run this mixture of experts as llm_jax does: it has .*"
                                               "experts.shared_d_ff=40 \\(a shared expert"):
            save_gguf(tmp_path / "m.gguf", model.config, model.params, "F32")


@pytest.mark.parametrize("family, architecture", [("qwen3_moe", "Qwen3MoeForCausalLM"),
                                                  ("qwen2_moe", "Qwen2MoeForCausalLM")])
def test_qwen_moe_dense_layers_are_refused(family, architecture):
    hf = {**FAMILIES[family][1], "architectures": [architecture]}
    assert config_from_hf(hf).experts == FAMILIES[family][2]["experts"]
    with pytest.raises(ConfigError, match=r"mlp_only_layers=\[1\]"):
        config_from_hf({**hf, "mlp_only_layers": [1]})
    with pytest.raises(ConfigError, match="decoder_sparse_step=2"):
        config_from_hf({**hf, "decoder_sparse_step": 2})
    with pytest.raises(ConfigError, match="top_k must be an integer from 1 to num_experts=8"):
        config_from_hf({**hf, "num_experts_per_tok": 9})


def test_qwen2_moe_config_fields():
    """Qwen2-MoE's shared expert width, ``norm_topk_prob`` and ``qkv_bias`` are read, transformers' defaults
    filled in; a shared expert's width must be positive, and Qwen3-MoE has none."""
    hf = {**FAMILIES["qwen2_moe"][1], "architectures": ["Qwen2MoeForCausalLM"]}
    assert config_from_hf({**hf, "norm_topk_prob": True}).experts.normalize_top_k
    assert not config_from_hf({**hf, "qkv_bias": False}).qkv_bias
    defaults = {k: v for k, v in hf.items() if k not in ("num_experts", "num_experts_per_tok", "moe_intermediate_size",
                                                         "shared_expert_intermediate_size")}
    config = config_from_hf(defaults)
    assert (config.experts, config.d_ff) == (Experts(num_experts=60, top_k=4, normalize_top_k=False,
                                                     shared_d_ff=5632), 1408)
    with pytest.raises(ConfigError, match="experts shared_d_ff must be a positive integer or None, got 0"):
        config_from_hf({**hf, "shared_expert_intermediate_size": 0})
    qwen3 = {**FAMILIES["qwen3_moe"][1], "architectures": ["Qwen3MoeForCausalLM"]}
    with pytest.raises(ConfigError, match="with a shared expert"):
        config_from_hf({**qwen3, "shared_expert_intermediate_size": 40})
