"""Named model shapes for benchmarks with random weights.

The story models are llama2.c's (``stories*``: tied classifier, theta 10000, eps 1e-5); ``1B`` is
TinyLlama-1.1B (grouped-query attention, untied head). Only the shapes matter for speed, so random
weights of the right shape stand in for the checkpoints.
"""

from __future__ import annotations

from llm_jax.config import ModelConfig

_STORIES = dict(vocab_size=32000, norm_eps=1e-5, tie_embeddings=True)

SHAPES: dict[str, ModelConfig] = {
    "260K": ModelConfig(vocab_size=512, d_model=64, n_layers=5, n_heads=8, n_kv_heads=4, head_dim=8, d_ff=172,
                        max_seq_len=512, norm_eps=1e-5, tie_embeddings=True),
    "15M": ModelConfig(d_model=288, n_layers=6, n_heads=6, n_kv_heads=6, head_dim=48, d_ff=768, max_seq_len=256,
                       **_STORIES),
    "110M": ModelConfig(d_model=768, n_layers=12, n_heads=12, n_kv_heads=12, head_dim=64, d_ff=2048,
                        max_seq_len=1024, **_STORIES),
    "1B": ModelConfig(vocab_size=32000, d_model=2048, n_layers=22, n_heads=32, n_kv_heads=4, head_dim=64,
                      d_ff=5632, max_seq_len=2048, norm_eps=1e-5, tie_embeddings=False),
}


def shape_config(name: str, *, dtype: str, n_layers: int | None = None) -> ModelConfig:
    """The config of shape ``name`` with params and activations in ``dtype`` (and optionally a different
    depth, for compile-time studies)."""
    if name not in SHAPES:
        raise ValueError(f"unknown model shape {name!r}; choose one of {', '.join(SHAPES)}")
    config = SHAPES[name].replace(param_dtype=dtype, compute_dtype=dtype)
    return config if n_layers is None else config.replace(n_layers=n_layers)
