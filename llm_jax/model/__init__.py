"""The decoder as pure functions of an explicit params pytree: layers, attention's projections, the stack."""

from llm_jax.model.layers import final_norm
from llm_jax.model.transformer import (LayerHooks, Params, embed, forward, forward_extend, forward_hidden,
                                       forward_paged, forward_prefill, greedy_tokens, init_params, param_shapes,
                                       resolve_backend, unembed)

__all__ = ["LayerHooks", "Params", "embed", "final_norm", "forward", "forward_extend", "forward_hidden",
           "forward_paged", "forward_prefill", "greedy_tokens", "init_params", "param_shapes", "resolve_backend",
           "unembed"]
