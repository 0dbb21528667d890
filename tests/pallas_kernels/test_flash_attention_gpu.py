"""The Triton prefill kernel, interpreted on the CPU, against the reference; its Triton lowering."""

import functools

import jax.numpy as jnp
import numpy as np
import pytest

from attention_testing import (
    GPU_INTERPRET, Case, assert_matches_reference, calls_triton, lower, prefill_inputs,
    random_prefill_cases, stale_past_lengths,
)
from pallas_kernels.flash_attention_gpu import flash_attention_gpu
from pallas_kernels.reference import attention_reference

NAMED_CASES = [
    # a single token, and a single token against a longer cache
    Case(T=1, S=1, N=2, K=1, H=16, lengths=(1,)),
    Case(T=1, S=9, N=2, K=2, H=32, lengths=(1,), dtype="bfloat16"),
    # GQA ratios 1/2/4/8, lengths that are not multiples of the blocks
    Case(B=2, T=45, S=45, N=3, K=3, H=32, lengths=(45, 17), block_q=16, block_k=16),
    Case(B=2, T=45, S=45, N=4, K=2, H=32, lengths=(45, 30), block_q=16, block_k=32),
    Case(B=2, T=37, S=37, N=8, K=2, H=24, lengths=(37, 5), block_q=32, block_k=16),
    Case(B=1, T=50, S=50, N=8, K=1, H=64, lengths=(50,), dtype="bfloat16", block_q=16,
         block_k=16),
    # padding: a fully padded sequence, a length-1 sequence, keys past T in the cache
    Case(B=3, T=33, S=40, N=2, K=1, H=16, lengths=(0, 1, 40), block_q=16, block_k=16),
    # sliding window (Mistral) narrower than a block, and soft-cap (Gemma 2) with both
    Case(B=2, T=70, S=70, N=4, K=2, H=40, lengths=(70, 61), sliding_window=5, block_q=16,
         block_k=16),
    Case(B=2, T=70, S=75, N=4, K=2, H=40, lengths=(70, 31), sliding_window=23,
         logit_softcap=50.0, block_q=32, block_k=16, dtype="bfloat16"),
    Case(B=1, T=64, S=64, N=2, K=1, H=16, lengths=(64,), logit_softcap=5.0, block_q=16,
         block_k=32),
    # the default block sizes
    Case(B=1, T=100, S=100, N=2, K=1, H=80, lengths=(97,)),
]
CASES = NAMED_CASES + random_prefill_cases(12, seed=5)


@pytest.mark.parametrize("case", CASES, ids=str)
def test_matches_reference_and_writes_every_element(case: Case):
    q, k, v, lengths = prefill_inputs(case)
    out = flash_attention_gpu(q, k, v, lengths, **case.options, block_q=case.block_q,
                              block_k=case.block_k, interpret=GPU_INTERPRET, poison_output=True)
    ref = attention_reference(q, k, v, lengths, **case.options)
    assert_matches_reference(out, ref)
    padding_rows = np.arange(case.T)[None, :] >= np.asarray(case.lengths)[:, None]
    assert not np.asarray(out, np.float32)[padding_rows].any(), "padding rows must be exactly 0"


def test_ignores_cache_contents_past_the_length():
    """NaN in K/V past each sequence's length (a stale cache) must not reach the output."""
    case = Case(B=2, T=20, S=48, N=2, K=1, H=16, lengths=(20, 9), block_q=16, block_k=16)
    q, k, v, lengths = prefill_inputs(case)
    out = flash_attention_gpu(q, stale_past_lengths(k, lengths), stale_past_lengths(v, lengths),
                              lengths, **case.options, block_q=16, block_k=16,
                              interpret=GPU_INTERPRET)
    assert_matches_reference(out, attention_reference(q, k, v, lengths, **case.options))


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("T,N,K,H,window,softcap", [
    (1000, 8, 2, 128, None, None),
    (1000, 28, 4, 80, 256, None),  # G = 7, head dim padded to 128
    (777, 8, 8, 256, 4096, 50.0),  # Gemma 2: wide heads, window, soft-cap
    (2048, 4, 1, 64, None, 30.0),
])
def test_lowers_to_triton(dtype, T, N, K, H, window, softcap):
    """Triton lowering (run here, without a GPU) accepts every tile: power-of-two sizes, ops."""
    attention = functools.partial(flash_attention_gpu, sm_scale=H ** -0.5,
                                  sliding_window=window, logit_softcap=softcap)
    assert calls_triton(lower(attention, "cuda", (2, T, N, H), (2, T, K, H), dtype))


@pytest.mark.parametrize("kwargs,message", [
    (dict(block_q=48), "block_q=48 must be a power of two"),
    (dict(block_k=8), "block_k=8 must be a power of two >= 16"),
    (dict(sliding_window=0), "sliding_window must be a positive int"),
    (dict(logit_softcap=-1.0), "logit_softcap must be positive"),
])
def test_rejects_bad_options(kwargs, message):
    q, k, v, lengths = prefill_inputs(Case(T=40, S=40, N=2, K=1, H=16, lengths=(40,)))
    with pytest.raises(ValueError, match=message):
        flash_attention_gpu(q, k, v, lengths, sm_scale=0.25, interpret=GPU_INTERPRET, **kwargs)


@pytest.mark.parametrize("shapes,message", [
    (((1, 8, 3, 16), (1, 8, 2, 16)), "N=3 must be a multiple of kv heads K=2"),
    (((1, 8, 2, 16), (1, 6, 1, 16)), "S=6 < T=8"),
    (((1, 8, 2, 16), (1, 8, 1, 32)), r"head dim of k_BSKH \(32\) != head dim of the queries"),
    (((2, 8, 2, 16), (1, 8, 1, 16)), r"batch of k_BSKH \(1\) != batch of the queries \(2\)"),
])
def test_rejects_mismatched_shapes(shapes, message):
    q_shape, kv_shape = shapes
    q, kv = jnp.zeros(q_shape), jnp.zeros(kv_shape)
    with pytest.raises(ValueError, match=message):
        flash_attention_gpu(q, kv, kv, jnp.zeros(q_shape[0], jnp.int32), sm_scale=0.25,
                            interpret=GPU_INTERPRET)
