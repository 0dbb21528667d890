"""compressed-tensors folders (llm-compressor's pack-quantized W4A16 / W8A16) against the package that writes
them (its own quantize-dequantize of each weight) and ``transformers``, which decompresses the symmetric
ones: our quantized leaves dequantize to those weights bit for bit (within an ulp with zero points),
logits agree within 1e-4 in float32 on XLA and the CPU kernels (greedy tokens identical), as floats too
(``dequantize=True``), through a converted checkpoint; what we do not read is refused by name."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

import llm_jax
from llm_jax.config import PROJECTION_NAMES
from llm_jax.model import forward
from llm_jax.weights.layout import WeightsError
from tests.llm_jax.weights.compressed_checkpoints import assert_greedy_tokens_equal, save_compressed

pytest.importorskip("compressed_tensors")  # a test dependency (pyproject's test extra)

ATOL = 1e-4
TOKENS = np.array([[1, 5, 9, 20, 33, 2, 60, 71, 8, 44, 90]])
CASES = {
    "w4_g16": dict(bits=4, group_size=16),
    "w4_channel_odd_width": dict(bits=4, group_size=None, intermediate_size=91),
    "w8_g32": dict(bits=8, group_size=32),
    "w8_channel": dict(bits=8, group_size=None),
    "w4_g16_down_proj_in_floats": dict(bits=4, group_size=16, ignore=("lm_head", "re:.*down_proj")),
    "w4_g16_zero_points": dict(bits=4, group_size=16, symmetric=False),
    "w8_channel_zero_points": dict(bits=8, group_size=None, symmetric=False),
}
jit_forward = jax.jit(forward, static_argnames=("config", "backend"))


@pytest.fixture(scope="module", params=sorted(CASES))
def compressed(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    reference = save_compressed(folder, **CASES[request.param])
    if CASES[request.param].get("symmetric", True):  # transformers decompresses these: the same model
        loaded = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        with torch.no_grad():
            loaded(torch.tensor(TOKENS))  # it decompresses on its first call
        for name, param in reference.state_dict().items():
            torch.testing.assert_close(loaded.state_dict()[name], param, rtol=0, atol=0, msg=name)
    return request.param, folder, reference


def test_quantized_leaves_are_transformers_weights_and_logits(compressed):
    name, folder, reference = compressed
    with torch.no_grad():
        expected = reference(torch.tensor(TOKENS)).logits.numpy()
    model = llm_jax.load(folder, dtype="float32", backend="xla")
    case = CASES[name]
    q = model.config.quantization
    assert (q.bits, q.group_size, q.offsets) == (case["bits"], case["group_size"], not case.get("symmetric", True))
    for proj in PROJECTION_NAMES:
        group = "attn" if proj in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
        leaf = model.params["layers"][group][proj]
        floats = "down_proj" in name and proj == "down_proj"
        assert (type(leaf).__name__ == "QuantizedArray") != floats, proj
        ours = np.asarray(leaf.dequantize() if not floats else leaf).reshape(model.config.n_layers,
                                                                           -1, leaf.shape[-1] if floats else leaf.N)
        for layer in range(model.config.n_layers):
            module = getattr(reference.model.layers[layer], "self_attn" if group == "attn" else "mlp")
            hf = getattr(module, proj).weight.detach().numpy()  # [out, in]
            if case.get("symmetric", True):  # the same integers times the same scales: bit for bit
                np.testing.assert_array_equal(ours[layer].reshape(hf.shape[1], -1), hf.T, err_msg=f"{proj} {layer}")
            else:  # s·u + o rounds twice where s·(q − z) rounds once
                np.testing.assert_allclose(ours[layer].reshape(hf.shape[1], -1), hf.T, rtol=1e-6, atol=1e-7,
                                           err_msg=f"{proj} {layer}")
    for backend in ("xla", "cpu"):
        model = llm_jax.load(folder, dtype="float32", backend=backend)
        logits = np.asarray(jit_forward(model.weights, model.config, jnp.asarray(TOKENS), backend=model.backend))
        np.testing.assert_allclose(logits, expected, atol=ATOL, rtol=0, err_msg=backend)
    floats = llm_jax.load(folder, dtype="float32", backend="xla", dequantize=True)
    assert floats.config.quantization is None
    np.testing.assert_allclose(np.asarray(jit_forward(floats.params, floats.config, jnp.asarray(TOKENS))), expected,
                               atol=ATOL, rtol=0)


def test_greedy_tokens_and_a_converted_checkpoint(compressed, tmp_path):
    name, folder, reference = compressed
    model = assert_greedy_tokens_equal(reference, folder, TOKENS[0, :6].tolist())
    llm_jax.convert(folder, tmp_path / "ckpt", dtype="float32")
    converted = llm_jax.load(tmp_path / "ckpt", backend="xla")
    assert converted.config.quantization == model.config.quantization
    leaf, again = model.params["layers"]["attn"]["q_proj"], converted.params["layers"]["attn"]["q_proj"]
    np.testing.assert_array_equal(np.asarray(again.values), np.asarray(leaf.values))
    np.testing.assert_array_equal(np.asarray(again.scales), np.asarray(leaf.scales))


def _edit(folder, change):
    path = folder / "config.json"
    config = json.loads(path.read_text())
    change(config["quantization_config"])
    path.write_text(json.dumps(config))


@pytest.mark.parametrize("change, message", [
    (lambda q: q.update(quant_method="awq"), "quant_method 'awq' is not read"),
    (lambda q: q["config_groups"]["group_0"]["weights"].update(actorder="group"), r"weights.actorder is 'group'"),
    (lambda q: q["config_groups"]["group_0"].update(input_activations={"num_bits": 8}), "activations are quantized"),
    (lambda q: q["config_groups"]["group_0"].update(format="int-quantized"), "format 'int-quantized' is not read"),
    (lambda q: q["config_groups"]["group_0"]["weights"].update(num_bits=2), r"weights.num_bits is 2"),
])
def test_what_is_not_read_is_refused_by_name(tmp_path, change, message):
    save_compressed(tmp_path, bits=4, group_size=16)
    _edit(tmp_path, change)
    with pytest.raises(WeightsError, match=message):
        llm_jax.load(tmp_path)


@pytest.mark.parametrize("strategy", ["tensor", "channel", "block"])
def test_fp8_folders_load_as_their_floats(tmp_path, strategy):
    """float-quantized (FP8 e4m3 weights, a scale per tensor, channel or 32×32 block): floats equal to the
    package's quantize-dequantize bit for bit, which transformers' decompression gives too."""
    reference = save_compressed(tmp_path, bits=8, group_size=None, fp8=strategy)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    with torch.no_grad():
        expected = reference(torch.tensor(TOKENS)).logits.numpy()
        np.testing.assert_array_equal(loaded(torch.tensor(TOKENS)).logits.numpy(), expected)
    model = llm_jax.load(tmp_path, dtype="float32", backend="xla")
    assert model.config.quantization is None
    for layer in range(model.config.n_layers):
        hf = reference.model.layers[layer].mlp.down_proj.weight.detach().numpy()
        np.testing.assert_array_equal(np.asarray(model.params["layers"]["mlp"]["down_proj"][layer]), hf.T)
    np.testing.assert_allclose(np.asarray(jit_forward(model.params, model.config, jnp.asarray(TOKENS))), expected,
                               atol=ATOL, rtol=0)
