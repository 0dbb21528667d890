"""Building blocks of the decoder: RMSNorm, token embedding, the gated MLP and its sparse mixture of experts.

Flax linen modules used as pure functions: parameters live in an explicit pytree passed to ``apply``.
Every matrix product, embedding lookup and activation goes through the module's ``backend``
(:mod:`llm_jax.backends`), which accumulates in float32 whatever the parameter dtype.

A module built with ``stack=L`` is one layer of a stack of L: its params hold every layer's weights
([L, ...]) and each call names the ``layer`` to use (a traced index, in a loop over layers). The backend
gets the whole stack and the index, so its kernels can read the layer where it lies.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen as nn

from llm_jax.backends.base import Backend, Xla, gated, layer_of
from llm_jax.config import Activation, Experts, ModelConfig
from llm_jax.lora import LoraBatch

_init = nn.initializers.normal(stddev=0.02)


def stacked_param(module: nn.Module, name: str, init, shape: tuple[int, ...], stack: int | None) -> jax.Array:
    """``module.param(name, init, shape)``, with a leading axis of ``stack`` layers when given."""
    return module.param(name, init, shape if stack is None else (stack, *shape))


def weight(module: nn.Module, name: str, shape: tuple[int, ...], stack: int | None) -> Any:
    """The weight ``name`` of ``module``: an array [*shape] (a stack [L, *shape]), or, in weights a
    backend prepared (:meth:`Backend.prepare`), the typed leaf it put there for its kernels."""
    if module.has_variable("params", name):
        value = module.get_variable("params", name)
        if not isinstance(value, (jax.Array, np.ndarray)):
            return value
    return stacked_param(module, name, _init, shape, stack)


class RMSNorm(nn.Module):
    """Root-mean-square norm (Zhang & Sennrich 2019) over the last ``axes`` axes, computed in float32, its scale
    of their shape: one axis for a hidden state [..., D] or a head [..., H]; two for OLMo 2's q/k norm, over all
    heads [..., N, H] at once (under a mesh that splits the heads, XLA sums the squares across the shards).

    ``weight_offset`` is 1 for Gemma, whose checkpoints store ``scale - 1``.
    """

    eps: float
    weight_offset: float = 0.0
    stack: int | None = None
    axes: int = 1

    @nn.compact
    def __call__(self, x: jax.Array, layer: jax.Array | None = None) -> jax.Array:
        init = nn.initializers.zeros if self.weight_offset else nn.initializers.ones
        scale = stacked_param(self, "scale", init, tuple(x.shape[-self.axes:]), self.stack)
        scale = scale if layer is None else layer_of(scale, layer)
        x32 = x.astype(jnp.float32)
        over = tuple(range(-self.axes, 0))
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=over, keepdims=True) + self.eps)
        return (normed * (self.weight_offset + scale.astype(jnp.float32))).astype(x.dtype)


def final_norm(params: dict, config: ModelConfig, x_BTD: jax.Array) -> jax.Array:
    """The model's final RMSNorm (``params["final_norm"]``), what the LM head reads ([..., D])."""
    return RMSNorm(eps=config.norm_eps, weight_offset=config.norm_weight_offset).apply(
        {"params": params["final_norm"]}, x_BTD)


class Embedder(nn.Module):
    """Token embedding E [V, D]; also the LM head when embeddings are tied."""

    vocab_size: int
    d_model: int
    backend: Backend = Xla()

    def setup(self) -> None:
        self.embedding = weight(self, "embedding", (self.vocab_size, self.d_model), None)

    def encode(self, tokens_BT: jax.Array, out_dtype) -> jax.Array:
        return self.backend.embed(self.embedding, tokens_BT, out_dtype)

    def decode(self, x_BTD: jax.Array) -> jax.Array:
        """Logits [B, T, V] in float32 against the (tied) embedding table."""
        return self.backend.dense("BTD,VD->BTV", x_BTD, self.embedding, jnp.float32)


