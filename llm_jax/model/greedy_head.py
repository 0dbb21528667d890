"""Greedy decoding through a screen of the LM head: the same tokens, a half to a quarter of the head's
bytes.

A greedy step needs one number per row from the LM head, the index of its largest logit, not the V
logits. The screen is a narrower copy of the head W [D, V] (in the panel layout) with a bound on its
error per column: the screened logits ã cost less memory traffic than W's (the head is 60 % of the 15M
shape's weights, 22 % of 110M's), and then only the columns that can still be the largest are computed
exactly, from W itself, so the token is W's own.

Two screens, by the rows of a step (``INT8_MAX_ROWS``):

- **int8, few rows** (batch-1 decode, memory-bound): q = round(w / s) per column, s = max |w| / 127; a
  quarter of a float32 head's bytes, half of a bfloat16 one's. ã = s · (x · q).
- **many rows** (batched decode, bound by arithmetic):
  - **int8 in quads of rows, x quantized too**, where AVX-512 VNNI runs it and AMX does not, for heads of
    either dtype with D a multiple of 4 up to ``QUADS_MAX_D``: x = t n + δ per row (n int8, t = max |x| /
    127, ``cpu_kernels.quantize_rows``), ã = s · t · (n · q) with exact integer sums, on vpdpbusd: twice
    the multiply-adds of bfloat16's dot products and half their bytes. Its bound grows with D faster than
    the others' (through ‖δ‖₂), and so do the columns computed exactly: 15M's [32000, 288] greedy head at
    32 rows (screen, then argmax; calls taking turns, paired medians of 30, Zen 4) 0.71× the time of the
    bfloat16 screen (0.74× the time of a bfloat16 head's full logits), 110M's [32000, 768] 0.91×, and
    TinyLlama's [32000, 2048] 2.97× (2.10× for bfloat16; ≈ 190 columns a row to compute exactly).
  - **bfloat16** elsewhere (float32 heads only): ã = bf16(x) · bf16(W), on the bfloat16 dot products that
    double the arithmetic where the CPU has them.

The bounds (u = 2⁻⁸, bfloat16's unit roundoff; u₃₂ = 2⁻²⁴; γ_D = D u₃₂ / (1 − D u₃₂), float32
summation of D terms in any order; e the logit the head's own product gives, ℓ = x · w its exact value,
x the row the head's product sees: a bfloat16 head's is x rounded to bfloat16):

    |e − ℓ| ≤ γ_D Σ_d |x_d w_d|                                          (the head's float32 sums)
    bfloat16: |ã − ℓ| ≤ (2u + u²) Σ|x_d w_d| + γ_D (1 + u)² Σ|x_d w_d|   (rounding x and w, then summing)
    int8:     |s·q_d − w_d| ≤ s / 2 (1 + 2⁻¹²) (w / s is rounded before it is rounded to an
              integer: 127 · a few units of 2⁻²⁴ at most), so
              |ã − ℓ| ≤ (s/2) ‖x‖₁ (1 + 2⁻¹²) + (γ_D + u₃₂) (Σ|x_d w_d| + (s/2) ‖x‖₁)
    quads:    ℓ − s t (n · q) = x · (w − s q) + s q · δ exactly, each bounded by Cauchy–Schwarz with
              E ≥ ‖w − s q‖₂ stored per column (and ‖s q‖₂ ≤ ‖w‖₂ + E); three roundings make ã from
              the exact integer sum, so
              |ã − ℓ| ≤ (1 + 3.01 u₃₂) (‖x‖₂ E + ‖δ‖₂ (‖w‖₂ + E)) + 3.01 u₃₂ ‖x‖₂ ‖w‖₂

With Σ|x_d w_d| ≤ ‖x‖₂ ‖w‖₂ (Cauchy–Schwarz), |ã − e| ≤ r = c₁ ‖x‖₁ s + c₂ ‖x‖₂ ‖w‖₂, or, through the
quads, r = c₁ (‖x‖₂ + ‖δ‖₂) E + (c₁ ‖δ‖₂ + c₂ ‖x‖₂) ‖w‖₂ (the kernel quantizes x again, as the product
did, for ‖δ‖₂), c₁ and c₂ from :func:`bounds` (1 % above the sums of the terms; the kernel adds 0.1 % more
for its own roundings, far beyond them since r is at least 0.4 % of |ã|). Every e lies in [ã − r, ã + r], so the largest e is at
least t = max (ã − r), and a column whose ã + r < t cannot be the largest: the kernel
(``cpu_kernels.screened_argmax``) computes exactly — in double precision — only the columns with
ã + r ≥ t (typically one to six of 32,000 through bfloat16, a few more through int8, 5–30 through the
quads at D = 288–768) and returns the
largest, the first on ties, as ``jnp.argmax`` does. A row with a NaN or an infinity is computed in full.
Through the quads the product and the argmax are one call (``cpu_kernels.quads_argmax``): each unit of
columns is bounded as the product finishes it, and the screened logits [B, V] never go through memory
(15M float32 decode at 32 rows, the two forms' programs taking turns in one process: 1.12× the speed,
tokens identical).

Where it applies: float32 or bfloat16 weights in the panel layout (where the CPU kernels run), the
kernels' own products (``MatmulImpl.AUTO``), no final-logit soft-capping (Gemma 2's tanh makes distinct
logits equal), and a decode step that needs only the argmax — every row greedy, no logits processors, no
log-probabilities (:func:`llm_jax.decode.decode` checks, statically). Elsewhere, and for a bfloat16 head
at many rows without the quads, the logits are computed in full as before. The cost is memory: the
screens are 0.75 of a float32 head again (28 MB for the 15M shape, 74 MB for 110M) with the bfloat16
screen, 0.5 with the quads; 0.5 or 1 of a bfloat16 one, built by
:func:`with_screen` in :func:`llm_jax.model.for_inference` and dropped by
:func:`llm_jax.model.unfuse_projections` (checkpoints never hold them).

In the params pytree: ``greedy_screen/int8`` [V / 16, D, 16] (int8), ``greedy_screen/scales_V`` and
``greedy_screen/norms_V`` [V] (float32; each norm ≥ its column's), and for a float32 head
``greedy_screen/bfloat16`` [V / 16, D, 16] — or, where the CPU's bfloat16 dot products run
(``cpu_kernels.pairs_available()``, D even), the same in pairs of rows as they read it,
``greedy_screen/bfloat16_pairs``: no rearranging per step (the screen's product alone, calls taking
turns, paired medians of 30: 15M's [32000, 288] 0.85–0.87× the time of rearranging it at 32 rows, 0.70×
at 8; 110M's [32000, 768] 0.87–0.88× and 0.75×). Where AMX runs too, products of 32 rows and more read
the pairs straight into its tiles (15M's screen at 32 rows on a Xeon with AMX: 0.71–0.87× the time of the
panel layout, with the next unit's panels read ahead). Where the quads are built (:func:`quads_apply`),
``greedy_screen/int8_quads`` (the int8 screen in quads of rows, ``cpu_kernels.to_quads``) and
``greedy_screen/errors_V`` [V] (float32, each ≥ its column's ‖w − s q‖₂) take the bfloat16 screen's place.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp

import cpu_kernels
from llm_jax.config import MatmulImpl, ModelConfig
from llm_jax.model.layers import PANELS_SUFFIX, final_norm

Params = dict[str, Any]

SCREEN = "greedy_screen"
PAIRED = "bfloat16_pairs"  # the bfloat16 screen in pairs of rows (cpu_kernels.to_pairs), where they run
QUADS = "int8_quads"  # the int8 screen in quads of rows (cpu_kernels.to_quads), where VNNI runs them
UNIT_ROUNDOFF_BF16 = 2.0 ** -8
UNIT_ROUNDOFF_F32 = 2.0 ** -24
# Rows up to which the int8 screen runs (the products' register tiles start at 8 rows, where they are
# bound by arithmetic: int8 widened there is no faster than bfloat16, and slower than its dot products).
# LM head alone, 2 threads, Zen 3: 1 row 0.32 (int8) / 0.53 (bfloat16) / 1.17 (float32) ms for 15M,
# 1.07 / 2.05 / 4.09 ms for 110M; 4 rows 0.71 / 1.05 / 1.90 and 2.30 / 3.47 / 5.72 ms; 32 rows the same
# within 4 %.
INT8_MAX_ROWS = 7
# The widest rows the int8 screen in quads serves (its bound grows with D; see the module docstring).
QUADS_MAX_D = 1024


def bounds(d_model: int, screen: str) -> tuple[float, float]:
    """(c₁, c₂) of the module docstring for rows of ``d_model`` values through the ``"int8"`` or the
    ``"bfloat16"`` screen: |screened − head's logit| ≤ c₁ ‖x‖₁ s + c₂ ‖x‖₂ ‖w‖₂."""
    u, u32 = UNIT_ROUNDOFF_BF16, UNIT_ROUNDOFF_F32
    n = d_model * u32
    gamma = n / (1.0 - n)
    if screen == "bfloat16":
        return 0.0, 1.01 * (2 * u + u * u + 2.1 * gamma)
    if screen == "int8":
        return 1.01 * 0.5 * (1 + 2.0 ** -12) * (1 + gamma + u32), 1.01 * 2.1 * (gamma + u32)
    if screen == QUADS:
        return 1.01 * (1 + 3.01 * u32), 1.01 * 2 * (gamma + 3.01 * u32)
    raise ValueError(f"unknown screen {screen!r}")


