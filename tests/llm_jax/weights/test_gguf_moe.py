"""Mixtures of experts in GGUF, read and written as llama.cpp does: Mixtral as ``llama`` with
``llama.expert_count``, Qwen3-MoE as ``qwen3moe``; each layer's router ``ffn_gate_inp`` [E, D] (F32) and its
experts stacked, ``ffn_{gate,up}_exps`` [E, F, D] and ``ffn_down_exps`` [E, D, F] (numpy's order; ggml's
{D, F, E} and {F, D, E}).

The reference files are written here from tiny random ``transformers`` models (routers scaled up, so that
tokens prefer a few experts and a routing bug moves the logits), following ``convert_hf_to_gguf.py``'s rules
(our code, as ``test_gguf.py``'s writer): logits and greedy ids against ``transformers``; llm_jax's writer
against these files, tensor for tensor; block-typed experts (Q8_0, Q4_0, and Q4_K / Q6_K as a Q4_K_M file
holds them) load as quantized leaves holding the file's blocks, floats with ``dequantize``; and what
llama.cpp would run otherwise is refused by name. Expected values come from ``transformers`` and the
``gguf`` package only.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import re

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from safetensors.numpy import load_file

import llm_jax
from llm_jax.config import ConfigError, Experts
from llm_jax.model import forward
from llm_jax.quantization import is_quantized
from llm_jax.weights import gguf_blocks
from llm_jax.weights.from_gguf import load_gguf, read_gguf_config
from llm_jax.weights.layout import WeightsError
from llm_jax.weights.placement import leaves_by_path
from llm_jax.weights.to_gguf import encode, save_gguf
from tests.llm_jax.model.test_families import greedy_decode, jit_forward, tokens, torch_greedy
from tests.llm_jax.weights.test_gguf import gguf_name, meta_interleave, random_blocks, torch_logits

ATOL = 1e-4  # float32 max |Δlogit| against transformers
Q = gguf.GGMLQuantizationType
COMMON = dict(vocab_size=96, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=128, rms_norm_eps=1e-6, initializer_range=0.15, num_experts_per_tok=2,
              rope_theta=5000.0, bos_token_id=None, eos_token_id=None, pad_token_id=None)
ROUTER_SCALE = 4.0


@dataclasses.dataclass(frozen=True)
class Family:
    config_class: type
    fields: dict
    architecture: str  # llama.cpp's
    expect: dict  # fields of our config


FAMILIES = {
    "mixtral": Family(transformers.MixtralConfig, dict(num_local_experts=4, intermediate_size=64, head_dim=8),
                      "llama", dict(experts=Experts(num_experts=4, top_k=2), d_ff=64, qk_norm=False)),
    "qwen3_moe": Family(transformers.Qwen3MoeConfig,
                        dict(num_experts=4, moe_intermediate_size=32, intermediate_size=96, head_dim=16,
                             norm_topk_prob=True),
                        "qwen3moe", dict(experts=Experts(num_experts=4, top_k=2), d_ff=32, qk_norm=True)),
}
# HF expert projection → llama.cpp's stacked tensor (Mixtral's w1 / w3 / w2, Qwen3-MoE's names)
EXPERT_NAMES = {"w1": "ffn_gate_exps", "w3": "ffn_up_exps", "w2": "ffn_down_exps", "gate_proj": "ffn_gate_exps",
                "up_proj": "ffn_up_exps", "down_proj": "ffn_down_exps"}
EXPERT = re.compile(r"model\.layers\.(\d+)\.(?:block_sparse_moe|mlp)\.experts\.(\d+)\.(\w+)\.weight")
ROUTER = re.compile(r"model\.layers\.(\d+)\.(?:block_sparse_moe|mlp)\.gate\.weight")


def write_moe_gguf(path: pathlib.Path, hf_folder: pathlib.Path, qtype=Q.F32, *, extra=None,
                   arch: str | None = None, replace: dict | None = None) -> pathlib.Path:
    """A GGUF of the Hugging Face mixture of experts as ``convert_hf_to_gguf.py`` writes it: ``expert_count``,
    ``expert_used_count`` (and ``qwen3moe``'s ``expert_feed_forward_length``); each layer's experts stacked
    along a first axis, in ``qtype``; routers, norms F32; ``llama`` q/k rows in Meta's interleaved layout.
    ``replace``: {stacked experts' tensor name: (raw blocks, type)} written in their place."""
    replace = replace or {}
    hf = json.loads((hf_folder / "config.json").read_text())
    arch = arch or {"MixtralForCausalLM": "llama", "Qwen3MoeForCausalLM": "qwen3moe"}[hf["architectures"][0]]
    n_heads, n_kv, head_dim = hf["num_attention_heads"], hf["num_key_value_heads"], hf["head_dim"]
    n_experts = hf.get("num_local_experts") or hf["num_experts"]
    w = gguf.GGUFWriter(path, arch)
    w.add_context_length(hf["max_position_embeddings"])
    w.add_embedding_length(hf["hidden_size"])
    w.add_block_count(hf["num_hidden_layers"])
    w.add_feed_forward_length(hf["intermediate_size"])
    w.add_head_count(n_heads)
    w.add_head_count_kv(n_kv)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_dimension_count(head_dim)
    w.add_layer_norm_rms_eps(hf["rms_norm_eps"])
    w.add_rope_freq_base((hf.get("rope_parameters") or hf)["rope_theta"])
    w.add_expert_count(n_experts)
    w.add_expert_used_count(hf["num_experts_per_tok"])
    if arch == "qwen3moe":
        w.add_expert_feed_forward_length(hf["moe_intermediate_size"])
    if extra is not None:
        extra(w)
    experts: dict[tuple[int, str], dict[int, np.ndarray]] = {}
    for name, x in load_file(hf_folder / "model.safetensors").items():
        x = x.astype(np.float32)
        if m := EXPERT.fullmatch(name):
            experts.setdefault((int(m[1]), EXPERT_NAMES[m[3]]), {})[int(m[2])] = x
            continue
        if m := ROUTER.fullmatch(name):  # F32 in every file, as llama.cpp's converter keeps it
            w.add_tensor(f"blk.{m[1]}.ffn_gate_inp.weight", x)
            continue
        if arch == "llama" and name.endswith("q_proj.weight"):
            x = meta_interleave(x, n_heads)
        if arch == "llama" and name.endswith("k_proj.weight"):
            x = meta_interleave(x, n_kv)
        data, raw = encode(x, qtype.name if x.ndim == 2 else "F32")
        w.add_tensor(gguf_name(name, arch), data, raw_dtype=raw)
    for (layer, stacked), by_expert in sorted(experts.items()):
        name = f"blk.{layer}.{stacked}.weight"
        data, raw = replace.get(name) or encode(np.stack([by_expert[i] for i in range(n_experts)]), qtype.name)
        w.add_tensor(name, data, raw_dtype=raw)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    folder: pathlib.Path  # the Hugging Face folder in folder / "hf", GGUF files beside it
    torch_model: object
    path: pathlib.Path  # the reference F32 GGUF


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def case(request, tmp_path_factory) -> Case:
    family = FAMILIES[request.param]
    config = family.config_class(**COMMON, **family.fields)
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
    torch_model.save_pretrained(folder / "hf")
    return Case(request.param, folder, torch_model, write_moe_gguf(folder / "f32.gguf", folder / "hf"))


def experts_used(torch_model, ids: np.ndarray) -> list[int]:
    """How many distinct experts the tokens ``ids`` route to, in each layer (transformers' router)."""
    with torch.no_grad():
        routers = torch_model(torch.tensor(ids), output_router_logits=True).router_logits
    k = torch_model.config.num_experts_per_tok
    return [len(set(torch.topk(logits, k, dim=-1).indices.flatten().tolist())) for logits in routers]


def test_float_file_runs_as_transformers(case):
    """Config from the metadata (the top-k weights renormalised, as llama.cpp runs both), the params of the
    Hugging Face folder bit for bit, the logits and 32 greedy ids of transformers, every expert in use.
    (``test_moe.py`` shows that the logits see the renormalisation.)"""
    model = llm_jax.load(case.path)
    family = FAMILIES[case.name]
    for field, value in family.expect.items():
        assert getattr(model.config, field) == value, field
    assert model.config.param_dtype == "float32"
    reference = llm_jax.load(case.folder / "hf", dtype="float32")
    ours = leaves_by_path(model.params)
    for path, x in leaves_by_path(reference.params).items():
        np.testing.assert_array_equal(np.asarray(ours[path]), np.asarray(x), err_msg=str(path))
    ids = tokens(model.config.vocab_size, 0, 28)
    assert min(experts_used(case.torch_model, ids)) == 4
    logits = np.asarray(jit_forward(model.params, model.config, jnp.asarray(ids)))
    delta = float(np.abs(logits - torch_logits(case.torch_model, ids)).max())
    print(f"{case.name}: F32 GGUF max |Δlogit| {delta:.2e}")
    assert delta <= ATOL
    prompts = tokens(model.config.vocab_size, 1, 12)
    greedy, _ = greedy_decode(model.params, model.config, jnp.asarray(prompts), 32)
    np.testing.assert_array_equal(np.asarray(greedy), torch_greedy(case.torch_model, prompts))


def test_bf16_file_loads_as_bfloat16(case):
    """Every matrix BF16 but the routers (F32, as llama.cpp writes them): bfloat16 params, the source's rounding."""
    path = write_moe_gguf(case.folder / "bf16.gguf", case.folder / "hf", Q.BF16)
    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(path).tensors}
    assert types["blk.0.ffn_gate_inp.weight"] == "F32" and types["blk.0.ffn_up_exps.weight"] == "BF16"
    model = llm_jax.load(path)
    assert model.config.param_dtype == "bfloat16"
    reference = leaves_by_path(llm_jax.load(case.folder / "hf", dtype="bfloat16").params)
    for path, x in leaves_by_path(model.params).items():
        np.testing.assert_array_equal(np.asarray(x), np.asarray(reference[path]), err_msg=str(path))


def test_written_file_is_the_converters_and_reads_back(case):
    """HF → llm_jax → our writer: every tensor and ``{arch}.*`` key as the converter's rules write them (Q8_0
    experts included), and the F32 file reads back to the same params."""
    model = llm_jax.load(case.folder / "hf", dtype="float32", backend="xla")
    architecture = FAMILIES[case.name].architecture
    reference = gguf.GGUFReader(write_moe_gguf(case.folder / "reference-q8.gguf", case.folder / "hf", Q.Q8_0))
    ours = gguf.GGUFReader(save_gguf(case.folder / "ours-q8.gguf", model.config, model.params, "Q8_0"))
    assert ours.get_field("general.architecture").contents() == architecture
    theirs = {t.name: t for t in reference.tensors}
    assert sorted(t.name for t in ours.tensors) == sorted(theirs)
    for t in ours.tensors:
        assert t.tensor_type == theirs[t.name].tensor_type, t.name
        np.testing.assert_array_equal(t.data, theirs[t.name].data, err_msg=t.name)
    # feed_forward_length aside: the converter writes Qwen3-MoE's dense intermediate_size, which no layer has
    # and llama.cpp does not use beside expert_feed_forward_length; we write the experts' width.
    keys = [k for k in reference.fields if k.startswith(f"{architecture}.") and not k.endswith(".feed_forward_length")]
    assert {f"{architecture}.expert_count", f"{architecture}.expert_used_count"} <= set(keys)
    for key in keys:
        assert ours.get_field(key) is not None, key
        assert ours.get_field(key).contents() == reference.get_field(key).contents(), key
    config, params = load_gguf(save_gguf(case.folder / "ours-f32.gguf", model.config, model.params, "F32"))
    assert config == model.config
    for path, x in leaves_by_path(model.params).items():
        np.testing.assert_array_equal(leaves_by_path(params)[path], np.asarray(x), err_msg=str(path))


def check_experts_are_the_files(model, path) -> None:
    """Each layer's router (float32) and each expert's quantized leaf, dequantized, equal to the ``gguf``
    package's dequantization of the file's tensors, bit for bit."""
    tensors = {t.name: t for t in gguf.GGUFReader(path).tensors}
    moe = model.params["layers"]["moe"]
    for layer in range(model.config.n_layers):
        router = tensors[f"blk.{layer}.ffn_gate_inp.weight"]
        np.testing.assert_array_equal(np.asarray(moe["router"][layer]), router.data.T)
        for ours, name in [("gate_proj", "ffn_gate_exps"), ("up_proj", "ffn_up_exps"), ("down_proj", "ffn_down_exps")]:
            t = tensors[f"blk.{layer}.{name}.weight"]
            theirs = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32).swapaxes(1, 2)
            leaf = moe[ours]
            assert is_quantized(leaf) and leaf.lead == (model.config.n_layers, model.config.experts.num_experts)
            np.testing.assert_array_equal(np.asarray(leaf.layer(layer).dequantize()), theirs, err_msg=f"{layer} {ours}")


