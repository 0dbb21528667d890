"""The panel layout: projection weights stored the way the CPU kernels' register tiles read them.

A projection W [K, N] (in × out) is held as panels [N / 16, K, 16]: panel q is columns 16q ... 16q + 15,
row after row, one contiguous run (``cpu_kernels.to_panels``). The kernels' products with many rows
(batched decode, prefill) otherwise pack every block of W into exactly this form on every call, which
took a third of a batch-32 layer's time on one core (copying, and waiting on memory for the copy); with
the panels in memory they run on W as it lies. With one row (batch-1 decode) a unit of work streams a
few panels, each one long contiguous run, and keeps their 16 sums in registers for the whole of K.

In the params pytree a weight in this layout is named ``<name>_panels`` (``layers/attn/o_proj_panels``
[L, D / 16, N·H, 16] in place of ``layers/attn/o_proj`` [L, N, H, D]); the modules read either. Every
projection whose output width is a multiple of 16 takes it: q/k/v (or the fused qkv), o, gate/up (or
the fused gate_up), down and an untied LM head; and a tied embedding table, as the LM head it also is
(``embedder/embedding_panels`` [V / 16, D, 16]). :func:`llm_jax.model.fused.fuse_projections` applies it
with ``panels=True`` where the kernels run; :func:`llm_jax.model.fused.unfuse_projections` undoes it.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax

import cpu_kernels
from llm_jax.bits import moving_bits
from llm_jax.config import ModelConfig

Params = dict[str, Any]

SUFFIX = "_panels"


@dataclasses.dataclass(frozen=True)
class Panels:
    """A projection W [*lead, K, *out] held as panels ``data`` [*lead, N / 16, K, 16], N = prod(out).

    ``shape`` and ``dtype`` are W's, so the products can treat it as the matrix it stands for."""

    data: jax.Array
    out_shape: tuple[int, ...]

    @property
    def shape(self) -> tuple[int, ...]:
        *lead, _, K, _ = self.data.shape
        return (*lead, K, *self.out_shape)

    @property
    def dtype(self):
        return self.data.dtype

    def unpacked(self) -> jax.Array:
        """W [*lead, K, *out] (a copy: for XLA's products, not the kernels')."""
        return cpu_kernels.from_panels(self.data).reshape(self.shape)


# The projections [*in, *out] (each a stack [L, ...] under "layers") the layout applies to, by path.
PROJECTIONS = (("layers", "attn", "qkv_proj"), ("layers", "attn", "q_proj"), ("layers", "attn", "k_proj"),
               ("layers", "attn", "v_proj"), ("layers", "attn", "o_proj"), ("layers", "mlp", "gate_up_proj"),
               ("layers", "mlp", "gate_proj"), ("layers", "mlp", "up_proj"), ("layers", "mlp", "down_proj"),
               ("lm_head",))
# A tied embedding table E [V, D] is the LM head W = E^T [D, V]: held as W's panels [V / 16, D, 16], from
# which a token's row is gathered (E[t] = panels[t // 16, :, t % 16]; a few cache lines per token).
EMBEDDING = ("embedder", "embedding")


def _get(params: Params, path: tuple[str, ...]):
    for key in path:
        if not isinstance(params, dict) or key not in params:
            return None
        params = params[key]
    return params


def _replace(params: Params, path: tuple[str, ...], old: str, new: str, value) -> Params:
    """A copy of ``params`` with the leaf ``path[:-1] + (old,)`` replaced by ``new``: ``value``."""
    if len(path) == 1:
        out = {k: v for k, v in params.items() if k != old}
        out[new] = value
        return out
    return {**params, path[0]: _replace(params[path[0]], path[1:], old, new, value)}


def has_panels(params: Params) -> bool:
    """Whether any projection of ``params`` (or the embedding table) is in the panel layout."""
    return any(_get(params, (*path[:-1], path[-1] + SUFFIX)) is not None for path in (*PROJECTIONS, EMBEDDING))


