"""Greedy steps through a screen of the LM head: the head's own argmax, reading a fraction of its bytes.

A greedy step needs one number per row from the LM head: the index of its largest logit. The screen is a
narrower copy of the head W [D, V] (in panels) with a proven bound r on how far each screened logit ã lies
from the float32 logit e that the head's own product computes. Every e lies in [ã − r, ã + r], so a column
whose ã + r is below the largest ã − r cannot win; the kernel (``cpu_kernels.screened_argmax``) computes
only the columns that can, with the same float32 arithmetic as the head's product, and returns the largest,
the first on ties: the token of the unscreened path, at a half to a quarter of its bytes.

Screens, by the rows of a step:

- **int8, up to** ``INT8_MAX_ROWS`` **rows** (memory-bound decode): q = round(w / s) per column,
  s = max |w| / 127; ã = s · (x · q).
- **int8 in quads of rows, x quantized too** (many rows, where AVX-512 VNNI runs it and AMX does not; D a
  multiple of 4 up to ``QUADS_MAX_D``): x = t n + δ per row, ã = s · t · (n · q) with exact integer sums;
  product and argmax in one call (``cpu_kernels.quads_argmax``).
- **bfloat16** (many rows elsewhere, float32 heads only): ã = bf16(x) · bf16(W), stored in pairs of rows
  where the CPU's bfloat16 dot products read them (``cpu_kernels.to_pairs``).

Which instructions run is the backend's choice, as for every product: its options ``amx``, ``bf16_dot`` and
``int8_dot`` (:class:`llm_jax.backends.CpuKernels`, each used where the CPU has it). The screens are built,
chosen and read with them, and the exact check computes the head's logits on the path the head's product
takes with them.

The bounds (u = 2⁻⁸, u₃₂ = 2⁻²⁴, γ_D = D u₃₂ / (1 − D u₃₂): float32 summation of D terms in any order;
ℓ = x · w exactly):

    |e − ℓ| ≤ γ_D Σ_d |x_d w_d|                                          (the head's float32 sums)
    bfloat16: |ã − ℓ| ≤ (2u + u²) Σ|x_d w_d| + γ_D (1 + u)² Σ|x_d w_d|
    int8:     |ã − ℓ| ≤ (s/2) ‖x‖₁ (1 + 2⁻¹²) + (γ_D + u₃₂) (Σ|x_d w_d| + (s/2) ‖x‖₁)
    quads:    |ã − ℓ| ≤ (1 + 3.01 u₃₂) (‖x‖₂ E + ‖δ‖₂ (‖w‖₂ + E)) + 3.01 u₃₂ ‖x‖₂ ‖w‖₂,  E ≥ ‖w − s q‖₂

With Σ|x_d w_d| ≤ ‖x‖₂ ‖w‖₂, |ã − e| ≤ r = c₁ ‖x‖₁ s + c₂ ‖x‖₂ ‖w‖₂, or through the quads
r = c₁ (‖x‖₂ + ‖δ‖₂) E + (c₁ ‖δ‖₂ + c₂ ‖x‖₂) ‖w‖₂; c₁, c₂ from :func:`bounds`, 1 % above the sums.

Screens apply to float32 or bfloat16 heads in panels without final-logit soft-capping (Gemma 2's tanh
makes distinct logits equal), in steps that need only the argmax (:func:`llm_jax.decoding.argmax_only`).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

import cpu_kernels
from llm_jax.backends.cpu.forms import Panels, head_panels
from llm_jax.config import ModelConfig

SCREEN = "greedy_screen"  # where the prepared weights hold the screen
UNIT_ROUNDOFF_BF16 = 2.0 ** -8
UNIT_ROUNDOFF_F32 = 2.0 ** -24
# Rows up to which the int8 screen runs: from 8 rows the products run register tiles, bound by arithmetic,
# where int8 widened to float32 is no faster than the bfloat16 screen (docs/benchmarks.md).
INT8_MAX_ROWS = 7
QUADS_MAX_D = 1024  # the widest rows the quads serve (their bound grows with D)


def _optional():
    return dataclasses.field(default=None)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, kw_only=True)
class Screen:
    """The LM head's screens, each column's scale and a bound on its norm; the many-row screen is one of
    ``int8_quads`` (with ``errors_V``), ``bfloat16_pairs`` or ``bfloat16``, or none."""

    int8: jax.Array  # [V / 16, D, 16] int8
    scales_V: jax.Array  # float32
    norms_V: jax.Array  # float32, each ≥ its column's ‖w‖₂
    int8_quads: jax.Array | None = _optional()  # the int8 screen in quads of rows (cpu_kernels.to_quads)
    errors_V: jax.Array | None = _optional()  # float32, each ≥ its column's ‖w − s q‖₂
    bfloat16_pairs: jax.Array | None = _optional()  # in pairs of rows (cpu_kernels.to_pairs)
    bfloat16: jax.Array | None = _optional()  # [V / 16, D, 16]


def bounds(d_model: int, screen: str) -> tuple[float, float]:
    """(c₁, c₂) of the module docstring for rows of ``d_model`` values through the ``"int8"``,
    ``"int8_quads"`` or ``"bfloat16"`` screen."""
    u, u32 = UNIT_ROUNDOFF_BF16, UNIT_ROUNDOFF_F32
    n = d_model * u32
    gamma = n / (1.0 - n)
    if screen == "bfloat16":
        return 0.0, 1.01 * (2 * u + u * u + 2.1 * gamma)
    if screen == "int8":
        return 1.01 * 0.5 * (1 + 2.0 ** -12) * (1 + gamma + u32), 1.01 * 2.1 * (gamma + u32)
    if screen == "int8_quads":
        return 1.01 * (1 + 3.01 * u32), 1.01 * 2 * (gamma + 3.01 * u32)
    raise ValueError(f"unknown screen {screen!r}; choose 'int8', 'int8_quads' or 'bfloat16'")


def applies(config: ModelConfig) -> bool:
    """Whether greedy steps of a model of ``config`` can read a screen (given its head in panels)."""
    return config.param_jnp_dtype in (jnp.float32, jnp.bfloat16) and config.final_logit_softcap is None


def quads_apply(d_model: int, *, int8_dot: bool = True, amx: bool = True) -> bool:
    """Whether many-row steps read the int8 screen in quads for rows of ``d_model`` values: where VNNI runs
    (``int8_dot`` and the CPU's) and AMX does not (its bfloat16 tiles read the pairs instead)."""
    return (int8_dot and cpu_kernels.quads_available() and not (amx and cpu_kernels.build.amx())
            and d_model % 4 == 0 and d_model <= QUADS_MAX_D)


def build(head: Panels, *, amx: bool = True, bf16_dot: bool = True, int8_dot: bool = True) -> Screen:
    """The screens of an LM head held as panels [V / 16, D, 16], for the instruction paths the options
    allow: in quads where :func:`quads_apply`, the bfloat16 one in pairs where the dot products run."""
    return _screens(head.data, quads_apply(head.data.shape[1], int8_dot=int8_dot, amx=amx),
                    bf16_dot and cpu_kernels.pairs_available())


def _screens(head: jax.Array, quads: bool, pairs: bool | None = None) -> Screen:
    """The screens of panels ``head``: with the int8 screen in quads when ``quads``, else (a float32 head)
    with the bfloat16 one, in pairs of rows when ``pairs`` (None: where the CPU's dot products run)."""
    pairs = cpu_kernels.pairs_available() if pairs is None else pairs
    return _built_screens(head, quads, pairs and head.shape[1] % 2 == 0)


@functools.partial(jax.jit, static_argnums=(1, 2))
def _built_screens(head: jax.Array, quads: bool, pairs: bool) -> Screen:
    # Norms are summed in float32 (relative error ≤ D · 2⁻²⁴) and raised by 0.1 % to stay above the exact
    # ones; so are the errors ‖w − s q‖₂, raised by 4 units of float32's roundoff of ‖w‖₂ for the
    # roundings of w − s q.
    w = head.astype(jnp.float32)
    norms_V = jnp.sqrt(jnp.sum(jnp.square(w), axis=1)).reshape(-1) * jnp.float32(1.001)
    scales_P16 = jnp.max(jnp.abs(w), axis=1) / jnp.float32(127)
    safe = jnp.where(scales_P16 > 0, scales_P16, jnp.float32(1))
    int8 = jnp.clip(jnp.round(w / safe[:, None, :]), -127, 127).astype(jnp.int8)
    screen = Screen(int8=int8, scales_V=scales_P16.reshape(-1), norms_V=norms_V)
    if quads:
        delta = w - scales_P16[:, None, :] * int8.astype(jnp.float32)
        errors_V = jnp.sqrt(jnp.sum(jnp.square(delta), axis=1)).reshape(-1) * jnp.float32(1.001)
        return dataclasses.replace(screen, int8_quads=cpu_kernels.to_quads(int8),
                                   errors_V=errors_V + jnp.float32(2.0 ** -22) * norms_V)
    if head.dtype == jnp.float32:
        bf16 = head.astype(jnp.bfloat16)
        if pairs:
            return dataclasses.replace(screen, bfloat16_pairs=cpu_kernels.to_pairs(bf16))
        return dataclasses.replace(screen, bfloat16=bf16)
    return screen


def screen_for(screen: Screen, rows: int, *, int8_dot: bool = True) -> str | None:
    """Which screen a greedy step of ``rows`` rows reads (the quads where ``int8_dot`` and the CPU run
    them), or None where it computes every logit."""
    if rows <= INT8_MAX_ROWS:
        return "int8"
    if screen.int8_quads is not None and int8_dot and cpu_kernels.quads_available():
        return "int8_quads"
    if screen.bfloat16_pairs is not None or screen.bfloat16 is not None:
        return "bfloat16"
    return None


def greedy_tokens(weights: dict, config: ModelConfig, x_BD: jax.Array, *, amx: bool = True, bf16_dot: bool = True,
                  int8_dot: bool = True) -> jax.Array | None:
    """The greedy token [B] (int32) of final-normed hidden states ``x_BD`` through the screen of the
    prepared ``weights``, the token of the head's product on the instruction paths the options allow;
    None where there is no screen or none serves B rows."""
    screen, head = weights.get(SCREEN), head_panels(weights, config)
    if screen is None or head is None or not applies(config):
        return None
    which = screen_for(screen, x_BD.shape[0], int8_dot=int8_dot)
    if which is None:
        return None
    x_BD = x_BD.astype(head.dtype).astype(jnp.float32)  # as the head's product rounds it
    c1, c2 = bounds(config.d_model, which)
    paths = dict(amx=amx, bf16_dot=bf16_dot)
    with jax.named_scope("greedy_head"):
        if which == "int8_quads":
            return cpu_kernels.quads_argmax(x_BD, screen.int8_quads, head.data, screen.scales_V, screen.errors_V,
                                            screen.norms_V, c1, c2, int8_dot=int8_dot, **paths)
        if which == "int8":
            screened_BV = cpu_kernels.matmul(x_BD, screen.int8, panels=True, **paths)
            return cpu_kernels.screened_argmax(screened_BV, x_BD, head.data, screen.scales_V, screen.norms_V, c1, c2,
                                               **paths)
        paired = screen.bfloat16_pairs is not None
        screened_BV = cpu_kernels.matmul(x_BD, screen.bfloat16_pairs if paired else screen.bfloat16, panels=True,
                                         pairs=paired, **paths)
        return cpu_kernels.screened_argmax(screened_BV, x_BD, head.data, None, screen.norms_V, c1, c2, **paths)