def logits_against_floats(model, floats, name: str) -> None:
    """The quantized model's logits (XLA's, and the CPU kernels' on their form) against the dequantized
    model's: float32, within 1e-4 of the logits' scale."""
    ids = tokens(model.config.vocab_size, 0, 28)
    run = jax.jit(forward, static_argnums=1, static_argnames="backend")
    expected = np.asarray(run(floats.params, floats.config, jnp.asarray(ids), backend="xla"))
    scale = float(np.abs(expected).max())
    for backend in ("xla", "cpu"):
        on = model.with_backend(backend)
        delta = float(np.abs(np.asarray(run(on.weights, on.config, jnp.asarray(ids), backend=on.backend))
                             - expected).max())
        print(f"{name} {backend}: max |Δlogit| {delta:.2e} of logits up to {scale:.2f}")
        assert delta <= 1e-4 * scale


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_0], ids=lambda q: q.name)
def test_block_typed_experts_load_as_their_integers(case, qtype):
    """A Q8_0 / Q4_0 file loads without ``dequantize``: the experts (and every other matrix) quantized leaves
    holding the file's blocks, which dequantize to the ``gguf`` package's floats bit for bit, the router in
    floats; the logits are the dequantized model's. ``dequantize=True`` still gives floats, bfloat16 too."""
    path = write_moe_gguf(case.folder / f"{qtype.name}.gguf", case.folder / "hf", qtype)
    model = llm_jax.load(path)
    scheme = gguf_blocks.SCHEMES[qtype.name]
    assert model.config.quantization.plain == scheme and model.config.quantization.projections == ()
    check_experts_are_the_files(model, path)
    floats = llm_jax.load(path, dequantize=True)
    assert floats.config.quantization is None and floats.config.param_dtype == "float32"
    moe = leaves_by_path(floats.params["layers"]["moe"])
    assert all(not is_quantized(x) for x in moe.values())
    logits_against_floats(model, floats, f"{case.name} {qtype.name}")
    bf16 = llm_jax.load(path, dequantize=True, dtype="bfloat16")
    assert bf16.config.param_dtype == "bfloat16" and bf16.params["layers"]["moe"]["up_proj"].dtype == jnp.bfloat16