class GatedMLP(nn.Module):
    """``down(act(gate(x)) * up(x))``: SwiGLU (Shazeer 2020) or GeGLU with tanh-approximated GELU.
    gate_proj and up_proj [D, F], down_proj [F, D]."""

    d_ff: int
    activation: Activation
    backend: Backend = Xla()
    stack: int | None = None

    @nn.compact
    def __call__(self, x_BTD: jax.Array, layer: jax.Array | None = None, lora: LoraBatch | None = None) -> jax.Array:
        D, F = x_BTD.shape[-1], self.d_ff
        gate_DF = weight(self, "gate_proj", (D, F), self.stack)
        up_DF = weight(self, "up_proj", (D, F), self.stack)
        down_FD = weight(self, "down_proj", (F, D), self.stack)
        if lora is None:
            gated_BTF = self.backend.gate_up(x_BTD, gate_DF, up_DF, self.activation, layer)
            return self.backend.dense("BTF,FD->BTD", gated_BTF.astype(x_BTD.dtype), down_FD, x_BTD.dtype, layer)
        # With adapters the products are updated before the activation: no fused gate/up.
        gate_BTF, up_BTF = self.backend.dense_many(["BTD,DF->BTF"] * 2, x_BTD, [gate_DF, up_DF], jnp.float32, layer)
        gated_BTF = gated(lora.apply("gate_proj", x_BTD, gate_BTF, layer), lora.apply("up_proj", x_BTD, up_BTF, layer),
                          self.activation).astype(x_BTD.dtype)
        y_BTD = self.backend.dense("BTF,FD->BTD", gated_BTF, down_FD, jnp.float32, layer)
        return lora.apply("down_proj", gated_BTF, y_BTD, layer).astype(x_BTD.dtype)


class MoeMLP(nn.Module):
    """A sparse mixture of gated MLPs (Mixtral, Qwen2-MoE, Qwen3-MoE; :class:`llm_jax.config.Experts`): router
    [D, E], each expert's gate_proj and up_proj [E, D, F], down_proj [E, F, D], run as the backend's ``moe_mlp``.
    With a shared expert (Qwen2-MoE), shared_gate_proj and shared_up_proj [D, F'], shared_down_proj [F', D]
    (F' = ``experts.shared_d_ff``), a gated MLP every token runs, its output scaled by ``sigmoid(x ·
    shared_expert_gate)`` ([D]) and added to the experts' sum in float32."""

    d_ff: int
    experts: Experts
    activation: Activation
    backend: Backend = Xla()
    stack: int | None = None

    @nn.compact
    def __call__(self, x_BTD: jax.Array, layer: jax.Array | None = None, lora: LoraBatch | None = None) -> jax.Array:
        if lora is not None:
            raise NotImplementedError("LoRA adapters on mixture-of-experts models are not supported")
        D, E, F = x_BTD.shape[-1], self.experts.num_experts, self.d_ff
        router_DE = weight(self, "router", (D, E), self.stack)
        gate_EDF = weight(self, "gate_proj", (E, D, F), self.stack)
        up_EDF = weight(self, "up_proj", (E, D, F), self.stack)
        down_EFD = weight(self, "down_proj", (E, F, D), self.stack)
        y_BTD = self.backend.moe_mlp(x_BTD, router_DE, gate_EDF, up_EDF, down_EFD, experts=self.experts,
                                     activation=self.activation, layer=layer)
        if self.experts.shared_d_ff is None:
            return y_BTD
        F_shared = self.experts.shared_d_ff
        gate_DF = weight(self, "shared_gate_proj", (D, F_shared), self.stack)
        up_DF = weight(self, "shared_up_proj", (D, F_shared), self.stack)
        down_FD = weight(self, "shared_down_proj", (F_shared, D), self.stack)
        scale_D = weight(self, "shared_expert_gate", (D,), self.stack)
        gated_BTF = self.backend.gate_up(x_BTD, gate_DF, up_DF, self.activation, layer).astype(x_BTD.dtype)
        shared_BTD = self.backend.dense("BTF,FD->BTD", gated_BTF, down_FD, jnp.float32, layer)
        scale_BT = jax.nn.sigmoid(self.backend.dense("BTD,D->BT", x_BTD, scale_D, jnp.float32, layer))
        return (y_BTD.astype(jnp.float32) + scale_BT[..., None] * shared_BTD).astype(x_BTD.dtype)
