"""llm_jax config and float params → a GGUF file (llama.cpp's format), the reverse of ``from_gguf``.

:func:`save_gguf` writes a model of llama.cpp's ``llama`` architecture (Llama, Mistral without its window,
Mixtral), ``qwen3moe`` (Qwen3-MoE) or ``gemma3`` (Gemma 3's text model) as ``convert_hf_to_gguf.py`` would:
the architecture's metadata from the config, the tokenizer of a folder (:func:`add_tokenizer`), and every
tensor under llama.cpp's name, its matrices (a mixture's experts stacked, one tensor per layer and
projection) stored as F32, F16, BF16, Q8_0 or Q4_0 (:func:`encode`) and its norms and routers as F32.
What llama.cpp then runs is the same model: ``llm_jax.load`` of the file gives back the params (exactly
for F32; for the other types, their rounding of them; a mixture's block types with ``dequantize``). A
config llama.cpp would run otherwise is refused by name (:func:`gguf_architecture`).

The quirks, done here and undone by ``from_gguf``: llama.cpp rotates adjacent pairs of a ``llama`` head
(Meta's interleaved RoPE layout), we rotate halves, so the q and k rows of each head are permuted into
Meta's order; ``gemma3`` norms are stored as ``offset + w`` (llama.cpp's RMSNorm multiplies by the weight
alone).
"""

from __future__ import annotations

import math
import os
import pathlib
from typing import Any

import numpy as np

from llm_jax.config import Activation, ConfigError, DefaultRope, LinearRope, ModelConfig, YarnRope, yarn_mscale
from llm_jax.weights.from_gguf import (GEMMA3_LOCAL_THETA, GEMMA3_PERIOD, ROUTER, gemma3_sliding_layers,
                                       gemma_attention_scalar, rope_is_interleaved, tensor_specs)
from llm_jax.weights.layout import WeightsError

# The ggml types a file's matrices may be written in, with llama.cpp's name of such a file
# (``general.file_type``, ``gguf.LlamaFileType``).
FILE_TYPES = {"F32": "ALL_F32", "F16": "MOSTLY_F16", "BF16": "MOSTLY_BF16", "Q8_0": "MOSTLY_Q8_0",
              "Q4_0": "MOSTLY_Q4_0", "Q4_1": "MOSTLY_Q4_1"}

# The config fields of families other than Llama, at their Llama values: a config that sets one is not
# a model llama.cpp's ``llama`` architecture runs.
_LLAMA = ModelConfig(vocab_size=1, d_model=2, n_layers=1, n_heads=1, n_kv_heads=1, head_dim=2, d_ff=1,
                     max_seq_len=1)
_NOT_LLAMA = ("activation", "qkv_bias", "qk_norm", "qk_norm_scope", "norm_weight_offset", "embed_scale",
              "sandwich_norm", "pre_norm", "query_pre_attn_scalar", "attn_logit_softcap", "final_logit_softcap",
              "sliding_window", "rotary_dim")


def encode(x: np.ndarray, type_name: str) -> tuple[np.ndarray, Any]:
    """A float tensor as ``GGUFWriter.add_tensor`` takes it in ggml type ``type_name``: (data, raw_dtype),
    raw_dtype None for F32 and F16 (numpy's own dtypes). Other types (BF16, Q8_0, Q4_0, and whatever else
    ``gguf.quants`` can quantize) are rounded by ``gguf.quants``, as llama.cpp's converter rounds them; a
    tensor whose rows are not whole blocks of the type is written F16, as llama.cpp falls back."""
    import gguf

    x = np.asarray(x, np.float32)
    if type_name not in gguf.GGMLQuantizationType.__members__:
        raise ValueError(f"unknown ggml type {type_name!r}; GGUF files are written as {', '.join(FILE_TYPES)}")
    kind = gguf.GGMLQuantizationType[type_name]
    if x.shape[-1] % gguf.GGML_QUANT_SIZES[kind][0]:
        kind = gguf.GGMLQuantizationType.F16
    if kind == gguf.GGMLQuantizationType.F32:
        return x, None
    if kind == gguf.GGMLQuantizationType.F16:
        return x.astype(np.float16), None
    return gguf.quants.quantize(x, kind), kind


