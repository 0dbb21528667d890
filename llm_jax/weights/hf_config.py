"""Hugging Face ``config.json`` → :class:`ModelConfig`: one small builder per supported architecture.

Every family is the same decoder with different switches; a builder only reads the family's field
names and defaults. It owns the config quirks: the spellings of transformers 4 and 5 (``rope_theta`` /
``rope_scaling`` vs ``rope_parameters``), fields that transformers fills in when a config omits them
(the family defaults below), Gemma's legacy ``hidden_act: gelu``, Phi-3's older LongRoPE names and partial
rotary factor, YaRN's fallbacks and DeepSeek's mscale ratio, Gemma 3's and OLMo 3's two RoPEs, the
``text_config`` of Gemma 3's multimodal checkpoints, and the mixture-of-experts fields of Mixtral, Qwen2-MoE and
Qwen3-MoE (their training-only router jitter and auxiliary loss are not read: they do not change inference).
"""

from __future__ import annotations

import json
import math
import pathlib
from typing import Any, Callable

from llm_jax.config import (Activation, Classifier, ConfigError, DefaultRope, Experts, LinearRope, Llama3Rope,
                            LongRope, ModelConfig, Problem, QKNormScope, YarnRope, yarn_mscale)


def read_json(path: pathlib.Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise FileNotFoundError(f"{path} does not exist") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path} does not hold a JSON object")
    return data


def _rope(hf: dict[str, Any]) -> tuple[float, Any]:
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
        case "longrope":
            return theta, _longrope(hf, scaling)
        case "yarn":
            return theta, _yarn(hf, scaling)
    raise ConfigError(f"unsupported rope scaling type {kind!r}; supported: default, linear, llama3, longrope, yarn")


def _yarn(hf: dict[str, Any], scaling: dict[str, Any]) -> YarnRope:
    """YaRN as transformers' ``_compute_yarn_parameters`` resolves it: ``original_max_position_embeddings`` from
    the scaling, else ``max_position_embeddings`` (one written beside the scaling is not read: transformers reads
    it for Phi-3 only); a ``factor`` of null is ``max_position_embeddings`` / that; the attention factor
    ``attention_factor`` if given, else DeepSeek's ratio of mscales where ``mscale`` and ``mscale_all_dim`` are
    both set (non-zero), else YaRN's own (None); ``beta_fast`` / ``beta_slow`` 32 / 1 where absent, null or 0."""
    if "factor" not in scaling:
        raise ConfigError(f"rope scaling yarn {scaling} has no factor (transformers requires one; null reads "
                          "max_position_embeddings / original_max_position_embeddings)")
    orig = scaling.get("original_max_position_embeddings") or hf["max_position_embeddings"]
    if isinstance(orig, float) and orig.is_integer():
        orig = int(orig)
    factor = scaling["factor"]
    if factor is None:
        factor = hf["max_position_embeddings"] / orig
    attention_factor = scaling.get("attention_factor")
    mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
    if attention_factor is None and mscale and mscale_all_dim:
        attention_factor = yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
    return YarnRope(factor=factor, original_max_position_embeddings=orig,
                    beta_fast=scaling.get("beta_fast") or 32.0, beta_slow=scaling.get("beta_slow") or 1.0,
                    attention_factor=attention_factor, truncate=scaling.get("truncate", True))


def _longrope(hf: dict[str, Any], scaling: dict[str, Any]) -> LongRope:
    """LongRoPE's factors, and its attention factor as transformers resolves it: ``attention_factor`` if given,
    else sqrt(1 + log(s) / log(orig)) for the extension s (``factor``, else ``max_position_embeddings`` /
    ``original_max_position_embeddings``; 1 when s <= 1). ``original_max_position_embeddings`` is read from
    the scaling or, as transformers 4 wrote it, beside it."""
    orig = int(scaling.get("original_max_position_embeddings") or hf["original_max_position_embeddings"])
    factor = scaling.get("factor") or hf.get("max_position_embeddings", orig) / orig
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(orig))
    return LongRope(short_factor=scaling["short_factor"], long_factor=scaling["long_factor"],
                    original_max_position_embeddings=orig, attention_factor=float(attention_factor))


_ACTIVATIONS = {"silu": Activation.SILU, "swish": Activation.SILU,
                "gelu_pytorch_tanh": Activation.GELU_TANH, "gelu_new": Activation.GELU_TANH}


