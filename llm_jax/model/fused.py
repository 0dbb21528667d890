"""Fused projections: each layer's q/k/v weights as one matrix, and gate/up as one; and the layout
decode on CPU reads fastest (fused, then in the panels of :mod:`llm_jax.model.panels`).

Decode on CPU reads every weight once per step, and reads one wide matrix faster than several narrow
ones of the same total size: a unit of work is then one long contiguous stretch of memory instead of
several short ones, each of which the hardware prefetcher must find anew. Measured in a standalone
harness of the kernels whose decode-like steps take turns between the layouts (2 threads, medians):
15M float32 q/k/v 0.451 → 0.358 ms and gate/up 0.631 → 0.567 ms per step of 6 layers (the step 3.25 →
3.08 ms); 110M float32 q/k/v 5.63 → 4.90 ms, gate/up 8.55 → 8.20 ms per 12 layers (step 26.4 → 25.5 ms).

The fused params pytree holds, per layer stack,

    layers/attn/qkv_proj      [L, D, (N + 2K)·H]   columns: q (N·H), then k (K·H), then v (K·H)
    layers/mlp/gate_up_proj   [L, D, 2F]           columns: gate (F), then up (F)

in place of ``q_proj``/``k_proj``/``v_proj`` and ``gate_proj``/``up_proj``; the model's modules read either
layout. Without panels a group is fused only where its fused row of weights stays within what the
kernels read as whole rows (``FUSED_ROW_BYTES``, ``kFullRowBytes`` in ``cpu_kernels/matmul.cc``): the 1B
shape's bfloat16 gate/up (22 KiB rows) would be cut into column tiles, which read slower than its two
11 KiB matrices. In panels (``panels=True``, what :func:`for_inference` and ``llm_jax.load`` use where the
kernels run) every group is fused: a unit of work is a few panels, whatever the width of the matrix; and
the LM head gets its screens for greedy decoding (:mod:`llm_jax.model.greedy_head`).

Checkpoints, converters and sharding keep the separate layout: :func:`llm_jax.load` fuses where the CPU
kernels run (one CPU device), ``save_checkpoint`` and ``Model.shard`` unfuse.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp

import cpu_kernels
from llm_jax.bits import moving_bits
from llm_jax.config import ModelConfig
from llm_jax.model import greedy_head as _greedy_head
from llm_jax.model import panels as _panels

Params = dict[str, Any]

FUSED_ROW_BYTES = 16384
QKV = ("q_proj", "k_proj", "v_proj")
GATE_UP = ("gate_proj", "up_proj")


def fusion_plan(config: ModelConfig, *, panels: bool = False) -> tuple[bool, bool]:
    """(fuse q/k/v, fuse gate/up) for ``config``'s shapes and parameter dtype; with the panel layout,
    whose units are panels whatever the width of the matrix, both."""
    if panels:
        return True, True
    itemsize = jnp.dtype(config.param_jnp_dtype).itemsize
    qkv_row = (config.n_heads + 2 * config.n_kv_heads) * config.head_dim * itemsize
    return qkv_row <= FUSED_ROW_BYTES, 2 * config.d_ff * itemsize <= FUSED_ROW_BYTES


def kernels_prefer_fused() -> bool:
    """Whether products here run the CPU kernels, for which the fused layout is faster."""
    return jax.device_count() == 1 and cpu_kernels.available()


def is_fused(params: Params) -> bool:
    """Whether ``params`` are in an inference layout: a fused group (``qkv_proj`` or ``gate_up_proj``) or
    projections in the panel layout."""
    layers = params.get("layers", {})
    return ("qkv_proj" in layers.get("attn", {}) or "gate_up_proj" in layers.get("mlp", {})
            or _panels.has_panels(params))


def fuse_projections(params: Params, config: ModelConfig, *, consume: bool = False, panels: bool = False,
                     screen: bool = True) -> Params:
    """``params`` with q/k/v and gate/up fused where :func:`fusion_plan` says (a new pytree; the other
    leaves are shared), and with ``panels`` every projection it can take in the panel layout of
    :mod:`llm_jax.model.panels`, and (``screen``) the LM head's screens of
    :mod:`llm_jax.model.greedy_head`. Already fused groups stay as they are. ``consume``: the replaced
    arrays are deleted (for a caller that owns ``params`` and will not use them again)."""
    add_screen = _greedy_head.with_screen if screen else lambda params, config: _greedy_head.without_screen(params)
    if _panels.has_panels(params):
        if panels:
            return add_screen(params, config)  # already the layout asked for
        params = unfuse_projections(params, config)  # back to the plain layout first
    fuse_qkv, fuse_gate_up = fusion_plan(config, panels=panels)
    layers = dict(params["layers"])
    attn, mlp = dict(layers["attn"]), dict(layers["mlp"])
    if fuse_qkv and "q_proj" in attn:
        parts = [attn.pop(name) for name in QKV]
        attn["qkv_proj"] = _side_by_side(parts)
        if consume:  # freed now: left to the arrays' own release, the 1B shape's process grew by 1 GiB
            _panels.release(parts, attn["qkv_proj"])
    if fuse_gate_up and "gate_proj" in mlp:
        parts = [mlp.pop(name) for name in GATE_UP]
        mlp["gate_up_proj"] = _side_by_side(parts)
        if consume:
            _panels.release(parts, mlp["gate_up_proj"])
    layers["attn"], layers["mlp"] = attn, mlp
    params = {**params, "layers": layers}
    if not panels:
        return params
    return add_screen(_panels.to_panel_layout(params, config, consume=consume), config)


def unfuse_projections(params: Params, config: ModelConfig) -> Params:
    """``params`` in the separate layout of checkpoints and sharding (unchanged if not fused)."""
    params = _greedy_head.without_screen(params)
    if not is_fused(params):
        return params
    params = _panels.from_panel_layout(params, config)
    layers = dict(params["layers"])
    attn, mlp = dict(layers["attn"]), dict(layers["mlp"])
    if "qkv_proj" in attn:
        attn.update(zip(QKV, _apart(attn.pop("qkv_proj"), config)))
    if "gate_up_proj" in mlp:
        mlp.update(zip(GATE_UP, _halves(mlp.pop("gate_up_proj"))))
    layers["attn"], layers["mlp"] = attn, mlp
    return {**params, "layers": layers}


# Jitted, so that each leaf is built in one pass (eager reshapes would copy every part first: the 1B
# shape's q/k/v fused eagerly left the process 1 GiB larger, jitted 34 MiB).
@jax.jit
@moving_bits
def _side_by_side(parts: list[jax.Array]) -> jax.Array:
    """[L, D, ...] stacks → [L, D, Σ columns], the parts' columns one after another."""
    return jnp.concatenate([w.reshape(*w.shape[:2], -1) for w in parts], axis=-1)


