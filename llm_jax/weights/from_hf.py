"""Hugging Face model folders (``config.json`` + ``*.safetensors``) → llm_jax config and params.

One tensor map serves every supported family, switched by the config (q/k/v biases, q/k norms, Gemma 2's
extra norms, OLMo 2's norms after the sub-blocks only and q/k norms over all heads, tied embeddings, a mixture
of experts: each expert's tensors apart, as the released checkpoints and transformers 5's ``save_pretrained``
store them, stacked [L, E, ...], and Qwen2-MoE's shared expert); of a multimodal checkpoint (Gemma 3's 4B,
12B, 27B) only the language model is read, its vision tower ignored (:class:`TextTensors`); Phi-3's fused
qkv_proj and gate_up_proj are split into our q/k/v and gate/up params.
torch ``Linear`` weights are stored [out, in] and transposed here; Hugging Face already rotates RoPE halves, as
our model does, so q/k need no permutation.
The config side (architectures, field names, family defaults) is ``hf_config.py``.
"""

from __future__ import annotations

import dataclasses
import pathlib
from typing import Any, Callable

import numpy as np

from llm_jax.config import PROJECTION_NAMES, ModelConfig, QKNormScope
from llm_jax.weights import from_compressed
from llm_jax.weights.hf_config import read_hf_config, read_json
from llm_jax.weights.layout import (TensorSpec, WeightsError, assemble, heads_bias, heads_in, heads_out, rows,
                                    transpose)
from llm_jax.weights.safetensors_file import SafetensorsFolder

# A multimodal checkpoint's language model (Gemma3ForConditionalGeneration): transformers writes it under
# "language_model.model." (as the released checkpoints are), its modules name it "model.language_model.".
_TEXT_PREFIXES = {"language_model.model.": "model.", "model.language_model.": "model.",
                  "language_model.lm_head.": "lm_head."}
# The other towers of such a checkpoint, which llm_jax does not run.
_OTHER_TOWERS = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.", "model.multi_modal_projector.")
# Mixtral's names for its mixture of experts (``block_sparse_moe``, the experts' w1 / w3 / w2), as the released
# checkpoints and transformers' save_pretrained write them → Qwen3-MoE's (``mlp``, gate / up / down_proj).
_MIXTRAL_NAMES = ((".block_sparse_moe.", ".mlp."), (".w1.", ".gate_proj."), (".w3.", ".up_proj."),
                  (".w2.", ".down_proj."))


class TextTensors:
    """The tensors of a Hugging Face folder under a text-only checkpoint's names: a multimodal checkpoint's
    language model renamed ("model.*", "lm_head.weight"), its vision tower and projector left out; a Mixtral
    checkpoint's experts under Qwen3-MoE's names ("mlp.gate", "mlp.experts.{i}.gate_proj", ...); any other
    folder's as they are."""

    def __init__(self, folder: pathlib.Path):
        self.folder = SafetensorsFolder(folder)
        stored = self.folder.names()
        self.stored_name = {name: name for name in stored}
        if any(name.startswith(tuple(_TEXT_PREFIXES)) for name in stored):
            self.stored_name = {}
            for name in stored:
                prefix = next((p for p in _TEXT_PREFIXES if name.startswith(p)), None)
                if prefix is not None:
                    self.stored_name[_TEXT_PREFIXES[prefix] + name[len(prefix):]] = name
                elif not name.startswith(_OTHER_TOWERS):
                    self.stored_name[name] = name
        self.stored_name = {_mixtral_renamed(ours): name for ours, name in self.stored_name.items()}

    def names(self) -> set[str]:
        return set(self.stored_name)

    def where(self, name: str) -> str:
        return self.folder.where(self.stored_name[name])

    def read(self, name: str) -> np.ndarray:
        return self.folder.read(self.stored_name[name])