def _activation(name: str | None, field: str) -> Activation:
    if name not in _ACTIVATIONS:
        raise ConfigError(f"{field}={name!r} is not supported; supported: {sorted(_ACTIVATIONS)}")
    return _ACTIVATIONS[name]


def _windows(hf: dict[str, Any]) -> dict[str, Any]:
    """``sliding_window`` / ``sliding_layers`` from ``layer_types`` (transformers 5), Qwen's
    ``use_sliding_window`` + ``max_window_layers``, or a bare ``sliding_window`` (every layer: Mistral)."""
    window = hf.get("sliding_window")
    if window is None or hf.get("use_sliding_window") is False:
        return {}
    n_layers = hf["num_hidden_layers"]
    types = hf.get("layer_types")
    if types is None and "max_window_layers" in hf:  # Qwen before layer_types
        types = ["sliding_attention" if i >= hf["max_window_layers"] else "full_attention" for i in range(n_layers)]
    if types is None:
        return {"sliding_window": int(window)}
    unknown = sorted(set(types) - {"sliding_attention", "full_attention"})
    if unknown or len(types) != n_layers:
        raise ConfigError(f"layer_types {types} must list 'sliding_attention' or 'full_attention' for each of "
                          f"the {n_layers} layers")
    flags = tuple(t == "sliding_attention" for t in types)
    return {"sliding_window": int(window), "sliding_layers": flags} if any(flags) else {}


def _decoder(hf: dict[str, Any], **switches: Any) -> ModelConfig:
    """The fields every family spells the Llama way, plus the family's switches."""
    n_heads = hf["num_attention_heads"]
    theta, scaling = _rope(hf)
    return ModelConfig(
        vocab_size=hf["vocab_size"], d_model=hf["hidden_size"], n_layers=hf["num_hidden_layers"],
        n_heads=n_heads, n_kv_heads=hf.get("num_key_value_heads") or n_heads,
        head_dim=hf.get("head_dim") or hf["hidden_size"] // n_heads, d_ff=hf["intermediate_size"],
        max_seq_len=hf.get("max_position_embeddings", 2048), norm_eps=hf.get("rms_norm_eps", 1e-6),
        rope_theta=theta, rope_scaling=scaling, tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        **switches)


def _refuse(hf: dict[str, Any], *fields: str) -> None:
    """Features of a family that our decoder does not implement (biases it has no parameter for)."""
    on = [f for f in fields if hf.get(f)]
    if on:
        raise ConfigError(f"{hf['architectures'][0]} with {', '.join(f'{f}=true' for f in on)} is not supported")


def _llama(hf: dict[str, Any]) -> ModelConfig:
    _refuse(hf, "attention_bias", "mlp_bias")
    return _decoder(hf, activation=_activation(hf.get("hidden_act", "silu"), "hidden_act"))


def _mistral(hf: dict[str, Any]) -> ModelConfig:
    return _decoder(hf, activation=_activation(hf.get("hidden_act", "silu"), "hidden_act"), **_windows(hf))


def _qwen2(hf: dict[str, Any]) -> ModelConfig:
    # Qwen2 always has q/k/v biases (and none on o_proj); attention_bias is not read by transformers.
    return _decoder(hf, activation=_activation(hf.get("hidden_act", "silu"), "hidden_act"), qkv_bias=True,
                    **_windows(hf))


def _qwen3(hf: dict[str, Any]) -> ModelConfig:
    _refuse(hf, "attention_bias")  # would put a bias on o_proj too
    return _decoder(hf, activation=_activation(hf.get("hidden_act", "silu"), "hidden_act"), qk_norm=True,
                    **_windows(hf))


def _mixtral(hf: dict[str, Any]) -> ModelConfig:
    """Every layer's MLP a mixture of ``num_local_experts`` experts of width ``intermediate_size``, the top-k
    weights always renormalised."""
    hf = {"num_local_experts": 8, "num_experts_per_tok": 2, **hf}
    experts = Experts(num_experts=hf["num_local_experts"], top_k=hf["num_experts_per_tok"], normalize_top_k=True)
    return _decoder(hf, activation=_activation(hf.get("hidden_act", "silu"), "hidden_act"), experts=experts,
                    **_windows(hf))


