"""Hugging Face folders quantized with compressed-tensors (llm-compressor's W4A16 / W8A16 checkpoints, the
``pack-quantized`` format) → quantized leaves, bit for bit; FP8 folders (compressed-tensors' and
``transformers``' own) → floats.

Such a folder's ``config.json`` has a ``quantization_config`` with ``quant_method: "compressed-tensors"``;
each quantized Linear ``…{proj}`` stores, instead of ``weight``:

- ``weight_packed`` int32 [out, ⌈in · b / 32⌉]: the b-bit integers ``q`` of a row along the input, each
  stored as ``q + 2^(b-1)`` (unsigned) and packed densely from the low bits of the first word up. For
  b = 4 that is two inputs per byte, input 2j in the low nibble, offset by 8 — exactly our 4-bit storage
  (``llm_jax.quantization``), so the bytes are taken as they are; for b = 8 each byte is ``q + 128``.
- ``weight_scale`` [out, groups] (``strategy: group``, ``group_size`` inputs each) or [out, 1]
  (``channel``): W[o, i] = scale[o, i // group_size] · q[o, i]; ``weight_shape`` [out, in].
- asymmetric weights (``symmetric: false``) add ``weight_zero_point`` z, packed the same way along the
  outputs (int32 [⌈out · b / 32⌉, groups]): W = scale · (q − z). Our leaf with offsets holds W = s · u + o
  (u the stored nibble for 4 bits, q for 8), so o = −s · (z + 8) for 4 bits, −s · z for 8: the same
  weights, rounded twice rather than once (within an ulp of ``transformers``' dequantization).

FP8 folders (``float-quantized``: ``weight`` in float8 e4m3 beside ``weight_scale`` per tensor, channel,
group or block) load as floats, each weight ``weight · scale`` exactly as stored (activations are not
quantized: a W8A8-FP8 checkpoint runs with float activations).

Read: ``type: int`` weights of 4 or 8 bits, symmetric or not, per group or per channel, without activation
reordering (``actorder``; a ``weight_g_idx`` is refused) and without activation quantization (W8A8: a
``quantization_config`` with ``input_activations``), on any subset of the seven projections (the others,
listed in ``ignore``, stay floats). Anything else is refused by name. The same folder loads as floats
(each weight dequantized, as ``transformers`` decompresses it) with ``dequantize=True``.

``transformers``' own FP8 folders (``FineGrainedFP8Config``, ``quant_method: "fp8"``, the format of
Qwen3-*-FP8 and DeepSeek-V3) load as floats too. Each quantized Linear stores ``weight`` float8 e4m3 [out, in] beside
``weight_scale_inv`` float32 [⌈out / bo⌉, ⌈in / bi⌉] for ``weight_block_size: [bo, bi]`` (a scalar with
``weight_block_size: null``); despite its name it multiplies: W[o, i] = weight[o, i] ·
weight_scale_inv[o // bo, i // bi], the last blocks of a row or column partial. Modules in
``modules_to_not_convert`` are stored in floats, without a scale: in both formats a weight is scaled when
its scale is stored beside it (the LM head too), so the lists need no reading. Read: ``activation_scheme:
dynamic`` (per-token activation quantization on GPUs; floats here) and float32 scales (``scale_fmt:
float``); refused by name: static activation scales, power-of-two (``ue8m0``) scales, FP8 embeddings
(``modules_to_convert``), FP4 experts, and fields not in ``_FP8_FIELDS``.
"""

from __future__ import annotations

from typing import Any, Callable

import dataclasses

import numpy as np

from llm_jax.config import PROJECTION_NAMES, ModelConfig, Quantization, QuantScheme
from llm_jax.weights.layout import WeightsError

_MODULES = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
            "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}
_GROUPS = {name: ("attn" if module == "self_attn" else "mlp") for name, module in _MODULES.items()}


def hf_name(name: str, layer: int) -> str:
    """The Hugging Face module of projection ``name`` in ``layer``."""
    return f"model.layers.{layer}.{_MODULES[name]}.{name}"


@dataclasses.dataclass(frozen=True)
class Float8Weights:
    """FP8 (e4m3) weights with a float scale per tensor, channel, group or block: loaded as floats."""

    strategy: str  # "tensor", "channel", "group" or "block"
    group_size: int | None = None
    block: tuple[int, int] | None = None  # (outputs, inputs) per block
    scale: str = "weight_scale"  # the tensor beside ``weight`` holding its scales ("weight_scale_inv": transformers')