def add_tokenizer(writer, folder: pathlib.Path, pre: str = "gpt-2") -> None:
    """The tokenizer of ``folder`` as ``convert_hf_to_gguf.py`` writes it: a sentencepiece
    ``tokenizer.model`` 's pieces, scores, types and normalizer flags, or ``tokenizer.json`` 's tokens
    (control / user-defined) and merges with llama.cpp's pre-tokenizer name ``pre``; special token ids and
    ``add_bos_token`` from the folder's ``tokenizer_config.json`` / ``config.json`` where it has them."""
    import json

    import gguf

    if (folder / "tokenizer.model").is_file():
        from sentencepiece import sentencepiece_model_pb2

        vocab = gguf.vocab.SentencePieceVocab(folder)
        pieces = list(vocab.all_tokens())
        writer.add_tokenizer_model("llama")
        writer.add_tokenizer_pre("default")
        writer.add_token_list([p for p, _, _ in pieces])
        writer.add_token_scores([s for _, s, _ in pieces])
        writer.add_token_types([t for _, _, t in pieces])
        proto = sentencepiece_model_pb2.ModelProto()
        proto.ParseFromString((folder / "tokenizer.model").read_bytes())
        writer.add_add_space_prefix(proto.normalizer_spec.add_dummy_prefix)
        writer.add_remove_extra_whitespaces(proto.normalizer_spec.remove_extra_whitespaces)
        gguf.SpecialVocab(folder, n_vocab=len(pieces)).add_to_gguf(writer, quiet=True)
        return
    if not (folder / "tokenizer.json").is_file():
        raise FileNotFoundError(f"{folder} holds no tokenizer.model or tokenizer.json to write into the GGUF file")
    tok = json.loads((folder / "tokenizer.json").read_text())
    added = {t["id"]: t for t in tok["added_tokens"]}
    ids = {**tok["model"]["vocab"], **{t["content"]: i for i, t in added.items()}}
    names = sorted(ids, key=ids.get)
    if [ids[n] for n in names] != list(range(len(names))):
        raise WeightsError(f"{folder / 'tokenizer.json'}: token ids are not 0 ... {len(names) - 1} without gaps")
    types = [gguf.TokenType.NORMAL if i not in added else
             gguf.TokenType.CONTROL if added[i]["special"] else gguf.TokenType.USER_DEFINED for i in range(len(names))]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(names)
    writer.add_token_types(types)
    gguf.SpecialVocab(folder, load_merges=True, n_vocab=len(names)).add_to_gguf(writer, quiet=True)


def _llama_differences(config: ModelConfig, allowed: tuple[str, ...] = ()) -> list[str]:
    """The fields by which ``config`` is not a model llama.cpp's ``llama`` architecture runs as we do (but for
    the ``allowed`` ones)."""
    other = [f"{name}={getattr(config, name)!r}" for name in _NOT_LLAMA
             if name not in allowed and getattr(config, name) != getattr(_LLAMA, name)]
    match config.rope_scaling:
        case DefaultRope() | LinearRope():
            pass
        case YarnRope(truncate=False):
            other.append(f"rope_scaling={config.rope_scaling!r} (llama.cpp truncates YaRN's ramp)")
        case YarnRope() as yarn if not math.isclose(yarn.cos_sin_scale, yarn_mscale(yarn.factor), rel_tol=1e-6):
            other.append(f"rope_scaling={config.rope_scaling!r} (llama.cpp scales YaRN's cos and sin by "
                         f"0.1 ln(factor) + 1 = {yarn_mscale(yarn.factor):.6g}, not {yarn.cos_sin_scale:.6g})")
        case YarnRope():
            pass
        case other_rope:
            other.append(f"rope_scaling={other_rope!r}")
    return other


def _moe_architecture(config: ModelConfig) -> str:
    """``qwen3moe`` for a mixture of experts with q/k norms (Qwen3-MoE), else ``llama`` (Mixtral), each run by
    llama.cpp as Llama but for Qwen3's q/k norms, its top-k expert weights always renormalised. Refuses,
    naming the fields, what they would run otherwise."""
    architecture = "qwen3moe" if config.qk_norm else "llama"
    other = _llama_differences(config, allowed=("qk_norm",))
    if config.experts.shared_d_ff is not None:
        other.insert(0, f"experts.shared_d_ff={config.experts.shared_d_ff} (a shared expert: Qwen2-MoE's, which "
                        "llama.cpp runs as qwen2moe, not written here)")
    if not config.experts.normalize_top_k:
        other.insert(0, "experts.normalize_top_k=False (Qwen3-MoE's norm_topk_prob=False; llama.cpp renormalises "
                        "the top-k weights)")
    if other:
        raise ConfigError(f"llama.cpp's {architecture} architecture would not run this mixture of experts as llm_jax "
                          f"does: it has {', '.join(other)}")
    return architecture