def _every_layer_sparse(hf: dict[str, Any]) -> None:
    """Refuses Qwen's dense layers among the sparse ones (``mlp_only_layers``, ``decoder_sparse_step`` above 1):
    the layer stack has one kind of MLP."""
    name = hf["architectures"][0]
    if hf.get("mlp_only_layers"):
        raise ConfigError(f"{name} with dense layers (mlp_only_layers={hf['mlp_only_layers']}) is not supported; "
                          "every layer's MLP must be a mixture of experts")
    if hf.get("decoder_sparse_step", 1) != 1:
        raise ConfigError(f"{name} with decoder_sparse_step={hf['decoder_sparse_step']} (dense layers between the "
                          "sparse ones) is not supported; only 1, every layer a mixture of experts")


def _qwen2_moe(hf: dict[str, Any]) -> ModelConfig:
    """Qwen2 (q/k/v biases, ``qkv_bias``) with every layer's MLP a mixture of ``num_experts`` experts of width
    ``moe_intermediate_size`` and a shared expert of width ``shared_expert_intermediate_size`` (Qwen1.5-MoE,
    Qwen2-57B-A14B). Dense layers among them are refused (:func:`_every_layer_sparse`)."""
    hf = {"num_experts_per_tok": 4, "moe_intermediate_size": 1408, "shared_expert_intermediate_size": 5632, **hf}
    _every_layer_sparse(hf)
    experts = Experts(num_experts=hf.get("num_experts", hf.get("num_local_experts", 60)),
                      top_k=hf["num_experts_per_tok"], normalize_top_k=bool(hf.get("norm_topk_prob", False)),
                      shared_d_ff=hf["shared_expert_intermediate_size"])
    return _decoder({**hf, "intermediate_size": hf["moe_intermediate_size"]},
                    activation=_activation(hf.get("hidden_act", "silu"), "hidden_act"),
                    qkv_bias=bool(hf.get("qkv_bias", True)), experts=experts, **_windows(hf))


def _qwen3_moe(hf: dict[str, Any]) -> ModelConfig:
    """Qwen3 with every layer's MLP a mixture of experts of width ``moe_intermediate_size`` (``num_experts``;
    transformers 5 writes ``num_local_experts``). Dense layers among them are refused (:func:`_every_layer_sparse`)."""
    _refuse(hf, "attention_bias")
    _every_layer_sparse(hf)
    name = hf["architectures"][0]
    if hf.get("shared_expert_intermediate_size"):
        raise ConfigError(f"{name} with a shared expert (shared_expert_intermediate_size="
                          f"{hf['shared_expert_intermediate_size']}) is not supported")
    num_experts = hf.get("num_experts", hf.get("num_local_experts", 128))
    experts = Experts(num_experts=num_experts, top_k=hf.get("num_experts_per_tok", 8),
                      normalize_top_k=bool(hf.get("norm_topk_prob", False)))
    return _decoder({**hf, "intermediate_size": hf.get("moe_intermediate_size", 768)},
                    activation=_activation(hf.get("hidden_act", "silu"), "hidden_act"), qk_norm=True,
                    experts=experts, **_windows(hf))


# Phi3Config's defaults where they differ from _decoder's.
_PHI3_DEFAULTS = dict(max_position_embeddings=4096, original_max_position_embeddings=4096, rms_norm_eps=1e-5)


def _phi3(hf: dict[str, Any]) -> ModelConfig:
    """Phi-3, Phi-3.5 and Phi-4 (mini): Llama's decoder with fused qkv_proj and gate_up_proj (split by the
    weight converter), a sliding window (Phi-3-mini-4k), LongRoPE (``longrope``, which transformers also
    reads from the older ``su`` and ``yarn``) and partial rotary embeddings (``partial_rotary_factor``:
    Phi-4-mini rotates 3/4 of each head)."""
    hf = {**_PHI3_DEFAULTS, **hf}
    rope = {**(hf.get("rope_scaling") or {}), **(hf.get("rope_parameters") or {})}
    if rope.get("rope_type", rope.get("type")) in ("su", "yarn"):  # transformers' Phi3Config renames them
        rope["rope_type"] = "longrope"
    hf = {**hf, "rope_parameters": rope, "rope_scaling": None}
    n_heads = hf["num_attention_heads"]
    head_dim = hf.get("head_dim") or hf["hidden_size"] // n_heads
    partial = float(rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0)))
    if not 0.0 < partial <= 1.0:
        raise ConfigError(f"partial_rotary_factor={partial} must be in (0, 1]")
    return _decoder(hf, activation=_activation(hf.get("hidden_act", "silu"), "hidden_act"),
                    rotary_dim=int(head_dim * partial), **_windows(hf))


_GEMMA_DEFAULTS = dict(head_dim=256, tie_word_embeddings=True)


