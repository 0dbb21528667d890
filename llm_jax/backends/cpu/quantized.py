"""The CPU kernels' form of quantized weights (``llm_jax.quantization``): integer panels read in place.

A projection quantized to 8 or 4 bits is held as :class:`QuantizedPanels`: its integers in the panel
layout of ``cpu_kernels`` ([*lead, N / 16, K, 16] int8, or [*lead, N / 16, ceil(K / 2), 16] uint8 holding
two inputs per byte as the canonical leaf does) and its scales likewise ([*lead, N / 16, groups, 16]). The
kernels read the bytes and convert them in registers; decode reads a quarter (int8) or an eighth (int4)
of float32's bytes per step:

- 8 bits per output channel (one group): the kernels' int8 panel product (``cpu_kernels.matmuls``, x · q,
  every projection of one input in one call), each output column then scaled: ``(x · q) · s = x · W``;
- groups, and 4 bits: ``cpu_kernels.quant_matmul``, group by group, each group's sums scaled;
- offsets (asymmetric leaves): ``quant_matmul`` adds each group's ``o_g · Σ_{k in g} x_k`` as it goes.
  The kernels read 4-bit nibbles as ``u - 8``; the 4-bit offsets the panels hold are ``o + 8 s``, the
  same function (within float32 rounding).

A mixture's experts [L, E, *in, *out] are held the same way ([L, E, N / 16, ...]); decode's kernels read
each chosen expert in place as entry l·E + e of the stack seen as one (:func:`one_stack`), and a prefill
dequantizes its layer's (:func:`dequantized`).

A quantized LM head (an untied one, or the tied embedding table, whose rows the embedding lookup then
gathers from the panels) is held the same way. A quantized table that is not the head stays a
:class:`QuantizedArray`, whose rows the backend gathers as XLA does. A float LM head keeps its float panels
and screen (:mod:`llm_jax.backends.cpu.forms`).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp

import cpu_kernels
from llm_jax.config import ModelConfig
from llm_jax.quantization import QuantizedArray, projections

Params = dict[str, Any]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QuantizedPanels:
    """A quantized [*lead, *in, *out] weight in panels: ``data`` its integers [*lead, N / 16, K (or
    ceil(K / 2) for 4 bits), 16], ``scales`` float32 [*lead, N / 16, ceil(K / group_size), 16], ``offsets``
    None or float32 like the scales (the offsets of the integers as the kernels read them)."""

    data: jax.Array
    scales: jax.Array
    in_shape: tuple[int, ...] = dataclasses.field(metadata={"static": True})
    out_shape: tuple[int, ...] = dataclasses.field(metadata={"static": True})
    bits: int = dataclasses.field(metadata={"static": True})
    group_size: int = dataclasses.field(metadata={"static": True})
    offsets: jax.Array | None = None

    @property
    def shape(self) -> tuple[int, ...]:
        return (*self.data.shape[:-3], *self.in_shape, *self.out_shape)

    @property
    def dtype(self):
        return self.data.dtype

    @property
    def per_channel(self) -> bool:
        """8 bits, one scale per output column: the int8 panel product, then the scales."""
        return self.bits == 8 and self.scales.shape[-2] == 1 and self.offsets is None


def takes_panels(w: Any) -> bool:
    """Whether the kernels read quantized leaf ``w`` as :class:`QuantizedPanels`."""
    return (isinstance(w, QuantizedArray) and not w.transposed and w.N % cpu_kernels.PANEL == 0
            and (w.bits == 8 or w.group_size % 2 == 0))


def prepare(params: Params, config: ModelConfig) -> Params:
    """``params`` with each projection the kernels read in panels in that form, and a quantized LM head
    (others unchanged)."""
    layers = {name: dict(module) if isinstance(module, dict) else module for name, module in params["layers"].items()}
    for module, name, _ in projections(config):
        w = layers[module][name]
        if takes_panels(w):
            layers[module][name] = _as_panels(w)
    out = {**params, "layers": layers}
    head = out.get("lm_head")
    if takes_panels(head):
        out["lm_head"] = _as_panels(head)
    table = params["embedder"].get("embedding")
    if config.tie_embeddings and isinstance(table, QuantizedArray) and table.transposed and not table.lead \
            and table.N % cpu_kernels.PANEL == 0 and (table.bits == 8 or table.group_size % 2 == 0):
        # rows of E [V, D] are the columns of the head W = Eᵀ [D, V]
        w = dataclasses.replace(table, values=table.values.T, scales=table.scales.T, transposed=False,
                                offsets=None if table.offsets is None else table.offsets.T)
        out["embedder"] = {**params["embedder"], "embedding": _as_panels(w)}
    return out


def _as_panels(w: QuantizedArray) -> QuantizedPanels:
    offsets = None if w.offsets is None else _panels(_kernel_offsets(w.offsets, w.scales, w.bits))
    return QuantizedPanels(_panels(w.values), _panels(w.scales), w.in_shape, w.out_shape, w.bits, w.group_size,
                           offsets)


def table_rows(table: QuantizedPanels, tokens_BT: jax.Array, out_dtype) -> jax.Array:
    """Rows ``tokens_BT`` [B, T] of an embedding table held as its head's panels: column t of W [D, V] is
    panel t // 16, lane t % 16. [B, T, D] in ``out_dtype`` (an index past the table reads zeros)."""
    P, (D,) = cpu_kernels.PANEL, table.in_shape

    def lanes(a: jax.Array) -> jax.Array:  # [V / 16, X, 16] → [B · T, X]
        return a.at[tokens_BT // P, :, tokens_BT % P].get(mode="fill", fill_value=0).reshape(-1, a.shape[1])

    rows = lanes(table.data).shape[0]
    # The integers as the kernels read them (4 bits: u - 8) times the scales, plus the kernels' offsets.
    x = QuantizedArray(lanes(table.data), lanes(table.scales), (D,), (rows,), table.bits, table.group_size,
                       transposed=True).dequantize(jnp.float32)
    if table.offsets is not None:
        x = x + jnp.repeat(lanes(table.offsets), table.group_size, axis=-1)[:, :D]
    return x.reshape(*tokens_BT.shape, D).astype(out_dtype)


def one_stack(w: QuantizedPanels) -> QuantizedPanels:
    """``w`` [*lead, ...] as one stack [prod(lead), ...] (a reshape, no copy): expert e of layer l of a mixture's
    experts [L, E, ...] is entry l·E + e, which :func:`products` reads in place as its ``layer``."""
    def flat(a):
        return a.reshape(-1, *a.shape[-3:])

    return dataclasses.replace(w, data=flat(w.data), scales=flat(w.scales),
                               offsets=None if w.offsets is None else flat(w.offsets))


def dequantized(w: QuantizedPanels, layer: jax.Array | None, dtype) -> jax.Array:
    """The array [*lead, *in, *out] that ``w`` (layer ``layer`` of its stack, where given: [*lead[1:], ...])
    stands for as the kernels read it (4 bits: ``u - 8``, plus the kernels' offsets), in ``dtype``."""
    def at(a):
        return a if layer is None else jax.lax.dynamic_index_in_dim(a, layer, keepdims=False)

    values, scales = cpu_kernels.from_panels(at(w.data)), cpu_kernels.from_panels(at(w.scales))
    K = math.prod(w.in_shape)
    x = QuantizedArray(values, scales, (K,), (values.shape[-1],), w.bits, w.group_size).dequantize(jnp.float32)
    if w.offsets is not None:
        x = x + jnp.repeat(cpu_kernels.from_panels(at(w.offsets)), w.group_size, axis=-2)[..., :K, :]
    return x.reshape(*x.shape[:-2], *w.in_shape, *w.out_shape).astype(dtype)


_panels = jax.jit(cpu_kernels.to_panels)


@functools.partial(jax.jit, static_argnums=2)
def _kernel_offsets(offsets: jax.Array, scales: jax.Array, bits: int) -> jax.Array:
    """A leaf's offsets for integers as the kernels read them (4 bits: ``u - 8``, so ``o + 8 s``)."""
    return offsets + 8 * scales if bits == 4 else offsets



def products(x: jax.Array, ws: list[QuantizedPanels], out_dtype, layer: jax.Array | None) -> list[jax.Array]:
    """``x [..., *in] · W_i`` for each W_i: [..., *out_i] in ``out_dtype``. The per-channel int8 ones in one
    kernel call, each other one in a call of its own."""
    K = math.prod(ws[0].in_shape)
    rows = x.shape[: x.ndim - len(ws[0].in_shape)]
    x_RK = x.reshape(-1, K).astype(jnp.float32)
    out: list[jax.Array | None] = [None] * len(ws)
    channel = [i for i, w in enumerate(ws) if w.per_channel]
    if channel:
        ys = cpu_kernels.matmuls(x_RK, [ws[i].data for i in channel], panels=True, layer=layer)
        for i, y_RN in zip(channel, ys):
            s = ws[i].scales if layer is None else jax.lax.dynamic_index_in_dim(ws[i].scales, layer, keepdims=False)
            out[i] = y_RN * s.reshape(-1)  # [N / 16, 1, 16]: the columns in order
    for i, w in enumerate(ws):
        if out[i] is None:
            out[i] = cpu_kernels.quant_matmul(x_RK, w.data, w.scales, bits=w.bits, group_size=w.group_size, layer=layer,
                                              offsets=w.offsets)
    return [y.reshape(*rows, *w.out_shape).astype(out_dtype) for w, y in zip(ws, out)]