# The fields of transformers' FineGrainedFP8Config (``ignored_layers``: MiniMax's name for modules_to_not_convert;
# ``fmt``: DeepSeek's note of the float8 format) and ``dequantize``, a loading option it saves with them.
_FP8_FIELDS = ("quant_method", "activation_scheme", "weight_block_size", "modules_to_not_convert", "ignored_layers",
               "modules_to_convert", "scale_fmt", "expert_dtype", "dequantize", "fmt")


def read_scheme(hf: dict[str, Any], where: str) -> QuantScheme | Float8Weights | None:
    """The scheme a ``config.json``'s ``quantization_config`` gives its quantized projections (None: none)."""
    qc = hf.get("quantization_config")
    if qc is None:
        return None
    method = qc.get("quant_method")
    if method == "fp8":
        return _finegrained_fp8(qc, where)
    if method != "compressed-tensors":
        raise WeightsError(f"{where}: quant_method {method!r} is not read; llm_jax reads compressed-tensors "
                           "(pack-quantized W4A16 / W8A16, float-quantized FP8) and transformers' fp8 folders, "
                           "GGUF files, and its own checkpoints")
    for field, ok in (("sparsity_config", not qc.get("sparsity_config")), ("transform_config",
                      not qc.get("transform_config")), ("kv_cache_scheme", qc.get("kv_cache_scheme") is None)):
        if not ok:
            raise WeightsError(f"{where}: quantization_config.{field} is set; llm_jax reads weight-only schemes")
    groups = qc.get("config_groups") or {}
    schemes = {_group_scheme(name, group, qc.get("format"), where) for name, group in groups.items()}
    if len(schemes) != 1:
        raise WeightsError(f"{where}: quantization_config has {len(schemes)} different weight schemes; llm_jax "
                           "reads one")
    return schemes.pop()


def _group_scheme(name: str, group: dict[str, Any], default_format: str | None, where: str) -> QuantScheme:
    where = f"{where}: quantization_config.config_groups.{name}"
    fmt = group.get("format") or default_format
    if fmt == "float-quantized":
        return _float8(group.get("weights") or {}, where)
    if fmt != "pack-quantized":
        raise WeightsError(f"{where}: format {fmt!r} is not read; supported: pack-quantized, float-quantized")
    if group.get("input_activations") or group.get("output_activations"):
        raise WeightsError(f"{where}: activations are quantized (W8A8); llm_jax reads weight-only schemes "
                           "(W4A16, W8A16)")
    weights = group.get("weights") or {}
    bits, strategy = weights.get("num_bits"), weights.get("strategy")
    refusals = {"type": weights.get("type") != "int", "num_bits": bits not in (4, 8),
                "strategy": strategy not in ("group", "channel"),
                "actorder": weights.get("actorder") not in (None, False), "dynamic": bool(weights.get("dynamic"))}
    for field, bad in refusals.items():
        if bad:
            raise WeightsError(f"{where}.weights.{field} is {weights.get(field)!r}; llm_jax reads int weights "
                               "of 4 or 8 bits, per group or per channel, without activation reordering")
    group_size = weights.get("group_size") if strategy == "group" else None
    if strategy == "group" and not isinstance(group_size, int):
        raise WeightsError(f"{where}.weights.group_size is {group_size!r}")
    return QuantScheme(bits=bits, group_size=group_size, offsets=not weights.get("symmetric", True))


def _float8(weights: dict[str, Any], where: str) -> Float8Weights:
    strategy = weights.get("strategy")
    if weights.get("type") != "float" or weights.get("num_bits") != 8 or strategy not in ("tensor", "channel", "group",
                                                                                          "block"):
        raise WeightsError(f"{where}.weights is {weights}; llm_jax reads float weights of 8 bits (e4m3) per "
                           "tensor, channel, group or block")
    block = weights.get("block_structure")
    return Float8Weights(strategy=strategy, group_size=weights.get("group_size"),
                         block=None if block is None else (int(block[0]), int(block[1])))


