"""The rooflines of decode: bytes one step must read and the arithmetic it must do, and the token rates
memory bandwidth and the arithmetic peak allow.

A decode step of a batch reads every weight once (the LM head included; of the embedding table only
the B rows looked up) and, for attention, the keys and values of every cached token. Nothing can be
faster than reading those bytes at the machine's bandwidth, so ``B × bandwidth ÷ bytes`` bounds
tokens/s from above, however well the step is written. That bound binds at batch 1; with many rows each
weight does B multiply-adds per read, and the arithmetic binds instead: 2 flops per weight and row for
the matrix products, 4 per cached key, query head and head dimension for attention (q·k and p·v), at the
measured peak of the arithmetic the kernels use (:func:`compute_roofline`).

With a ``screen`` (greedy decoding through a screen of the LM head, :mod:`llm_jax.backends.cpu.greedy_head`)
the head counts as what that step reads and computes: its int8 copy (1 byte a weight, and a scale and a
norm per column) at the float32 peak, its bfloat16 copy (2 bytes a weight, and a norm per column) at
the bfloat16 peak, or its int8 copy in quads (1 byte a weight, and a scale, a norm and an error per
column) at the int8 peak; the few columns then computed exactly from the head (one line per row of D
each) are not counted: how many depends on the logits.
"""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp

from llm_jax.config import PROJECTION_NAMES, ModelConfig
from llm_jax.kv_cache import cache_bytes_per_token
from llm_jax.quantization import projection_dims


def weight_bytes_per_step(config: ModelConfig, batch: int, *, screen: str | None = None) -> int:
    """Bytes of parameters one decode step reads (with ``screen``, ``"int8"``, ``"bfloat16"`` or
    ``"int8_quads"``, the LM head's screen instead of the head)."""
    itemsize = jnp.dtype(config.param_dtype).itemsize
    embedding = config.vocab_size * config.d_model
    read = config.num_params() - embedding + batch * config.d_model
    if config.tie_embeddings:  # the table is the LM head, read whole
        read += embedding
    quantized = 0
    if config.quantization is not None:  # the projections (and a quantized head) as integers, scales, offsets
        for name in PROJECTION_NAMES:
            scheme = config.quantization.scheme(name)
            if scheme is None:  # kept in floats
                continue
            ins, outs = projection_dims(name, config)
            K, count = math.prod(ins), config.n_layers * math.prod(ins) * math.prod(outs)
            read -= count
            quantized += _quantized_bytes(count, K, scheme)
        head = config.quantization.embedding if config.tie_embeddings else config.quantization.lm_head
        if head is not None:  # the LM head as integers (no screen then)
            read -= embedding
            quantized += _quantized_bytes(embedding, config.d_model, head)
    if screen is None:
        return read * itemsize + quantized
    per_weight, per_column = SCREEN_BYTES[screen]
    return (read - embedding) * itemsize + quantized + embedding * per_weight + config.vocab_size * per_column


def _quantized_bytes(count: int, K: int, scheme) -> int:
    """Bytes of ``count`` weights held in ``scheme`` with ``K`` inputs per output: integers, float32 scales
    (and offsets) per group."""
    groups_per_input = math.ceil(K / (scheme.group_size or K)) / K
    return count * scheme.bits // 8 + round(count * groups_per_input * 4 * (1 + scheme.offsets))


# Bytes a screen reads per weight of the head and per column (scales, norms).
SCREEN_BYTES = {"int8": (1, 8), "bfloat16": (2, 4), "int8_quads": (1, 12)}
# Screens whose products run on dot products of their own (at head_peak's peak, not the weights' dtype's).
DOT_SCREENS = ("bfloat16", "int8_quads")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Roofline:
    weight_bytes: int  # per step
    kv_bytes: int  # per step, averaged over the decode
    tokens_per_s: float  # batch × bandwidth ÷ bytes per step

    @property
    def bytes_per_step(self) -> int:
        return self.weight_bytes + self.kv_bytes