def _gemma3_differences(config: ModelConfig) -> list[str]:
    """The fields by which ``config`` is not a model llama.cpp's ``gemma3`` architecture runs as we do: its
    switches, the attention scale it derives, and its fixed layer pattern and local RoPE (``from_gguf``)."""
    wanted = dict(activation=Activation.GELU_TANH, qkv_bias=False, qk_norm=True, embed_scale=True, sandwich_norm=True,
                  attn_logit_softcap=None, query_pre_attn_scalar=gemma_attention_scalar(config, 62), rotary_dim=None)
    other = [f"{name}={getattr(config, name)!r} (gemma3: {value!r})" for name, value in wanted.items()
             if getattr(config, name) != value]
    if not isinstance(config.rope_scaling, DefaultRope | LinearRope):
        other.append(f"rope_scaling={config.rope_scaling!r} (gemma3: none or linear)")
    windows = config.layer_windows()
    if any(w is not None for w in windows):
        pattern = gemma3_sliding_layers(config.n_layers)
        if windows != tuple(config.sliding_window if s else None for s in pattern):
            other.append(f"sliding layers {[w is not None for w in windows]} (gemma3: {list(pattern)}, every "
                         f"{GEMMA3_PERIOD}th layer global)")
        if config.sliding_rope_theta != GEMMA3_LOCAL_THETA:
            other.append(f"sliding_rope_theta={config.sliding_rope_theta!r} (gemma3: {GEMMA3_LOCAL_THETA})")
    return other


def gguf_architecture(config: ModelConfig) -> str:
    """The llama.cpp architecture ``config`` is written as: ``gemma3`` for a Gemma-style model (sandwich
    norms), ``llama`` or ``qwen3moe`` for a mixture of experts (Mixtral, Qwen3-MoE), else ``llama``. Refuses,
    naming the fields, a config that architecture does not run as we do."""
    if config.classifier is not None:
        raise ConfigError("a sequence classifier is not written as GGUF: llama.cpp's architectures have an LM "
                          "head, not a classifier's score head")
    if config.quantization is not None:
        raise ConfigError(f"GGUF files are written from float weights; these are quantized ({config.quantization}): "
                          "load them without quantize and choose the file's type instead")
    olmo = [f"{name}={getattr(config, name)!r}" for name in ("pre_norm", "qk_norm_scope")
            if getattr(config, name) != getattr(_LLAMA, name)]
    if olmo:
        raise ConfigError(f"OLMo 2's layers ({', '.join(olmo)}: norms after the sub-blocks only, q/k norms over all "
                          "heads) are not written as GGUF; llama.cpp's olmo2 architecture is not supported here")
    if config.experts is not None:
        return _moe_architecture(config)
    if config.sandwich_norm or config.sliding_rope_theta is not None:
        other = _gemma3_differences(config)
        if other:
            raise ConfigError(f"llama.cpp's gemma3 architecture would not run this model as llm_jax does: it has "
                              f"{', '.join(other)}")
        return "gemma3"
    other = _llama_differences(config)
    if other:
        raise ConfigError(f"only models of llama.cpp's llama and gemma3 architectures are written as GGUF; as llama "
                          f"this config sets {', '.join(other)}")
    return "llama"