def test_k_quant_experts_load_as_their_integers(tmp_path):
    """Experts as llama.cpp's Q4_K_M files hold them (rows of whole super-blocks: d_model and the experts'
    width 256): gate and up Q4_K (4 bits with offsets, groups of 32), down Q6_K (8 bits, groups of 16), the
    rest Q8_0. Each projection in its type's scheme, the blocks held exactly; the dequantized model's logits."""
    config = transformers.MixtralConfig(**{**COMMON, "hidden_size": 256, "num_hidden_layers": 1},
                                        num_local_experts=4, intermediate_size=256, head_dim=64)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "hf")
    rng = np.random.default_rng(5)
    replace = {}
    for name, qtype in (("ffn_gate_exps", Q.Q4_K), ("ffn_up_exps", Q.Q4_K), ("ffn_down_exps", Q.Q6_K)):
        # scales small enough that the weights are of the usual size (the largest codes are ~64 · 16 steps)
        blocks = random_blocks(rng, qtype, 4 * 256, 256, scale=2e-4)
        replace[f"blk.0.{name}.weight"] = (blocks.reshape(4, 256, -1), qtype)
    path = write_moe_gguf(tmp_path / "q4_k_m.gguf", tmp_path / "hf", Q.Q8_0, replace=replace)
    model = llm_jax.load(path)
    quantization = model.config.quantization
    assert quantization.plain == gguf_blocks.SCHEMES["Q8_0"]
    assert dict(quantization.projections) == {"gate_proj": gguf_blocks.SCHEMES["Q4_K"],
                                              "up_proj": gguf_blocks.SCHEMES["Q4_K"],
                                              "down_proj": gguf_blocks.SCHEMES["Q6_K"]}
    check_experts_are_the_files(model, path)
    logits_against_floats(model, llm_jax.load(path, dequantize=True), "mixtral Q4_K/Q6_K")