def _gemma(hf: dict[str, Any]) -> ModelConfig:
    hf = {**_GEMMA_DEFAULTS, **hf}
    _refuse(hf, "attention_bias")
    act = hf.get("hidden_act") or hf.get("hidden_activation") or "gelu_pytorch_tanh"
    # The original Gemma releases say "gelu" but were trained with the tanh approximation; transformers
    # rewrites it the same way.
    act = "gelu_pytorch_tanh" if act == "gelu" else act
    return _decoder(hf, activation=_activation(act, "hidden_act"), norm_weight_offset=1.0, embed_scale=True)


_GEMMA2_DEFAULTS = dict(head_dim=256, tie_word_embeddings=True, query_pre_attn_scalar=256,
                        attn_logit_softcapping=50.0, final_logit_softcapping=30.0, sliding_window=4096)


def _gemma2(hf: dict[str, Any]) -> ModelConfig:
    hf = {**_GEMMA2_DEFAULTS, **hf}
    _refuse(hf, "attention_bias")
    if hf.get("layer_types") is None:  # Gemma 2 alternates: layers 0, 2, 4, ... use the window
        hf["layer_types"] = ["sliding_attention" if i % 2 == 0 else "full_attention"
                             for i in range(hf["num_hidden_layers"])]
    return _decoder(hf, activation=_activation(hf.get("hidden_activation", "gelu_pytorch_tanh"), "hidden_activation"),
                    norm_weight_offset=1.0, embed_scale=True, sandwich_norm=True,
                    query_pre_attn_scalar=float(hf["query_pre_attn_scalar"]),
                    attn_logit_softcap=hf["attn_logit_softcapping"], final_logit_softcap=hf["final_logit_softcapping"],
                    **_windows(hf))


# Gemma3TextConfig's defaults: the multimodal checkpoints' ``text_config`` spells out only what differs.
_GEMMA3_DEFAULTS = dict(vocab_size=262_208, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26,
                        num_attention_heads=8, num_key_value_heads=4, head_dim=256, max_position_embeddings=131_072,
                        rms_norm_eps=1e-6, tie_word_embeddings=True, query_pre_attn_scalar=256, sliding_window=4096,
                        rope_theta=1_000_000.0, rope_local_base_freq=10_000.0, sliding_window_pattern=6)


def _gemma3_rope(hf: dict[str, Any]) -> dict[str, Any]:
    """The global layers' RoPE (``rope_parameters["full_attention"]``, or transformers 4's ``rope_theta`` and
    ``rope_scaling``) and the local layers' base (``rope_parameters["sliding_attention"]`` or
    ``rope_local_base_freq``), which must be plain RoPE: the fields that say so to :func:`_decoder`, and the base."""
    params = hf.get("rope_parameters") or {}
    if "full_attention" in params or "sliding_attention" in params:
        full = {"rope_theta": hf["rope_theta"], **(params.get("full_attention") or {})}
        local = {"rope_theta": hf["rope_local_base_freq"], **(params.get("sliding_attention") or {})}
    else:  # transformers 4, or a flat rope_parameters: the global layers'
        full = {"rope_theta": hf["rope_theta"], **(hf.get("rope_scaling") or {}), **params}
        local = {"rope_theta": hf["rope_local_base_freq"]}
    if local.get("rope_type", local.get("type", "default")) != "default":
        raise ConfigError(f"sliding_attention RoPE {local} is not supported; Gemma 3's local layers use plain RoPE")
    _refuse_per_layer_type_quirks(full)
    return {"rope_parameters": full, "rope_scaling": None, "sliding_rope_theta": float(local["rope_theta"])}


def _refuse_per_layer_type_quirks(full: dict[str, Any]) -> None:
    """Refuses global-layer RoPE settings that transformers 5 reads otherwise than they say where it keeps one RoPE
    per layer type (Gemma 3, OLMo 3; transformers 4's ``rope_scaling`` too, merged into ``full_attention``): a
    ``type`` without ``rope_type`` (its ``rope_type`` stays "default": plain RoPE) and YaRN's ``truncate: false``
    (read from the top level of ``rope_parameters`` only, so truncated all the same)."""
    if "rope_type" not in full and full.get("type", "default") != "default":
        raise ConfigError(f"full_attention RoPE {full} names its type as 'type' only; transformers 5 then runs plain "
                          "RoPE on these layers (its rope_type stays 'default'): write rope_type")
    if full.get("rope_type", full.get("type")) == "yarn" and full.get("truncate", True) is not True:
        raise ConfigError(f"full_attention RoPE {full}: truncate={full['truncate']!r} is not supported per layer "
                          "type; transformers 5 reads truncate from the top level of rope_parameters only, and so "
                          "truncates these layers' YaRN all the same")


