"""The Mosaic prefill kernel, interpreted on the CPU, against the reference; its Mosaic lowering.

Poisoned runs use Pallas' generic interpreter, which proves every output element is written (see
``tpu_tiles.interpreter``); the TPU interpreter, which simulates DMAs and VMEM and raises on
out-of-bounds reads, runs the first case. Both are slow, so each case packs several sequences.
"""

import functools

import numpy as np
import pytest

from attention_testing import (
    MOSAIC_CALL, TPU_INTERPRET, Case, assert_matches_reference, lower, prefill_inputs,
)
from pallas_kernels.flash_attention_tpu import flash_attention_tpu
from pallas_kernels.reference import attention_reference

CASES = [
    # H % 128 == 0 (tiled in place); ragged last query and key blocks; GQA 2; full, partial,
    # empty and single-token sequences
    Case(B=4, T=300, S=300, N=2, K=1, H=128, lengths=(300, 129, 0, 1), block_q=128,
         block_k=128),
    # H = 40 (transposed layout); GQA 4; keys past T; window and soft-cap; bfloat16
    Case(B=3, T=45, S=61, N=4, K=1, H=40, lengths=(45, 20, 61), sliding_window=9,
         logit_softcap=30.0, dtype="bfloat16", block_q=16),
    # a single token; MHA
    Case(B=2, T=1, S=1, N=3, K=3, H=16, lengths=(1, 0)),
]


def _check(case: Case, *, poison_output: bool) -> None:
    q, k, v, lengths = prefill_inputs(case)
    out = flash_attention_tpu(q, k, v, lengths, **case.options, block_q=case.block_q,
                              block_k=case.block_k, interpret=TPU_INTERPRET,
                              poison_output=poison_output)
    assert_matches_reference(out, attention_reference(q, k, v, lengths, **case.options))
    padding_rows = np.arange(case.T)[None, :] >= np.asarray(case.lengths)[:, None]
    assert not np.asarray(out, np.float32)[padding_rows].any(), "padding rows must be exactly 0"


@pytest.mark.parametrize("case", CASES, ids=str)
def test_matches_reference_and_writes_every_element(case: Case):
    _check(case, poison_output=True)


@pytest.mark.parametrize("case", CASES[:1], ids=str)
def test_matches_reference_in_the_tpu_interpreter(case: Case):
    _check(case, poison_output=False)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("T,N,K,H,window,softcap", [
    (1000, 8, 2, 128, None, None),
    (1000, 28, 4, 80, 256, None),  # head dim off the 128-lane grid: transposed layout
    (777, 8, 8, 256, 4096, 50.0),  # Gemma 2
    (2048, 4, 1, 64, None, 30.0),
])
def test_lowers_to_mosaic(dtype, T, N, K, H, window, softcap):
    """Mosaic lowering (run here, without a TPU) accepts the block shapes, index maps and ops."""
    attention = functools.partial(flash_attention_tpu, sm_scale=H ** -0.5,
                                  sliding_window=window, logit_softcap=softcap)
    assert MOSAIC_CALL in lower(attention, "tpu", (2, T, N, H), (2, T, K, H), dtype)


@pytest.mark.parametrize("kwargs,message", [
    (dict(block_q=20), r"block_q=20 must be a multiple of 8 or the whole axis \(40\)"),
    (dict(block_k=100), r"block_k=100 must be a multiple of 128 or the whole axis \(200\)"),
])
def test_rejects_blocks_off_the_tpu_tiling(kwargs, message):
    q, k, v, lengths = prefill_inputs(Case(T=40, S=200, N=2, K=1, H=16, lengths=(40,)))
    with pytest.raises(ValueError, match=message):
        flash_attention_tpu(q, k, v, lengths, sm_scale=0.25, interpret=True, **kwargs)
