"""The oracle itself against PyTorch in float64: ``scaled_dot_product_attention``, and the eager
attention of Hugging Face ``transformers`` (soft-cap as in Gemma 2, sliding window as Mistral)."""

import numpy as np
import pytest
import torch

from attention_testing import Case, decode_inputs, prefill_inputs
from pallas_kernels.reference import attention_reference, decode_attention_reference


def _torch_visible(q_pos_BT, S, lengths_B, window):
    """[B, 1, T, S] bool: the visibility rule written independently, in torch."""
    q_pos = torch.tensor(np.asarray(q_pos_BT))[:, None, :, None]
    k_pos = torch.arange(S)[None, None, None, :]
    lengths = torch.tensor(np.asarray(lengths_B))[:, None, None, None]
    ok = (k_pos <= q_pos) & (k_pos < lengths) & (q_pos < lengths)
    if window is not None:
        ok &= q_pos - k_pos < window
    return ok


def _torch_eager(q_BTNH, k_BSKH, v_BSKH, visible, *, sm_scale, softcap):
    """transformers' eager_attention_forward (repeat_kv, scale, soft-cap, mask, float32 softmax),
    in float64; returns [B, T, N, H]. Rows that see nothing come out NaN, as in torch."""
    q = torch.as_tensor(np.asarray(q_BTNH, np.float64)).transpose(1, 2)
    k = torch.as_tensor(np.asarray(k_BSKH, np.float64)).transpose(1, 2)
    v = torch.as_tensor(np.asarray(v_BSKH, np.float64)).transpose(1, 2)
    G = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(G, dim=1), v.repeat_interleave(G, dim=1)
    if softcap is None:
        o = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=visible,
                                                             scale=sm_scale)
        return o.transpose(1, 2).numpy()
    w = torch.matmul(q, k.transpose(2, 3)) * sm_scale
    w = torch.tanh(w / softcap) * softcap
    w = w.masked_fill(~visible, -torch.inf)
    return torch.matmul(torch.softmax(w, dim=-1), v).transpose(1, 2).numpy()


CASES = [
    Case(B=3, T=13, S=17, N=4, K=2, H=8, lengths=(13, 5, 0)),
    Case(B=2, T=20, S=20, N=8, K=1, H=16, lengths=(20, 11), sliding_window=6),
    Case(B=2, T=20, S=24, N=2, K=2, H=16, lengths=(24, 20), logit_softcap=5.0, sliding_window=9),
    Case(B=1, T=1, S=1, N=2, K=1, H=4, lengths=(1,)),
]


@pytest.mark.parametrize("case", CASES, ids=str)
def test_prefill_matches_torch(case: Case):
    q, k, v, lengths = prefill_inputs(case)
    out = np.asarray(attention_reference(q, k, v, lengths, **case.options))
    q_pos = np.broadcast_to(np.arange(case.T), (case.B, case.T))
    visible = _torch_visible(q_pos, case.S, np.asarray(lengths), case.sliding_window)
    expected = _torch_eager(q, k, v, visible, sm_scale=case.sm_scale, softcap=case.logit_softcap)
    seen = visible.any(-1)[:, 0].numpy()  # [B, T]
    np.testing.assert_allclose(out[seen], expected[seen], atol=2e-6, rtol=0)
    assert not out[~seen].any(), "rows that see no key must be exactly 0"


@pytest.mark.parametrize("case", [
    Case(B=4, S=30, N=4, K=2, H=8, lengths=(30, 7, 1, 0)),
    Case(B=2, S=30, N=4, K=1, H=8, lengths=(30, 12), sliding_window=5, logit_softcap=20.0),
], ids=str)
def test_decode_matches_torch(case: Case):
    q, k, v, lengths = decode_inputs(case)
    out = np.asarray(decode_attention_reference(q, k, v, lengths, **case.options))
    visible = _torch_visible(np.asarray(lengths)[:, None] - 1, case.S, np.asarray(lengths),
                             case.sliding_window)
    expected = _torch_eager(q[:, None], k, v, visible, sm_scale=case.sm_scale,
                            softcap=case.logit_softcap)[:, 0]
    seen = np.asarray(lengths) > 0
    np.testing.assert_allclose(out[seen], expected[seen], atol=2e-6, rtol=0)
    assert not out[~seen].any()
