"""The Pallas backend: the fused attention kernels of ``pallas_kernels`` on GPU (Triton) and TPU (Mosaic).

Prefill attention is the causal flash-attention kernel; a decode step's attention is the split-K
(flash-decoding) kernel reading layer ``layer`` of the stacked cache where it lies; a serving step's is the
ragged paged kernel, over the pages of every sequence in the step. Under a mesh each
runs on every device's shard (``llm_jax.sharding.attention_on_shards``). Products and the rest are
XLA's. Off an accelerator the kernels run in Pallas' interpreter (``interpret``: tests).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
from jax.sharding import Mesh

import pallas_kernels
from llm_jax import kv_cache as kvc
from llm_jax.backends.base import Backend
from llm_jax.config import ModelConfig
from llm_jax.sharding import DATA, attention_on_shards, paged_attention_on_shards, stacked_attention_on_shards


@dataclasses.dataclass(frozen=True)
class Pallas(Backend):
    """Pallas attention kernels; ``interpret`` None compiles them on GPU/TPU and interprets elsewhere."""

    interpret: bool | None = None
    name = "pallas"

    def _common(self, config: ModelConfig, window: int | None) -> dict:
        return dict(sm_scale=config.attn_scale, sliding_window=window, logit_softcap=config.attn_logit_softcap,
                    interpret=self.interpret)

    def attention(self, q_BTNH, k_BTKH, v_BTKH, lengths_B, *, config: ModelConfig, window: int | None,
                  mesh: Mesh | None = None) -> jax.Array:
        kernel = functools.partial(pallas_kernels.flash_attention, **self._common(config, window))
        return attention_on_shards(kernel, mesh, q_BTNH, k_BTKH, v_BTKH, lengths_B)

    def append_and_attend(self, q_BTNH, k_BTKH, v_BTKH, k_LBSKH, v_LBSKH, layer, slots_BT, positions_BT, *,
                          config: ModelConfig, window: int | None, mesh: Mesh | None = None):
        if isinstance(k_LBSKH, kvc.Int8KV) and (mesh is None or mesh.shape.get(DATA, 1) == 1):
            # The ragged paged kernel reads int8 in place, each row of the cache one page. (With rows split
            # over data the pages would be gathered whole: XLA's attention then.)
            return self.append_and_attend_as_pages(q_BTNH, k_BTKH, v_BTKH, k_LBSKH, v_LBSKH, layer, slots_BT,
                                                   positions_BT, config=config, window=window, mesh=mesh)
        if q_BTNH.shape[1] != 1 or isinstance(k_LBSKH, kvc.Int8KV):  # a prompt continuing a cache: XLA's
            return super().append_and_attend(q_BTNH, k_BTKH, v_BTKH, k_LBSKH, v_LBSKH, layer, slots_BT,
                                             positions_BT, config=config, window=window, mesh=mesh)
        k_LBSKH = kvc.write_tokens(k_LBSKH, layer, slots_BT, k_BTKH)
        v_LBSKH = kvc.write_tokens(v_LBSKH, layer, slots_BT, v_BTKH)
        kernel = functools.partial(pallas_kernels.decode_attention, **self._common(config, window))
        o_BNH = stacked_attention_on_shards(kernel, mesh, q_BTNH[:, 0], k_LBSKH, v_LBSKH, layer,
                                            positions_BT[:, 0] + 1)
        return o_BNH[:, None].astype(q_BTNH.dtype), k_LBSKH, v_LBSKH

    def paged_attention(self, q_TNH, k_TKH, v_TKH, k_LPZKH, v_LPZKH, layer, batch: kvc.PagedBatch, *,
                        config: ModelConfig, window: int | None, mesh: Mesh | None = None):
        k_LPZKH = kvc.write_slots(k_LPZKH, layer, batch.slots_T, k_TKH)
        v_LPZKH = kvc.write_slots(v_LPZKH, layer, batch.slots_T, v_TKH)
        kernel = functools.partial(pallas_kernels.ragged_paged_attention, **self._common(config, window))
        # Int8 pages go to the kernel as pairs (values, scales), which it dequantizes tile by tile.
        k_pages, v_pages = ((p.q_LBSKH, p.s_LBSK) if isinstance(p, kvc.Int8KV) else p for p in (k_LPZKH, v_LPZKH))
        o_TNH = paged_attention_on_shards(kernel, mesh, q_TNH, k_pages, v_pages, layer, batch)
        return o_TNH.astype(q_TNH.dtype), k_LPZKH, v_LPZKH
