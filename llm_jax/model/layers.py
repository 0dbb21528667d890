"""Building blocks of the decoder: RMSNorm, token embedding, gated MLP, and the matrix product they share.

Flax linen modules used as pure functions: parameters live in an explicit pytree passed to ``apply``.
Matrix products accumulate in float32 (``preferred_element_type``) whatever the parameter dtype.
"""

from __future__ import annotations

import math
from typing import Sequence

import jax
import jax.numpy as jnp
from flax import linen as nn

import cpu_kernels
from llm_jax.config import Activation, MatmulImpl

_init = nn.initializers.normal(stddev=0.02)


def dense(equation: str, x: jnp.ndarray, w: jnp.ndarray, out_dtype: jnp.dtype,
          impl: MatmulImpl = MatmulImpl.AUTO) -> jnp.ndarray:
    """``einsum(equation, x, w)`` with float32 accumulation, cast to ``out_dtype``.

    With ``MatmulImpl.AUTO``, when ``equation`` contracts trailing axes of ``x`` with leading
    (``"BTD,DF->BTF"``) or trailing (``"BTD,VD->BTV"``) axes of ``w``, products with bfloat16 weights on
    one CPU device run the streaming kernels of :mod:`cpu_kernels` (XLA's own product elsewhere).
    """
    return dense_many([equation], x, [w], out_dtype, impl)[0]


def dense_many(equations: Sequence[str], x: jnp.ndarray, ws: Sequence[jnp.ndarray], out_dtype: jnp.dtype,
               impl: MatmulImpl = MatmulImpl.AUTO) -> list[jnp.ndarray]:
    """:func:`dense` of one input with several weights (q/k/v, gate/up). When the CPU kernels run, one
    call streams all the weights: one fork-join of the threads instead of one per product."""
    forms = [_as_matmul(eq, x.shape, w.shape) for eq, w in zip(equations, ws)]
    kernel = (impl is MatmulImpl.AUTO and all(forms) and len({(f[0], f[1], f[3]) for f in forms}) == 1
              and len({w.dtype for w in ws}) == 1 and _use_kernel(ws[0].dtype))
    if not kernel:
        return [jnp.einsum(eq, x.astype(w.dtype), w, preferred_element_type=jnp.float32).astype(out_dtype)
                for eq, w in zip(equations, ws)]
    R, K, _, transposed, _ = forms[0]
    ws_2d = [w.reshape(N, K) if transposed else w.reshape(K, N) for w, (_, _, N, _, _) in zip(ws, forms)]
    ys = cpu_kernels.matmuls(x.reshape(R, K), ws_2d, transposed=transposed)
    return [y.reshape(form[4]).astype(out_dtype) for y, form in zip(ys, forms)]


def as_bits(a: jnp.ndarray) -> jnp.ndarray:
    """bfloat16 arrays as uint16, for slicing and gathering: XLA:CPU has no bfloat16 dynamic-slice or
    gather, and around one it converts the whole operand to float32 (for stacked weights in a loop,
    hoisted: a float32 copy of the model in every decode call)."""
    return jax.lax.bitcast_convert_type(a, jnp.uint16) if a.dtype == jnp.bfloat16 else a


def from_bits(a: jnp.ndarray, dtype) -> jnp.ndarray:
    """Undoes :func:`as_bits` for an array that was of ``dtype``."""
    return jax.lax.bitcast_convert_type(a, jnp.bfloat16) if dtype == jnp.bfloat16 else a


def _use_kernel(dtype) -> bool:
    # bfloat16 only: XLA:CPU has no bfloat16 product and converts every weight matrix to float32 in memory
    # on every call, which the kernels avoid by reading bfloat16 in place (1B decode: 0.2 → several tok/s).
    # For float32 weights XLA's products are as fast under load and keep its exact summation order.
    # The kernels are single-device custom calls: on several devices GSPMD would gather their operands
    # (every weight, every step), so sharded programs keep XLA's products.
    return dtype == jnp.bfloat16 and jax.device_count() == 1 and cpu_kernels.available()


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

    @nn.compact
    def __call__(self, x: jnp.ndarray) -> jnp.ndarray:
        init = nn.initializers.zeros if self.weight_offset else nn.initializers.ones
        scale = self.param("scale", init, (x.shape[-1],))
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return (normed * (self.weight_offset + scale.astype(jnp.float32))).astype(x.dtype)


class Embedder(nn.Module):
    """Token embedding [V, D]; also the LM head when embeddings are tied."""

    vocab_size: int
    d_model: int
    matmul: MatmulImpl = MatmulImpl.AUTO

    def setup(self) -> None:
        self.embedding = self.param("embedding", _init, (self.vocab_size, self.d_model))

    def encode(self, tokens_BT: jnp.ndarray, out_dtype: jnp.dtype) -> jnp.ndarray:
        rows_BTD = jnp.take(as_bits(self.embedding), tokens_BT, axis=0)
        return from_bits(rows_BTD, self.embedding.dtype).astype(out_dtype)

    def decode(self, x_BTD: jnp.ndarray) -> jnp.ndarray:
        """Logits [B, T, V] in float32 against the (tied) embedding table."""
        return dense("BTD,VD->BTV", x_BTD, self.embedding, jnp.float32, self.matmul)


class GatedMLP(nn.Module):
    """``down(act(gate(x)) * up(x))``: SwiGLU (Shazeer 2020) or GeGLU with tanh-approximated GELU."""

    d_ff: int
    activation: Activation
    matmul: MatmulImpl = MatmulImpl.AUTO

    @nn.compact
    def __call__(self, x_BTD: jnp.ndarray) -> jnp.ndarray:
        D = x_BTD.shape[-1]
        gate_DF = self.param("gate_proj", _init, (D, self.d_ff))
        up_DF = self.param("up_proj", _init, (D, self.d_ff))
        down_FD = self.param("down_proj", _init, (self.d_ff, D))
        gate_BTF, up_BTF = dense_many(["BTD,DF->BTF"] * 2, x_BTD, [gate_DF, up_DF], jnp.float32, self.matmul)
        match self.activation:
            case Activation.SILU:
                act_BTF = jax.nn.silu(gate_BTF)
            case Activation.GELU_TANH:
                act_BTF = jax.nn.gelu(gate_BTF, approximate=True)
        return dense("BTF,FD->BTD", (act_BTF * up_BTF).astype(x_BTD.dtype), down_FD, x_BTD.dtype, self.matmul)
