"""Rotary position embeddings (RoFormer, Su et al. 2021), in the rotate-halves layout of Hugging Face.

The model knows exactly one RoPE layout: dimension i of a head pairs with dimension i + H/2. Checkpoints
that pair adjacent dimensions (Meta's original Llama, llama2.c) are permuted by their converter.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np

from llm_jax.config import DefaultRope, LinearRope, Llama3Rope, RopeScaling


def inverse_frequencies(head_dim: int, theta: float, scaling: RopeScaling) -> np.ndarray:
    """The H/2 inverse frequencies, float32, scaled as the config asks (host-side constant)."""
    exponents = np.arange(0, head_dim, 2, dtype=np.float32) / np.float32(head_dim)
    inv_freq = (1.0 / (np.float32(theta) ** exponents)).astype(np.float32)
    match scaling:
        case DefaultRope():
            return inv_freq
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
    raise TypeError(f"unsupported rope scaling {scaling!r}")


def rope_angles(positions_BT: jnp.ndarray, inv_freq: np.ndarray) -> tuple[jnp.ndarray, jnp.ndarray]:
    """cos and sin of ``position * inv_freq``, each [B, T, H/2], float32."""
    angles_BTh = positions_BT.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)
    return jnp.cos(angles_BTh), jnp.sin(angles_BTh)


def apply_rope(x_BTnH: jnp.ndarray, cos_BTh: jnp.ndarray, sin_BTh: jnp.ndarray) -> jnp.ndarray:
    """Rotate each head of ``x`` ([B, T, heads, H]) by its position's angles (halves layout)."""
    half = x_BTnH.shape[-1] // 2
    x1, x2 = x_BTnH[..., :half].astype(jnp.float32), x_BTnH[..., half:].astype(jnp.float32)
    cos, sin = cos_BTh[:, :, None, :], sin_BTh[:, :, None, :]
    rotated = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return rotated.astype(x_BTnH.dtype)