# --- refusals --------------------------------------------------------------------------------------------------


def test_what_llama_cpp_runs_otherwise_is_refused_on_reading(case, tmp_path):
    """Shared experts, a weights scale, renormalisation switched off, gate and up fused in one tensor."""
    arch = FAMILIES[case.name].architecture
    refusals = {
        rf"{arch}.expert_shared_count=1: llm_jax runs mixtures of experts without shared experts":
            lambda w: w.add_expert_shared_count(1),
        rf"{arch}.expert_weights_scale=2.5: .* unscaled": lambda w: w.add_expert_weights_scale(2.5),
        rf"{arch}.expert_weights_norm=False: .* renormalised": lambda w: w.add_expert_weights_norm(False),
    }
    for message, extra in refusals.items():
        path = write_moe_gguf(tmp_path / "m.gguf", case.folder / "hf", extra=extra)
        with pytest.raises(ConfigError, match=message):
            read_gguf_config(path)
    fused = write_moe_gguf(tmp_path / "fused.gguf", case.folder / "hf", extra=lambda w: w.add_tensor(
        "blk.0.ffn_gate_up_exps.weight", np.zeros((4, 2 * FAMILIES[case.name].expect["d_ff"], 32), np.float32)))
    with pytest.raises(ConfigError, match=r"fused in one tensor \(blk.0.ffn_gate_up_exps.weight ...: "):
        read_gguf_config(fused)
    fine = write_moe_gguf(tmp_path / "fine.gguf", case.folder / "hf", extra=lambda w: (
        w.add_expert_weights_scale(1.0), w.add_expert_weights_norm(True)))
    assert read_gguf_config(fine).experts == Experts(num_experts=4, top_k=2)


