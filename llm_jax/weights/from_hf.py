"""Hugging Face model folders (``config.json`` + ``*.safetensors``) → llm_jax config and params.

This module owns the Hugging Face quirks: config spellings of transformers 4 and 5 (``rope_theta`` /
``rope_scaling`` vs ``rope_parameters``), torch ``Linear`` weights stored [out, in], sharded checkpoints
with ``model.safetensors.index.json``.
"""

from __future__ import annotations

import json
import pathlib
from typing import Any, Callable

import numpy as np
from safetensors import safe_open

from llm_jax.config import ConfigError, DefaultRope, LinearRope, Llama3Rope, ModelConfig
from llm_jax.weights.layout import (TensorSpec, WeightsError, assemble, heads_in, heads_out, transpose)

SAFETENSORS_INDEX = "model.safetensors.index.json"


def read_json(path: pathlib.Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise FileNotFoundError(f"{path} does not exist") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path} is not valid JSON: {e}") from None


def _rope_params(hf: dict[str, Any]) -> tuple[float, Any]:
    """(theta, scaling) from either spelling: transformers 5 ``rope_parameters`` or 4 ``rope_theta``."""
    params = dict(hf.get("rope_parameters") or {})
    legacy = hf.get("rope_scaling") or {}
    theta = float(params.get("rope_theta", hf.get("rope_theta", 10_000.0)))
    scaling = {**legacy, **params}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    match kind:
        case "default" | None:
            return theta, DefaultRope()
        case "linear":
            return theta, LinearRope(factor=float(scaling["factor"]))
        case "llama3":
            return theta, Llama3Rope(
                factor=float(scaling["factor"]), low_freq_factor=float(scaling["low_freq_factor"]),
                high_freq_factor=float(scaling["high_freq_factor"]),
                original_max_position_embeddings=int(scaling["original_max_position_embeddings"]))
    raise ConfigError(f"unsupported rope scaling type {kind!r}; supported: default, linear, llama3")


def _llama_like_config(hf: dict[str, Any], **overrides: Any) -> ModelConfig:
    n_heads = hf["num_attention_heads"]
    theta, scaling = _rope_params(hf)
    fields = dict(
        vocab_size=hf["vocab_size"], d_model=hf["hidden_size"], n_layers=hf["num_hidden_layers"],
        n_heads=n_heads, n_kv_heads=hf.get("num_key_value_heads") or n_heads,
        head_dim=hf.get("head_dim") or hf["hidden_size"] // n_heads, d_ff=hf["intermediate_size"],
        max_seq_len=hf.get("max_position_embeddings", 2048), norm_eps=hf.get("rms_norm_eps", 1e-6),
        rope_theta=theta, rope_scaling=scaling, tie_embeddings=bool(hf.get("tie_word_embeddings", False)))
    fields.update(overrides)
    return ModelConfig(**fields)


def _llama_config(hf: dict[str, Any]) -> ModelConfig:
    act = hf.get("hidden_act", "silu")
    if act != "silu":
        raise ConfigError(f"Llama config has hidden_act={act!r}; only 'silu' is supported")
    if hf.get("attention_bias") or hf.get("mlp_bias"):
        raise ConfigError("Llama configs with attention_bias or mlp_bias are not supported")
    return _llama_like_config(hf)


# architectures entry → builder of our config from config.json
ARCHITECTURES: dict[str, Callable[[dict[str, Any]], ModelConfig]] = {
    "LlamaForCausalLM": _llama_config,
}


def config_from_hf(hf: dict[str, Any], *, where: str = "config.json") -> ModelConfig:
    archs = hf.get("architectures") or []
    known = [a for a in archs if a in ARCHITECTURES]
    if not known:
        raise ConfigError(f"{where}: unsupported architectures {archs}; supported: {sorted(ARCHITECTURES)}")
    try:
        return ARCHITECTURES[known[0]](hf)
    except KeyError as e:
        raise ConfigError(f"{where}: missing field {e.args[0]!r} for {known[0]}") from None


