"""The Triton flash-decoding kernel, interpreted on the CPU, against the reference; its lowering."""

import functools

import jax.numpy as jnp
import numpy as np
import pytest

from attention_testing import (
    GPU_INTERPRET, Case, assert_matches_reference, calls_triton, decode_inputs, lower,
    random_decode_cases, stale_past_lengths,
)
from pallas_kernels.decode_attention_gpu import decode_attention_gpu, default_num_splits
from pallas_kernels.reference import decode_attention_reference

NAMED_CASES = [
    # one cached token; an empty sequence next to full ones (its output must be 0, not NaN)
    Case(B=1, S=1, N=2, K=1, H=16, lengths=(1,)),
    Case(B=3, S=50, N=4, K=2, H=32, lengths=(0, 50, 1), block_k=16, num_splits=4),
    # GQA ratios 1/2/4/8 with lengths off the block grid and more splits than blocks
    Case(B=2, S=77, N=3, K=3, H=24, lengths=(77, 40), block_k=16, num_splits=3),
    Case(B=2, S=77, N=4, K=2, H=24, lengths=(70, 3), block_k=32, num_splits=7),
    Case(B=2, S=77, N=8, K=2, H=80, lengths=(33, 77), block_k=16, num_splits=2),
    Case(B=2, S=130, N=8, K=1, H=64, lengths=(130, 129), dtype="bfloat16", block_k=32,
         num_splits=3),
    # sliding window inside one block and across splits; soft-cap
    Case(B=2, S=150, N=4, K=1, H=16, lengths=(150, 90), sliding_window=7, block_k=32,
         num_splits=4),
    Case(B=2, S=150, N=4, K=2, H=16, lengths=(150, 9), sliding_window=100, logit_softcap=5.0,
         block_k=16, num_splits=3, dtype="bfloat16"),
    # the default block size and split count
    Case(B=2, S=300, N=2, K=1, H=64, lengths=(300, 123)),
]
CASES = NAMED_CASES + random_decode_cases(10, seed=11)


@pytest.mark.parametrize("case", CASES, ids=str)
def test_matches_reference_and_writes_every_element(case: Case):
    q, k, v, lengths = decode_inputs(case)
    out = decode_attention_gpu(q, k, v, lengths, **case.options, block_k=case.block_k,
                               num_splits=case.num_splits, interpret=GPU_INTERPRET,
                               poison_output=True)
    ref = decode_attention_reference(q, k, v, lengths, **case.options)
    assert_matches_reference(out, ref)
    empty = np.asarray(case.lengths) == 0
    assert not np.asarray(out, np.float32)[empty].any(), "empty sequences must give exactly 0"


def test_ignores_cache_contents_past_the_length():
    case = Case(B=2, S=64, N=2, K=1, H=16, lengths=(40, 0), block_k=16, num_splits=2)
    q, k, v, lengths = decode_inputs(case)
    out = decode_attention_gpu(q, stale_past_lengths(k, lengths), stale_past_lengths(v, lengths),
                               lengths, **case.options, block_k=16, num_splits=2,
                               interpret=GPU_INTERPRET)
    assert_matches_reference(out, decode_attention_reference(q, k, v, lengths, **case.options))


def test_split_count_does_not_change_the_result():
    """Flash-decoding's combine is exact up to rounding: 1 split and 5 agree to float32 eps."""
    case = Case(B=2, S=200, N=4, K=2, H=32, lengths=(200, 77))
    q, k, v, lengths = decode_inputs(case)
    one, five = (decode_attention_gpu(q, k, v, lengths, **case.options, block_k=16, num_splits=p,
                                      interpret=GPU_INTERPRET) for p in (1, 5))
    np.testing.assert_allclose(np.asarray(one), np.asarray(five), atol=2e-6, rtol=0)


def test_default_splits_fill_the_gpu_but_never_exceed_the_blocks():
    assert default_num_splits(batch=1, kv_heads=8, num_key_blocks=512) >= 16
    assert default_num_splits(batch=64, kv_heads=8, num_key_blocks=512) == 1
    assert default_num_splits(batch=1, kv_heads=1, num_key_blocks=3) == 3


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("B,S,N,K,H,window,softcap", [
    (1, 32768, 32, 8, 128, None, None),
    (64, 1000, 28, 4, 80, 256, None),  # G = 7 (rows padded to 8 -> 16), head dim 80 -> 128
    (8, 8192, 16, 8, 256, 4096, 50.0),  # Gemma 2
    (4, 4096, 12, 12, 64, None, 30.0),  # MHA: G = 1
])
def test_lowers_to_triton(dtype, B, S, N, K, H, window, softcap):
    attention = functools.partial(decode_attention_gpu, sm_scale=H ** -0.5,
                                  sliding_window=window, logit_softcap=softcap)
    assert calls_triton(lower(attention, "cuda", (B, N, H), (B, S, K, H), dtype))


@pytest.mark.parametrize("kwargs,message", [
    (dict(block_k=24), "block_k=24 must be a power of two"),
    (dict(num_splits=0), "num_splits must be a positive int"),
])
def test_rejects_bad_options(kwargs, message):
    q, k, v, lengths = decode_inputs(Case(S=40, N=2, K=1, H=16, lengths=(40,)))
    with pytest.raises(ValueError, match=message):
        decode_attention_gpu(q, k, v, lengths, sm_scale=0.25, interpret=GPU_INTERPRET, **kwargs)


def test_rejects_lengths_of_the_wrong_shape():
    q, k, v, _ = decode_inputs(Case(B=2, S=40, N=2, K=1, H=16, lengths=(40, 40)))
    with pytest.raises(ValueError, match=r"lengths_B must be integers of shape \(2,\), got shape"):
        decode_attention_gpu(q, k, v, jnp.zeros(3, jnp.int32), sm_scale=0.25,
                             interpret=GPU_INTERPRET)
