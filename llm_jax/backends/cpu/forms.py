"""The execution form of the weights on the CPU kernels: typed leaves derived from the canonical params.

Decode on CPU reads every weight once per step. The kernels read two forms faster than the checkpoint's:

- **panels**: W [K, N] held as [N / 16, K, 16] (``cpu_kernels.to_panels``): panel q is columns 16q ...
  16q + 15, row after row, one contiguous run. Products of many rows run their register tiles on the
  panels as they lie (no packing per call); a product of one row streams a few panels at a time.
- **fused groups**: q/k/v side by side as one matrix, and gate/up as one: one long stream per layer
  instead of several short ones, and one call (one fork-join of the threads) instead of several.

:func:`prepare` builds the form once, leaf by leaf, from the canonical params (``llm_jax.model``'s
layout), keeping every path: ``layers/attn/q_proj`` becomes a :class:`Fused` group holding q, k and v,
``k_proj`` and ``v_proj`` :class:`FusedPart` markers pointing into it; ``o_proj``, ``down_proj`` and an
untied ``lm_head`` become :class:`Panels`; a tied ``embedder/embedding`` becomes :class:`Panels` of the
head it also is (``transposed``); a mixture's experts (``layers/moe``) become :class:`Panels` [L, E, N / 16,
K, 16], whose chosen experts decode's kernels read in the stack (a prefill unpacks a layer's for XLA's
``ragged_dot``), and a shared expert's gate and up a :class:`Fused` group. The model hands these leaves to the
backend untouched; only :class:`llm_jax.backends.CpuKernels` reads them.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp

import cpu_kernels
from llm_jax.bits import moving_bits
from llm_jax.config import ModelConfig

Params = dict[str, Any]


def _static(**kwargs):
    return dataclasses.field(metadata=dict(static=True), **kwargs)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Panels:
    """A weight W [*lead, *in, *out] held as panels ``data`` [*lead, N / 16, K, 16], K = prod(in),
    N = prod(out). ``transposed``: it stands for Wᵀ [*lead, *out, *in] instead (a tied embedding table
    E [V, D], whose transpose, the LM head, is what the panels hold)."""

    data: jax.Array
    in_shape: tuple[int, ...] = _static()
    out_shape: tuple[int, ...] = _static()
    transposed: bool = _static(default=False)

    @property
    def lead(self) -> tuple[int, ...]:
        return tuple(self.data.shape[:-3])

    @property
    def shape(self) -> tuple[int, ...]:
        inner = (*self.out_shape, *self.in_shape) if self.transposed else (*self.in_shape, *self.out_shape)
        return (*self.lead, *inner)

    @property
    def dtype(self):
        return self.data.dtype

    def unpacked(self) -> jax.Array:
        """The array it stands for (a copy)."""
        w = _unpanel(self.data, (*self.lead, *self.in_shape, *self.out_shape))
        if not self.transposed:
            return w
        n_in, n_out = len(self.in_shape), len(self.out_shape)
        lead = tuple(range(len(self.lead)))
        ins = tuple(range(len(lead), len(lead) + n_in))
        return jnp.transpose(w, (*lead, *(len(lead) + n_in + i for i in range(n_out)), *ins))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Fused:
    """Several projections of one input side by side: ``data`` W [*lead, K, Σ parts] (or its
    :class:`Panels`), columns of part 0, then part 1, ...; it stands at part 0's path, and
    :class:`FusedPart` markers at the others'. ``out_shapes`` are each part's own output axes."""

    data: jax.Array | Panels
    out_shapes: tuple[tuple[int, ...], ...] = _static()

    @property
    def widths(self) -> tuple[int, ...]:
        return tuple(math.prod(s) for s in self.out_shapes)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class FusedPart:
    """Part ``index`` of the :class:`Fused` group at the first path of the same group (no data)."""

    index: int = _static()


def is_form(leaf: Any) -> bool:
    """Whether ``leaf`` is one of this module's typed leaves (not a plain array)."""
    return isinstance(leaf, (Panels, Fused, FusedPart))