def test_other_mixtures_are_refused(case, tmp_path):
    """Qwen2-MoE (``qwen2moe``: shared experts beside the routed ones) by its architecture; a shared expert's
    tensors in a file that claims none by name."""
    hf = case.folder / "hf"
    with pytest.raises(ConfigError, match=r"unsupported GGUF architecture 'qwen2moe'; supported: .*'qwen3moe'"):
        read_gguf_config(write_moe_gguf(tmp_path / "qwen2moe.gguf", hf, arch="qwen2moe"))
    shared = write_moe_gguf(tmp_path / "shared.gguf", hf, extra=lambda w: w.add_tensor(
        "blk.0.ffn_gate_inp_shexp.weight", np.zeros((1, 32), np.float32)))
    with pytest.raises(WeightsError, match=r"unexpected tensors \['blk.0.ffn_gate_inp_shexp.weight'\]"):
        llm_jax.load(shared)


def test_dense_architecture_with_experts_is_refused(tmp_path):
    w = gguf.GGUFWriter(tmp_path / "qwen2.gguf", "qwen2")
    for add in (lambda: w.add_block_count(1), lambda: w.add_embedding_length(8), lambda: w.add_head_count(2),
                lambda: w.add_feed_forward_length(16), lambda: w.add_expert_count(4),
                lambda: w.add_expert_used_count(2)):
        add()
    w.add_tensor("token_embd.weight", np.zeros((10, 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ConfigError, match=r"qwen2.expert_count=4: a mixture of experts is read for llama.cpp's "
                                          r"llama and qwen3moe architectures, not 'qwen2'"):
        read_gguf_config(tmp_path / "qwen2.gguf")


def test_what_llama_cpp_runs_otherwise_is_refused_on_writing(case, tmp_path):
    """llama.cpp renormalises the top-k weights (Qwen3-MoE's norm_topk_prob=False is not its model) and runs
    ``llama`` without a window."""
    model = llm_jax.load(case.folder / "hf", dtype="float32", backend="xla")
    config = model.config.replace(experts=Experts(num_experts=4, top_k=2, normalize_top_k=False))
    arch = FAMILIES[case.name].architecture
    with pytest.raises(ConfigError, match=rf"llama.cpp's {arch} architecture would not run this mixture of "
                                          r"experts as llm_jax does: it has experts.normalize_top_k=False"):
        save_gguf(tmp_path / "m.gguf", config, model.params, "F32")
    with pytest.raises(ConfigError, match=r"it has sliding_window=6"):
        save_gguf(tmp_path / "m.gguf", model.config.replace(sliding_window=6), model.params, "F32")
    with pytest.raises(ConfigError, match=r"it has qkv_bias=True"):
        save_gguf(tmp_path / "m.gguf", model.config.replace(qkv_bias=True), model.params, "F32")
    assert not list(tmp_path.iterdir())
