"""Quantized weights: integers plus a float32 scale per group, one typed leaf of the params pytree.

A projection W [*in, *out] (K = prod(in) inputs, N = prod(out) outputs) is held as a
:class:`QuantizedArray`: integer values ``q`` and scales ``s``, groups of ``group_size`` consecutive
inputs (along K, row-major over the input axes) sharing one scale per output column:

    W[k, n] = s[k // group_size, n] * q[k, n]

Per output channel is one group spanning all of K (``group_size == K``). The last group may be shorter
(K not a multiple of the group size: stories260K's MLP width of 172). Symmetric, or with ``offsets``
(asymmetric: a float32 offset ``o`` per group and output column as well):

    W[k, n] = s[k // group_size, n] * q[k, n] + o[k // group_size, n]

Storage (``values``, with the leaf's leading axes first, e.g. [L] for stacked layers, [L, E] for a mixture's
experts, each expert's groups along its own inputs):

- **8 bits**: int8 [*lead, K, N], ``q`` itself (-127 ... 127 when made by :func:`quantize`).
- **4 bits**: uint8 [*lead, ceil(K / 2), N], two inputs per byte: input 2j in the low nibble, input
  2j + 1 in the high nibble, each stored offset by 8 (nibble ``u`` in 0 ... 15 means ``q = u - 8``, so
  -8 ... 7; an odd K's last high nibble is 8, a zero). With offsets the nibble is ``q`` itself, unsigned
  (0 ... 15, as llama.cpp's Q4_1 and Q4_K store it).
- ``scales``: float32 [*lead, ceil(K / group_size), N]; ``offsets`` (or None) likewise.
- ``transposed``: the leaf stands for a matrix stored as [*out, *in] (the embedding table E [V, D], whose
  input, as the tied LM head, is D): ``values`` [*lead, N, K] (or [*lead, N, ceil(K / 2)]) and ``scales``
  [*lead, N, ceil(K / group_size)], the same rules along the last axis.

llama.cpp's GGUF blocks map onto this exactly (GGUF stores a Linear weight as rows of outputs, each row
running along the input: blocks run along K, as our groups do; its float16 scales are exact in float32):

- **Q8_0**: blocks of 32 inputs, ``d`` (float16) and 32 int8 ``qs``, value ``d * qs[i]``: 8 bits,
  ``group_size=32``, ``q = qs``, ``s = float32(d)``.
- **Q4_0**: blocks of 32 inputs, ``d`` (float16) and 16 bytes ``qs``, value ``d * (u - 8)`` where ``u`` is
  the low nibble of ``qs[i]`` for input i < 16 and the high nibble of ``qs[i - 16]`` for input i >= 16:
  4 bits, ``group_size=32``, ``s = float32(d)``, and the same nibbles ``u`` reordered into our pairs (input
  2j low, 2j + 1 high); the offset of 8 is the same as ours.

The other types llama.cpp writes that are integers times per-block scales (and offsets) map onto leaves
exactly too, every one in one scheme (the table in ``llm_jax.weights.gguf_blocks``): for example Q4_1 and
Q4_K as 4 bits with offsets, Q6_K as 8 bits in groups of 16, the i-quants as 8 bits. The sub-block scales
of the K-quants are products of a float16 and a 6-bit integer, exact in float32.

:meth:`QuantizedArray.dequantize` is the one definition of what a leaf stands for; the XLA products
dequantize then multiply (:mod:`llm_jax.backends.base`), the CPU kernels dequantize in registers.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from llm_jax.config import ModelConfig, Quantization, QuantScheme

Params = dict[str, Any]

BITS = (8, 4)
# The projections of every family, by module: W [*in, *out] stacked over layers. A mixture of experts
# (``layers/moe``) has the MLP's three as its experts' stacks [L, E, *in, *out], and a shared expert's
# (Qwen2-MoE) as ``shared_`` ones [L, *in, *out]; the router [L, D, E] is not one (it stays in floats).
PROJECTIONS = {"attn": ("q_proj", "k_proj", "v_proj", "o_proj"), "mlp": ("gate_proj", "up_proj", "down_proj")}
SHARED = "shared_"


def _static(**kwargs):
    return dataclasses.field(metadata={"static": True}, **kwargs)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QuantizedArray:
    """A weight [*lead, *in, *out] (``transposed``: [*lead, *out, *in]) held as integer ``values`` and
    float32 ``scales`` per group of ``group_size`` inputs (the module docstring gives the layout)."""

    values: jax.Array
    scales: jax.Array
    in_shape: tuple[int, ...] = _static()
    out_shape: tuple[int, ...] = _static()
    bits: int = _static()
    group_size: int = _static()
    transposed: bool = _static(default=False)
    offsets: jax.Array | None = None

    @property
    def scheme(self) -> QuantScheme:
        return QuantScheme(bits=self.bits, group_size=self.group_size, offsets=self.offsets is not None)

    @property
    def K(self) -> int:
        return math.prod(self.in_shape)

    @property
    def N(self) -> int:
        return math.prod(self.out_shape)

    @property
    def lead(self) -> tuple[int, ...]:
        return tuple(self.values.shape[:-2])

    @property
    def shape(self) -> tuple[int, ...]:
        """The shape of the array it stands for."""
        inner = (*self.out_shape, *self.in_shape) if self.transposed else (*self.in_shape, *self.out_shape)
        return (*self.lead, *inner)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def dtype(self):
        """The stored integers' dtype (int8, or uint8 for packed 4 bits)."""
        return self.values.dtype

    @property
    def n_groups(self) -> int:
        return -(-self.K // self.group_size)

    @property
    def nbytes(self) -> int:
        return self.values.nbytes + self.scales.nbytes + (0 if self.offsets is None else self.offsets.nbytes)

    def layer(self, index: jax.Array | int) -> QuantizedArray:
        """Entry ``index`` of the leading axis (a layer of a stack; a traced index is fine)."""
        take = functools.partial(jax.lax.dynamic_index_in_dim, index=index, axis=0, keepdims=False)
        return dataclasses.replace(self, values=take(self.values), scales=take(self.scales),
                                   offsets=None if self.offsets is None else take(self.offsets))

    def chosen(self, index_R: jax.Array, layer: jax.Array | int | None = None) -> QuantizedArray:
        """Entries ``index_R`` [R] of the leading axis (of entry ``layer`` of the one before it, where given): a
        mixture's chosen experts [L, E, ...] → [R, ...], their integers and scales gathered, nothing else read."""
        def take(a):
            return a[index_R] if layer is None else a[layer, index_R]

        return dataclasses.replace(self, values=take(self.values), scales=take(self.scales),
                                   offsets=None if self.offsets is None else take(self.offsets))

    def rows(self, index: jax.Array) -> QuantizedArray:
        """Outputs ``index`` [*I] of a ``transposed`` matrix (rows of an embedding table [V, D]): a
        transposed leaf of shape [*I, *in]. An index past the outputs reads a zero row."""
        if not self.transposed or self.lead or len(self.out_shape) != 1:
            raise ValueError(f"rows() takes a transposed matrix [out, *in], not a leaf of shape {self.shape}"
                             f"{'' if self.transposed else ' (not transposed)'}")
        flat = index.reshape(-1)
        take = functools.partial(jnp.take, indices=flat, axis=0, mode="fill", fill_value=0)
        return dataclasses.replace(self, values=take(self.values), scales=take(self.scales),
                                   offsets=None if self.offsets is None else take(self.offsets),
                                   out_shape=tuple(index.shape))

    def ints(self) -> jax.Array:
        """``q`` as int8 [*lead, K, N] (``transposed``: [*lead, N, K]), 4-bit values unpacked."""
        if self.bits == 8:
            return self.values
        k_axis = -1 if self.transposed else -2
        zero = 0 if self.offsets is not None else 8
        low = (self.values & 0xF).astype(jnp.int8) - zero
        high = (self.values >> 4).astype(jnp.int8) - zero
        if self.transposed:  # [..., N, K / 2, 2] → [..., N, K]: inputs 2j, 2j + 1
            q = jnp.stack([low, high], axis=-1).reshape(*self.values.shape[:-1], -1)
        else:  # [..., K / 2, 2, N] → [..., K, N]
            q = jnp.stack([low, high], axis=-2).reshape(*self.lead, -1, self.N)
        return jax.lax.slice_in_dim(q, 0, self.K, axis=k_axis)

    def dequantize(self, dtype=jnp.float32) -> jax.Array:
        """The array it stands for, ``s * q`` (``s * q + o``) computed in float32 then cast to ``dtype``."""
        q = self.ints()
        g, G, K = self.group_size, self.n_groups, self.K
        k_axis = q.ndim - 1 if self.transposed else q.ndim - 2
        pad = [(0, 0)] * q.ndim
        pad[k_axis] = (0, G * g - K)
        q = jnp.pad(q, pad).astype(jnp.float32)
        if self.transposed:
            w = q.reshape(*q.shape[:-1], G, g) * self.scales[..., None]
            if self.offsets is not None:
                w = w + self.offsets[..., None]
            w = w.reshape(*q.shape[:-1], G * g)
        else:
            w = q.reshape(*self.lead, G, g, self.N) * self.scales[..., None, :]
            if self.offsets is not None:
                w = w + self.offsets[..., None, :]
            w = w.reshape(*self.lead, G * g, self.N)
        w = jax.lax.slice_in_dim(w, 0, K, axis=k_axis)
        return w.reshape(self.shape).astype(dtype)


def is_quantized(leaf: Any) -> bool:
    return isinstance(leaf, QuantizedArray)


def quantize(w: jax.Array, bits: int = 8, group_size: int | None = None, *, in_shape: tuple[int, ...] | None = None,
             out_shape: tuple[int, ...] | None = None, transposed: bool = False,
             offsets: bool = False) -> QuantizedArray:
    """``w`` [*lead, *in, *out] (``transposed``: [*lead, *out, *in]) quantized symmetrically, per group, by
    llama.cpp's rules (``quantize_row_q8_0`` / ``quantize_row_q4_0``, whose blocks are groups of 32):

    - 8 bits: ``s = max|w| / 127``, ``q = round(w / s)`` (halves away from zero): -127 ... 127.
    - 4 bits: ``s = m / -8`` with ``m`` the group's value of largest magnitude, so that ``m`` is exactly
      ``q = -8`` and every level of -8 ... 7 is used: ``q = floor(w / s + 8.5) - 8``, clipped to 7.

    ``w / s`` is computed as ``w · (1 / s)``, as llama.cpp does, so a group of 32 gets llama.cpp's integers
    bit for bit. With ``offsets`` (asymmetric), each group's range [lo, hi] is cut into equal steps:

    - 8 bits: ``o = (lo + hi) / 2``, ``s = (hi - lo) / 254``, ``q = round((w - o) / s)``: -127 ... 127.
    - 4 bits: ``o = lo``, ``s = (hi - lo) / 15``, ``q = min(15, floor((w - lo) / s + 0.5))``: 0 ... 15,
      llama.cpp's ``quantize_row_q4_1`` rule.

    ``group_size`` None: one group per output column. ``in_shape`` / ``out_shape`` default to
    w's last two axes."""
    if bits not in BITS:
        raise ValueError(f"bits must be one of {BITS}, got {bits!r}")
    if in_shape is None or out_shape is None:
        if w.ndim < 2:
            raise ValueError(f"quantize takes a matrix, got shape {tuple(w.shape)}")
        a, b = (w.shape[-1],), (w.shape[-2],)
        in_shape, out_shape = (a, b) if transposed else (b, a)
    in_shape, out_shape = tuple(in_shape), tuple(out_shape)
    inner = (*out_shape, *in_shape) if transposed else (*in_shape, *out_shape)
    lead = w.ndim - len(inner)
    if lead < 0 or tuple(w.shape[lead:]) != inner:
        raise ValueError(f"a weight of shape {tuple(w.shape)} is not [..., {', '.join(map(str, inner))}] "
                         f"(inputs {in_shape}, outputs {out_shape}{', transposed' if transposed else ''})")
    K = math.prod(in_shape)
    group_size = K if group_size is None else int(group_size)
    if group_size <= 0:
        raise ValueError(f"group_size must be positive, got {group_size}")
    values, scales, zero = _quantize(w, bits, group_size, K, math.prod(out_shape), lead, transposed, bool(offsets))
    return QuantizedArray(values, scales, in_shape, out_shape, bits, group_size, transposed, zero)


@functools.partial(jax.jit, static_argnums=(1, 2, 3, 4, 5, 6, 7))
def _quantize(w, bits: int, g: int, K: int, N: int, lead: int, transposed: bool, offsets: bool):
    lead_shape = w.shape[:lead]
    w = w.astype(jnp.float32).reshape(*lead_shape, *((N, K) if transposed else (K, N)))
    if not transposed:
        w = jnp.swapaxes(w, -1, -2)  # [*lead, N, K]: groups along the last axis from here on
    G = -(-K // g)
    w_NGg = jnp.pad(w, [(0, 0)] * (w.ndim - 1) + [(0, G * g - K)]).reshape(*w.shape[:-1], G, g)
    if offsets:  # the padding of a short last group repeats its first value, so the range is its own
        w_NGg = jnp.pad(w, [(0, 0)] * (w.ndim - 1) + [(0, G * g - K)], mode="edge").reshape(*w.shape[:-1], G, g)
        lo, hi = jnp.min(w_NGg, axis=-1), jnp.max(w_NGg, axis=-1)
        o_NG = (lo + hi) / 2 if bits == 8 else lo
        s_NG = (hi - lo) / (254 if bits == 8 else 15)
        x_NGg = (w_NGg - o_NG[..., None]) * jnp.where(s_NG == 0, 0, 1 / jnp.where(s_NG == 0, 1, s_NG))[..., None]
        if bits == 8:
            q_NGg = jnp.clip(jnp.sign(x_NGg) * jnp.floor(jnp.abs(x_NGg) + 0.5), -127, 127)
        else:
            q_NGg = jnp.minimum(jnp.floor(x_NGg + 0.5), 15)
        q_NK = q_NGg.astype(jnp.int8).reshape(*w.shape[:-1], G * g)[..., :K]
        values = q_NK if bits == 8 else pack_int4(q_NK - 8)
        if transposed:
            return values, s_NG, o_NG
        return jnp.swapaxes(values, -1, -2), jnp.swapaxes(s_NG, -1, -2), jnp.swapaxes(o_NG, -1, -2)
    if bits == 8:
        s_NG = jnp.max(jnp.abs(w_NGg), axis=-1) / 127
    else:  # the value of largest magnitude, sign kept, is -8 steps
        largest = jnp.take_along_axis(w_NGg, jnp.argmax(jnp.abs(w_NGg), axis=-1)[..., None], axis=-1)[..., 0]
        s_NG = largest / -8
    x_NGg = w_NGg * jnp.where(s_NG == 0, 0, 1 / jnp.where(s_NG == 0, 1, s_NG))[..., None]
    if bits == 8:
        q_NGg = jnp.sign(x_NGg) * jnp.floor(jnp.abs(x_NGg) + 0.5)
    else:
        q_NGg = jnp.minimum(jnp.floor(x_NGg + 8.5), 15) - 8
    q_NK = q_NGg.astype(jnp.int8).reshape(*w.shape[:-1], G * g)[..., :K]
    values = q_NK if bits == 8 else pack_int4(q_NK)
    if transposed:
        return values, s_NG, None
    return jnp.swapaxes(values, -1, -2), jnp.swapaxes(s_NG, -1, -2), None


def pack_int4(q: jax.Array) -> jax.Array:
    """int8 ``q`` [..., K] in -8 ... 7 → uint8 [..., ceil(K / 2)]: input 2j in the low nibble, 2j + 1 in the
    high one, each offset by 8 (an odd K's missing last input is a zero: nibble 8)."""
    K = q.shape[-1]
    u = (jnp.pad(q, [(0, 0)] * (q.ndim - 1) + [(0, K % 2)]).astype(jnp.int32) + 8).astype(jnp.uint8)
    return u[..., 0::2] | (u[..., 1::2] << 4)


def quantize_params(params: Params, config: ModelConfig, quantization: Quantization) -> tuple[ModelConfig, Params]:
    """Every projection of ``params`` (canonical; stacked over layers; :func:`projections`) quantized as
    ``quantization`` says, and the embedding table and an untied LM head where ``quantization.embedding`` /
    ``lm_head`` give them a scheme: ``(config recording it, params)``. A mixture's experts [L, E, *in, *out]
    are quantized expert by expert (groups along each one's inputs, leading axes L, E), a shared expert's
    projections as the MLP's of the same name. Other leaves (norms, biases, a mixture's router) are kept as
    they are."""
    if config.quantization is not None:
        raise ValueError(f"the params are already quantized ({config.quantization})")
    layers = dict(params["layers"])
    for module, name, lead in projections(config):
        group = layers[module] = dict(layers[module])
        ins, outs = projection_dims(name, config)
        w = _checked(group.get(name), f"layers/{module}/{name}", (*lead, *ins, *outs))
        scheme = quantization.scheme(scheme_name(name))
        if scheme is None:  # kept in floats
            continue
        # A mixture's experts a layer at a time: float32 temporaries of one layer's experts, not of all of them.
        parts = [quantize(w_l, scheme.bits, scheme.group_size, in_shape=ins, out_shape=outs, offsets=scheme.offsets)
                 for w_l in (w if len(lead) > 1 else [w])]
        group[name] = parts[0] if len(parts) == 1 else _stacked(parts)
    out = {**params, "layers": layers}
    V, D = config.vocab_size, config.d_model
    if (table := quantization.embedding) is not None:  # rows of E [V, D]: inputs D, as the tied head reads it
        out["embedder"] = {**params["embedder"], "embedding": quantize(
            _checked(params["embedder"].get("embedding"), "embedder/embedding", (V, D)), table.bits,
            table.group_size, in_shape=(D,), out_shape=(V,), transposed=True, offsets=table.offsets)}
    if (head := quantization.lm_head) is not None and "lm_head" in params:
        out["lm_head"] = quantize(_checked(params["lm_head"], "lm_head", (D, V)), head.bits, head.group_size,
                                  offsets=head.offsets)
    return config.replace(quantization=quantization), out


def _stacked(parts: list[QuantizedArray]) -> QuantizedArray:
    """Leaves of the same scheme and shape as one leaf with a new leading axis."""
    def stack(name):
        return None if getattr(parts[0], name) is None else jnp.stack([getattr(p, name) for p in parts])

    return dataclasses.replace(parts[0], values=stack("values"), scales=stack("scales"), offsets=stack("offsets"))


# The schemes the command lines name: (bits, default group size (int8: per output channel), offsets).
SCHEMES = {"int8": (8, None, False), "int4": (4, 32, False), "int4-asym": (4, 32, True)}


def parse_quantization(name: str, group_size: int | None = None, *, embedding: bool = False) -> Quantization:
    """``"int8"`` / ``"int4"`` (command-line names) → a :class:`Quantization`; ``group_size`` None takes
    the scheme's default (int8: per output channel; int4: 32)."""
    if name not in SCHEMES:
        raise ValueError(f"unknown quantization {name!r}; choose one of {', '.join(map(repr, SCHEMES))}")
    bits, default, offsets = SCHEMES[name]
    return Quantization(bits=bits, group_size=default if group_size is None else group_size, offsets=offsets,
                        embedding=embedding)


def projections(config: ModelConfig) -> list[tuple[str, str, tuple[int, ...]]]:
    """(module, name, leading axes) of every projection of ``config``'s layers: [L] for a layer's matrix,
    [L, E] for a mixture's experts (``layers/moe``), whose shared expert's are [L] (``shared_`` names)."""
    L = config.n_layers
    out = [("attn", name, (L,)) for name in PROJECTIONS["attn"]]
    if config.experts is None:
        return out + [("mlp", name, (L,)) for name in PROJECTIONS["mlp"]]
    out += [("moe", name, (L, config.experts.num_experts)) for name in PROJECTIONS["mlp"]]
    if config.experts.shared_d_ff is not None:
        out += [("moe", SHARED + name, (L,)) for name in PROJECTIONS["mlp"]]
    return out


def scheme_name(name: str) -> str:
    """The name :meth:`Quantization.scheme` knows projection ``name`` by: a shared expert's projections
    are quantized as the MLP's of the same name (``shared_gate_proj`` as ``gate_proj``), as the experts are."""
    return name.removeprefix(SHARED)


def projection_dims(name: str, config: ModelConfig) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(input axes, output axes) of the projection ``name``: W [*in, *out] (per layer; per expert for a
    mixture's; F' wide for a shared expert's ``shared_`` ones)."""
    D, N, K, H, F = config.d_model, config.n_heads, config.n_kv_heads, config.head_dim, config.d_ff
    if name.startswith(SHARED):
        F = config.experts.shared_d_ff if config.experts is not None else None
        if F is None:
            raise ValueError(f"{name}: the config has no shared expert")
        name = scheme_name(name)
    return {"q_proj": ((D,), (N, H)), "k_proj": ((D,), (K, H)), "v_proj": ((D,), (K, H)), "o_proj": ((N, H), (D,)),
            "gate_proj": ((D,), (F,)), "up_proj": ((D,), (F,)), "down_proj": ((F,), (D,))}[name]


def _checked(w: Any, name: str, shape: tuple[int, ...]) -> jax.Array:
    if is_quantized(w):
        raise ValueError(f"params/{name} is already quantized")
    found = "missing" if w is None else tuple(getattr(w, "shape", ()))
    if w is None or found != shape:
        raise ValueError(f"params/{name} is {found}; the config says {list(shape)}")
    return w


def quantized_shapes(shapes: Params, config: ModelConfig) -> Params:
    """The float params' shapes (``jax.ShapeDtypeStruct`` s, as ``llm_jax.model.param_shapes`` gives them)
    as the params quantized by ``config.quantization`` have them."""
    if config.quantization is None:
        return shapes
    plain = config.replace(quantization=None)
    return jax.eval_shape(lambda p: quantize_params(p, plain, config.quantization)[1], shapes)


def from_gguf_blocks(q: np.ndarray, d: np.ndarray, bits: int) -> tuple[np.ndarray, np.ndarray]:
    """Helper for GGUF readers: blocks of 32 inputs, ``q`` int [R, K] (8 bits: ``qs``; 4 bits: the nibbles
    ``u`` in 0 ... 15, in input order) and ``d`` [R, K / 32], R output rows → (values, scales) of a
    ``transposed`` leaf of ``group_size=32`` ([R, K] int8 or [R, K / 2] uint8, and [R, K / 32] float32).
    Transpose both for a leaf of a [*in, *out] weight."""
    d = np.asarray(d).astype(np.float32)
    if bits == 8:
        return np.asarray(q).astype(np.int8), d
    u = np.asarray(q).astype(np.uint8)
    if u.shape[-1] % 2:
        u = np.concatenate([u, np.full((*u.shape[:-1], 1), 8, np.uint8)], axis=-1)
    return (u[..., 0::2] | (u[..., 1::2] << 4)).astype(np.uint8), d
