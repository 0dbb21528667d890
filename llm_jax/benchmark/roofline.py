"""The memory roofline of decode: bytes one step must read, and the token rate bandwidth allows.

A decode step of a batch reads every weight once (the LM head included; of the embedding table only
the B rows looked up) and, for attention, the keys and values of every cached token. Nothing can be
faster than reading those bytes at the machine's bandwidth, so ``B × bandwidth ÷ bytes`` bounds
tokens/s from above, however well the step is written.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from llm_jax.config import ModelConfig
from llm_jax.kv_cache import cache_bytes_per_token


def weight_bytes_per_step(config: ModelConfig, batch: int) -> int:
    """Bytes of parameters one decode step reads."""
    itemsize = jnp.dtype(config.param_dtype).itemsize
    embedding = config.vocab_size * config.d_model
    read = config.num_params() - embedding + batch * config.d_model
    if config.tie_embeddings:  # the table is the LM head, read whole
        read += embedding
    return read * itemsize


@dataclasses.dataclass(frozen=True, kw_only=True)
class Roofline:
    weight_bytes: int  # per step
    kv_bytes: int  # per step, averaged over the decode
    tokens_per_s: float  # batch × bandwidth ÷ bytes per step

    @property
    def bytes_per_step(self) -> int:
        return self.weight_bytes + self.kv_bytes


def decode_roofline(config: ModelConfig, *, batch: int, prompt_len: int, new_tokens: int,
                    bandwidth_gbps: float) -> Roofline:
    """Roofline of decoding ``new_tokens`` after a ``prompt_len`` prompt, for ``batch`` sequences.

    The KV term counts the tokens actually in context (on average ``prompt_len + new_tokens / 2``), not
    the slots a bucketed cache allocates: the bound is on what the computation needs.
    """
    weights = weight_bytes_per_step(config, batch)
    mean_context = prompt_len + new_tokens / 2
    kv = int(batch * mean_context * cache_bytes_per_token(config))
    return Roofline(weight_bytes=weights, kv_bytes=kv,
                    tokens_per_s=batch * bandwidth_gbps * 1e9 / (weights + kv))
