"""GGUF files (llama.cpp's format) → llm_jax config and params.

The file is read through the ``gguf`` package's reader (a memory map). Its metadata (``{arch}.block_count``,
``{arch}.attention.head_count``, ...) becomes a :class:`ModelConfig` for the architectures our decoder
runs: ``llama`` (Llama 1-3, Mistral; Mixtral, its ``expert_count`` set), ``qwen2``, ``qwen3``, ``qwen3moe``,
``gemma``, ``gemma2`` and ``gemma3``. Tensors become our leaves one at a time (``layout.assemble``): F32,
F16 and BF16 as they are; projections in the integer block types (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, the
K-quants Q2_K ... Q6_K, the i-quants IQ1_S ... IQ4_XS) as quantized leaves holding the file's integers,
scales and offsets value for value (``llm_jax.weights.gguf_blocks``; a projection whose layers mix types
in the narrowest scheme that holds them all), and so the embedding table and an untied LM head; with
``dequantize`` (or where no projection is of those types) every tensor as float32, through the ``gguf``
package's own dequantization (:func:`dequantize_rows`). A mixture of experts (``ffn_gate_inp`` the router,
F32 in llama.cpp's files, read as floats; ``ffn_{gate,up,down}_exps`` the experts stacked in one tensor per
layer) holds its experts' blocks the same way, expert by expert, in leaves [L, E, in, out].

The quirks of llama.cpp's converter (``convert_hf_to_gguf.py``) undone here:

- ``llama`` q/k rows are in Meta's interleaved RoPE layout (llama.cpp rotates adjacent pairs for that
  architecture), so they are permuted back to rotate-halves; the other architectures already rotate halves.
- Gemma's norm weights are stored as ``1 + w`` (llama.cpp's RMSNorm multiplies by the weight alone), so
  the config keeps them as they are: ``norm_weight_offset=0``.
- Llama 3.1's RoPE scaling is stored as a ``rope_freqs`` tensor of per-frequency factors, not as metadata:
  the :class:`Llama3Rope` parameters are recovered and checked against it.
- YaRN's metadata leaves out what llama.cpp fixes (a truncated ramp, its own attention factor): files that say
  otherwise are refused by key (:func:`_yarn_rope`).
- Gemma 2's and Gemma 3's attention scale is not stored; llama.cpp uses ``head_dim`` except for the 27B
  (46 and 62 layers), which use ``d_model / n_heads``, and so do we.
- Gemma 3's layer pattern and local RoPE are not read from the file: llama.cpp makes every 6th layer
  global and the others slide (when the file has a window), rotating them by plain RoPE of base 10000;
  ``rope.freq_base`` and the scaling are the global layers'.
- A mixture's routing is not stored either: llama.cpp renormalises the top-k weights of ``llama`` (Mixtral)
  and ``qwen3moe`` experts always (:func:`_experts`).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import pathlib
from collections.abc import Callable
from typing import Any

import numpy as np

from llm_jax.config import (PROJECTION_NAMES, Activation, ConfigError, DefaultRope, Experts, LinearRope, Llama3Rope,
                            ModelConfig, Quantization, YarnRope, yarn_mscale)
from llm_jax.weights import gguf_blocks
from llm_jax.weights.layout import (TensorSpec, WeightsError, assemble, heads_bias, heads_in, heads_out,
                                    interleaved_to_halves, transpose)

# Types we read. Every other ggml type (for example the ternary and FP4 types of architectures we do not run)
# is refused by name.
FLOAT_TYPES = ("F32", "F16", "BF16")
# Integers times per-block scales (and offsets): every block type llama.cpp writes for the architectures we
# run, as quantized leaves exactly (``gguf_blocks``), or float32 (``gguf.quants.dequantize``). Its K-quant
# files hold the legacy types too where a row is not whole super-blocks of 256 values (Q4_K → Q5_0,
# Q5_K → Q5_1, Q6_K → Q8_0 for widths such as 64, 576 or 896).
BLOCK_TYPES = gguf_blocks.TYPES
SUPPORTED_TYPES = FLOAT_TYPES + BLOCK_TYPES


@dataclasses.dataclass(frozen=True)
class GGUFTensor:
    """One tensor of the file: its ggml type name, our (row-major) shape and its bytes or values."""

    name: str
    type_name: str
    shape: tuple[int, ...]  # row-major, as numpy and torch see it: [out, in] for a matrix
    data: np.ndarray  # a memory map: values for F32/F16, raw bytes for BF16 and block types


class GGUFFile:
    """The metadata and tensors of a ``.gguf`` file (read lazily from a memory map)."""

    def __init__(self, path: pathlib.Path):
        import gguf

        self.path = path
        try:
            self._reader = gguf.GGUFReader(path)
        except (ValueError, OSError, IndexError) as error:
            raise WeightsError(f"{path}: not a readable GGUF file: {error}") from error
        shards = int(self.get("split.count", 1))
        if shards > 1:
            raise WeightsError(f"{path}: shard {int(self.get('split.no', 0)) + 1} of a GGUF split into {shards} "
                               "files; merge them first (llama.cpp's llama-gguf-split --merge)")
        self.tensors: dict[str, GGUFTensor] = {}
        for t in self._reader.tensors:
            shape = tuple(int(d) for d in reversed(t.shape.tolist()))
            self.tensors[t.name] = GGUFTensor(t.name, t.tensor_type.name, shape, t.data)

    def get(self, key: str, default: Any = None) -> Any:
        field = self._reader.get_field(key)
        return default if field is None else field.contents()

    def require(self, key: str) -> Any:
        value = self.get(key)
        if value is None:
            raise ConfigError(f"{self.path}: missing metadata {key!r}")
        return value

    @property
    def architecture(self) -> str:
        return self.require("general.architecture")


@functools.lru_cache(maxsize=2)
def _open(path: str, mtime_ns: int, size: int) -> GGUFFile:
    return GGUFFile(pathlib.Path(path))


def open_gguf(path: str | os.PathLike) -> GGUFFile:
    """The parsed file, shared by the config, params and tokenizer readers of one load (re-read if it changed)."""
    path = pathlib.Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist")
    stat = path.stat()
    return _open(str(path), stat.st_mtime_ns, stat.st_size)


# --- metadata → config -----------------------------------------------------------------------------------


def _uniform(f: GGUFFile, key: str, value: Any) -> int:
    """A per-layer metadata array with one value for all layers (ours has one), else the scalar itself."""
    if isinstance(value, list):
        if len(set(value)) != 1:
            raise ConfigError(f"{f.path}: {key} differs between layers ({value}); llm_jax needs one value")
        value = value[0]
    return int(value)


def _real(value: Any) -> float:
    """A float32 metadata value as the decimal it was written from (1e-05, not 9.99999974738e-06)."""
    return float(str(np.float32(value)))


def _decoder(f: GGUFFile, d_ff: int | None = None, **switches: Any) -> ModelConfig:
    """The config of the file's metadata, with the family's ``switches``; ``d_ff`` where it is not
    ``feed_forward_length`` (a mixture's experts)."""
    arch = f.architecture

    def key(name: str) -> str:
        return f"{arch}.{name}"

    n_heads = _uniform(f, key("attention.head_count"), f.require(key("attention.head_count")))
    n_kv = f.get(key("attention.head_count_kv"), n_heads)
    n_kv = _uniform(f, key("attention.head_count_kv"), n_kv)
    d_model = int(f.require(key("embedding_length")))
    head_dim = int(f.get(key("attention.key_length"), d_model // n_heads))
    value_dim = int(f.get(key("attention.value_length"), head_dim))
    if value_dim != head_dim:
        raise ConfigError(f"{f.path}: attention.key_length={head_dim} != value_length={value_dim} (not supported)")
    rope_dims = int(f.get(key("rope.dimension_count"), head_dim))
    if rope_dims != head_dim and rope_is_interleaved(arch):  # the permutation to halves spans the whole head
        raise ConfigError(f"{f.path}: rope.dimension_count={rope_dims} rotates part of each head of {head_dim} in "
                          f"{arch}'s interleaved layout; partial rotary embeddings are read for halves-layout "
                          "architectures only")
    if int(f.get(key("expert_count"), 0) or 0) > 0 and "experts" not in switches:
        raise ConfigError(f"{f.path}: {arch}.expert_count={f.get(key('expert_count'))}: a mixture of experts is read "
                          f"for llama.cpp's {' and '.join(MOE_ARCHITECTURES)} architectures, not {arch!r}")
    embedding = f.tensors.get("token_embd.weight")
    if embedding is None:
        raise WeightsError(f"{f.path}: missing tensor 'token_embd.weight'")
    theta = _real(f.get(key("rope.freq_base"), 10_000.0))
    return ModelConfig(
        vocab_size=embedding.shape[0], d_model=d_model, n_layers=int(f.require(key("block_count"))),
        n_heads=n_heads, n_kv_heads=n_kv, head_dim=head_dim,
        d_ff=d_ff if d_ff is not None else _uniform(f, key("feed_forward_length"),
                                                    f.require(key("feed_forward_length"))),
        max_seq_len=int(f.get(key("context_length"), 2048)),
        norm_eps=_real(f.get(key("attention.layer_norm_rms_epsilon"), 1e-5)), rope_theta=theta,
        rope_scaling=_rope_scaling(f, rope_dims, theta), rotary_dim=rope_dims,
        tie_embeddings="output.weight" not in f.tensors, **switches)


def _rope_scaling(f: GGUFFile, rope_dim: int, theta: float):
    arch = f.architecture
    kind = f.get(f"{arch}.rope.scaling.type", "none")
    factor = f.get(f"{arch}.rope.scaling.factor", f.get(f"{arch}.rope.scale_linear"))
    if "rope_freqs.weight" in f.tensors:
        if kind not in ("none", "linear") or (factor not in (None, 1.0)):
            raise ConfigError(f"{f.path}: rope_freqs with rope.scaling.type={kind!r} is not supported")
        return _llama3_rope(f, rope_dim, theta)
    if kind == "linear" or (kind == "none" and factor not in (None, 1.0)):
        return LinearRope(factor=_real(factor))
    if kind == "none":
        return DefaultRope()
    if kind == "yarn":
        return _yarn_rope(f, factor)
    raise ConfigError(f"{f.path}: unsupported rope scaling type {kind!r}; supported: none, linear, yarn, and "
                      "Llama 3's rope_freqs")


def _yarn_rope(f: GGUFFile, factor: Any) -> YarnRope:
    """YaRN as llama.cpp runs it, which is transformers' YaRN where these keys say no more: the ramp's ends
    truncated, ``yarn_beta_fast`` / ``yarn_beta_slow`` 32 / 1 where absent, the original context
    ``original_context_length`` (else ``context_length``, as llama.cpp falls back), cos and sin scaled by
    0.1·ln(factor) + 1. Refused by key: an extrapolation mix other than 1 (``yarn_ext_factor``), DeepSeek's
    ``yarn_log_multiplier``, and an attention factor other than YaRN's own (``yarn_attn_factor``,
    ``attn_factor``), which llama.cpp versions have applied differently."""
    arch = f.architecture

    def key(name: str) -> str:
        return f"{arch}.rope.scaling.{name}"

    if factor is None:
        raise ConfigError(f"{f.path}: rope.scaling.type='yarn' without {key('factor')}")
    factor = _real(factor)
    refused = {"yarn_ext_factor": 1.0, "yarn_log_multiplier": 0.0, "attn_factor": 1.0,
               "yarn_attn_factor": yarn_mscale(factor)}
    for name, agrees in refused.items():
        value = f.get(key(name))
        if value is not None and not math.isclose(float(value), agrees, rel_tol=1e-6):
            raise ConfigError(f"{f.path}: {key(name)}={_real(value)} is not supported (YaRN is read where it "
                              f"is {agrees:g}: transformers' YaRN, as llama.cpp runs it)")
    orig = f.get(key("original_context_length")) or f.require(f"{arch}.context_length")
    return YarnRope(factor=factor, original_max_position_embeddings=int(orig),
                    beta_fast=_real(f.get(key("yarn_beta_fast"), 32.0)),
                    beta_slow=_real(f.get(key("yarn_beta_slow"), 1.0)))


def _llama3_rope(f: GGUFFile, rope_dim: int, theta: float):
    """The Llama3Rope whose frequencies divide ours by ``rope_freqs`` (what llama.cpp multiplies wavelengths by)."""
    from llm_jax.model.rope import inverse_frequencies

    tensor = f.tensors["rope_freqs.weight"]
    if tensor.type_name != "F32" or tensor.shape != (rope_dim // 2,):
        raise WeightsError(f"{f.path}: tensor 'rope_freqs.weight' is {tensor.type_name} {tensor.shape}, "
                           f"expected F32 ({rope_dim // 2},)")
    factors = np.asarray(tensor.data, dtype=np.float64)
    base = inverse_frequencies(rope_dim, theta, DefaultRope()).astype(np.float64)
    wanted = base / factors
    factor = float(factors.max())
    if factor == 1.0:
        return DefaultRope()
    # Only the ratios low/orig and high/orig shape the curve: try Meta's published values (1, 4, 8192) at the
    # file's original context, then ratios that reproduce the factors (the band between the plateaus).
    orig = int(f.get(f"{f.architecture}.rope.scaling.original_context_length", 8192))
    candidates = [Llama3Rope(factor=factor, low_freq_factor=1.0, high_freq_factor=4.0,
                             original_max_position_embeddings=orig)]
    for low, high in _band_edges(base / (2 * math.pi), factors, factor):
        if 0 < low < high:
            candidates.append(Llama3Rope(factor=factor, low_freq_factor=low * orig, high_freq_factor=high * orig,
                                         original_max_position_embeddings=orig))
    for rope in candidates:
        if np.allclose(inverse_frequencies(rope_dim, theta, rope), wanted, rtol=1e-5, atol=0):
            return rope
    raise ConfigError(f"{f.path}: tensor 'rope_freqs.weight' {factors.tolist()} matches no Llama 3 RoPE scaling")


def _band_edges(u: np.ndarray, factors: np.ndarray, factor: float):
    """(low, high) = (lo, hi) / orig of Llama 3 scaling consistent with ``factors`` at 1 / wavelengths ``u``:
    ``factor`` where u < low, 1 where u > high, and between 1 / ((1 - s) / factor + s) with
    s = (u - low) / (high - low)."""
    band = (factors > 1.0) & (factors < factor)
    smooth = (1 / factors[band] - 1 / factor) / (1 - 1 / factor)
    below = float(u[factors == factor].max()) if (factors == factor).any() else 0.0  # low lies above these
    above = float(u[factors == 1.0].min()) if (factors == 1.0).any() else 2 * float(u.max())  # high below these
    if band.sum() >= 2:
        ub, sb = u[band], smooth
        slope = (sb[-1] - sb[0]) / (ub[-1] - ub[0])
        low = ub[0] - sb[0] / slope
        yield low, low + 1 / slope
    elif band.sum() == 1:
        u1, s1 = float(u[band][0]), float(smooth[0])
        for t in (0.5, 0.9, 0.1, 0.99):
            low = below + t * (u1 - below)
            yield low, low + (u1 - low) / s1
    else:
        yield below + (above - below) / 3, below + 2 * (above - below) / 3


# The architectures whose mixtures of experts we read: llama.cpp's ``llama`` (Mixtral) and ``qwen3moe``.
MOE_ARCHITECTURES = ("llama", "qwen3moe")
ROUTER = "ffn_gate_inp.weight"  # a layer's router [E, D]; llama.cpp keeps it F32 whatever the file's type


def _experts(f: GGUFFile) -> Experts | None:
    """The mixture of a file with ``{arch}.expert_count`` (None without one).

    llama.cpp runs ``llama`` 's and ``qwen3moe`` 's experts one way (``build_moe_ffn``): a softmax over all the
    router's logits, the ``expert_used_count`` most probable experts, their weights renormalised to sum to 1
    (Mixtral's rule; Qwen3-MoE's ``norm_topk_prob=True``, which llama.cpp applies whatever the model was
    trained with), then scaled by ``expert_weights_scale`` where one is set. What it would run otherwise, or
    we cannot, is refused by key: shared experts, a scale, ``expert_weights_norm`` false; and gate and up
    fused in one tensor."""
    arch = f.architecture
    count = int(f.get(f"{arch}.expert_count", 0) or 0)
    if count == 0:
        return None
    used = int(f.require(f"{arch}.expert_used_count"))
    refused = {
        "expert_shared_count": lambda v: int(v) > 0,
        "expert_shared_feed_forward_length": lambda v: int(v) > 0,
        "expert_weights_scale": lambda v: float(v) not in (0.0, 1.0),
        "expert_weights_norm": lambda v: not bool(v),
    }
    for name, unsupported in refused.items():
        value = f.get(f"{arch}.{name}")
        if value is not None and unsupported(value):
            raise ConfigError(f"{f.path}: {arch}.{name}={value!r}: llm_jax runs mixtures of experts without shared "
                              "experts, their top-k weights renormalised and unscaled (Mixtral, Qwen3-MoE)")
    fused = sorted(n for n in f.tensors if n.endswith("ffn_gate_up_exps.weight"))
    if fused:
        raise ConfigError(f"{f.path}: experts' gate and up projections fused in one tensor ({fused[0]} ...: "
                          "convert_hf_to_gguf's fuse_gate_up_exps) are not read; convert without fusing them")
    try:
        return Experts(num_experts=count, top_k=used, normalize_top_k=True)
    except ConfigError as e:
        raise ConfigError(f"{f.path}: {arch}.expert_count={count}, expert_used_count={used}: {e}") from None


def _llama(f: GGUFFile) -> ModelConfig:
    biased = sorted(n for n in f.tensors if n.startswith("blk.0.attn_") and n.endswith(".bias"))
    if biased:
        raise ConfigError(f"{f.path}: llama with attention biases ({', '.join(biased)}) is not supported")
    window = f.get("llama.attention.sliding_window")
    experts = _experts(f)  # Mixtral: its experts feed_forward_length wide
    return _decoder(f, activation=Activation.SILU, **({"sliding_window": int(window)} if window else {}),
                    **({"experts": experts} if experts else {}))


def _qwen2(f: GGUFFile) -> ModelConfig:
    return _decoder(f, activation=Activation.SILU, qkv_bias=True)


def _qwen3(f: GGUFFile) -> ModelConfig:
    return _decoder(f, activation=Activation.SILU, qk_norm=True)


def _qwen3moe(f: GGUFFile) -> ModelConfig:
    """Qwen3 whose every MLP is a mixture of experts ``expert_feed_forward_length`` wide (else, as llama.cpp,
    ``feed_forward_length / expert_used_count``)."""
    experts = _experts(f)
    if experts is None:
        raise ConfigError(f"{f.path}: qwen3moe without qwen3moe.expert_count (llama.cpp requires it)")
    width = f.get("qwen3moe.expert_feed_forward_length")
    if width is None:
        width = _uniform(f, "qwen3moe.feed_forward_length", f.require("qwen3moe.feed_forward_length")) // experts.top_k
    return _decoder(f, int(width), activation=Activation.SILU, qk_norm=True, experts=experts)


def _gemma(f: GGUFFile) -> ModelConfig:
    # norm_weight_offset stays 0: the file stores 1 + w (see the module docstring).
    return _decoder(f, activation=Activation.GELU_TANH, embed_scale=True)


def _gemma2(f: GGUFFile) -> ModelConfig:
    config = _decoder(f, activation=Activation.GELU_TANH, embed_scale=True, sandwich_norm=True)
    scale = f.get("gemma2.attention.scale")
    if scale is not None:
        scalar = _real(scale) ** -2
    else:  # llama.cpp's rule: the 27B model (46 layers) scales by d_model / n_heads
        scalar = gemma_attention_scalar(config, 46)
    window = f.get("gemma2.attention.sliding_window")
    windows = {}
    if window:  # llama.cpp's Gemma 2 pattern: even layers slide, odd ones attend globally
        windows = {"sliding_window": int(window), "sliding_layers": tuple(i % 2 == 0 for i in range(config.n_layers))}
    caps = {name: _real(f.get(f"gemma2.{name}ping")) if f.get(f"gemma2.{name}ping") else None
            for name in ("attn_logit_softcap", "final_logit_softcap")}
    return config.replace(query_pre_attn_scalar=float(scalar), **caps, **windows)


# llama.cpp's Gemma 3 (``gemma3``): what it fixes rather than reads from the file.
GEMMA3_PERIOD = 6  # every 6th layer attends globally (layers 5, 11, ...), the others within the window
GEMMA3_LOCAL_THETA = 10_000.0  # the local layers' RoPE base, their RoPE unscaled


def gemma3_sliding_layers(n_layers: int) -> tuple[bool, ...]:
    """Which layers llama.cpp's ``gemma3`` runs with the sliding window."""
    return tuple((i + 1) % GEMMA3_PERIOD != 0 for i in range(n_layers))


def gemma_attention_scalar(config: ModelConfig, n_layers_27b: int) -> float:
    """The ``query_pre_attn_scalar`` llama.cpp gives Gemma 2 / 3 (it stores none): ``d_model / n_heads`` for the
    27B models (``n_layers_27b`` layers), else ``head_dim``."""
    return float(config.d_model / config.n_heads if config.n_layers == n_layers_27b else config.head_dim)


def _gemma3(f: GGUFFile) -> ModelConfig:
    config = _decoder(f, activation=Activation.GELU_TANH, embed_scale=True, sandwich_norm=True, qk_norm=True)
    window = f.get("gemma3.attention.sliding_window")
    windows = {}
    if window:  # llama.cpp's pattern and local RoPE, whatever else the file says
        windows = {"sliding_window": int(window), "sliding_layers": gemma3_sliding_layers(config.n_layers),
                   "sliding_rope_theta": GEMMA3_LOCAL_THETA}
    cap = f.get("gemma3.final_logit_softcapping")
    return config.replace(query_pre_attn_scalar=gemma_attention_scalar(config, 62),
                          final_logit_softcap=_real(cap) if cap else None, **windows)


# ``general.architecture`` → builder of our config from the metadata
ARCHITECTURES: dict[str, Callable[[GGUFFile], ModelConfig]] = {
    "llama": _llama,
    "qwen2": _qwen2,
    "qwen3": _qwen3,
    "qwen3moe": _qwen3moe,
    "gemma": _gemma,
    "gemma2": _gemma2,
    "gemma3": _gemma3,
}


def config_from_gguf(f: GGUFFile) -> ModelConfig:
    arch = f.architecture
    if arch not in ARCHITECTURES:
        raise ConfigError(f"{f.path}: unsupported GGUF architecture {arch!r}; supported: {sorted(ARCHITECTURES)}")
    try:
        return ARCHITECTURES[arch](f)
    except ConfigError as e:
        message = str(e)
        raise ConfigError(message if message.startswith(str(f.path)) else f"{f.path}: {message}") from None


def read_gguf_config(path: str | os.PathLike, *, dequantize: bool = False) -> ModelConfig:
    """The config of a GGUF file; dtypes float32, or bfloat16 when every matrix is stored in BF16.

    A file whose projections are all of integer block types gets the ``quantization`` that holds them
    (:func:`block_quantization`; a mixture's experts too), its blocks becoming QuantizedArray leaves;
    ``dequantize`` reads it as floats instead. The routers (F32 in llama.cpp's files of every type) do not
    count towards the dtype. Types that map onto no leaf are refused by name when the tensors are read
    (:func:`check_types`), experts' as any other.
    """
    f = open_gguf(path)
    config = config_from_gguf(f)
    matrices = {t.type_name for name, t in f.tensors.items() if len(t.shape) >= 2 and not name.endswith(ROUTER)}
    dtype = "bfloat16" if matrices == {"BF16"} else "float32"
    quantization = None if dequantize else block_quantization(f, config)
    return config.replace(param_dtype=dtype, compute_dtype=dtype, quantization=quantization)


def rope_is_interleaved(architecture: str) -> bool:
    """Whether llama.cpp's converter wrote q/k in Meta's interleaved layout (llama.cpp's "normal" RoPE)."""
    return architecture == "llama"


# --- tensors ---------------------------------------------------------------------------------------------


def _interleaved_bias(n_heads: int, head_dim: int) -> Callable[[np.ndarray], np.ndarray]:
    """[n*H] in Meta's interleaved layout → [n, H] rotating halves (the bias twin of interleaved_to_halves)."""
    return lambda b: b.reshape(n_heads, head_dim // 2, 2).transpose(0, 2, 1).reshape(n_heads, head_dim)


def _experts_in(w: np.ndarray) -> np.ndarray:
    """Stacked experts [E, out, in] → ours [E, in, out]."""
    return w.swapaxes(1, 2)


def tensor_specs(config: ModelConfig, *, interleaved: bool) -> list[TensorSpec]:
    """Where each of our params comes from in a GGUF file (names of llama.cpp's ``gguf`` tensor map)."""
    D, N, K, H, F, V = (config.d_model, config.n_heads, config.n_kv_heads, config.head_dim, config.d_ff,
                        config.vocab_size)
    qk_rows = interleaved_to_halves if interleaved else heads_in
    qk_bias = _interleaved_bias if interleaved else heads_bias
    p = "blk.{layer}."
    specs = [
        TensorSpec(("embedder", "embedding"), "token_embd.weight", (V, D)),
        TensorSpec(("layers", "attn_norm", "scale"), p + "attn_norm.weight", (D,)),
        TensorSpec(("layers", "attn", "q_proj"), p + "attn_q.weight", (N * H, D), qk_rows(N, H)),
        TensorSpec(("layers", "attn", "k_proj"), p + "attn_k.weight", (K * H, D), qk_rows(K, H)),
        TensorSpec(("layers", "attn", "v_proj"), p + "attn_v.weight", (K * H, D), heads_in(K, H)),
        TensorSpec(("layers", "attn", "o_proj"), p + "attn_output.weight", (D, N * H), heads_out(N, H)),
        TensorSpec(("layers", "mlp_norm", "scale"), p + "ffn_norm.weight", (D,)),
    ]
    if config.experts is None:
        specs += [
            TensorSpec(("layers", "mlp", "gate_proj"), p + "ffn_gate.weight", (F, D), transpose),
            TensorSpec(("layers", "mlp", "up_proj"), p + "ffn_up.weight", (F, D), transpose),
            TensorSpec(("layers", "mlp", "down_proj"), p + "ffn_down.weight", (D, F), transpose),
        ]
    else:  # the experts stacked, each one's matrix [out, in] as a dense one's ([E, F, D]: ggml's {D, F, E})
        E = config.experts.num_experts
        specs += [
            TensorSpec(("layers", "moe", "router"), p + ROUTER, (E, D), transpose),
            TensorSpec(("layers", "moe", "gate_proj"), p + "ffn_gate_exps.weight", (E, F, D), _experts_in),
            TensorSpec(("layers", "moe", "up_proj"), p + "ffn_up_exps.weight", (E, F, D), _experts_in),
            TensorSpec(("layers", "moe", "down_proj"), p + "ffn_down_exps.weight", (E, D, F), _experts_in),
        ]
    specs.append(TensorSpec(("final_norm", "scale"), "output_norm.weight", (D,)))
    if config.sandwich_norm:
        specs += [
            TensorSpec(("layers", "post_attn_norm", "scale"), p + "post_attention_norm.weight", (D,)),
            TensorSpec(("layers", "post_mlp_norm", "scale"), p + "post_ffw_norm.weight", (D,)),
        ]
    if config.qkv_bias:
        specs += [
            TensorSpec(("layers", "attn", "q_bias"), p + "attn_q.bias", (N * H,), qk_bias(N, H)),
            TensorSpec(("layers", "attn", "k_bias"), p + "attn_k.bias", (K * H,), qk_bias(K, H)),
            TensorSpec(("layers", "attn", "v_bias"), p + "attn_v.bias", (K * H,), heads_bias(K, H)),
        ]
    if config.qk_norm:
        specs += [
            TensorSpec(("layers", "attn", "q_norm", "scale"), p + "attn_q_norm.weight", (H,)),
            TensorSpec(("layers", "attn", "k_norm", "scale"), p + "attn_k_norm.weight", (H,)),
        ]
    if not config.tie_embeddings:
        specs.append(TensorSpec(("lm_head",), "output.weight", (V, D), transpose))
    return specs


# Tensors a GGUF may hold that are no param of ours: read into the config, or llama.cpp's own caches.
_NOT_PARAMS = ("rope_freqs.weight",)
_ROWS_PER_CHUNK = 4096  # dequantize this many rows at a time, so temporaries stay small


def dequantize_rows(tensor: GGUFTensor, where: str = "") -> np.ndarray:
    """A block-quantized tensor's float32 values, as ggml defines them: the ``gguf`` package's dequantization,
    ``_ROWS_PER_CHUNK`` rows at a time (the blocks run along each row)."""
    import gguf

    qtype = gguf.GGMLQuantizationType[tensor.type_name]
    per_block, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    *rows_shape, cols = tensor.shape
    if cols % per_block:
        raise WeightsError(f"{where}: tensor {tensor.name!r} ({tensor.type_name}) has rows of {cols} values, "
                           f"not a multiple of the block size {per_block}")
    rows = math.prod(rows_shape)
    data = np.asarray(tensor.data).reshape(rows, cols // per_block * block_bytes)
    out = np.empty((rows, cols), np.float32)
    for start in range(0, rows, _ROWS_PER_CHUNK):
        out[start:start + _ROWS_PER_CHUNK] = gguf.quants.dequantize(data[start:start + _ROWS_PER_CHUNK], qtype)
    return out.reshape(tensor.shape)


def read_tensor(tensor: GGUFTensor, where: str = "") -> np.ndarray:
    """A tensor's values in a float dtype numpy reads: a view for F32/F16/BF16, float32 for block types."""
    match tensor.type_name:
        case "F32" | "F16":
            return tensor.data
        case "BF16":
            import ml_dtypes

            return np.asarray(tensor.data).view(ml_dtypes.bfloat16).reshape(tensor.shape)
        case name if name in BLOCK_TYPES:
            return dequantize_rows(tensor, where)
    raise WeightsError(f"{where}: tensor {tensor.name!r} has ggml type {tensor.type_name}, which llm_jax does not "
                       f"read; supported: {', '.join(SUPPORTED_TYPES)}")


def check_types(f: GGUFFile, names: set[str]) -> None:
    """Refuse, before reading anything, a file with tensors of a type we do not read (naming them)."""
    bad = sorted((n, f.tensors[n].type_name) for n in names if f.tensors[n].type_name not in SUPPORTED_TYPES)
    if bad:
        types = sorted({t for _, t in bad})
        shown = ", ".join(f"{n} ({t})" for n, t in bad[:6]) + (" ..." if len(bad) > 6 else "")
        raise WeightsError(f"{f.path}: unsupported GGUF tensor types {types} in {len(bad)} tensors: {shown}; "
                           f"supported: {', '.join(SUPPORTED_TYPES)}")


def block_quantization(f: GGUFFile, config: ModelConfig) -> Quantization | None:
    """The :class:`Quantization` holding the file's projections of integer block types exactly
    (``gguf_blocks.SCHEMES``; a projection whose layers mix types in the scheme common to them): the scheme
    of most projections the default, the others named, a projection with a layer of any other type (F16
    where a row is not whole blocks: stories260K's ``ffn_down``) named as floats; the embedding table and an
    untied LM head in their type's scheme where it is one. None when no projection is of integer block
    types (the file loads as floats)."""
    schemes = {}
    for name in _PROJECTIONS:
        types = {f.tensors[t].type_name for t in _sources(config, name) if t in f.tensors}
        if not types:
            return None
        schemes[name] = (gguf_blocks.common_scheme(gguf_blocks.SCHEMES[t] for t in sorted(types))
                         if types <= set(BLOCK_TYPES) else None)  # a layer in a float type: floats
    held = [s for s in schemes.values() if s is not None]
    if not held:
        return None
    counts = [held.count(s) for s in held]
    default = held[counts.index(max(counts))]
    return Quantization(bits=default.bits, group_size=default.group_size, offsets=default.offsets,
                        embedding=_table_scheme(f, TABLE), lm_head=None if config.tie_embeddings else _table_scheme(
                            f, HEAD), projections=tuple((n, s) for n, s in schemes.items() if s != default))


TABLE, HEAD = "token_embd.weight", "output.weight"


def _table_scheme(f: GGUFFile, name: str):
    """The scheme of the embedding table or LM head ``name`` where it is of an integer block type, else None."""
    tensor = f.tensors.get(name)
    return None if tensor is None else gguf_blocks.SCHEMES.get(tensor.type_name)


_PROJECTIONS = PROJECTION_NAMES


def _sources(config: ModelConfig, name: str) -> list[str]:
    """The file's tensors (one per layer) of projection ``name``."""
    (spec,) = [s for s in tensor_specs(config, interleaved=False) if s.path[-1] == name]
    return [spec.source.format(layer=layer) for layer in range(config.n_layers)]


def _halves_rows(n_heads: int, head_dim: int) -> np.ndarray:
    """For each of our rotate-halves rows (head n, half j, index i), its row in Meta's interleaved layout."""
    n, j, i = np.ix_(np.arange(n_heads), np.arange(2), np.arange(head_dim // 2))
    return (n * head_dim + 2 * i + j).reshape(-1)


def quantized_projection(tensor: GGUFTensor, scheme, rows: np.ndarray | None = None, where: str = ""
                         ) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """A block-quantized matrix [out, in] as a :class:`QuantizedArray`'s (values, scales, offsets) of a
    [in, out] weight in ``scheme`` (its type's own, or one that widens it): ``rows`` reorders the outputs."""
    n_out, k = tensor.shape
    data = np.asarray(tensor.data).reshape(n_out, -1)
    per_block = _per_block(tensor.type_name)
    if k % per_block:
        raise WeightsError(f"{where}: tensor {tensor.name!r} ({tensor.type_name}) has rows of {k} values, "
                           f"not a multiple of the block size {per_block}")
    if rows is not None:
        data = data[rows]
    blocks = gguf_blocks.widen(gguf_blocks.decode(tensor.type_name, data, k), scheme)
    return gguf_blocks.leaf_arrays(blocks)


def _per_block(type_name: str) -> int:
    import gguf

    return gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[type_name]][0]


def _experts_of(tensor: GGUFTensor) -> list[GGUFTensor]:
    """A mixture's stacked experts [E, out, in] as E matrices [out, in] (views of the file's bytes); a
    matrix as itself."""
    if len(tensor.shape) == 2:
        return [tensor]
    E, *shape = tensor.shape
    data = np.asarray(tensor.data).reshape(E, -1)
    return [GGUFTensor(f"{tensor.name}[{e}]", tensor.type_name, tuple(shape), data[e]) for e in range(E)]


def _quantized_leaves(f: GGUFFile, config: ModelConfig, quantization: Quantization, specs: list[TensorSpec],
                      progress, place) -> dict:
    """The projections of ``specs`` as QuantizedArray leaves stacked over layers (a mixture's experts over
    layers, then experts: [L, E, ...], each expert's blocks decoded apart): {(module, name): leaf}."""
    from llm_jax.quantization import QuantizedArray, projection_dims

    interleaved = rope_is_interleaved(f.architecture)
    out = {}
    for spec in specs:
        name = spec.path[-1]
        ins, outs = projection_dims(name, config)
        scheme = quantization.scheme(name)
        rows = None
        if interleaved and name in ("q_proj", "k_proj"):
            rows = _halves_rows(config.n_heads if name == "q_proj" else config.n_kv_heads, config.head_dim)
        lead = (config.n_layers, *spec.source_shape[:-2])  # [L] or [L, E]
        stacks: list[np.ndarray | None] = [None, None, None]
        for layer in range(config.n_layers):
            source = spec.source.format(layer=layer)
            tensor = f.tensors[source]
            if tensor.shape != tuple(spec.source_shape):
                raise WeightsError(f"{f.path}: tensor {source!r} has shape {tensor.shape}, expected "
                                   f"{tuple(spec.source_shape)} from the config")
            for expert, matrix in enumerate(_experts_of(tensor)):
                for i, a in enumerate(quantized_projection(matrix, scheme, rows, str(f.path))):
                    if a is None:
                        continue
                    if stacks[i] is None:
                        stacks[i] = np.empty((*lead, *a.shape), a.dtype)
                    stacks[i][(layer, expert)[:len(lead)]] = a
            if progress is not None:
                progress(source)
        values, scales, offsets = stacks
        if place is not None:  # each tensor of the leaf at its own path, as the checkpoint stores it
            values, scales = place((*spec.path, "values"), values), place((*spec.path, "scales"), scales)
            offsets = None if offsets is None else place((*spec.path, "offsets"), offsets)
        out[spec.path] = QuantizedArray(values, scales, ins, outs, scheme.bits, scheme.group_size, offsets=offsets)
    return out


def load_gguf_params(path: str | os.PathLike, config: ModelConfig, *, dtype=np.float32,
                     progress: Callable[[str], None] | None = None,
                     place: Callable[[tuple[str, ...], np.ndarray], Any] | None = None) -> dict:
    """The params of a GGUF file, tensor by tensor (see ``layout.assemble``): floats cast to ``dtype``, and
    when ``config.quantization`` is set (``read_gguf_config``) the projections (and the tables it names) as
    QuantizedArray leaves holding the file's integer blocks value for value."""
    f = open_gguf(path)
    names = set(f.tensors) - set(_NOT_PARAMS)
    check_types(f, names)
    where = str(f.path)
    specs = tensor_specs(config, interleaved=rope_is_interleaved(f.architecture))
    quantized, tables = [], []
    if config.quantization is not None:
        if config.quantization != block_quantization(f, config):
            raise WeightsError(f"{where}: the projections are not all stored as {config.quantization}")
        held = {name for name in _PROJECTIONS if config.quantization.scheme(name) is not None}
        quantized = [s for s in specs if s.path[-1] in held]
        tables = [s for s in specs if _table_of(s, config.quantization) is not None]
        specs = [s for s in specs if s.path[-1] not in held and s not in tables]
        names -= {s.source.format(layer=l) for s in quantized for l in range(config.n_layers)}
        names -= {s.source for s in tables}
    params = assemble(specs, config, lambda name: read_tensor(f.tensors[name], where), names, where=where,
                      dtype=dtype, progress=progress, place=place)
    for (_, module, name), leaf in _quantized_leaves(f, config, config.quantization, quantized, progress,
                                                     place).items():
        params["layers"].setdefault(module, {})[name] = leaf
    for spec in tables:
        leaf = _table_leaf(f, config, spec, _table_of(spec, config.quantization), place)
        if spec.path == ("lm_head",):
            params["lm_head"] = leaf
        else:
            params.setdefault("embedder", {})["embedding"] = leaf
        if progress is not None:
            progress(spec.source)
    return params


def _table_of(spec: TensorSpec, quantization: Quantization):
    """The scheme ``quantization`` gives the embedding table or LM head ``spec`` (None: floats, or not one)."""
    return {("embedder", "embedding"): quantization.embedding, ("lm_head",): quantization.lm_head}.get(spec.path)


def _table_leaf(f: GGUFFile, config: ModelConfig, spec: TensorSpec, scheme, place):
    """The embedding table (a ``transposed`` leaf: its rows, inputs d_model) or an untied LM head (W [D, V])
    as a QuantizedArray holding the file's blocks."""
    from llm_jax.quantization import QuantizedArray

    tensor = f.tensors[spec.source]
    if tensor.shape != tuple(spec.source_shape):
        raise WeightsError(f"{f.path}: tensor {spec.source!r} has shape {tensor.shape}, expected "
                           f"{tuple(spec.source_shape)} from the config")
    V, D = tensor.shape
    blocks = gguf_blocks.widen(gguf_blocks.decode(tensor.type_name, np.asarray(tensor.data).reshape(V, -1), D), scheme)
    transposed = spec.path != ("lm_head",)
    arrays = dict(zip(("values", "scales", "offsets"), gguf_blocks.leaf_arrays(blocks, transposed=transposed)))
    if place is not None:
        arrays = {k: None if a is None else place((*spec.path, k), a) for k, a in arrays.items()}
    return QuantizedArray(arrays["values"], arrays["scales"], (D,), (V,), scheme.bits, scheme.group_size,
                          transposed=transposed, offsets=arrays["offsets"])


def load_gguf(path: str | os.PathLike, *, dtype=np.float32, dequantize: bool = False,
              progress=None) -> tuple[ModelConfig, dict]:
    """Config and numpy params from a GGUF file; float params are cast to ``dtype`` (see ``read_gguf_config``
    for ``dequantize``)."""
    config = read_gguf_config(path, dequantize=dequantize)
    return config, load_gguf_params(path, config, dtype=dtype, progress=progress)
