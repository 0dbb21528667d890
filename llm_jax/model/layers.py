"""Building blocks of the decoder: RMSNorm, token embedding, gated MLP, and the matrix product they share.

Flax linen modules used as pure functions: parameters live in an explicit pytree passed to ``apply``.
Matrix products accumulate in float32 (``preferred_element_type``) whatever the parameter dtype.

A module built with ``stack=L`` is one layer of a stack of L: its params hold every layer's weights
([L, ...]) and each call names the ``layer`` to use (a traced index, in a loop over layers). Products
then hand the whole stack and the index to :func:`dense_many`, so the CPU kernels read the layer's
weights where they lie; slicing them out first would cost XLA:CPU a copy of every weight on every
decode step.
"""

from __future__ import annotations

import math
from typing import Sequence

import jax
import jax.numpy as jnp
from flax import linen as nn

import cpu_kernels
from llm_jax.bits import as_bits, from_bits
from llm_jax.config import Activation, MatmulImpl, ModelConfig
from llm_jax.model.panels import SUFFIX as PANELS_SUFFIX
from llm_jax.model.panels import Panels

_init = nn.initializers.normal(stddev=0.02)


def dense(equation: str, x: jnp.ndarray, w: jnp.ndarray, out_dtype: jnp.dtype,
          impl: MatmulImpl = MatmulImpl.AUTO, layer: jnp.ndarray | None = None) -> jnp.ndarray:
    """``einsum(equation, x, w)`` with float32 accumulation, cast to ``out_dtype``; with ``layer``, ``w``
    is a stack [L, ...] of every layer's weights and ``w[layer]`` is used.

    With ``MatmulImpl.AUTO``, when ``equation`` contracts trailing axes of ``x`` with leading
    (``"BTD,DF->BTF"``) or trailing (``"BTD,VD->BTV"``) axes of ``w``, products on one CPU device run the
    kernels of :mod:`cpu_kernels` (XLA's own product elsewhere), float32 or bfloat16 weights, any number of
    rows.
    """
    return dense_many([equation], x, [w], out_dtype, impl, layer)[0]


def dense_many(equations: Sequence[str], x: jnp.ndarray, ws: Sequence[jnp.ndarray | Panels], out_dtype: jnp.dtype,
               impl: MatmulImpl = MatmulImpl.AUTO, layer: jnp.ndarray | None = None) -> list[jnp.ndarray]:
    """:func:`dense` of one input with several weights (q/k/v, gate/up). When the CPU kernels run, one
    call streams all the weights: one fork-join of the threads instead of one per product. A weight may
    be a :class:`Panels` (the panel layout of :mod:`llm_jax.model.panels`), standing for W."""
    lead = 0 if layer is None else 1
    forms = [_as_matmul(eq, x.shape, w.shape[lead:]) for eq, w in zip(equations, ws)]
    kernel = (impl is MatmulImpl.AUTO and all(forms) and len({(f[0], f[1], f[3]) for f in forms}) == 1
              and len({w.dtype for w in ws}) == 1 and _use_kernel(ws[0].dtype))
    if not kernel:
        ws = [w.unpacked() if isinstance(w, Panels) else w for w in ws]
        ws = ws if layer is None else [layer_of(w, layer) for w in ws]
        return [jnp.einsum(eq, x.astype(w.dtype), w, preferred_element_type=jnp.float32).astype(out_dtype)
                for eq, w in zip(equations, ws)]
    R, K, _, transposed, _ = forms[0]
    x_RK, ys = x.reshape(R, K), [None] * len(ws)
    for panels in (False, True):  # one call per layout
        which = [i for i, w in enumerate(ws) if isinstance(w, Panels) == panels]
        if not which:
            continue
        mats = [ws[i].data if panels else ws[i].reshape(*ws[i].shape[:lead], *((forms[i][2], K) if transposed
                                                                               else (K, forms[i][2])))
                for i in which]
        for i, y in zip(which, cpu_kernels.matmuls(x_RK, mats, transposed=transposed, panels=panels, layer=layer)):
            ys[i] = y
    return [y.reshape(form[4]).astype(out_dtype) for y, form in zip(ys, forms)]


def layer_of(w_L: jnp.ndarray, layer: jnp.ndarray) -> jnp.ndarray:
    """``w_L[layer]`` for a stack of weights [L, ...] and a traced index (bfloat16 sliced as uint16, see
    :func:`as_bits`)."""
    return from_bits(jax.lax.dynamic_index_in_dim(as_bits(w_L), layer, keepdims=False), w_L.dtype)