def head_panels(params: Params, config: ModelConfig) -> jax.Array | None:
    """The LM head's panels [V / 16, D, 16] (an untied head's, or the tied embedding table's), or None
    where the head is not in the panel layout."""
    if config.tie_embeddings:
        return params.get("embedder", {}).get("embedding" + PANELS_SUFFIX)
    return params.get("lm_head" + PANELS_SUFFIX)


def applies(config: ModelConfig) -> bool:
    """Whether a model of ``config`` decodes greedily through a screen (given its head in panels)."""
    return (config.param_jnp_dtype in (jnp.float32, jnp.bfloat16) and config.final_logit_softcap is None
            and config.matmul_impl == MatmulImpl.AUTO)


def has_screen(params: Params) -> bool:
    return SCREEN in params


def with_screen(params: Params, config: ModelConfig) -> Params:
    """``params`` with the screens of their LM head added where :func:`applies` and the head is in panels
    (a new pytree; the other leaves shared); otherwise ``params``."""
    head = head_panels(params, config)
    if has_screen(params) or head is None or head.dtype not in (jnp.float32, jnp.bfloat16) or not applies(config):
        return params
    return {**params, SCREEN: _screens(head, quads_apply(head.shape[1]))}


def quads_apply(d_model: int) -> bool:
    """Whether greedy steps of many rows read the int8 screen in quads for rows of ``d_model`` values: AVX-512
    VNNI runs it (``cpu_kernels.quads_available()``) and AMX does not run the bfloat16 screen instead,
    ``d_model`` a multiple of 4 up to ``QUADS_MAX_D``."""
    return (cpu_kernels.quads_available() and not cpu_kernels.build.amx() and d_model % 4 == 0
            and d_model <= QUADS_MAX_D)