def _gemma3(hf: dict[str, Any]) -> ModelConfig:
    """Gemma 3's text model; a multimodal folder's (``Gemma3ForConditionalGeneration``) is its ``text_config``."""
    text = hf.get("text_config") or hf
    text = {**_GEMMA3_DEFAULTS, **text, "architectures": hf["architectures"]}
    _refuse(text, "attention_bias", "use_bidirectional_attention")
    if text.get("layer_types") is None:  # every sliding_window_pattern-th layer is global
        pattern = text["sliding_window_pattern"]
        text["layer_types"] = ["sliding_attention" if (i + 1) % pattern else "full_attention"
                               for i in range(text["num_hidden_layers"])]
    rope = _gemma3_rope(text)
    windows = _windows(text)
    return _decoder({**text, **rope}, activation=_activation(text.get("hidden_activation", "gelu_pytorch_tanh"),
                                                             "hidden_activation"),
                    norm_weight_offset=1.0, embed_scale=True, sandwich_norm=True, qk_norm=True,
                    query_pre_attn_scalar=float(text["query_pre_attn_scalar"]),
                    attn_logit_softcap=text.get("attn_logit_softcapping"),
                    final_logit_softcap=text.get("final_logit_softcapping"),
                    sliding_rope_theta=rope["sliding_rope_theta"] if windows.get("sliding_layers") else None,
                    **windows)


def _olmo2(hf: dict[str, Any]) -> ModelConfig:
    """OLMo 2: no norms before attention and the MLP, their outputs normed instead (``pre_norm=False`` with the
    sandwich's post norms), and q/k norms over each token's whole projection (``QKNormScope.ALL_HEADS``)."""
    _refuse(hf, "attention_bias")  # would put a bias on o_proj too
    return _decoder({"rms_norm_eps": 1e-5, **hf}, activation=_activation(hf.get("hidden_act", "silu"), "hidden_act"),
                    sandwich_norm=True, pre_norm=False, qk_norm=True, qk_norm_scope=QKNormScope.ALL_HEADS)


def _olmo3_rope(hf: dict[str, Any], sliding: bool) -> dict[str, Any]:
    """OLMo 3's two RoPEs: the global layers' (``rope_parameters["full_attention"]``, or transformers 4's
    ``rope_theta`` and ``rope_scaling``) for :func:`_decoder`, and ``sliding_rope_theta`` where the sliding layers
    rotate otherwise (plain RoPE: no scaling, maybe another base); the sliding layers' own scaling is refused."""
    params = hf.get("rope_parameters") or {}
    theta = hf.get("rope_theta") or 500_000.0  # Olmo3Config's default base
    if "full_attention" in params or "sliding_attention" in params:
        full = {"rope_theta": theta, **(params.get("full_attention") or {})}
        local = {"rope_theta": theta, **(params.get("sliding_attention") or {})}
    else:  # transformers 4, or a flat rope_parameters: the global layers' (transformers applies no scaling locally)
        full = {"rope_theta": theta, **(hf.get("rope_scaling") or {}), **params}
        local = {"rope_theta": full["rope_theta"]}
    if local.get("rope_type", local.get("type", "default")) != "default":
        raise ConfigError(f"sliding_attention RoPE {local} is not supported; only plain RoPE on the sliding layers")
    _refuse_per_layer_type_quirks(full)
    full_theta, full_scaling = _rope({**hf, "rope_parameters": full, "rope_scaling": None})
    plain_alike = isinstance(full_scaling, DefaultRope) and float(local["rope_theta"]) == full_theta
    local_theta = None if plain_alike or not sliding else float(local["rope_theta"])
    return {"rope_parameters": full, "rope_scaling": None, "sliding_rope_theta": local_theta}


def _olmo3(hf: dict[str, Any]) -> ModelConfig:
    """OLMo 3: OLMo 2 with sliding-window layers (``layer_types``; by default three of every four, the fourth
    global), each layer type with its own RoPE (:func:`_olmo3_rope`)."""
    hf = {"sliding_window": 4096, **hf}
    if hf.get("layer_types") is None:
        hf["layer_types"] = ["sliding_attention" if (i + 1) % 4 else "full_attention"
                             for i in range(hf["num_hidden_layers"])]
    windows = _windows(hf)
    rope = _olmo3_rope(hf, bool(windows.get("sliding_layers")))
    return _olmo2({**hf, "rope_parameters": rope["rope_parameters"], "rope_scaling": None}).replace(
        sliding_rope_theta=rope["sliding_rope_theta"], **windows)