def _mixtral_renamed(name: str) -> str:
    """Mixtral's name of a mixture-of-experts tensor under Qwen3-MoE's; any other name as it is."""
    if ".block_sparse_moe." not in name:
        return name
    for theirs, ours in _MIXTRAL_NAMES:
        name = name.replace(theirs, ours)
    return name


# The tensor that tells a checkpoint with Phi-3's fused projections (qkv_proj, gate_up_proj) from the others.
FUSED_MARKER = "model.layers.0.self_attn.qkv_proj.weight"


def tensor_specs(config: ModelConfig, *, fused: bool = False) -> list[TensorSpec]:
    """Where each of our params comes from in a Hugging Face state dict of a family with ``config``; ``fused``:
    Phi-3's, whose q/k/v rows are one qkv_proj [(N + 2K)·H, D] and gate/up rows one gate_up_proj [2F, D]."""
    D, N, K, H, F, V = (config.d_model, config.n_heads, config.n_kv_heads, config.head_dim, config.d_ff,
                        config.vocab_size)
    p = "model.layers.{layer}."
    attn = p + "self_attn."
    if fused:
        qkv = (attn + "qkv_proj.weight", ((N + 2 * K) * H, D))
        q_k_v = [TensorSpec(("layers", "attn", "q_proj"), *qkv, rows(0, N * H, heads_in(N, H))),
                 TensorSpec(("layers", "attn", "k_proj"), *qkv, rows(N * H, (N + K) * H, heads_in(K, H))),
                 TensorSpec(("layers", "attn", "v_proj"), *qkv, rows((N + K) * H, (N + 2 * K) * H, heads_in(K, H)))]
    else:
        q_k_v = [TensorSpec(("layers", "attn", "q_proj"), attn + "q_proj.weight", (N * H, D), heads_in(N, H)),
                 TensorSpec(("layers", "attn", "k_proj"), attn + "k_proj.weight", (K * H, D), heads_in(K, H)),
                 TensorSpec(("layers", "attn", "v_proj"), attn + "v_proj.weight", (K * H, D), heads_in(K, H))]
    specs = [
        TensorSpec(("embedder", "embedding"), "model.embed_tokens.weight", (V, D)),
        *q_k_v,
        TensorSpec(("layers", "attn", "o_proj"), attn + "o_proj.weight", (D, N * H), heads_out(N, H)),
        TensorSpec(("final_norm", "scale"), "model.norm.weight", (D,)),
    ]
    if fused and config.experts is None:  # gate_up_proj: the gate's F rows, then the up projection's
        gate_up = (p + "mlp.gate_up_proj.weight", (2 * F, D))
        specs += [
            TensorSpec(("layers", "mlp", "gate_proj"), *gate_up, rows(0, F, transpose)),
            TensorSpec(("layers", "mlp", "up_proj"), *gate_up, rows(F, 2 * F, transpose)),
            TensorSpec(("layers", "mlp", "down_proj"), p + "mlp.down_proj.weight", (D, F), transpose),
        ]
    elif config.experts is None:
        specs += [
            TensorSpec(("layers", "mlp", "gate_proj"), p + "mlp.gate_proj.weight", (F, D), transpose),
            TensorSpec(("layers", "mlp", "up_proj"), p + "mlp.up_proj.weight", (F, D), transpose),
            TensorSpec(("layers", "mlp", "down_proj"), p + "mlp.down_proj.weight", (D, F), transpose),
        ]
    else:  # each expert's projections apart, stacked [L, E, ...]; the router ("gate") [E, D]
        E, expert = config.experts.num_experts, p + "mlp.experts.{expert}."
        specs += [
            TensorSpec(("layers", "moe", "router"), p + "mlp.gate.weight", (E, D), transpose),
            TensorSpec(("layers", "moe", "gate_proj"), expert + "gate_proj.weight", (F, D), transpose),
            TensorSpec(("layers", "moe", "up_proj"), expert + "up_proj.weight", (F, D), transpose),
            TensorSpec(("layers", "moe", "down_proj"), expert + "down_proj.weight", (D, F), transpose),
        ]
        if config.experts.shared_d_ff is not None:  # Qwen2-MoE's shared expert, and its gate [1, D] as a vector
            F_shared, shared = config.experts.shared_d_ff, p + "mlp.shared_expert."
            specs += [
                TensorSpec(("layers", "moe", "shared_gate_proj"), shared + "gate_proj.weight", (F_shared, D),
                           transpose),
                TensorSpec(("layers", "moe", "shared_up_proj"), shared + "up_proj.weight", (F_shared, D), transpose),
                TensorSpec(("layers", "moe", "shared_down_proj"), shared + "down_proj.weight", (D, F_shared),
                           transpose),
                TensorSpec(("layers", "moe", "shared_expert_gate"), p + "mlp.shared_expert_gate.weight", (1, D),
                           lambda w: w[0]),
            ]
    if config.pre_norm:
        specs.append(TensorSpec(("layers", "attn_norm", "scale"), p + "input_layernorm.weight", (D,)))
    if config.sandwich_norm:
        # Gemma 2 and OLMo 2 reuse the name post_attention_layernorm for the norm of the attention *output*.
        specs += [
            TensorSpec(("layers", "post_attn_norm", "scale"), p + "post_attention_layernorm.weight", (D,)),
            TensorSpec(("layers", "post_mlp_norm", "scale"), p + "post_feedforward_layernorm.weight", (D,)),
        ]
        if config.pre_norm:
            specs.append(TensorSpec(("layers", "mlp_norm", "scale"), p + "pre_feedforward_layernorm.weight", (D,)))
    else:
        specs.append(TensorSpec(("layers", "mlp_norm", "scale"), p + "post_attention_layernorm.weight", (D,)))
    if config.qkv_bias:
        specs += [
            TensorSpec(("layers", "attn", "q_bias"), attn + "q_proj.bias", (N * H,), heads_bias(N, H)),
            TensorSpec(("layers", "attn", "k_bias"), attn + "k_proj.bias", (K * H,), heads_bias(K, H)),
            TensorSpec(("layers", "attn", "v_bias"), attn + "v_proj.bias", (K * H,), heads_bias(K, H)),
        ]
    if config.qk_norm and config.qk_norm_scope is QKNormScope.HEAD:
        specs += [
            TensorSpec(("layers", "attn", "q_norm", "scale"), attn + "q_norm.weight", (H,)),
            TensorSpec(("layers", "attn", "k_norm", "scale"), attn + "k_norm.weight", (H,)),
        ]
    elif config.qk_norm:  # OLMo 2: over the whole projection, [N·H] and [K·H] → [N, H] and [K, H]
        specs += [
            TensorSpec(("layers", "attn", "q_proj_norm", "scale"), attn + "q_norm.weight", (N * H,), heads_bias(N, H)),
            TensorSpec(("layers", "attn", "k_proj_norm", "scale"), attn + "k_norm.weight", (K * H,), heads_bias(K, H)),
        ]
    if config.classifier is not None:  # a sequence classifier: ``score`` [C, D], no LM head
        specs.append(TensorSpec(("score",), "score.weight", (config.classifier.num_labels, D), transpose))
    elif not config.tie_embeddings:
        specs.append(TensorSpec(("lm_head",), "lm_head.weight", (V, D), transpose))
    return specs


