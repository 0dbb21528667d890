"""transformers' own FP8 folders (``FineGrainedFP8Config``, ``quant_method: "fp8"``: float8 e4m3 weights beside
float32 ``weight_scale_inv`` per block or per tensor) against ``transformers``.

The folders hold tiny random Llama and Qwen3 models. Where every block is whole, ``transformers`` writes them
(its ``Fp8Quantize``, the op that quantizes a model on GPUs, run here on CPU) and loads them (on CPU it
dequantizes each weight as it loads): that model is the reference. Its quantizer leaves a weight whose blocks
do not tile it in floats, and its CPU dequantization refuses or mis-tiles partial blocks, so the folders with
partial blocks are quantized here on the ceil grid of scales ``FP8Linear`` declares, and the reference is a
float ``transformers`` model holding ``transformers``' own ``_dequantize_fp8_weight`` of the stored tensors.
Our floats equal the reference's weights bit for bit; logits agree within 1e-4 in float32 on the default
backend and on XLA; greedy tokens are the reference's own; a converted checkpoint keeps the floats; what we do
not read is refused by name.
"""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import safetensors.torch
import torch
import transformers
from transformers.integrations.finegrained_fp8 import Fp8Quantize, _dequantize_fp8_weight
from transformers.quantizers.quantizer_finegrained_fp8 import FineGrainedFP8HfQuantizer
from transformers.quantizers.quantizers_utils import should_convert_module

import llm_jax
from llm_jax.config import PROJECTION_NAMES
from llm_jax.model import forward
from llm_jax.weights.layout import WeightsError
from tests.llm_jax.weights.compressed_checkpoints import assert_greedy_tokens_equal


ATOL = 1e-4
TOKENS = np.array([[1, 5, 9, 20, 33, 2, 60, 71, 8, 44, 90]])
FAMILIES = {
    "llama": (transformers.LlamaConfig, dict(hidden_size=64, intermediate_size=96)),
    "qwen3": (transformers.Qwen3Config, dict(hidden_size=64, intermediate_size=96, head_dim=16)),
}
CASES = {
    "llama_16x16": dict(family="llama", block=[16, 16]),
    "llama_per_tensor": dict(family="llama", block=None),
    "qwen3_16x16_o_proj_in_floats": dict(family="qwen3", block=[16, 16], fields=dict(fmt="e4m3"),  # as Qwen3-FP8's
                                         not_convert=["lm_head", "model.layers.1.self_attn.o_proj"]),
    # 72 = 2 · 32 + 8 inputs, 91 = 11 · 8 + 3 outputs, and a quantized LM head of 97 = 12 · 8 + 1 rows.
    "qwen3_8x32_partial_blocks_quantized_head": dict(
        family="qwen3", block=[8, 32], hidden_size=72, intermediate_size=91,
        not_convert=["model.layers.0.mlp.down_proj"]),
    "llama_16x32_partial_blocks": dict(family="llama", block=[16, 32], intermediate_size=88),
}
jit_forward = jax.jit(forward, static_argnames=("config", "backend"))


def save_fp8(folder, *, family: str, block: list[int] | None, not_convert=("lm_head",), fields=None, seed: int = 0,
             **overrides) -> dict[str, torch.Tensor]:
    """A random model of ``family`` saved as transformers' FP8 folder: each Linear not matched by ``not_convert``
    (transformers' own matcher) in float8 e4m3 with its ``weight_scale_inv``; ``fields`` join the saved
    ``quantization_config``. Returns the tensors stored."""
    config_class, family_fields = FAMILIES[family]
    config = config_class(vocab_size=97, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                          max_position_embeddings=128, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
                          **{**family_fields, **overrides})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):  # away from 1, so a misapplied norm shows in the logits
                param.add_(0.3 * torch.randn_like(param))
    quantization = transformers.FineGrainedFP8Config(weight_block_size=block, modules_to_not_convert=list(not_convert))
    quantize = Fp8Quantize(FineGrainedFP8HfQuantizer(quantization))
    tensors = {name: t.detach().clone().contiguous() for name, t in model.state_dict().items()}
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and should_convert_module(name, quantization.modules_to_not_convert):
            w = tensors.pop(f"{name}.weight")
            whole = block is None or (w.shape[0] % block[0] == 0 and w.shape[1] % block[1] == 0)
            if whole:
                stored = quantize.convert({f"{name}.weight": w})
                if block is None:  # FP8Linear's per-tensor scale is a scalar parameter
                    stored[f"{name}.weight_scale_inv"] = stored[f"{name}.weight_scale_inv"].reshape(())
            else:
                stored = _partial_blocks(name, w, block)
            tensors.update(stored)
    model.config.quantization_config = {**quantization.to_dict(), **(fields or {})}
    model.config.architectures = [type(model).__name__]
    model.config.save_pretrained(folder)
    safetensors.torch.save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    return tensors