def stacked_param(module: nn.Module, name: str, init, shape: tuple[int, ...], stack: int | None) -> jnp.ndarray:
    """``module.param(name, init, shape)``, with a leading axis of ``stack`` layers when given."""
    return module.param(name, init, shape if stack is None else (stack, *shape))


def has_projection(module: nn.Module, name: str) -> bool:
    """Whether the params of ``module`` hold the projection ``name``, in either layout."""
    return module.has_variable("params", name) or module.has_variable("params", name + PANELS_SUFFIX)


def projection_param(module: nn.Module, name: str, in_shape: tuple[int, ...], out_shape: tuple[int, ...],
                     stack: int | None) -> jnp.ndarray | Panels:
    """The projection ``name`` of ``module``: W [*in, *out] (a stack [L, ...] when ``stack``), or, when the
    params hold it in the panel layout as ``<name>_panels``, a :class:`Panels` standing for it."""
    K, N = math.prod(in_shape), math.prod(out_shape)
    if module.has_variable("params", name + PANELS_SUFFIX):
        data = stacked_param(module, name + PANELS_SUFFIX, _init, (N // cpu_kernels.PANEL, K, cpu_kernels.PANEL), stack)
        return Panels(data, tuple(out_shape))
    return stacked_param(module, name, _init, (*in_shape, *out_shape), stack)


# From this many rows on, the gated MLP's activation (fused gate/up layout, where the matrix products run
# on the kernels) is cpu_kernels.glu; fewer rows keep XLA's fusion, which costs less than a kernel call.
GLU_KERNEL_MIN_ROWS = 8


def _use_kernel(dtype) -> bool:
    # bfloat16: XLA:CPU has no bfloat16 product and converts every weight matrix to float32 in memory on
    # every call, which the kernels avoid by reading bfloat16 in place (1B decode: 0.2 → several tok/s).
    # float32: the kernels take a layer of stacked weights in place, where XLA:CPU copies it out of the
    # stack before its product (a loop over 110M's 12 layers, one row: 24 ms with the kernels, 50 ms with
    # XLA), and with many rows their register tiles beat XLA's product too (110M prefill, 64 tokens:
    # 116–124 ms against 170–192; 256 tokens: 446–486 against 510–551; 1000 tokens: the same; 15M decode
    # at batch 64: 24–26 ms per step against 35).
    # The kernels are single-device custom calls: on several devices GSPMD would gather their operands
    # (every weight, every step), so sharded programs keep XLA's products.
    wanted = dtype in (jnp.bfloat16, jnp.float32)
    return wanted and jax.device_count() == 1 and cpu_kernels.available()


def _as_matmul(equation: str, x_shape, w_shape):
    """(R, K, N, transposed, out_shape) when ``equation`` is x [rows..., k...] · w [k..., out...] (or
    w [out..., k...], transposed) with the output [rows..., out...]; None for any other einsum."""
    inputs, out = equation.replace(" ", "").split("->")
    x_spec, w_spec = inputs.split(",")
    contracted = [a for a in x_spec if a in w_spec]
    n_c = len(contracted)
    if not contracted or x_spec[len(x_spec) - n_c:] != "".join(contracted):
        return None
    rows_spec = x_spec[: len(x_spec) - n_c]
    if w_spec[:n_c] == "".join(contracted):
        transposed, out_spec = False, w_spec[n_c:]
    elif w_spec[len(w_spec) - n_c:] == "".join(contracted):
        transposed, out_spec = True, w_spec[: len(w_spec) - n_c]
    else:
        return None
    if out != rows_spec + out_spec:
        return None
    R = math.prod(x_shape[: len(rows_spec)])
    K = math.prod(x_shape[len(rows_spec):])
    out_dims = w_shape[: len(out_spec)] if transposed else w_shape[n_c:]
    return R, K, math.prod(out_dims), transposed, (*x_shape[: len(rows_spec)], *out_dims)


class RMSNorm(nn.Module):
    """Root-mean-square norm (Zhang & Sennrich 2019) over the last axis, computed in float32.

    ``weight_offset`` is 1 for Gemma, whose checkpoints store ``scale - 1``.
    """

    eps: float
    weight_offset: float = 0.0
    stack: int | None = None

    @nn.compact
    def __call__(self, x: jnp.ndarray, layer: jnp.ndarray | None = None) -> jnp.ndarray:
        init = nn.initializers.zeros if self.weight_offset else nn.initializers.ones
        scale = stacked_param(self, "scale", init, (x.shape[-1],), self.stack)
        scale = scale if layer is None else layer_of(scale, layer)
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return (normed * (self.weight_offset + scale.astype(jnp.float32))).astype(x.dtype)


def final_norm(params: dict, config: ModelConfig, x_BTD: jnp.ndarray) -> jnp.ndarray:
    """The model's final RMSNorm (``params["final_norm"]``), what the LM head reads ([..., D])."""
    return RMSNorm(eps=config.norm_eps, weight_offset=config.norm_weight_offset).apply(
        {"params": params["final_norm"]}, x_BTD)


class Embedder(nn.Module):
    """Token embedding [V, D]; also the LM head when embeddings are tied. In the panel layout of
    :mod:`llm_jax.model.panels` the table is held as the LM head's panels, ``embedding_panels`` [V / 16, D, 16]."""

    vocab_size: int
    d_model: int
    matmul: MatmulImpl = MatmulImpl.AUTO

    def setup(self) -> None:
        V, D = self.vocab_size, self.d_model
        if self.has_variable("params", "embedding" + PANELS_SUFFIX):
            self.head = Panels(self.param("embedding" + PANELS_SUFFIX, _init, (V // cpu_kernels.PANEL, D,
                                                                                 cpu_kernels.PANEL)), (V,))
        else:
            self.embedding = self.param("embedding", _init, (V, D))

    def encode(self, tokens_BT: jnp.ndarray, out_dtype: jnp.dtype) -> jnp.ndarray:
        if hasattr(self, "head"):  # row t is column t of the head: panel t // 16, lane t % 16
            bits = as_bits(self.head.data)
            rows_BTD = bits.at[tokens_BT // cpu_kernels.PANEL, :, tokens_BT % cpu_kernels.PANEL].get(mode="fill")
            return from_bits(rows_BTD, self.head.dtype).astype(out_dtype)
        rows_BTD = jnp.take(as_bits(self.embedding), tokens_BT, axis=0)
        return from_bits(rows_BTD, self.embedding.dtype).astype(out_dtype)

    def decode(self, x_BTD: jnp.ndarray) -> jnp.ndarray:
        """Logits [B, T, V] in float32 against the (tied) embedding table."""
        if hasattr(self, "head"):
            return dense("BTD,DV->BTV", x_BTD, self.head, jnp.float32, self.matmul)
        return dense("BTD,VD->BTV", x_BTD, self.embedding, jnp.float32, self.matmul)


class GatedMLP(nn.Module):
    """``down(act(gate(x)) * up(x))``: SwiGLU (Shazeer 2020) or GeGLU with tanh-approximated GELU.

    gate_proj and up_proj [D, F], down_proj [F, D]; or, in the fused layout (:mod:`llm_jax.model.fused`),
    gate_up_proj [D, 2F] in place of gate/up_proj, whose output [gate | up] goes, from
    ``GLU_KERNEL_MIN_ROWS`` rows on where the products run on the CPU kernels, to ``cpu_kernels.glu``."""

    d_ff: int
    activation: Activation
    matmul: MatmulImpl = MatmulImpl.AUTO
    stack: int | None = None

    @nn.compact
    def __call__(self, x_BTD: jnp.ndarray, layer: jnp.ndarray | None = None) -> jnp.ndarray:
        D, F = x_BTD.shape[-1], self.d_ff
        if has_projection(self, "gate_up_proj"):  # the fused layout: llm_jax.model.fused
            gate_up_DE = projection_param(self, "gate_up_proj", (D,), (2 * F,), self.stack)
            gate_up_BTE = dense("BTD,DE->BTE", x_BTD, gate_up_DE, jnp.float32, self.matmul, layer)
            rows = math.prod(gate_up_BTE.shape[:-1])
            if self.matmul is MatmulImpl.AUTO and rows >= GLU_KERNEL_MIN_ROWS and _use_kernel(gate_up_DE.dtype):
                gated_RF = cpu_kernels.glu(gate_up_BTE.reshape(rows, 2 * F), self.activation.value)
                gated_BTF = gated_RF.reshape(*gate_up_BTE.shape[:-1], F)
            else:
                gated_BTF = cpu_kernels.gated(gate_up_BTE[..., :F], gate_up_BTE[..., F:], self.activation.value)
        else:
            gate_DF = projection_param(self, "gate_proj", (D,), (F,), self.stack)
            up_DF = projection_param(self, "up_proj", (D,), (F,), self.stack)
            gate_BTF, up_BTF = dense_many(["BTD,DF->BTF"] * 2, x_BTD, [gate_DF, up_DF], jnp.float32, self.matmul,
                                          layer)
            gated_BTF = cpu_kernels.gated(gate_BTF, up_BTF, self.activation.value)
        down_FD = projection_param(self, "down_proj", (F,), (D,), self.stack)
        return dense("BTF,FD->BTD", gated_BTF.astype(x_BTD.dtype), down_FD, x_BTD.dtype, self.matmul, layer)
