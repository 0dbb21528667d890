"""The decoder: layers, attention and the transformer stack."""

from llm_jax.model.transformer import (LayerHooks, Params, embed, forward, forward_extend, forward_hidden,
                                       forward_prefill, init_params, param_shapes, unembed)

__all__ = ["LayerHooks", "Params", "embed", "forward", "forward_extend", "forward_hidden", "forward_prefill",
           "init_params", "param_shapes", "unembed"]