def _finegrained_fp8(qc: dict[str, Any], where: str) -> Float8Weights:
    """transformers' FP8 format, from its ``FineGrainedFP8Config`` (defaults: dynamic, 128 × 128 blocks)."""
    where = f"{where}: quantization_config"
    if unknown := sorted(set(qc) - set(_FP8_FIELDS)):
        raise WeightsError(f"{where}.{unknown[0]} is not a field of transformers' fp8 format that llm_jax reads; "
                           f"it reads {', '.join(_FP8_FIELDS)}")
    activations = qc.get("activation_scheme", "dynamic")
    refusals = {
        "activation_scheme": (str(activations).lower() != "dynamic", "static activation scales (activation_scale) "
                              "clip the activations to a calibrated range; llm_jax reads dynamic fp8 folders, "
                              "whose activations it keeps in floats"),
        "scale_fmt": (qc.get("scale_fmt", "float") != "float", "llm_jax reads float32 scales (scale_fmt 'float'), "
                      "not power-of-two ue8m0 bytes"),
        "modules_to_convert": (bool(qc.get("modules_to_convert")), "llm_jax reads fp8 Linear weights, not FP8 "
                               "embedding tables"),
        "expert_dtype": (qc.get("expert_dtype", "fp8") != "fp8", "llm_jax reads fp8 weights, not FP4 experts"),
        "fmt": (qc.get("fmt", "e4m3") != "e4m3", "llm_jax reads e4m3 weights"),
    }
    for field, (bad, supported) in refusals.items():
        if bad:
            raise WeightsError(f"{where}.{field} is {qc.get(field)!r}; {supported}")
    block = qc.get("weight_block_size", (128, 128))
    if block is None:  # one scale per tensor
        return Float8Weights(strategy="tensor", scale="weight_scale_inv")
    if not (isinstance(block, (list, tuple)) and len(block) == 2
            and all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
        raise WeightsError(f"{where}.weight_block_size is {block!r}; expected [outputs, inputs] per block, or null")
    return Float8Weights(strategy="block", block=(block[0], block[1]), scale="weight_scale_inv")


def float8_reader(read: Callable[[str], np.ndarray], names: set[str], scheme: Float8Weights,
                  where: str) -> tuple[Callable[[str], np.ndarray], set[str]]:
    """A ``read`` that gives each FP8 weight with a scale beside it (``scheme.scale``) as float32
    ``weight · scale`` (an exact product), and the tensor names without the scales."""
    suffix = scheme.scale.removeprefix("weight")  # "…weight" + suffix names the weight's scales
    scaled = {name[:-len(suffix)] for name in names if name.endswith(f".{scheme.scale}")}

    def read_float(name: str) -> np.ndarray:
        w = read(name)
        if name not in scaled:
            if w.dtype.name.startswith("float8"):
                raise WeightsError(f"{where}: {name} is {w.dtype.name} without {name}{suffix} beside it")
            return w
        w = np.asarray(w, np.float32)
        s = np.asarray(read(f"{name}{suffix}"), np.float32)
        out, inputs = w.shape
        if scheme.strategy == "block":
            (bo, bi), s_grid = scheme.block, s
            if s_grid.shape != (grid := (-(-out // bo), -(-inputs // bi))):
                raise WeightsError(f"{where}: {name}{suffix} has shape {list(s_grid.shape)}, expected {list(grid)} "
                                   f"for a weight {list(w.shape)} in blocks of {bo} × {bi}")
            s = np.repeat(np.repeat(s_grid, bo, axis=0)[:out], bi, axis=1)[:, :inputs]
        elif scheme.strategy == "group":
            s = np.repeat(s, scheme.group_size, axis=1)[:, :inputs]
        if s.size != 1 and s.shape not in ((out, 1), (out, inputs)):
            raise WeightsError(f"{where}: {name}{suffix} has shape {list(s.shape)} for a weight {list(w.shape)}")
        return w * s.reshape(s.shape if s.size != 1 else ())

    return read_float, names - {f"{name}{suffix}" for name in scaled}


def quantization(scheme: QuantScheme, names: set[str], config: ModelConfig, where: str) -> Quantization:
    """The model's :class:`Quantization`: ``scheme`` for the projections stored packed (every layer alike),
    floats for the others."""
    if reordered := sorted(n for n in names if n.endswith(".weight_g_idx")):
        raise WeightsError(f"{where}: {reordered[0]} reorders the inputs' groups (GPTQ's activation order); "
                           "llm_jax reads groups of consecutive inputs")
    floats = []
    for proj in PROJECTION_NAMES:
        packed = [f"{hf_name(proj, layer)}.weight_packed" in names for layer in range(config.n_layers)]
        if any(packed) != all(packed):
            raise WeightsError(f"{where}: {proj} is packed in some layers only; llm_jax stacks a projection's "
                               "layers in one scheme")
        if not packed[0]:
            floats.append((proj, None))
    if "lm_head.weight_packed" in names:
        raise WeightsError(f"{where}: the LM head is quantized; llm_jax reads compressed-tensors folders whose "
                           "lm_head is in the ignore list")
    if len(floats) == len(PROJECTION_NAMES):
        raise WeightsError(f"{where}: quantization_config is set but no projection is packed")
    return Quantization(bits=scheme.bits, group_size=scheme.group_size, offsets=scheme.offsets,
                        projections=tuple(floats))


def _unpacked(packed: np.ndarray, bits: int, count: int) -> np.ndarray:
    """The first ``count`` b-bit integers of each row of int32 words, offset back to signed (int8)."""
    raw = np.ascontiguousarray(packed).astype("<i4", copy=False).view(np.uint8).reshape(packed.shape[0], -1)
    if bits == 8:
        return (raw[:, :count].astype(np.int16) - 128).astype(np.int8)
    nibbles = np.stack([raw & 0x0F, raw >> 4], axis=-1).reshape(raw.shape[0], -1)
    return (nibbles[:, :count].astype(np.int16) - 8).astype(np.int8)


def packed_projection(read: Callable[[str], np.ndarray], module: str, scheme: QuantScheme, K: int, N: int,
                      where: str) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """One layer's ``values`` [⌈K / 2⌉, N] uint8 (4 bits) or [K, N] int8 (8 bits), ``scales`` [groups, N]
    float32 and (asymmetric) ``offsets`` [groups, N] float32 for our leaf, from the module's packed tensors."""
    shape = tuple(int(d) for d in np.asarray(read(f"{module}.weight_shape")))
    if shape != (N, K):
        raise WeightsError(f"{where}: {module}.weight_shape is {list(shape)}, expected [{N}, {K}]")
    packed = np.ascontiguousarray(read(f"{module}.weight_packed"))
    words = -(-K * scheme.bits // 32)
    if packed.dtype != np.int32 or packed.shape != (N, words):
        raise WeightsError(f"{where}: {module}.weight_packed is {packed.dtype}{list(packed.shape)}, expected "
                           f"int32[{N}, {words}]")
    raw = packed.astype("<i4", copy=False).view(np.uint8).reshape(N, words * 4)
    if scheme.bits == 4:
        values = raw[:, :-(-K // 2)]
        if K % 2:  # the last input's partner nibble: ours holds 8 (a zero)
            values = values.copy()
            values[:, -1] = (values[:, -1] & 0x0F) | 0x80
    else:
        values = (raw[:, :K].astype(np.int16) - 128).astype(np.int8)
    group = scheme.group_size or K
    scales = np.asarray(read(f"{module}.weight_scale"), np.float32)
    groups = -(-K // group)
    if scales.shape != (N, groups):
        raise WeightsError(f"{where}: {module}.weight_scale has shape {list(scales.shape)}, expected [{N}, {groups}]")
    offsets = None
    if scheme.offsets:
        zero = np.asarray(read(f"{module}.weight_zero_point"))
        if zero.dtype == np.int32:  # packed along the outputs: [⌈N · b / 32⌉, groups]
            zero = _unpacked(zero.T, scheme.bits, N).T
        if zero.shape != (N, groups):
            raise WeightsError(f"{where}: {module}.weight_zero_point has shape {list(zero.shape)}, expected "
                               f"[{N}, {groups}]")
        shift = 8 if scheme.bits == 4 else 0  # our 4-bit nibble with offsets is the stored one, q + 8
        offsets = np.ascontiguousarray((-scales * (zero.astype(np.float32) + shift)).T)
    return np.ascontiguousarray(values.T), np.ascontiguousarray(scales.T), offsets