def without_screen(params: Params) -> Params:
    """``params`` without the screens (``params`` itself when there are none)."""
    return {k: v for k, v in params.items() if k != SCREEN} if has_screen(params) else params


@functools.partial(jax.jit, static_argnums=1)
def _screens(head: jax.Array, quads: bool) -> dict[str, jax.Array]:
    """The screens of panels [V / 16, D, 16] (with ``quads``, the int8 one in quads of rows too, instead of
    a bfloat16 one). Norms are summed in float32 (relative error ≤ D · 2⁻²⁴) and raised by 0.1 % to stay
    above the exact ones; so are the errors ‖w − s q‖₂, raised by 4 units of float32's roundoff of ‖w‖₂
    more for the roundings of w − s q."""
    w = head.astype(jnp.float32)
    norms_V = jnp.sqrt(jnp.sum(jnp.square(w), axis=1)).reshape(-1) * jnp.float32(1.001)
    scales_P16 = jnp.max(jnp.abs(w), axis=1) / jnp.float32(127)
    safe = jnp.where(scales_P16 > 0, scales_P16, jnp.float32(1))
    int8 = jnp.clip(jnp.round(w / safe[:, None, :]), -127, 127).astype(jnp.int8)
    screens = {"int8": int8, "scales_V": scales_P16.reshape(-1), "norms_V": norms_V}
    if quads:
        delta = w - scales_P16[:, None, :] * int8.astype(jnp.float32)
        errors_V = jnp.sqrt(jnp.sum(jnp.square(delta), axis=1)).reshape(-1) * jnp.float32(1.001)
        screens[QUADS] = cpu_kernels.to_quads(int8)
        screens["errors_V"] = errors_V + jnp.float32(2.0 ** -22) * norms_V
    elif head.dtype == jnp.float32:
        screen = head.astype(jnp.bfloat16)
        if cpu_kernels.pairs_available() and head.shape[1] % 2 == 0:  # as the dot products read it
            screens[PAIRED] = cpu_kernels.to_pairs(screen)
        else:
            screens["bfloat16"] = screen
    return screens


def screen_for(params: Params, config: ModelConfig, rows: int) -> str | None:
    """The screen a greedy step of ``rows`` rows reads (``"int8"`` or ``"bfloat16"``), or None where it
    computes every logit (no screen, or a bfloat16 head at many rows)."""
    if not (has_screen(params) and applies(config) and cpu_kernels.available()):
        return None
    if rows <= INT8_MAX_ROWS:
        return "int8"
    if QUADS in params[SCREEN] and cpu_kernels.quads_available():
        return QUADS
    return "bfloat16" if {"bfloat16", PAIRED} & params[SCREEN].keys() else None


def greedy_tokens(params: Params, config: ModelConfig, x_BD: jax.Array) -> jax.Array | None:
    """The greedy token [B] (int32) of the last hidden states ``x_BD`` (before the final norm) — the argmax
    of ``unembed``'s logits — through the screen :func:`screen_for` names; None where it names none."""
    screen = screen_for(params, config, x_BD.shape[0])
    if screen is None:
        return None
    x_BD = final_norm(params, config, x_BD)
    head, screens = head_panels(params, config), params[SCREEN]
    x_BD = x_BD.astype(head.dtype).astype(jnp.float32)  # as the head's product rounds it
    c1, c2 = bounds(config.d_model, screen)
    with jax.named_scope("greedy_head"):
        if screen == QUADS:  # the product and the argmax in one call
            return cpu_kernels.quads_argmax(x_BD, screens[QUADS], head, screens["scales_V"], screens["errors_V"],
                                            screens["norms_V"], c1, c2)
        paired = screen == "bfloat16" and PAIRED in screens
        screened_BV = cpu_kernels.matmul(x_BD, screens[PAIRED if paired else screen], panels=True, pairs=paired)
        scales_V = screens["scales_V"] if screen == "int8" else None
        return cpu_kernels.screened_argmax(screened_BV, x_BD, head, scales_V, screens["norms_V"], c1, c2)
