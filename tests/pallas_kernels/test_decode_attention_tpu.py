"""The Mosaic flash-decoding kernel, interpreted on the CPU, against the reference; its lowering.

As for the prefill kernel: poisoned runs use the generic interpreter, and the TPU interpreter runs
the first case.
"""

import functools

import numpy as np
import pytest

from attention_testing import (
    MOSAIC_CALL, TPU_INTERPRET, Case, assert_matches_reference, decode_inputs, lower,
)
from pallas_kernels.decode_attention_tpu import decode_attention_tpu, default_num_splits
from pallas_kernels.reference import decode_attention_reference

CASES = [
    # H % 128 == 0 (tiled in place); ragged last block; 3 splits over 3 blocks; GQA 8; full,
    # partial, single-token and empty sequences
    Case(B=4, S=300, N=8, K=1, H=128, lengths=(300, 129, 1, 0), block_k=128, num_splits=3),
    # H = 24 (transposed layout); GQA 2; window across a split boundary; soft-cap; bfloat16
    Case(B=3, S=77, N=4, K=2, H=24, lengths=(77, 40, 0), sliding_window=30, logit_softcap=5.0,
         dtype="bfloat16"),
]


def _check(case: Case, *, poison_output: bool) -> None:
    q, k, v, lengths = decode_inputs(case)
    out = decode_attention_tpu(q, k, v, lengths, **case.options, block_k=case.block_k,
                               num_splits=case.num_splits, interpret=TPU_INTERPRET,
                               poison_output=poison_output)
    assert_matches_reference(out, decode_attention_reference(q, k, v, lengths, **case.options))
    empty = np.asarray(case.lengths) == 0
    assert not np.asarray(out, np.float32)[empty].any(), "empty sequences must give exactly 0"


@pytest.mark.parametrize("case", CASES, ids=str)
def test_matches_reference_and_writes_every_element(case: Case):
    _check(case, poison_output=True)


@pytest.mark.parametrize("case", CASES[:1], ids=str)
def test_matches_reference_in_the_tpu_interpreter(case: Case):
    _check(case, poison_output=False)


def test_default_splits_only_feed_a_second_core():
    assert default_num_splits(batch=1, kv_heads=1, num_key_blocks=64) == 2
    assert default_num_splits(batch=1, kv_heads=1, num_key_blocks=1) == 1
    assert default_num_splits(batch=2, kv_heads=8, num_key_blocks=64) == 1


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("B,S,N,K,H,window,softcap,num_splits", [
    (1, 32768, 32, 8, 128, None, None, 4),
    (64, 1000, 28, 4, 80, 256, None, None),  # G = 7, transposed layout
    (8, 8192, 16, 8, 256, 4096, 50.0, 2),  # Gemma 2
])
def test_lowers_to_mosaic(dtype, B, S, N, K, H, window, softcap, num_splits):
    attention = functools.partial(decode_attention_tpu, sm_scale=H ** -0.5,
                                  sliding_window=window, logit_softcap=softcap,
                                  num_splits=num_splits)
    assert MOSAIC_CALL in lower(attention, "tpu", (B, N, H), (B, S, K, H), dtype)


def test_rejects_blocks_off_the_tpu_tiling():
    q, k, v, lengths = decode_inputs(Case(S=300, N=2, K=1, H=16, lengths=(300,)))
    with pytest.raises(ValueError, match=r"block_k=100 must be a multiple of 128 or the whole"):
        decode_attention_tpu(q, k, v, lengths, sm_scale=0.25, block_k=100, interpret=True)