def _partial_blocks(name: str, w: torch.Tensor, block: list[int]) -> dict[str, torch.Tensor]:
    """``w`` quantized per block on the ceil grid of scales ``FP8Linear`` declares (the last blocks partial), as
    Fp8Quantize does whole blocks: scale_inv = absmax / 448, weight = w / scale_inv in float8 e4m3."""
    (out, inputs), (bo, bi) = w.shape, block
    padded = torch.zeros(-(-out // bo) * bo, -(-inputs // bi) * bi)
    padded[:out, :inputs] = w
    absmax = padded.reshape(padded.shape[0] // bo, bo, padded.shape[1] // bi, bi).abs().amax((1, 3))
    scale_inv = torch.where(absmax > 0, absmax / torch.finfo(torch.float8_e4m3fn).max, torch.ones_like(absmax))
    full = scale_inv.repeat_interleave(bo, 0).repeat_interleave(bi, 1)[:out, :inputs]
    weight = (w / full).clamp(-448, 448).to(torch.float8_e4m3fn)
    return {f"{name}.weight": weight, f"{name}.weight_scale_inv": scale_inv}


def reference_model(folder, tensors: dict[str, torch.Tensor], block) -> transformers.PreTrainedModel:
    """``transformers`` loading the folder; where blocks are partial (its CPU dequantization mis-tiles them), a
    float model of the same config holding ``_dequantize_fp8_weight`` of each stored weight."""
    whole = all(block is None or (w.shape[0] % block[0] == 0 and w.shape[1] % block[1] == 0)
                for name, w in tensors.items() if f"{name}_scale_inv" in tensors)
    if whole:
        dequantize = transformers.FineGrainedFP8Config(dequantize=True)  # as it loads them without a GPU
        return transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32,
                                                                 quantization_config=dequantize).eval()
    config = transformers.AutoConfig.from_pretrained(folder)
    del config.quantization_config
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    floats = {name: _dequantize_fp8_weight(w, tensors[f"{name}_scale_inv"], block, torch.float32)
              if f"{name}_scale_inv" in tensors else w for name, w in tensors.items() if not name.endswith("_inv")}
    model.load_state_dict(floats, strict=True)
    return model


@pytest.fixture(scope="module", params=sorted(CASES))
def fp8(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    tensors = save_fp8(folder, **CASES[request.param])
    return request.param, folder, tensors, reference_model(folder, tensors, CASES[request.param]["block"])


def test_floats_are_the_references_weights_and_logits(fp8):
    name, folder, tensors, reference = fp8
    case = CASES[name]
    assert tensors["model.layers.0.self_attn.q_proj.weight"].dtype == torch.float8_e4m3fn
    not_convert = case.get("not_convert", ["lm_head"])
    for module in not_convert:  # modules_to_not_convert: stored in floats, without a scale
        assert tensors[f"{module}.weight"].dtype == torch.float32 and f"{module}.weight_scale_inv" not in tensors
    if "lm_head" not in not_convert:
        assert tensors["lm_head.weight"].dtype == torch.float8_e4m3fn
    model = llm_jax.load(folder, dtype="float32", backend="xla")
    assert model.config.quantization is None
    hf = reference.state_dict()
    for proj in PROJECTION_NAMES:
        group = "attn" if proj in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
        ours = np.asarray(model.params["layers"][group][proj])
        for layer in range(model.config.n_layers):
            weight = hf[f"model.layers.{layer}.{'self_attn' if group == 'attn' else 'mlp'}.{proj}.weight"].numpy()
            np.testing.assert_array_equal(ours[layer].reshape(weight.shape[1], -1), weight.T, err_msg=f"{proj} {layer}")
    np.testing.assert_array_equal(np.asarray(model.params["lm_head"]), hf["lm_head.weight"].numpy().T)
    with torch.no_grad():
        expected = reference(torch.tensor(TOKENS)).logits.numpy()
    for backend in ("auto", "xla"):
        model = llm_jax.load(folder, dtype="float32", backend=backend)
        logits = np.asarray(jit_forward(model.params, model.config, jnp.asarray(TOKENS), backend=model.backend))
        np.testing.assert_allclose(logits, expected, atol=ATOL, rtol=0, err_msg=backend)


def test_greedy_tokens_and_a_converted_checkpoint(fp8, tmp_path):
    name, folder, tensors, reference = fp8
    model = assert_greedy_tokens_equal(reference, folder, TOKENS[0, :6].tolist())
    llm_jax.convert(folder, tmp_path / "ckpt", dtype="float32")
    converted = llm_jax.load(tmp_path / "ckpt", backend="xla")
    assert converted.config.quantization is None
    flat, again = jax.tree_util.tree_leaves_with_path(model.params), jax.tree_util.tree_leaves(converted.params)
    assert len(flat) == len(again)
    for (path, leaf), leaf_again in zip(flat, again):
        np.testing.assert_array_equal(np.asarray(leaf_again), np.asarray(leaf), err_msg=jax.tree_util.keystr(path))


def _edit(folder, change: dict) -> None:
    path = folder / "config.json"
    config = json.loads(path.read_text())
    config["quantization_config"].update(change)
    path.write_text(json.dumps(config))


REFUSALS = {
    "static_activations": (dict(activation_scheme="static"),
                           r"quantization_config.activation_scheme is 'static'; static activation scales"),
    "ue8m0_scales": (dict(scale_fmt="ue8m0"), r"quantization_config.scale_fmt is 'ue8m0'"),
    "fp8_embeddings": (dict(modules_to_convert=["embed_tokens"]),
                       r"modules_to_convert is \['embed_tokens'\]; .* not FP8 embedding tables"),
    "fp4_experts": (dict(expert_dtype="fp4"), r"expert_dtype is 'fp4'"),
    "e5m2": (dict(fmt="e5m2"), r"fmt is 'e5m2'; llm_jax reads e4m3 weights"),
    "unknown_field": (dict(kv_cache_scheme={"num_bits": 8, "type": "float"}),
                      r"quantization_config.kv_cache_scheme is not a field of transformers' fp8 format"),
    "block_of_one_number": (dict(weight_block_size=[128]),
                            r"weight_block_size is \[128\]; expected \[outputs, inputs\]"),
    "blocks_not_the_stored_ones": (dict(weight_block_size=[32, 32]),
                                   r"model.layers.0.self_attn.q_proj.weight_scale_inv has shape \[4, 4\], expected "
                                   r"\[2, 2\] for a weight \[64, 64\] in blocks of 32 × 32"),
    "another_quant_method": (dict(quant_method="fbgemm_fp8"), r"quant_method 'fbgemm_fp8' is not read"),
}


@pytest.mark.parametrize("refusal", sorted(REFUSALS))
def test_what_is_not_read_is_refused_by_name(tmp_path, refusal):
    change, message = REFUSALS[refusal]
    save_fp8(tmp_path, family="llama", block=[16, 16])
    _edit(tmp_path, change)
    with pytest.raises(WeightsError, match=message):
        llm_jax.load(tmp_path)


def test_an_fp8_weight_without_its_scale_is_refused_by_name(tmp_path):
    tensors = save_fp8(tmp_path, family="llama", block=[16, 16])
    del tensors["model.layers.1.mlp.up_proj.weight_scale_inv"]
    safetensors.torch.save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(WeightsError, match=r"model.layers.1.mlp.up_proj.weight is float8_e4m3fn without "
                                           r"model.layers.1.mlp.up_proj.weight_scale_inv beside it"):
        llm_jax.load(tmp_path)