def _halves_to_interleaved(n_heads: int, head_dim: int):
    """Our q/k [D, n, H] (rotate halves) → llama.cpp's rows [n*H, D] in Meta's interleaved layout: within a
    head, row j * H/2 + i moves to row 2i + j (what ``convert_hf_to_gguf.py`` 's ``permute`` does)."""

    def permute(w: np.ndarray) -> np.ndarray:
        D = w.shape[0]
        return w.reshape(D, n_heads, 2, head_dim // 2).transpose(1, 3, 2, 0).reshape(n_heads * head_dim, D)

    return permute


def _to_source(config: ModelConfig, architecture: str) -> dict[tuple[str, ...], Any]:
    """Leaf path → the function from our layout to llama.cpp's tensor (the inverse of ``tensor_specs``' own)."""
    D, N, K, H = config.d_model, config.n_heads, config.n_kv_heads, config.head_dim
    transpose = np.transpose
    if rope_is_interleaved(architecture):
        q_rows, k_rows = _halves_to_interleaved(N, H), _halves_to_interleaved(K, H)
    else:
        q_rows, k_rows = (lambda w: w.reshape(D, N * H).T), (lambda w: w.reshape(D, K * H).T)
    return {
        ("layers", "attn", "q_proj"): q_rows,
        ("layers", "attn", "k_proj"): k_rows,
        ("layers", "attn", "v_proj"): lambda w: w.reshape(D, K * H).T,
        ("layers", "attn", "o_proj"): lambda w: w.reshape(N * H, D).T,
        ("layers", "mlp", "gate_proj"): transpose,
        ("layers", "mlp", "up_proj"): transpose,
        ("layers", "mlp", "down_proj"): transpose,
        ("layers", "moe", "router"): transpose,
        ("layers", "moe", "gate_proj"): _experts_out,
        ("layers", "moe", "up_proj"): _experts_out,
        ("layers", "moe", "down_proj"): _experts_out,
        ("lm_head",): transpose,
    }


def _experts_out(w: np.ndarray) -> np.ndarray:
    """Our stacked experts [E, in, out] → llama.cpp's [E, out, in] (ggml's {in, out, E})."""
    return w.swapaxes(1, 2)


def _leaf(params: dict, path: tuple[str, ...]):
    for key in path:
        params = params[key]
    return params


def save_gguf(path: str | os.PathLike, config: ModelConfig, params: dict, type_name: str, *,
              tokenizer: str | os.PathLike | None = None, name: str | None = None) -> pathlib.Path:
    """Write a model of llama.cpp's ``llama`` or ``gemma3`` architecture (:func:`gguf_architecture`; its float
    params, in any float dtype) as a GGUF file whose matrices
    are of ggml type ``type_name`` (``FILE_TYPES``; Q8_0 / Q4_0 rounded as llama.cpp's converter does), with
    the tokenizer of the folder ``tokenizer`` (see :func:`add_tokenizer`; llama.cpp needs one to load the
    file). The file appears whole or not at all (written beside, then renamed). Returns ``path``."""
    import gguf

    if type_name not in FILE_TYPES:
        raise ValueError(f"unsupported GGUF file type {type_name!r}; choose one of {', '.join(FILE_TYPES)}")
    architecture = gguf_architecture(config)
    path = pathlib.Path(path)
    partial = path.with_name(f".{path.name}.partial")
    try:
        _write(gguf.GGUFWriter(partial, architecture), architecture, config, params, type_name, tokenizer,
               name or path.stem)
        os.replace(partial, path)
    finally:
        partial.unlink(missing_ok=True)
    return path


def _write(writer, architecture: str, config: ModelConfig, params: dict, type_name: str, tokenizer,
           name: str) -> None:
    """Metadata, tokenizer and tensors of :func:`save_gguf` 's file, through ``writer``, which it closes."""
    import gguf

    writer.add_name(name)
    writer.add_file_type(gguf.LlamaFileType[FILE_TYPES[type_name]])
    writer.add_context_length(config.max_seq_len)
    writer.add_embedding_length(config.d_model)
    writer.add_block_count(config.n_layers)
    writer.add_feed_forward_length(config.d_ff)
    writer.add_head_count(config.n_heads)
    writer.add_head_count_kv(config.n_kv_heads)
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)
    writer.add_rope_dimension_count(config.rope_dim)
    writer.add_layer_norm_rms_eps(config.norm_eps)
    writer.add_rope_freq_base(config.rope_theta)
    if config.experts is not None:  # llama.cpp's llama: experts feed_forward_length wide; qwen3moe: its own key
        writer.add_expert_count(config.experts.num_experts)
        writer.add_expert_used_count(config.experts.top_k)
        if architecture == "qwen3moe":
            writer.add_expert_feed_forward_length(config.d_ff)
    if isinstance(config.rope_scaling, LinearRope):
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(config.rope_scaling.factor)
    if isinstance(config.rope_scaling, YarnRope):  # as convert_hf_to_gguf.py writes it; llama.cpp fixes the rest
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(config.rope_scaling.factor)
        writer.add_rope_scaling_orig_ctx_len(config.rope_scaling.original_max_position_embeddings)
        writer.add_rope_scaling_yarn_beta_fast(config.rope_scaling.beta_fast)
        writer.add_rope_scaling_yarn_beta_slow(config.rope_scaling.beta_slow)
    if architecture == "gemma3":
        if config.sliding_window is not None:  # llama.cpp fixes the pattern and the local RoPE
            writer.add_sliding_window(config.sliding_window)
        if config.final_logit_softcap is not None:
            writer.add_final_logit_softcapping(config.final_logit_softcap)
    if tokenizer is not None:
        add_tokenizer(writer, pathlib.Path(tokenizer), pre="qwen2" if architecture == "qwen3moe" else "gpt-2")
    to_source = _to_source(config, architecture)
    for spec in tensor_specs(config, interleaved=rope_is_interleaved(architecture)):
        leaf = _leaf(params, spec.path)
        for layer in range(config.n_layers) if spec.per_layer else [None]:
            ours = np.asarray(leaf if layer is None else leaf[layer]).astype(np.float32)
            if spec.path[-1] == "scale":  # llama.cpp's RMSNorm multiplies by the stored weight alone
                ours = ours + np.float32(config.norm_weight_offset)
            x = to_source.get(spec.path, lambda w: w)(ours)
            if x.shape != spec.source_shape:
                raise WeightsError(f"params/{'/'.join(spec.path)} gives {spec.source} of shape {x.shape}, "
                                   f"expected {spec.source_shape} from the config")
            matrix = x.ndim >= 2 and not spec.source.endswith(ROUTER)  # norms and routers F32, as llama.cpp's
            data, raw = encode(x, type_name if matrix else "F32")
            writer.add_tensor(spec.source.format(layer=layer), data, raw_dtype=raw)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
