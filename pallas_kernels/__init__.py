"""Pallas attention kernels for LLM inference: fused causal prefill, flash-decoding, and ragged
paged attention for a serving step.

Depends on jax only. Arrays are named with the dimension key of llm_jax (B batch, T query tokens,
S key/cache positions, N query heads, K kv heads, G = N/K query heads per kv head, H head dim,
L layers), plus P for the key splits of flash-decoding. The KV cache layout is [B, S, K, H]; decode
also reads layer ``layer`` of a model's stacked cache [L, B, S, K, H] in place. A paged cache is
[P, Z, K, H] (P there counts pages, Z tokens per page; its kernels call their key splits C), or
stacked [L, P, Z, K, H], with block tables [B, X] (X pages per sequence).

    flash_attention(q_BTNH, k_BSKH, v_BSKH, lengths_B, *, sm_scale, ...) -> o_BTNH   (prefill)
    decode_attention(q_BNH, k_BSKH, v_BSKH, lengths_B, *, sm_scale, ...) -> o_BNH    (one step)
    decode_attention(q_BNH, k_LBSKH, v_LBSKH, lengths_B, *, sm_scale, layer, ...) -> o_BNH
    ragged_paged_attention(q_TNH, k_pages, v_pages, block_tables_BX, query_start_B, num_tokens_B,
                           seq_lens_B, *, sm_scale, layer, ...) -> o_TNH   (a serving step)
    reference.attention_reference(...), reference.decode_attention_reference(...),
    reference.ragged_paged_attention_reference(...)  (the oracle)

Each has a GPU variant (Pallas on Triton) and a TPU variant (Pallas on Mosaic); ``dispatch`` picks
by backend and interprets on CPU.
"""

from pallas_kernels import reference
from pallas_kernels.dispatch import (
    Platform, decode_attention, flash_attention, ragged_paged_attention,
)

__all__ = ["Platform", "decode_attention", "flash_attention", "ragged_paged_attention", "reference"]
