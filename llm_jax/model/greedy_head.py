"""Greedy decoding of a float32 model through a bfloat16 screen of its LM head: the same tokens, half
the head's bytes.

A greedy step needs one number per row from the LM head, the index of its largest logit, not the V
logits. The screen is the head's bfloat16 copy W̃ (in the panel layout) and every column's norm: the
logits ã = bf16(x) · W̃ cost half the float32 head's memory traffic (the head is 60 % of the 15M
shape's weights, 22 % of 110M's) and, on CPUs with bfloat16 dot products, half its arithmetic; then
only the columns that can still be the largest are computed exactly, from the float32 head.

The bound (u = 2⁻⁸, bfloat16's unit roundoff; γ_D = D · 2⁻²⁴ / (1 - D · 2⁻²⁴), float32 summation of D
terms in any order). With x̃, w̃ the rounded x and column w, and ℓ = x · w the exact real logit:

    |x̃ · w̃ − x · w| ≤ Σ_d |x̃_d w̃_d − x_d w_d| ≤ (2u + u²) Σ_d |x_d w_d|
    |ã − x̃ · w̃|    ≤ γ_D Σ_d |x̃_d w̃_d| ≤ γ_D (1 + u)² Σ_d |x_d w_d|       (the screen's float32 sums)
    |e − x · w|     ≤ γ_D Σ_d |x_d w_d|                                     (the float32 head's logit e)

so |ã − e| ≤ (2u + u² + 2.1 γ_D) Σ_d |x_d w_d| ≤ c · ‖x‖₂ · ‖w‖₂ = r (Cauchy–Schwarz), with c that
constant (:func:`bound_factor`, 1 % above it; the kernel adds 0.1 % more for its own roundings, far
beyond them since r ≥ c |ã| / 1.01). Every e lies in [ã − r, ã + r], so the largest e is at least
t = max (ã − r), and a column whose ã + r < t cannot be the largest: the kernel
(``cpu_kernels.screened_argmax``) computes exactly — in double precision — only the columns with
ã + r ≥ t, typically one to six of 32,000 (r ≈ 0.8 % of ‖x‖‖w‖, while the top logits of a trained
or a random head lie several times that apart), and returns the largest, the first on ties, as
``jnp.argmax`` does. A row with a NaN or an infinity is computed in full.

Where it applies: float32 weights in the panel layout (where the CPU kernels run), the kernels' own
products (``MatmulImpl.AUTO``), no final-logit soft-capping (Gemma 2's tanh makes distinct logits
equal), and a decode step that needs only the argmax — every row greedy, no logits processors, no
log-probabilities (:func:`llm_jax.decode.decode` checks, statically). Elsewhere the logits are
computed in full as before. The cost is memory: the screen is half the head again (18 MB for the 15M
shape, 49 MB for 110M), built by :func:`with_screen` in :func:`llm_jax.model.for_inference` and
dropped by :func:`llm_jax.model.unfuse_projections` (checkpoints never hold it).

In the params pytree the screen is ``greedy_screen/panels`` [V / 16, D, 16] (bfloat16) and
``greedy_screen/norms_V`` [V] (float32, each ≥ its column's norm).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

import cpu_kernels
from llm_jax.config import MatmulImpl, ModelConfig
from llm_jax.model.layers import PANELS_SUFFIX, RMSNorm

Params = dict[str, Any]

SCREEN = "greedy_screen"
UNIT_ROUNDOFF_BF16 = 2.0 ** -8
UNIT_ROUNDOFF_F32 = 2.0 ** -24


def bound_factor(d_model: int) -> float:
    """c of the module docstring for rows of ``d_model`` values: |screened − float32 logit| ≤ c ‖x‖‖w‖."""
    u, n = UNIT_ROUNDOFF_BF16, d_model * UNIT_ROUNDOFF_F32
    gamma = n / (1.0 - n)
    return 1.01 * (2 * u + u * u + 2.1 * gamma)


def head_panels(params: Params, config: ModelConfig) -> jax.Array | None:
    """The float32 LM head's panels [V / 16, D, 16] (an untied head's, or the tied embedding table's),
    or None where the head is not in the panel layout."""
    if config.tie_embeddings:
        return params.get("embedder", {}).get("embedding" + PANELS_SUFFIX)
    return params.get("lm_head" + PANELS_SUFFIX)


def applies(config: ModelConfig) -> bool:
    """Whether a model of ``config`` decodes greedily through the screen (given its head in panels)."""
    return (config.param_jnp_dtype == jnp.float32 and config.compute_jnp_dtype == jnp.float32
            and config.final_logit_softcap is None and config.matmul_impl == MatmulImpl.AUTO)


def has_screen(params: Params) -> bool:
    return SCREEN in params


def uses_screen(params: Params, config: ModelConfig) -> bool:
    """Whether greedy steps of ``config`` with ``params`` run through the screen (it is there, and the
    config allows it: a copy of the config for XLA's products does not)."""
    return has_screen(params) and applies(config) and cpu_kernels.available()


def with_screen(params: Params, config: ModelConfig) -> Params:
    """``params`` with the screen of their LM head added where :func:`applies` and the head is in panels
    (a new pytree; the other leaves shared); otherwise ``params``."""
    head = head_panels(params, config)
    if has_screen(params) or head is None or head.dtype != jnp.float32 or not applies(config):
        return params
    panels, norms_V = _screen(head)
    return {**params, SCREEN: {"panels": panels, "norms_V": norms_V}}


def without_screen(params: Params) -> Params:
    """``params`` without the screen (``params`` itself when there is none)."""
    return {k: v for k, v in params.items() if k != SCREEN} if has_screen(params) else params


@jax.jit
def _screen(head: jax.Array) -> tuple[jax.Array, jax.Array]:
    """bfloat16 panels and column norms [V] of float32 panels [V / 16, D, 16]; the norms are summed in
    float32 (relative error ≤ D · 2⁻²⁴) and raised by 0.1 % to stay above the exact ones."""
    norms_V = jnp.sqrt(jnp.sum(jnp.square(head), axis=1)).reshape(-1) * jnp.float32(1.001)
    return head.astype(jnp.bfloat16), norms_V


def greedy_tokens(params: Params, config: ModelConfig, x_BD: jax.Array) -> jax.Array:
    """The greedy token [B] (int32) of the last hidden states ``x_BD`` (before the final norm): the
    argmax of ``unembed``'s logits, through the screen. ``params`` must hold it (:func:`with_screen`)."""
    x_BD = RMSNorm(eps=config.norm_eps, weight_offset=config.norm_weight_offset).apply(
        {"params": params["final_norm"]}, x_BD).astype(jnp.float32)
    screen = params[SCREEN]
    with jax.named_scope("greedy_head"):
        screened_BV = cpu_kernels.matmul(x_BD, screen["panels"], panels=True)
        return cpu_kernels.screened_argmax(screened_BV, x_BD, head_panels(params, config), screen["norms_V"],
                                           bound_factor(config.d_model))