def load_hf_params(folder: str | pathlib.Path, config: ModelConfig, *, dtype=np.float32,
                   progress: Callable[[str], None] | None = None,
                   place: Callable[[tuple[str, ...], np.ndarray], Any] | None = None) -> dict:
    """The params of the Hugging Face folder, tensor by tensor, cast to ``dtype`` (see ``layout.assemble``)."""
    folder = pathlib.Path(folder)
    reader = TextTensors(folder)
    names = reader.names()
    if config.tie_embeddings:
        # Some tied checkpoints still store the (identical) head; it carries no information.
        names.discard("lm_head.weight")
    fused = FUSED_MARKER in names
    specs, packed, read = tensor_specs(config, fused=fused), {}, reader.read
    scheme = from_compressed.read_scheme(read_json(folder / "config.json"), str(folder))
    if scheme is not None and fused:
        raise WeightsError(f"{folder}: {type(scheme).__name__} weights with fused projections (qkv_proj, "
                           "gate_up_proj: Phi-3) are not supported; compressed-tensors and FP8 loading read them "
                           "apart")
    if scheme is not None and config.experts is not None:
        raise WeightsError(f"{folder}: {type(scheme).__name__} weights of a mixture-of-experts model are not "
                           "supported (compressed-tensors and FP8 loading cover dense models only)")
    if isinstance(scheme, from_compressed.Float8Weights):  # FP8 weights: read as floats, scales applied
        read, names = from_compressed.float8_reader(reader.read, names, scheme, str(folder))
    elif scheme is not None:  # compressed-tensors: the packed projections are read apart
        stored = from_compressed.quantization(scheme, names, config, str(folder))
        packed = {spec.path: spec for spec in specs if spec.path[:1] == ("layers",)
                  and spec.path[-1] in PROJECTION_NAMES and stored.scheme(spec.path[-1]) is not None}
        specs = [spec for spec in specs if spec.path not in packed]
        names -= {f"{from_compressed.hf_name(path[-1], layer)}.{suffix}" for path in packed
                  for layer in range(config.n_layers)
                  for suffix in ("weight_packed", "weight_scale", "weight_shape", "weight_zero_point")}
    params = assemble(specs, config, read, names, where=str(folder), dtype=dtype, progress=progress,
                      locate=reader.where, place=place)
    for path in packed:  # quantized leaves, or floats when the config asks for floats (dequantize)
        leaf = _packed_leaf(reader, config, path[-1], scheme, str(folder), progress)
        if config.quantization is None:
            leaf = np.asarray(leaf.dequantize(np.float32)).astype(dtype)
            leaf = leaf if place is None else place(path, leaf)
        elif place is not None:
            leaf = dataclasses.replace(leaf, values=place((*path, "values"), leaf.values),
                                       scales=place((*path, "scales"), leaf.scales),
                                       offsets=None if leaf.offsets is None else place((*path, "offsets"),
                                                                                       leaf.offsets))
        params.setdefault(path[0], {}).setdefault(path[1], {})[path[2]] = leaf
    return params