# ``architectures`` entry → builder of our config from config.json
ARCHITECTURES: dict[str, Callable[[dict[str, Any]], ModelConfig]] = {
    "LlamaForCausalLM": _llama,
    "MistralForCausalLM": _mistral,
    "Qwen2ForCausalLM": _qwen2,
    "Qwen3ForCausalLM": _qwen3,
    "MixtralForCausalLM": _mixtral,
    "Qwen2MoeForCausalLM": _qwen2_moe,
    "Qwen3MoeForCausalLM": _qwen3_moe,
    "Phi3ForCausalLM": _phi3,
    "GemmaForCausalLM": _gemma,
    "Gemma2ForCausalLM": _gemma2,
    "Gemma3ForCausalLM": _gemma3,
    # The text model of Gemma 3's multimodal checkpoints (4B, 12B, 27B); the vision tower is not read.
    "Gemma3ForConditionalGeneration": _gemma3,
    "Olmo2ForCausalLM": _olmo2,
    "Olmo3ForCausalLM": _olmo3,
}


# Each family's sequence classifier (reward models, classifiers): the decoder, and ``score`` for its head.
CLASSIFIERS = {name.replace("ForCausalLM", "ForSequenceClassification"): name for name in ARCHITECTURES
               if name.endswith("ForCausalLM")}
# Gemma 3's text-only classifier has a name of its own (Gemma3ForSequenceClassification is the multimodal one).
CLASSIFIERS["Gemma3TextForSequenceClassification"] = "Gemma3ForCausalLM"


def config_from_hf(hf: dict[str, Any], *, where: str = "config.json") -> ModelConfig:
    archs = hf.get("architectures") or []
    known = [a for a in archs if a in ARCHITECTURES or a in CLASSIFIERS]
    if not known:
        raise ConfigError(f"{where}: unsupported architectures {archs}; supported: "
                          f"{sorted(ARCHITECTURES) + sorted(CLASSIFIERS)}")
    hf = {**hf, "architectures": known}
    try:
        if known[0] in CLASSIFIERS:
            return ARCHITECTURES[CLASSIFIERS[known[0]]](hf).replace(classifier=_classifier(hf))
        return ARCHITECTURES[known[0]](hf)
    except KeyError as e:
        raise ConfigError(f"{where}: missing field {e.args[0]!r} for {known[0]}") from None
    except (ConfigError, ValueError) as e:
        raise ConfigError(f"{where}: {e}") from None


def _classifier(hf: dict[str, Any]) -> Classifier:
    """The head of a ``*ForSequenceClassification``: its labels by id (``id2label``; else ``num_labels``
    named as ``transformers`` names them, LABEL_i; two by default) and its ``problem_type``."""
    id2label = hf.get("id2label")
    if id2label:
        try:
            ids = sorted((int(i), str(label)) for i, label in id2label.items())
        except (TypeError, ValueError, AttributeError):
            raise ConfigError(f"id2label must map label ids to names, got {id2label!r}") from None
        if [i for i, _ in ids] != list(range(len(ids))):
            raise ConfigError(f"id2label must name the labels 0 to {len(ids) - 1}, got ids {[i for i, _ in ids]}")
        labels = tuple(label for _, label in ids)
        if "num_labels" in hf and hf["num_labels"] != len(labels):
            raise ConfigError(f"num_labels={hf['num_labels']} but id2label names {len(labels)} labels")
    else:
        num_labels = hf.get("num_labels", 2)
        if not isinstance(num_labels, int) or num_labels < 1:
            raise ConfigError(f"num_labels must be a positive integer, got {num_labels!r}")
        labels = tuple(f"LABEL_{i}" for i in range(num_labels))
    problem = hf.get("problem_type") or Problem.SINGLE_LABEL.value
    if problem not in {p.value for p in Problem}:
        raise ConfigError(f"problem_type={problem!r} is not one of {sorted(p.value for p in Problem)}")
    return Classifier(labels=labels, problem=Problem(problem))


def read_hf_config(folder: pathlib.Path) -> ModelConfig:
    return config_from_hf(read_json(folder / "config.json"), where=str(folder / "config.json"))
