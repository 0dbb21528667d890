"""The public attention entry points: pick the kernel variant for the backend and call it.

``interpret=None`` chooses by ``jax.default_backend()``: "gpu" runs the Triton kernels, "tpu" the
Mosaic kernels, and any other backend (CPU) runs the GPU variant in Pallas' interpreter, which is
how the tests exercise the kernels without an accelerator. ``platform`` picks a variant explicitly;
a variant that does not match the backend can only be interpreted.
"""

import enum

import jax

from pallas_kernels.decode_attention_gpu import decode_attention_gpu
from pallas_kernels.decode_attention_tpu import decode_attention_tpu
from pallas_kernels.flash_attention_gpu import flash_attention_gpu
from pallas_kernels.flash_attention_tpu import flash_attention_tpu
from pallas_kernels.ragged_paged_attention_gpu import ragged_paged_attention_gpu
from pallas_kernels.ragged_paged_attention_tpu import ragged_paged_attention_tpu


class Platform(enum.Enum):
    """Which kernel variant runs: the Pallas lowering it is written for."""

    GPU = "gpu"  # Pallas on Triton
    TPU = "tpu"  # Pallas on Mosaic


def choose_variant(platform: Platform | None, interpret: bool | None) -> tuple[Platform, bool]:
    """(variant, interpret) for the default backend, honouring explicit choices."""
    if platform is not None and not isinstance(platform, Platform):
        raise ValueError(f"platform must be one of {list(Platform)} or None, got {platform!r}")
    backend = jax.default_backend()
    native = {"gpu": Platform.GPU, "tpu": Platform.TPU}.get(backend)
    platform = platform or native or Platform.GPU
    if interpret is None:
        interpret = platform is not native
    if not interpret and platform is not native:
        raise ValueError(
            f"the {platform.value} kernels cannot be compiled for the {backend!r} backend; pass "
            f"interpret=True (or interpret=None to choose), or use pallas_kernels.reference"
        )
    return platform, interpret


def flash_attention(
    q_BTNH: jax.Array,
    k_BSKH: jax.Array,
    v_BSKH: jax.Array,
    lengths_B: jax.Array,
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    logit_softcap: float | None = None,
    block_q: int | None = None,
    block_k: int | None = None,
    interpret: bool | None = None,
    platform: Platform | None = None,
) -> jax.Array:
    """Causal prefill attention, fused (FlashAttention-2): o_BTNH in q's dtype.

    Query i is at position i and key j at position j (S >= T, typically S == T). Semantics are
    ``reference.attention_reference`` with ``q_offset=0``: grouped-query heads (n reads kv head
    n // G), per-sequence ``lengths_B`` (rows at or past the length are 0), optional sliding window
    and logit soft-cap. Block sizes default per variant; see ``flash_attention_gpu`` and
    ``flash_attention_tpu`` for their constraints.
    """
    platform, interpret = choose_variant(platform, interpret)
    kwargs = dict(sm_scale=sm_scale, sliding_window=sliding_window, logit_softcap=logit_softcap,
                  block_q=block_q, block_k=block_k, interpret=interpret)
    match platform:
        case Platform.GPU:
            return flash_attention_gpu(q_BTNH, k_BSKH, v_BSKH, lengths_B, **kwargs)
        case Platform.TPU:
            return flash_attention_tpu(q_BTNH, k_BSKH, v_BSKH, lengths_B, **kwargs)


def decode_attention(
    q_BNH: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    lengths_B: jax.Array,
    *,
    sm_scale: float,
    layer: jax.Array | int | None = None,
    sliding_window: int | None = None,
    logit_softcap: float | None = None,
    block_k: int | None = None,
    num_splits: int | None = None,
    interpret: bool | None = None,
    platform: Platform | None = None,
) -> jax.Array:
    """One decode step of attention (Flash-Decoding): o_BNH in q's dtype.

    The query of sequence b is at position lengths_B[b] - 1 and sees keys 0..lengths_B[b] - 1 of the
    cache (within the sliding window); a sequence of length 0 gives 0. The caches are one layer's
    [B, S, K, H], or a model's stacked caches [L, B, S, K, H] with ``layer``, an int32 scalar that
    may be traced (in a ``lax.scan`` over layers, say) and is indexed as
    ``lax.dynamic_index_in_dim`` does: the kernel reads that layer where it lies, with no copy. A
    cache may hold bfloat16 as its bits (uint16). The key axis is cut into ``num_splits`` parallel
    splits whose partial softmaxes are combined; the default suits the variant (see
    ``decode_attention_gpu`` and ``decode_attention_tpu``).
    """
    platform, interpret = choose_variant(platform, interpret)
    kwargs = dict(sm_scale=sm_scale, layer=layer, sliding_window=sliding_window,
                  logit_softcap=logit_softcap, block_k=block_k, num_splits=num_splits,
                  interpret=interpret)
    match platform:
        case Platform.GPU:
            return decode_attention_gpu(q_BNH, k_cache, v_cache, lengths_B, **kwargs)
        case Platform.TPU:
            return decode_attention_tpu(q_BNH, k_cache, v_cache, lengths_B, **kwargs)


def ragged_paged_attention(
    q_TNH: jax.Array,
    k_pages: jax.Array | tuple[jax.Array, jax.Array],
    v_pages: jax.Array | tuple[jax.Array, jax.Array],
    block_tables_BX: jax.Array,
    query_start_B: jax.Array,
    num_tokens_B: jax.Array,
    seq_lens_B: jax.Array,
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    logit_softcap: float | None = None,
    layer: jax.Array | int | None = None,
    interpret: bool | None = None,
    platform: Platform | None = None,
) -> jax.Array:
    """Attention of one serving step over a paged KV cache (PagedAttention): o_TNH in q's dtype.

    The T query rows are a flat, ragged batch: sequence b owns q_TNH[query_start_B[b] :
    query_start_B[b] + num_tokens_B[b]], the last num_tokens_B[b] of its seq_lens_B[b] tokens
    (decode tokens and prefill chunks mix freely); rows no sequence owns are padding and give 0.
    Its key at position s is row s % Z of page block_tables_BX[b, s // Z] of ``k_pages``
    [P, Z, K, H], or with ``layer`` (an int32 scalar, may be traced) of the stacked pages
    [L, P, Z, K, H], read in place; pages may hold bfloat16 as uint16 bits, or be int8: then k
    and v are each a pair (int8 values [..., Z, K, H], float32 scales [..., Z, K]), x = values *
    scales (llm_jax's ``kv_cache.Int8KV``), and the kernels dequantize each tile as they load it.
    Causal within each sequence, with the optional sliding window and logit soft-cap: semantics are
    ``reference.ragged_paged_attention_reference``. Tiles default per variant; see
    ``ragged_paged_attention_gpu`` and ``ragged_paged_attention_tpu``.
    """
    platform, interpret = choose_variant(platform, interpret)
    args = (q_TNH, k_pages, v_pages, block_tables_BX, query_start_B, num_tokens_B, seq_lens_B)
    kwargs = dict(sm_scale=sm_scale, layer=layer, sliding_window=sliding_window,
                  logit_softcap=logit_softcap, interpret=interpret)
    match platform:
        case Platform.GPU:
            return ragged_paged_attention_gpu(*args, **kwargs)
        case Platform.TPU:
            return ragged_paged_attention_tpu(*args, **kwargs)