def tensor_specs(config: ModelConfig) -> list[TensorSpec]:
    """Where each of our params comes from in a Hugging Face Llama-family state dict."""
    D, N, K, H, F, V = (config.d_model, config.n_heads, config.n_kv_heads, config.head_dim, config.d_ff,
                        config.vocab_size)
    p = "model.layers.{layer}."
    specs = [
        TensorSpec(("embedder", "embedding"), "model.embed_tokens.weight", (V, D)),
        TensorSpec(("layers", "attn_norm", "scale"), p + "input_layernorm.weight", (D,)),
        TensorSpec(("layers", "attn", "q_proj"), p + "self_attn.q_proj.weight", (N * H, D), heads_in(N, H)),
        TensorSpec(("layers", "attn", "k_proj"), p + "self_attn.k_proj.weight", (K * H, D), heads_in(K, H)),
        TensorSpec(("layers", "attn", "v_proj"), p + "self_attn.v_proj.weight", (K * H, D), heads_in(K, H)),
        TensorSpec(("layers", "attn", "o_proj"), p + "self_attn.o_proj.weight", (D, N * H), heads_out(N, H)),
        TensorSpec(("layers", "mlp_norm", "scale"), p + "post_attention_layernorm.weight", (D,)),
        TensorSpec(("layers", "mlp", "gate_proj"), p + "mlp.gate_proj.weight", (F, D), transpose),
        TensorSpec(("layers", "mlp", "up_proj"), p + "mlp.up_proj.weight", (F, D), transpose),
        TensorSpec(("layers", "mlp", "down_proj"), p + "mlp.down_proj.weight", (D, F), transpose),
        TensorSpec(("final_norm", "scale"), "model.norm.weight", (D,)),
    ]
    if not config.tie_embeddings:
        specs.append(TensorSpec(("lm_head",), "lm_head.weight", (V, D), transpose))
    return specs


class SafetensorsReader:
    """Reads tensors by name from one ``model.safetensors`` or a sharded set with an index."""

    def __init__(self, folder: pathlib.Path):
        self.folder = folder
        self._handles: dict[pathlib.Path, Any] = {}
        index_path = folder / SAFETENSORS_INDEX
        if index_path.exists():
            weight_map = read_json(index_path).get("weight_map")
            if not isinstance(weight_map, dict):
                raise WeightsError(f"{index_path} has no 'weight_map'")
            self.file_of = {name: folder / file for name, file in weight_map.items()}
        else:
            files = sorted(folder.glob("*.safetensors"))
            if not files:
                raise FileNotFoundError(f"{folder} has no *.safetensors weights (only safetensors are supported)")
            self.file_of = {}
            for file in files:
                for name in self._open(file).keys():
                    self.file_of[name] = file

    def _open(self, file: pathlib.Path):
        if file not in self._handles:
            if not file.exists():
                raise FileNotFoundError(f"{file} (listed in {SAFETENSORS_INDEX}) does not exist")
            try:
                self._handles[file] = safe_open(str(file), framework="numpy")
            except Exception as e:  # safetensors raises its own error types for corrupt headers
                raise WeightsError(f"{file} is not a readable safetensors file: {e}") from None
        return self._handles[file]

    def names(self) -> set[str]:
        return set(self.file_of)

    def read(self, name: str) -> np.ndarray:
        file = self.file_of[name]
        try:
            return self._open(file).get_tensor(name)
        except Exception as e:
            raise WeightsError(f"{file}: cannot read tensor {name!r} (truncated or corrupt file?): {e}") from None


def load_hf(folder: str | pathlib.Path, *, dtype=np.float32, progress=None) -> tuple[ModelConfig, dict]:
    """Config and numpy params from a Hugging Face folder; params are cast to ``dtype``."""
    folder = pathlib.Path(folder)
    if not folder.is_dir():
        raise FileNotFoundError(f"{folder} is not a Hugging Face model folder")
    config = config_from_hf(read_json(folder / "config.json"), where=str(folder / "config.json"))
    reader = SafetensorsReader(folder)
    names = reader.names()
    if config.tie_embeddings:
        # Some tied checkpoints still store the (identical) head; it carries no information.
        names.discard("lm_head.weight")
    params = assemble(tensor_specs(config), config, reader.read, names, where=str(folder), dtype=dtype,
                      progress=progress)
    return config, params