# The groups fused, by the layer module holding them, and the projections held as panels: (path, in, out)
# as functions of the config.
GROUPS = {("layers", "attn"): ("q_proj", "k_proj", "v_proj"), ("layers", "mlp"): ("gate_proj", "up_proj")}


def projection_dims(name: str, config: ModelConfig) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(input axes, output axes) of the projection ``name``: W [*in, *out] (per layer)."""
    D, N, K, H, F = config.d_model, config.n_heads, config.n_kv_heads, config.head_dim, config.d_ff
    return {"q_proj": ((D,), (N, H)), "k_proj": ((D,), (K, H)), "v_proj": ((D,), (K, H)), "o_proj": ((N, H), (D,)),
            "gate_proj": ((D,), (F,)), "up_proj": ((D,), (F,)), "down_proj": ((F,), (D,)),
            "lm_head": ((D,), (config.vocab_size,))}[name]


def takes_panels(n_out: int) -> bool:
    """Whether a projection with ``n_out`` output columns is held as panels (whole panels only)."""
    return n_out % cpu_kernels.PANEL == 0


def prepare(params: Params, config: ModelConfig) -> Params:
    """The execution form of canonical ``params`` (a new pytree; norms, biases and other leaves shared).
    Built one leaf at a time, so preparing needs memory for the new form and one leaf in flight."""
    layers = {name: dict(module) if isinstance(module, dict) else module for name, module in params["layers"].items()}
    # A mixture of experts (``layers/moe``) has no dense MLP: its experts are prepared apart (_prepared_experts).
    dense_mlp = config.experts is None
    checked = (("attn", ("q_proj", "k_proj", "v_proj", "o_proj")),)
    checked += dense_mlp * (("mlp", ("gate_proj", "up_proj", "down_proj")),)
    for module, names in checked:
        for name in names:
            w = layers.get(module, {}).get(name)
            ins, outs = projection_dims(name, config)
            if w is None or not hasattr(w, "shape") or tuple(w.shape) != (config.n_layers, *ins, *outs):
                found = "missing" if w is None else (f"{tuple(w.shape)}" if hasattr(w, "shape") else type(w).__name__)
                raise ValueError(f"params/layers/{module}/{name} is {found}; the config says "
                                 f"{[config.n_layers, *ins, *outs]} (prepare takes the canonical params)")
    for (_, module), names in GROUPS.items():
        if module == "mlp" and not dense_mlp:
            continue
        group = layers[module]
        parts = [group[n] for n in names]
        outs = tuple(projection_dims(n, config)[1] for n in names)
        width = sum(math.prod(o) for o in outs)
        # One program from the parts to the fused panels: no fused copy in between.
        fused = (Panels(_fused_panels(parts), (config.d_model,), (width,)) if takes_panels(width)
                 else _side_by_side(parts))
        group[names[0]] = Fused(fused, outs)
        for i, n in enumerate(names[1:], start=1):
            group[n] = FusedPart(i)
    for module, name in (("attn", "o_proj"),) + dense_mlp * (("mlp", "down_proj"),):
        ins, outs = projection_dims(name, config)
        layers[module][name] = _maybe_panels(layers[module][name], ins, outs)
    if not dense_mlp:
        layers["moe"] = _prepared_experts(layers["moe"], config)
    return prepare_head({**params, "layers": layers}, config)


def _prepared_experts(moe: Params, config: ModelConfig) -> Params:
    """A mixture's experts as panels [L, E, N / 16, K, 16] where they take them (decode's kernels read the
    chosen ones in the stack); a shared expert (Qwen2-MoE) as the dense MLP is: gate and up fused, down panels."""
    D, F, F_shared = config.d_model, config.d_ff, config.experts.shared_d_ff
    out = {**moe, "gate_proj": _maybe_panels(moe["gate_proj"], (D,), (F,)),
           "up_proj": _maybe_panels(moe["up_proj"], (D,), (F,)),
           "down_proj": _maybe_panels(moe["down_proj"], (F,), (D,))}
    if F_shared is None:
        return out
    parts = [moe["shared_gate_proj"], moe["shared_up_proj"]]
    fused = (Panels(_fused_panels(parts), (D,), (2 * F_shared,)) if takes_panels(2 * F_shared)
             else _side_by_side(parts))
    return {**out, "shared_gate_proj": Fused(fused, ((F_shared,), (F_shared,))), "shared_up_proj": FusedPart(1),
            "shared_down_proj": _maybe_panels(moe["shared_down_proj"], (F_shared,), (D,))}


def prepare_head(params: Params, config: ModelConfig) -> Params:
    """``params`` with the LM head (an untied head, or the tied embedding table) as panels where it takes
    them (a new top-level dict)."""
    out = dict(params)
    if config.classifier is not None:  # no LM head: the embedding table is only looked up
        return out
    if "lm_head" in params:
        out["lm_head"] = _maybe_panels(params["lm_head"], *projection_dims("lm_head", config))
    elif takes_panels(config.vocab_size):
        out["embedder"] = {**params["embedder"],
                           "embedding": Panels(_table_panels(params["embedder"]["embedding"]), (config.d_model,),
                                               (config.vocab_size,), transposed=True)}
    return out


def _maybe_panels(w: jax.Array, ins: tuple[int, ...], outs: tuple[int, ...]) -> jax.Array | Panels:
    """``w`` [*lead, *ins, *outs] as :class:`Panels` where its output width takes them, else as it is."""
    K, N = math.prod(ins), math.prod(outs)
    lead = w.ndim - len(ins) - len(outs)
    if lead < 0 or tuple(w.shape[lead:]) != (*ins, *outs):
        raise ValueError(f"a weight of shape {tuple(w.shape)} where the config says "
                         f"[..., {', '.join(map(str, ins + outs))}]")
    if not takes_panels(N):
        return w
    return Panels(_panels(w, lead, K, N), ins, outs)


def head_panels(weights: Params, config: ModelConfig) -> Panels | None:
    """The LM head's panels (an untied head's, or the tied embedding table's), or None."""
    head = weights["embedder"]["embedding"] if config.tie_embeddings else weights.get("lm_head")
    return head if isinstance(head, Panels) else None


