"""Rotary position embeddings (RoFormer, Su et al. 2021), in the rotate-halves layout of Hugging Face.

The model knows exactly one RoPE layout: dimension i of a head pairs with dimension i + R/2, where R is the
rotary dimension count (``ModelConfig.rope_dim``: the head dim H, or its leading part for partial rotary
embeddings, whose other H - R dimensions pass through). Checkpoints that pair adjacent dimensions (Meta's
original Llama, llama2.c) are permuted by their converter.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np

from llm_jax.config import DefaultRope, LinearRope, Llama3Rope, LongRope, RopeScaling, YarnRope


def inverse_frequencies(rope_dim: int, theta: float, scaling: RopeScaling, *, long: bool = False) -> np.ndarray:
    """The R/2 inverse frequencies of ``rope_dim`` (R) rotating dimensions, float32, scaled as the config asks
    (host-side constant); of LongRoPE, its long set when ``long``, else its short one."""
    exponents = np.arange(0, rope_dim, 2, dtype=np.float32) / np.float32(rope_dim)
    inv_freq = (1.0 / (np.float32(theta) ** exponents)).astype(np.float32)
    match scaling:
        case DefaultRope():
            return inv_freq
        case LongRope(short_factor=short, long_factor=long_factor):
            # transformers: 1 / (factor * theta ** exponent), the product and the quotient in float32
            factors = np.asarray(long_factor if long else short, np.float32)
            return (np.float32(1.0) / (factors * (np.float32(theta) ** exponents))).astype(np.float32)
        case LinearRope(factor=factor):
            return (inv_freq / np.float32(factor)).astype(np.float32)
        case Llama3Rope(factor=factor, low_freq_factor=lo, high_freq_factor=hi,
                        original_max_position_embeddings=orig):
            # Llama 3.1 (Meta's apply_scaling): long wavelengths are divided by `factor`, short ones kept,
            # and the band between is interpolated smoothly.
            low_freq_wavelen = orig / lo
            high_freq_wavelen = orig / hi
            wavelen = 2 * math.pi / inv_freq
            scaled = np.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
            smooth = (orig / wavelen - lo) / (hi - lo)
            smoothed = (1 - smooth) * scaled / factor + smooth * scaled
            is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
            return np.where(is_medium, smoothed, scaled).astype(np.float32)
        case YarnRope():
            return _yarn_inverse_frequencies(rope_dim, theta, scaling)
    raise TypeError(f"unsupported rope scaling {scaling!r}")


def _yarn_inverse_frequencies(rope_dim: int, theta: float, yarn: YarnRope) -> np.ndarray:
    """YaRN's blend (§3.2): frequency i is kept (extrapolated) where it turns more than ``beta_fast`` times over
    the original context, divided by ``factor`` (interpolated) where it turns fewer than ``beta_slow`` times,
    and mixed linearly over the rotary dimensions between. In float32 as transformers computes it, the
    correction range in float64."""

    def correction_dim(turns: float) -> float:  # the dimension whose frequency turns `turns` times over orig
        return rope_dim * math.log(yarn.original_max_position_embeddings / (turns * 2 * math.pi)) / (
            2 * math.log(theta))

    low, high = correction_dim(yarn.beta_fast), correction_dim(yarn.beta_slow)
    if yarn.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rope_dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    ramp = np.clip((np.arange(rope_dim // 2, dtype=np.float32) - np.float32(low)) / np.float32(high - low), 0, 1)
    extrapolated = (np.float32(1) - ramp).astype(np.float32)  # 1: the frequency kept, 0: divided by factor
    pos_freqs = np.float32(theta) ** (np.arange(0, rope_dim, 2, dtype=np.float32) / np.float32(rope_dim))
    kept = np.float32(1) / pos_freqs
    interpolated = np.float32(1) / (np.float32(yarn.factor) * pos_freqs)
    return (interpolated * (np.float32(1) - extrapolated) + kept * extrapolated).astype(np.float32)


def rope_angles(positions_BT: jnp.ndarray, inv_freq: np.ndarray | jnp.ndarray) -> tuple[jnp.ndarray, jnp.ndarray]:
    """cos and sin of ``position * inv_freq``, each [B, T, R/2], float32 (``inv_freq`` [R/2], or each
    token's [B, T, R/2])."""
    angles_BTh = positions_BT.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)
    return jnp.cos(angles_BTh), jnp.sin(angles_BTh)


def rotary_cos_sin(positions_BT: jnp.ndarray, seq_lens_BT: jnp.ndarray | None, rope_dim: int, theta: float,
                   scaling: RopeScaling) -> tuple[jnp.ndarray, jnp.ndarray]:
    """cos and sin [B, T, R/2] (float32) that rotate each token at ``positions_BT``.

    LongRoPE picks each token's factor set by ``seq_lens_BT``, the length of its sequence (as the forward
    function counts it: a whole prompt's, or a decoded token's position + 1): the long set where that exceeds
    ``original_max_position_embeddings`` (transformers' rule, ``max(position_ids) + 1`` against it; None: each
    row's last position + 1, which is that where no padding follows); both are scaled by its attention factor.
    YaRN's cos and sin are scaled by its own (``YarnRope.cos_sin_scale``). Other scalings do not read
    ``seq_lens_BT``.
    """
    if isinstance(scaling, YarnRope):  # transformers scales cos and sin, not the attention logits
        cos_BTh, sin_BTh = rope_angles(positions_BT, inverse_frequencies(rope_dim, theta, scaling))
        factor = jnp.float32(scaling.cos_sin_scale)
        return cos_BTh * factor, sin_BTh * factor
    if not isinstance(scaling, LongRope):
        return rope_angles(positions_BT, inverse_frequencies(rope_dim, theta, scaling))
    if seq_lens_BT is None:
        seq_lens_BT = jnp.broadcast_to(jnp.max(positions_BT, axis=-1, keepdims=True) + 1, positions_BT.shape)
    short_h = inverse_frequencies(rope_dim, theta, scaling)
    long_h = inverse_frequencies(rope_dim, theta, scaling, long=True)
    is_long_BT1 = (seq_lens_BT > scaling.original_max_position_embeddings)[..., None]
    cos_BTh, sin_BTh = rope_angles(positions_BT, jnp.where(is_long_BT1, long_h, short_h))
    factor = jnp.float32(scaling.attention_factor)
    return cos_BTh * factor, sin_BTh * factor


def apply_rope(x_BTnH: jnp.ndarray, cos_BTh: jnp.ndarray, sin_BTh: jnp.ndarray) -> jnp.ndarray:
    """Rotate each head of ``x`` ([B, T, heads, H]) by its position's angles (halves layout): its first
    R = 2 · ``cos_BTh.shape[-1]`` dimensions, the others passing through (partial rotary embeddings)."""
    half = cos_BTh.shape[-1]
    x1, x2 = x_BTnH[..., :half].astype(jnp.float32), x_BTnH[..., half:2 * half].astype(jnp.float32)
    cos, sin = cos_BTh[:, :, None, :], sin_BTh[:, :, None, :]
    rotated = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x_BTnH.dtype)
    if 2 * half == x_BTnH.shape[-1]:
        return rotated
    return jnp.concatenate([rotated, x_BTnH[..., 2 * half:]], axis=-1)