def to_panel_layout(params: Params, config: ModelConfig, *, consume: bool = False) -> Params:
    """``params`` with every projection whose output width is a multiple of 16 in the panel layout, and a
    tied embedding table too (a new pytree; other leaves shared). ``consume``: each replaced array is
    deleted as soon as its panels exist, so that converting needs memory for one more leaf, not a second
    copy of the params."""
    table = _get(params, EMBEDDING)
    if config.tie_embeddings and table is not None and config.vocab_size % cpu_kernels.PANEL == 0:
        panels = _table_panels(table)
        params = _replace(params, EMBEDDING, EMBEDDING[-1], EMBEDDING[-1] + SUFFIX, panels)
        if consume:
            release([table], panels)
    for path in PROJECTIONS:
        w = _get(params, path)
        if w is None:
            continue
        ins, outs = projection_dims(path[-1], config)
        lead = w.ndim - len(ins) - len(outs)
        if lead < 0 or w.shape[lead:] != (*ins, *outs):
            raise ValueError(f"{'/'.join(path)} is {w.shape}, the config says [..., {', '.join(map(str, ins + outs))}]")
        K, N = math.prod(ins), math.prod(outs)
        if not takes_panels(N):
            continue
        panels = _panels(w, lead, K, N)
        params = _replace(params, path, path[-1], path[-1] + SUFFIX, panels)
        if consume:
            release([w], panels)
    return params


def release(replaced: list, replacement: jax.Array) -> None:
    """Delete the arrays in ``replaced`` once ``replacement`` (computed from them) is ready."""
    jax.block_until_ready(replacement)
    for w in replaced:
        if isinstance(w, jax.Array):
            w.delete()


def from_panel_layout(params: Params, config: ModelConfig) -> Params:
    """``params`` with every projection back in its plain layout [*in, *out] (unchanged if none is in panels)."""
    p = _get(params, (*EMBEDDING[:-1], EMBEDDING[-1] + SUFFIX))
    if p is not None:
        params = _replace(params, EMBEDDING, EMBEDDING[-1] + SUFFIX, EMBEDDING[-1], _table(p))
    for path in PROJECTIONS:
        name = path[-1] + SUFFIX
        p = _get(params, (*path[:-1], name))
        if p is not None:
            ins, outs = projection_dims(path[-1], config)
            params = _replace(params, path, name, path[-1], _unpacked(p, (*p.shape[:-3], *ins, *outs)))
    return params


def takes_panels(n_out: int) -> bool:
    """Whether a projection with ``n_out`` output columns is held in the panel layout (whole panels only)."""
    return n_out % cpu_kernels.PANEL == 0


def projection_dims(name: str, config: ModelConfig) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(input axes, output axes) of a layer's projection ``name``, W [*in, *out] (or of the LM head)."""
    D, N, K, H, F = config.d_model, config.n_heads, config.n_kv_heads, config.head_dim, config.d_ff
    return {"qkv_proj": ((D,), ((N + 2 * K) * H,)), "q_proj": ((D,), (N, H)), "k_proj": ((D,), (K, H)),
            "v_proj": ((D,), (K, H)), "o_proj": ((N, H), (D,)), "gate_up_proj": ((D,), (2 * F,)),
            "gate_proj": ((D,), (F,)), "up_proj": ((D,), (F,)), "down_proj": ((F,), (D,)),
            "lm_head": ((D,), (config.vocab_size,))}[name]


# Jitted, so that each leaf is built in one pass.
@functools.partial(jax.jit, static_argnums=(1, 2, 3))
@moving_bits
def _panels(w: jax.Array, lead: int, K: int, N: int) -> jax.Array:
    return cpu_kernels.to_panels(w.reshape(*w.shape[:lead], K, N))


@jax.jit
@moving_bits
def _table_panels(table_VD: jax.Array) -> jax.Array:
    return cpu_kernels.to_panels(table_VD.T)


@jax.jit
@moving_bits
def _table(panels: jax.Array) -> jax.Array:
    return cpu_kernels.from_panels(panels).T


@functools.partial(jax.jit, static_argnums=1)
@moving_bits
def _unpacked(p: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    return cpu_kernels.from_panels(p).reshape(shape)
