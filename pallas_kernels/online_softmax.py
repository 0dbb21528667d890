"""The online softmax on one tile: the arithmetic every attention kernel here shares.

Scores are kept in base 2 (scaled by log2 e) so the kernels use ``exp2``, which is a single
instruction on GPUs; ``m`` and the log-sum-exp are base 2 as well. The functions take and return
values, never refs, so the Triton and Mosaic kernels (which keep the state in registers and in
VMEM scratch respectively) call the same code.
"""

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

LOG2_E = math.log2(math.e)

# Finite, so a row whose keys are all masked so far has m = MASK_VALUE and exp2(m - m) = 1, not NaN;
# its probabilities are zeroed explicitly in ``update``.
MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)

_NT = (((1,), (1,)), ((), ()))  # contract the last dim of both operands: a @ b.T
_NN = (((1,), (0,)), ((), ()))  # a @ b


def matmul_precision(dtype) -> lax.Precision:
    """float32 tiles multiply in full float32 (Triton would otherwise use TF32); others natively."""
    return lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else lax.Precision.DEFAULT


def scores(q, k, *, sm_scale: float, logit_softcap: float | None):
    """Base-2 scores of q [rows, H] against k [cols, H]: float32 [rows, cols]."""
    s = lax.dot_general(
        q, k, _NT, precision=matmul_precision(q.dtype), preferred_element_type=jnp.float32
    )
    if logit_softcap is None:
        return s * (sm_scale * LOG2_E)
    # Gemma 2: cap * tanh(s * scale / cap), then into base 2.
    return (logit_softcap * LOG2_E) * jnp.tanh(s * (sm_scale / logit_softcap))


class State(NamedTuple):
    """Running statistics of one tile of rows (FlashAttention-2, Algorithm 1: m, ℓ and Õ)."""

    m: jax.Array  # [rows, 1] float32: running row max of the base-2 scores
    l: jax.Array  # [rows, 1] float32: running row sum of exp2(s - m)
    acc: jax.Array  # [rows, H] float32: unnormalised output, sum of exp2(s - m) v


def initial_state(rows: int, head_dim: int) -> State:
    return State(
        m=jnp.full((rows, 1), MASK_VALUE, jnp.float32),
        l=jnp.zeros((rows, 1), jnp.float32),
        acc=jnp.zeros((rows, head_dim), jnp.float32),
    )


def update(state: State, s, v, visible) -> State:
    """Fold one block of keys into the state: FlashAttention-2, Algorithm 1, lines 8-10.

    s: float32 [rows, cols] base-2 scores; v: [cols, H]; visible: bool [rows, cols], or None for an
    interior block where every score counts. Õ is rescaled by exp2(m_old - m_new) and never divided
    inside the loop (section 3.1.1, tweak 1).
    """
    if visible is not None:
        s = jnp.where(visible, s, MASK_VALUE)
    m_new = jnp.maximum(state.m, jnp.max(s, axis=1, keepdims=True))
    alpha = jnp.exp2(state.m - m_new)
    p = jnp.exp2(s - m_new)
    if visible is not None:
        p = jnp.where(visible, p, 0.0)
    l_new = alpha * state.l + jnp.sum(p, axis=1, keepdims=True)
    pv = lax.dot_general(
        p.astype(v.dtype), v, _NN, precision=matmul_precision(v.dtype),
        preferred_element_type=jnp.float32,
    )
    return State(m=m_new, l=l_new, acc=alpha * state.acc + pv)


def finalize(state: State, row_valid) -> jax.Array:
    """Normalised float32 output [rows, H] (Algorithm 1, line 12); rows that are not valid or saw
    no key are exactly 0."""
    keep = row_valid & (state.l > 0.0)
    return jnp.where(keep, state.acc / jnp.where(keep, state.l, 1.0), 0.0)


def log_sum_exp(state: State) -> jax.Array:
    """Base-2 log-sum-exp [rows, 1] of the scores seen (Algorithm 1, line 13); -inf if none."""
    return jnp.where(state.l > 0.0, state.m + jnp.log2(jnp.where(state.l > 0.0, state.l, 1.0)),
                     -jnp.inf)


def combine_splits(o_BKPGH: jax.Array, lse_BKPG: jax.Array) -> jax.Array:
    """Merge the P per-split normalised outputs with their base-2 log-sum-exps: o_BKGH float32.

    Flash-Decoding step 3: "reduce over all the splits ... using the log-sum-exp to scale the
    contribution of each split". Splits that saw no key (lse = -inf) weigh 0; a query no split saw
    stays 0. Plain jnp: it reads P x [N, H] floats per sequence, negligible next to the KV cache.
    """
    lse_max_BKG = jnp.max(lse_BKPG, axis=2)
    lse_max_BKG = jnp.where(jnp.isfinite(lse_max_BKG), lse_max_BKG, 0.0)
    weight_BKPG = jnp.exp2(lse_BKPG - lse_max_BKG[:, :, None])
    total_BKG = jnp.sum(weight_BKPG, axis=2)
    o_BKGH = jnp.einsum("bkpg,bkpgh->bkgh", weight_BKPG, o_BKPGH,
                        precision=lax.Precision.HIGHEST)
    return o_BKGH / jnp.where(total_BKG == 0.0, 1.0, total_BKG)[..., None]