def _packed_leaf(reader: TextTensors, config: ModelConfig, name: str, scheme, where: str, progress):
    """Projection ``name``'s layers from their compressed-tensors packing, as one quantized leaf."""
    from llm_jax.quantization import QuantizedArray, projection_dims

    ins, outs = projection_dims(name, config)
    K, N = int(np.prod(ins)), int(np.prod(outs))
    values, scales, offsets = [], [], []
    for layer in range(config.n_layers):
        module = from_compressed.hf_name(name, layer)
        v, s, o = from_compressed.packed_projection(reader.read, module, scheme, K, N, where)
        values.append(v)
        scales.append(s)
        offsets.append(o)
        if progress is not None:
            progress(f"{module}.weight_packed")
    return QuantizedArray(np.stack(values), np.stack(scales), ins, outs, scheme.bits, scheme.group_size or K,
                          offsets=None if scheme.offsets is False else np.stack(offsets))


def load_hf(folder: str | pathlib.Path, *, dtype=np.float32, progress=None) -> tuple[ModelConfig, dict]:
    """Config and numpy params from a Hugging Face folder; params are cast to ``dtype``."""
    folder = pathlib.Path(folder)
    if not folder.is_dir():
        raise FileNotFoundError(f"{folder} is not a Hugging Face model folder")
    config = read_hf_config(folder)
    return config, load_hf_params(folder, config, dtype=dtype, progress=progress)
