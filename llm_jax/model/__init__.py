"""The decoder: layers, attention and the transformer stack; the fused layout of its projections."""

from llm_jax.model.transformer import (LayerHooks, Params, embed, forward, forward_extend, forward_hidden,
                                       forward_prefill, init_params, param_shapes, unembed)
from llm_jax.model.fused import for_inference, fuse_projections, is_fused, unfuse_projections

__all__ = ["LayerHooks", "Params", "embed", "for_inference", "forward", "forward_extend", "forward_hidden",
           "forward_prefill", "fuse_projections", "init_params", "is_fused", "param_shapes", "unembed",
           "unfuse_projections"]
