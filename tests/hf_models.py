"""Tiny random Hugging Face models, built locally with ``transformers`` (never downloaded)."""

from __future__ import annotations

import pathlib

import torch
import transformers


def save_tiny_llama(folder: pathlib.Path, *, seed: int = 0, perturb_norms: bool = True, **overrides):
    """A random ``LlamaForCausalLM`` saved to ``folder`` (safetensors); returns the torch model (eager).

    Norm weights are perturbed away from 1 so a mistake in how they are applied shows in the logits.
    """
    fields = dict(vocab_size=97, hidden_size=48, intermediate_size=80, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                  rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
                  pad_token_id=None)
    fields.update(overrides)
    config = transformers.LlamaConfig(**fields)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(config).eval()
    if perturb_norms:
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith("norm.weight"):
                    param.add_(0.3 * torch.randn_like(param))
    model.save_pretrained(folder)
    return model


def save_random_model(folder: pathlib.Path, config: transformers.PretrainedConfig, *, make=None, seed: int = 0,
                      bias_scale: float | None = None):
    """A random causal LM of ``config`` (``make(config)``, by default the architecture's auto class) saved to
    ``folder``; returns the torch model (eager attention). Its norms (q/k norms too) are perturbed away from
    1, and with ``bias_scale`` its biases drawn, so a mistake in how they are applied shows in the logits."""
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = (make or transformers.AutoModelForCausalLM.from_config)(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(0.4 * torch.randn_like(param))
            elif bias_scale is not None and name.endswith("bias"):
                param.copy_(bias_scale * torch.randn_like(param))
    model.save_pretrained(folder)
    return model


LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def save_peft_adapter(base: transformers.PreTrainedModel, folder: pathlib.Path, *, seed: int = 0, scale: float = 1.0,
                      **fields):
    """A random PEFT LoRA adapter of ``base`` (every projection unless ``target_modules`` says) saved to
    ``folder``; returns the ``PeftModel`` (which wraps ``base``: build one base model per adapter).

    Both matrices are random (PEFT's ``init_lora_weights=False``); ``scale`` multiplies B, to make the
    update as large as a test needs."""
    import peft

    config = peft.LoraConfig(**{"r": 4, "lora_alpha": 8, "target_modules": LORA_TARGETS, "init_lora_weights": False,
                                **fields})
    torch.manual_seed(seed)
    model = peft.get_peft_model(base, config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.mul_(scale)
    model.save_pretrained(folder)
    return model
