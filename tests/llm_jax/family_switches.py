"""Each family's config switches, for random models that exercise what differs between families: sliding
windows that cross blocks of 4, q/k/v bias and tied embeddings, q/k norm, Gemma's scaled embedding, (1+w)
norms and GeGLU, Gemma 2's soft-capping, sandwich norms and local/global layers, Gemma 3's local layers
rotating by their own RoPE base beside a scaled global one, Phi-3's LongRoPE on 6 of each head's 8 dimensions
(its original context of 128 tokens crossed by the speculative tests' 128-token generations, not by the
engine's: a prompt prefilled in chunks of 8 would rotate them by other factors than ``generate``'s whole one),
OLMo 3's norms after the sub-blocks only and q/k norms over all heads, with its local/global layers."""

import jax
import numpy as np

import llm_jax
from llm_jax.config import LinearRope, LongRope, ModelConfig, QKNormScope
from llm_jax.model import init_params

FAMILIES = {
    "llama": dict(),
    "mistral": dict(sliding_window=6),
    "qwen2": dict(qkv_bias=True, tie_embeddings=True),
    "qwen3": dict(qk_norm=True),
    "gemma": dict(activation="gelu_tanh", norm_weight_offset=1.0, embed_scale=True, tie_embeddings=True),
    "gemma2": dict(sliding_window=5, sliding_layers=(True, False), attn_logit_softcap=20.0, final_logit_softcap=15.0,
                   sandwich_norm=True, norm_weight_offset=1.0, embed_scale=True, query_pre_attn_scalar=8.0,
                   activation="gelu_tanh"),
    "gemma3": dict(sliding_window=5, sliding_layers=(True, False), sliding_rope_theta=100.0, rope_theta=50_000.0,
                   rope_scaling=LinearRope(factor=8.0), qk_norm=True, sandwich_norm=True, norm_weight_offset=1.0,
                   embed_scale=True, query_pre_attn_scalar=8.0, activation="gelu_tanh", tie_embeddings=True),
    "phi3": dict(sliding_window=7, rotary_dim=6,
                 rope_scaling=LongRope(short_factor=(1.3, 0.7, 2.5), long_factor=(4.0, 9.0, 30.0),
                                       original_max_position_embeddings=128, attention_factor=1.25)),
    "olmo3": dict(sliding_window=5, sliding_layers=(True, False), pre_norm=False, sandwich_norm=True, qk_norm=True,
                  qk_norm_scope=QKNormScope.ALL_HEADS),
}


def random_model(family: str, seed: int, scale: float = 6.0) -> llm_jax.Model:
    """A small random model of ``family`` (vocabulary 96, 2 layers), its weights scaled up so that its
    next-token distributions are peaked, its biases and norms away from their defaults."""
    config = ModelConfig(vocab_size=96, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, d_ff=48,
                         max_seq_len=256, **FAMILIES[family])
    rng = np.random.default_rng(seed)
    params = jax.tree.map(lambda a: a * scale if a.ndim > 1 else a + 0.1 * rng.normal(size=a.shape).astype(a.dtype),
                          init_params(config, seed=seed))
    return llm_jax.Model(config=config, params=params, tokenizer=None, eos_ids=())
