"""The CPU kernels' form of quantized weights (``llm_jax.quantization``): int8 panels read in place.

A projection quantized to 8 bits per output channel (one group spanning its inputs: ``W = q · s[n]``) is
held as :class:`QuantizedPanels`: ``q`` in the panel layout [*lead, N / 16, K, 16] of ``cpu_kernels`` and
its scales [*lead, N]. The kernels' int8 panel product reads the bytes and converts them in registers
(``cpu_kernels.matmuls`` on int8 panels: x · q in float32), then each output column is scaled:
``(x · q) · s = x · W``. Decode reads a quarter of float32's bytes per step.

Other quantized leaves (groups, 4 bits, the embedding table) stay :class:`QuantizedArray` s, which the
backend multiplies as XLA does (dequantized). The LM head of a model whose embedding is not quantized
keeps its float panels and screen (:mod:`llm_jax.backends.cpu.forms`).
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
from llm_jax.quantization import PROJECTIONS, QuantizedArray

Params = dict[str, Any]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QuantizedPanels:
    """A [*lead, *in, *out] weight quantized to 8 bits per output channel: ``data`` int8 panels
    [*lead, N / 16, K, 16] of q, ``scales`` float32 [*lead, N]."""

    data: jax.Array
    scales: jax.Array
    in_shape: tuple[int, ...] = dataclasses.field(metadata={"static": True})
    out_shape: tuple[int, ...] = dataclasses.field(metadata={"static": True})

    @property
    def shape(self) -> tuple[int, ...]:
        return (*self.data.shape[:-3], *self.in_shape, *self.out_shape)

    @property
    def dtype(self):
        return self.data.dtype


def takes_panels(w: Any) -> bool:
    """Whether the kernels read quantized leaf ``w`` as :class:`QuantizedPanels`."""
    return (isinstance(w, QuantizedArray) and w.bits == 8 and w.n_groups == 1 and not w.transposed
            and w.N % cpu_kernels.PANEL == 0)


def prepare(params: Params, config: ModelConfig) -> Params:
    """``params`` with each projection the kernels read as int8 panels in that form (others unchanged)."""
    layers = {name: dict(module) if isinstance(module, dict) else module for name, module in params["layers"].items()}
    for module, names in PROJECTIONS.items():
        for name in names:
            w = layers[module][name]
            if takes_panels(w):
                layers[module][name] = QuantizedPanels(_panels(w.values, w.K, w.N), w.scales.reshape(*w.lead, w.N),
                                                       w.in_shape, w.out_shape)
    return {**params, "layers": layers}


@functools.partial(jax.jit, static_argnums=(1, 2))
def _panels(values: jax.Array, K: int, N: int) -> jax.Array:
    return cpu_kernels.to_panels(values.reshape(*values.shape[:-2], K, N))


def products(x: jax.Array, ws: list[QuantizedPanels], out_dtype, layer: jax.Array | None) -> list[jax.Array]:
    """``x [..., *in] · W_i`` for each W_i, in one kernel call: [..., *out_i] in ``out_dtype``."""
    K = math.prod(ws[0].in_shape)
    rows = x.shape[: x.ndim - len(ws[0].in_shape)]
    x_RK = x.reshape(-1, K).astype(jnp.float32)
    ys = cpu_kernels.matmuls(x_RK, [w.data for w in ws], panels=True, layer=layer)
    out = []
    for w, y_RN in zip(ws, ys):
        s_N = w.scales if layer is None else jax.lax.dynamic_index_in_dim(w.scales, layer, keepdims=False)
        out.append((y_RN * s_N).reshape(*rows, *w.out_shape).astype(out_dtype))
    return out