def decode_roofline(config: ModelConfig, *, batch: int, prompt_len: int, new_tokens: int,
                    bandwidth_gbps: float, screen: str | None = None, kv_cache_dtype: str | None = None) -> Roofline:
    """Roofline of decoding ``new_tokens`` after a ``prompt_len`` prompt, for ``batch`` sequences
    (``screen``: the LM head read through that screen), over a KV cache of ``kv_cache_dtype``.

    The KV term counts the tokens actually in context (on average ``prompt_len + new_tokens / 2``), not
    the slots a bucketed cache allocates: the bound is on what the computation needs.
    """
    weights = weight_bytes_per_step(config, batch, screen=screen)
    mean_context = prompt_len + new_tokens / 2
    kv = int(batch * mean_context * cache_bytes_per_token(config, kv_cache_dtype))
    return Roofline(weight_bytes=weights, kv_bytes=kv,
                    tokens_per_s=batch * bandwidth_gbps * 1e9 / (weights + kv))


def product_weights(config: ModelConfig) -> int:
    """Weights one row's matrix products multiply in a step: every projection and the LM head (not the
    embedding table's lookup, nor norm scales and biases)."""
    D, F, H = config.d_model, config.d_ff, config.head_dim
    per_layer = D * H * (config.n_heads + 2 * config.n_kv_heads) + config.n_heads * H * D + 3 * D * F
    return config.n_layers * per_layer + config.vocab_size * D


@dataclasses.dataclass(frozen=True, kw_only=True)
class ComputeRoofline:
    product_flops: int  # per step: the matrix products
    attention_flops: int  # per step, averaged over the decode
    screened_head_flops: int  # of product_flops, the LM head's through a screen of DOT_SCREENS (else 0)
    tokens_per_s: float  # batch ÷ the time both take at the peaks

    @property
    def flops_per_step(self) -> int:
        return self.product_flops + self.attention_flops


def compute_roofline(config: ModelConfig, *, batch: int, prompt_len: int, new_tokens: int,
                     product_gflops: float, attention_gflops: float, head_gflops: float | None = None,
                     screen: str | None = None) -> ComputeRoofline:
    """The arithmetic bound on decoding ``new_tokens`` after a ``prompt_len`` prompt, for ``batch``
    sequences: the matrix products at ``product_gflops`` (the peak of the weights' dtype: bfloat16 dot
    products where the CPU has them) and attention, in float32, at ``attention_gflops``. Its context is
    counted as :func:`decode_roofline` counts it. Through the ``"bfloat16"`` or ``"int8_quads"`` screen the
    LM head's products run at ``head_gflops`` (:func:`head_peak`) instead; through ``"int8"``'s, widened,
    at the float32 one."""
    mean_context = prompt_len + new_tokens / 2
    products = 2 * batch * product_weights(config)
    attention = int(4 * batch * mean_context * config.n_layers * config.n_heads * config.head_dim)
    head = 2 * batch * config.vocab_size * config.d_model if screen in DOT_SCREENS else 0
    seconds = arithmetic_seconds(products, attention, product_gflops, attention_gflops, head_flops=head,
                                 head_gflops=head_gflops)
    return ComputeRoofline(product_flops=products, attention_flops=attention, screened_head_flops=head,
                           tokens_per_s=batch / seconds)


def arithmetic_seconds(product_flops: int, attention_flops: int, product_gflops: float,
                       attention_gflops: float, *, head_flops: int = 0, head_gflops: float | None = None) -> float:
    """A step's arithmetic at the peaks: products at ``product_gflops``, attention at ``attention_gflops``;
    ``head_flops`` of the products (the screened LM head's) at ``head_gflops``."""
    head_gflops = product_gflops if head_gflops is None else head_gflops
    return ((product_flops - head_flops) / (product_gflops * 1e9) + head_flops / (head_gflops * 1e9)
            + attention_flops / (attention_gflops * 1e9))


def product_peak(dtype: str, peaks: tuple[float, ...]) -> float:
    """The peak the products of ``dtype`` weights can reach, of (float32, bfloat16, int8) peaks."""
    return peaks[1] if dtype == "bfloat16" else peaks[0]


def head_peak(screen: str | None, peaks: tuple[float, ...]) -> float:
    """The peak the LM head's product through ``screen`` can reach, of (float32, bfloat16, int8) peaks (the
    float32 one where it counts as no screen of its own: none, or the int8 one widened)."""
    return {"bfloat16": peaks[1], "int8_quads": peaks[2]}.get(screen, peaks[0])
