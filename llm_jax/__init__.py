"""llm_jax: JAX/XLA inference for decoder-only LLMs.

Dimension key, used in array names (``x_BTD``, ``k_cache_LBSKH``) and einsums throughout:

    B  batch                         T  query tokens (this call)
    S  key / cache positions         D  model width (hidden size)
    F  MLP hidden width              V  vocabulary
    N  query heads                   K  key/value heads
    G  query heads per kv head (N/K) H  head dim
    L  layers
"""