# Jitted, so that each leaf is built in one pass, and through the bits of bfloat16 arrays (XLA:CPU converts
# bfloat16 to float32 and back around a concatenate or transpose).
@jax.jit
@moving_bits
def _side_by_side(parts: list[jax.Array]) -> jax.Array:
    """[L, D, ...] stacks → [L, D, Σ columns], the parts' columns one after another."""
    return jnp.concatenate([w.reshape(*w.shape[:2], -1) for w in parts], axis=-1)


@jax.jit
@moving_bits
def _fused_panels(parts: list[jax.Array]) -> jax.Array:
    """[L, D, ...] stacks → the panels of [L, D, Σ columns]."""
    return cpu_kernels.to_panels(jnp.concatenate([w.reshape(*w.shape[:2], -1) for w in parts], axis=-1))


@functools.partial(jax.jit, static_argnums=(1, 2, 3))
@moving_bits
def _panels(w: jax.Array, lead: int, K: int, N: int) -> jax.Array:
    return cpu_kernels.to_panels(w.reshape(*w.shape[:lead], K, N))


@jax.jit
@moving_bits
def _table_panels(table_VD: jax.Array) -> jax.Array:
    return cpu_kernels.to_panels(table_VD.T)


@functools.partial(jax.jit, static_argnums=1)
@moving_bits
def _unpanel(p: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    return cpu_kernels.from_panels(p).reshape(shape)