@functools.partial(jax.jit, static_argnums=1)
@moving_bits
def _apart(qkv: jax.Array, config: ModelConfig) -> tuple[jax.Array, jax.Array, jax.Array]:
    """qkv_proj [L, D, (N + 2K)·H] → q_proj [L, D, N, H], k_proj and v_proj [L, D, K, H]."""
    heads = (config.n_heads, config.n_kv_heads, config.n_kv_heads)
    return tuple(w.reshape(*w.shape[:-1], n, config.head_dim) for w, n in zip(split_qkv(qkv, config), heads))


@jax.jit
@moving_bits
def _halves(gate_up: jax.Array) -> tuple[jax.Array, jax.Array]:
    """gate_up_proj [L, D, 2F] → gate_proj and up_proj [L, D, F]."""
    return tuple(jnp.split(gate_up, 2, axis=-1))


def split_qkv(qkv: jax.Array, config: ModelConfig) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The q, k and v parts of the last axis of ``qkv`` (N·H, K·H and K·H columns)."""
    q_cols, kv_cols = config.n_heads * config.head_dim, config.n_kv_heads * config.head_dim
    return qkv[..., :q_cols], qkv[..., q_cols:q_cols + kv_cols], qkv[..., q_cols + kv_cols:]


def for_inference(params: Params, config: ModelConfig, *, consume: bool = False, screen: bool = True) -> Params:
    """``params`` in the layout that decodes fastest here: fused and in panels, with the LM head's screens
    unless ``screen`` is False, where the CPU kernels run (``consume`` as for :func:`fuse_projections`)."""
    if not kernels_prefer_fused():
        return params
    return fuse_projections(params, config, consume=consume, panels=True, screen=screen)
