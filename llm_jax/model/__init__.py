"""The decoder: layers, attention and the transformer stack."""

from llm_jax.model.transformer import (Params, embed, forward, forward_extend, forward_prefill, init_params,
                                       param_shapes, unembed)

__all__ = ["Params", "embed", "forward", "forward_extend", "forward_prefill", "init_params", "param_shapes",
           "unembed"]
