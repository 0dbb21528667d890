"""Tiny compressed-tensors checkpoints written by the ``compressed-tensors`` package itself (llm-compressor's
format): a random ``transformers`` model, its Linear weights quantized by the package's own rules
(``calculate_qparams`` from each group's range, ``compress_model`` to pack them), saved as a Hugging Face
folder. The reference is the package's own round trip: a dense copy of the model whose weights are its
``fake_quantize`` (quantize, then dequantize) of each weight."""

from __future__ import annotations

import copy
import pathlib

import torch
import transformers


def save_compressed(folder: pathlib.Path, *, bits: int, group_size: int | None, ignore=("lm_head",),
                    symmetric: bool = True, seed: int = 0, fp8: str | None = None,
                    **overrides) -> transformers.LlamaForCausalLM:
    """A random Llama quantized to ``bits`` per group (``group_size``) or per channel (None), symmetric or
    with zero points, saved packed; or with ``fp8`` (a strategy: "tensor", "channel", "block") its weights in
    float8 e4m3 with float scales. Returns the dense model the folder stands for."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (QuantizationArgs, QuantizationConfig, QuantizationScheme,
                                                 apply_quantization_config, fake_quantize)
    from compressed_tensors.quantization.utils import calculate_qparams

    fields = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, tie_word_embeddings=False, max_position_embeddings=128, bos_token_id=1,
                  eos_token_id=2)
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**fields, **overrides})).eval()
    reference = copy.deepcopy(model)
    if fp8 is not None:
        args = QuantizationArgs(num_bits=8, type="float", symmetric=True, strategy=fp8,
                                **(dict(block_structure=[32, 32]) if fp8 == "block" else {}))
    else:
        args = QuantizationArgs(num_bits=bits, type="int", symmetric=symmetric,
                                strategy="group" if group_size else "channel", group_size=group_size)
    config = QuantizationConfig(config_groups={"group_0": QuantizationScheme(targets=["Linear"], weights=args)},
                                ignore=list(ignore))
    apply_quantization_config(model, config)
    dense = dict(reference.named_modules())
    with torch.no_grad():
        for name, module in model.named_modules():
            if hasattr(module, "weight_scale"):
                w = module.weight
                if fp8 == "tensor":
                    low, high = w.amin().reshape(1), w.amax().reshape(1)
                elif fp8 == "block":
                    blocks = w.reshape(w.shape[0] // 32, 32, w.shape[1] // 32, 32)
                    low, high = blocks.amin((1, 3)), blocks.amax((1, 3))
                else:
                    rows = w.reshape(w.shape[0], -1, group_size or w.shape[1])
                    low, high = rows.amin(-1), rows.amax(-1)
                scale, zero = calculate_qparams(low, high, args)
                module.weight_scale.copy_(scale.reshape(module.weight_scale.shape))
                module.weight_zero_point.copy_(zero.reshape(module.weight_zero_point.shape))
                dense[name].weight.copy_(fake_quantize(w, module.weight_scale, module.weight_zero_point, args))
    compressor = ModelCompressor.from_pretrained_model(
        model, quantization_format="float-quantized" if fp8 else "pack-quantized")
    compressor.compress_model(model)
    model.save_pretrained(folder)
    compressor.update_config(folder)
    return reference


def assert_greedy_tokens_equal(reference: transformers.PreTrainedModel, folder: pathlib.Path, prompt: list[int],
                               new_tokens: int = 16):
    """``llm_jax.generate``'s greedy tokens on ``folder`` equal ``reference``'s ``generate``; the model."""
    import llm_jax

    with torch.no_grad():
        out = reference.generate(torch.tensor([prompt]), attention_mask=torch.ones((1, len(prompt)), dtype=torch.long),
                                 max_new_tokens=new_tokens, do_sample=False, min_new_tokens=new_tokens)
    model = llm_jax.load(folder, dtype="float32")
    ours = llm_jax.generate(model, [prompt], max_new_tokens=new_tokens, ignore_eos=True)[0].output_ids
    assert ours == out[0, len(prompt):].tolist()
    return model
