"""Each family's config switches, for random models that exercise what differs between families: sliding
windows that cross blocks of 4, q/k/v bias and tied embeddings, q/k norm, Gemma's scaled embedding, (1+w)
norms and GeGLU, Gemma 2's soft-capping, sandwich norms and local/global layers."""

FAMILIES = {
    "llama": dict(),
    "mistral": dict(sliding_window=6),
    "qwen2": dict(qkv_bias=True, tie_embeddings=True),
    "qwen3": dict(qk_norm=True),
    "gemma": dict(activation="gelu_tanh", norm_weight_offset=1.0, embed_scale=True, tie_embeddings=True),
    "gemma2": dict(sliding_window=5, sliding_layers=(True, False), attn_logit_softcap=20.0, final_logit_softcap=15.0,
                   sandwich_norm=True, norm_weight_offset=1.0, embed_scale=True, query_pre_attn_scalar=8.0,
                   activation="gelu_tanh"),
}
