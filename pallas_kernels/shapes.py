"""Validation of the attention arguments, shared by every kernel's public wrapper.

Shapes are static under ``jit``, so every mistake is reported at trace time with the values that
caused it. ``lengths_B`` and a decode call's ``layer`` are traced, so their values cannot be checked
here: each length must be in [0, S]; the layer is read as ``lax.dynamic_index_in_dim`` reads it
(negative counts from the end, then clamped to [0, L)), so no value can read outside the cache.

A decode cache, or a paged one, may hold bfloat16 values as their bits (uint16), the form in which
llm_jax's CPU path keeps a bfloat16 cache. The kernels load such tiles as they are and bitcast them
to bfloat16 in registers: a bitcast of the whole cache outside the kernel is an XLA op, which can
copy the cache.

Paged K and V may also be int8, each passed as a pair (int8 values [..., Z, K, H], float32 scales
[..., Z, K]), x = values * scales (llm_jax's ``kv_cache.Int8KV``); the ragged paged kernels
dequantize each tile as they load it (``split_int8_pages``, ``dequantize``).
"""

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax

SUPPORTED_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
BITS_DTYPE = jnp.dtype(jnp.uint16)  # a cache of bfloat16 values held as their bits
INT8_DTYPE = jnp.dtype(jnp.int8)  # int8 pages, passed as pairs (values, scales)
SCALES_DTYPE = jnp.dtype(jnp.float32)  # their scales, one per slot and kv head


@dataclasses.dataclass(frozen=True, kw_only=True)
class AttentionDims:
    """The sizes of one attention call, in the letters of the dimension key."""

    B: int  # batch
    T: int  # queries per sequence (1 for decode)
    L: int = 1  # layers of a stacked decode cache (1 for one layer's cache)
    S: int  # keys per sequence (cache capacity)
    N: int  # query heads
    K: int  # kv heads
    H: int  # head dim

    @property
    def G(self) -> int:
        """Query heads per kv head."""
        return self.N // self.K


def check_prefill(q_BTNH, k_BSKH, v_BSKH, lengths_B, *, sliding_window, logit_softcap
                  ) -> AttentionDims:
    """Dimensions of a prefill call, or a ValueError naming the offending tensor and values."""
    if q_BTNH.ndim != 4:
        raise ValueError(f"q_BTNH must be [B, T, N, H], got shape {q_BTNH.shape}")
    dims = _check_kv(q_BTNH.shape[0], q_BTNH.shape[2], q_BTNH.shape[3], q_BTNH.dtype,
                     k_BSKH, v_BSKH, lengths_B, T=q_BTNH.shape[1])
    if dims.S < dims.T:
        raise ValueError(f"prefill needs a key for every query: S={dims.S} < T={dims.T} "
                         f"(q_BTNH {q_BTNH.shape}, k_BSKH {k_BSKH.shape})")
    _check_options(sliding_window, logit_softcap)
    return dims


def check_decode(q_BNH, k_cache, v_cache, lengths_B, *, layer, sliding_window, logit_softcap
                 ) -> AttentionDims:
    """Dimensions of a decode call (T = 1), or a ValueError naming the offending values.

    The caches are [B, S, K, H], or [L, B, S, K, H] when ``layer`` is given; they may hold
    bfloat16 as bits (uint16) when q is bfloat16.
    """
    if q_BNH.ndim != 3:
        raise ValueError(f"q_BNH must be [B, N, H], got shape {q_BNH.shape}")
    if layer is None:
        if k_cache.ndim == 5:
            raise ValueError(f"k_cache {k_cache.shape} is a stacked cache [L, B, S, K, H]: pass "
                             f"the layer to read as `layer`")
        L, k_BSKH, v_BSKH = 1, k_cache, v_cache
    else:
        _check_layer(layer)
        for name, cache in (("k", k_cache), ("v", v_cache)):
            if cache.ndim != 5:
                raise ValueError(f"with layer, {name}_cache must be the stacked cache "
                                 f"[L, B, S, K, H], got shape {cache.shape}")
        # One layer's shape, for the checks below (indexing the cache would trace a slice of it).
        L = k_cache.shape[0]
        k_BSKH, v_BSKH = (jax.ShapeDtypeStruct(c.shape[1:], c.dtype) for c in (k_cache, v_cache))
        if v_cache.shape[0] != L:
            raise ValueError(f"v_cache shape {v_cache.shape} != k_cache shape {k_cache.shape}")
    dims = _check_kv(q_BNH.shape[0], q_BNH.shape[1], q_BNH.shape[2], q_BNH.dtype,
                     k_BSKH, v_BSKH, lengths_B, T=1, bits_ok=True)
    _check_options(sliding_window, logit_softcap)
    return dataclasses.replace(dims, L=L)


@dataclasses.dataclass(frozen=True, kw_only=True)
class PagedDims:
    """The sizes of one ragged paged attention call (see ``check_ragged_paged``)."""

    T: int  # query tokens of the step, all sequences together
    N: int  # query heads
    K: int  # kv heads
    H: int  # head dim
    B: int  # sequences (padding ones included)
    X: int  # pages per sequence: the block tables' width
    P: int  # pages in the pool (of one layer)
    Z: int  # tokens per page
    L: int = 1  # layers of stacked pages (1 for one layer's pages)

    @property
    def G(self) -> int:
        """Query heads per kv head."""
        return self.N // self.K


def check_ragged_paged(q_TNH, k_pages, v_pages, block_tables_BX, query_start_B, num_tokens_B,
                       seq_lens_B, *, layer, sliding_window, logit_softcap) -> PagedDims:
    """Dimensions of a ragged paged attention call, or a ValueError naming the offending values.

    The pages are [P, Z, K, H], or [L, P, Z, K, H] when ``layer`` is given; they may hold bfloat16
    as bits (uint16) when q is bfloat16, or be int8 pairs (values, scales) of any float q (both k
    and v, see ``split_int8_pages``). The traced values cannot be checked here; the kernels read
    only in-bounds memory whatever they are (page ids and the layer are clamped), but their results
    are the reference's only when each sequence's queries lie in [0, T), no two sequences share a
    query row, 0 <= num_tokens_B[b] <= seq_lens_B[b] <= X * Z and the page ids are in [0, P).
    """
    if q_TNH.ndim != 3:
        raise ValueError(f"q_TNH must be [T, N, H], got shape {q_TNH.shape}")
    k_pages, v_pages, k_scales, _ = split_int8_pages(k_pages, v_pages)
    pages_ndim = 4 if layer is None else 5
    if layer is None and k_pages.ndim == 5:
        raise ValueError(f"k_pages {k_pages.shape} are stacked pages [L, P, Z, K, H]: pass the "
                         f"layer to read as `layer`")
    if layer is not None:
        _check_layer(layer)
    for name, pages in (("k_pages", k_pages), ("v_pages", v_pages)):
        if pages.ndim != pages_ndim:
            expected = (f"{name} must be [P, Z, K, H]" if layer is None else
                        f"with layer, {name} must be the stacked pages [L, P, Z, K, H]")
            raise ValueError(f"{expected}, got shape {pages.shape}")
    if v_pages.shape != k_pages.shape:
        raise ValueError(f"v_pages shape {v_pages.shape} != k_pages shape {k_pages.shape}")
    T, N, H = q_TNH.shape
    L = 1 if layer is None else k_pages.shape[0]
    P, Z, K, kH = k_pages.shape[-4:]
    if kH != H:
        raise ValueError(f"head dim of k_pages {k_pages.shape} ({kH}) != head dim of q_TNH "
                         f"{q_TNH.shape} ({H})")
    if K < 1 or N % K:
        raise ValueError(f"query heads N={N} must be a multiple of kv heads K={K}")
    if k_scales is None:
        for name, pages in (("k_pages", k_pages), ("v_pages", v_pages)):
            if jnp.dtype(pages.dtype) == INT8_DTYPE:
                raise ValueError(f"{name} are int8: pass int8 pages as pairs (values, scales)")
        _check_dtypes(q_TNH.dtype, k_pages.dtype, v_pages.dtype, bits_ok=True)
    elif jnp.dtype(q_TNH.dtype) not in SUPPORTED_DTYPES:
        raise ValueError(f"q dtype {q_TNH.dtype} is not one of "
                         f"{[str(d) for d in SUPPORTED_DTYPES]}")
    if block_tables_BX.ndim != 2 or not jnp.issubdtype(block_tables_BX.dtype, jnp.integer):
        raise ValueError(f"block_tables_BX must be integers of shape [B, X], got shape "
                         f"{block_tables_BX.shape} dtype {block_tables_BX.dtype}")
    B, X = block_tables_BX.shape
    for name, array in (("query_start_B", query_start_B), ("num_tokens_B", num_tokens_B),
                        ("seq_lens_B", seq_lens_B)):
        if jnp.shape(array) != (B,) or not jnp.issubdtype(jnp.result_type(array), jnp.integer):
            raise ValueError(f"{name} must be integers of shape ({B},) (one per row of "
                             f"block_tables_BX), got shape {jnp.shape(array)} dtype "
                             f"{jnp.result_type(array)}")
    if min(T, N, H, B, X, P, Z, L) < 1:
        raise ValueError(f"empty attention: T={T}, N={N}, H={H}, B={B}, X={X}, P={P}, Z={Z}, "
                         f"L={L}")
    _check_options(sliding_window, logit_softcap)
    return PagedDims(T=T, N=N, K=K, H=H, B=B, X=X, P=P, Z=Z, L=L)


def split_int8_pages(k_pages, v_pages) -> tuple:
    """(k values, v values, k scales, v scales) of paged K and V; the scales None for float pages.

    Int8 pages come as pairs (int8 values [..., Z, K, H], float32 scales [..., Z, K]), both k and
    v or neither; a ValueError names the argument whose pair is malformed.
    """
    is_pair = [isinstance(pages, (tuple, list)) for pages in (k_pages, v_pages)]
    if is_pair[0] != is_pair[1]:
        pair, array = ("k_pages", "v_pages") if is_pair[0] else ("v_pages", "k_pages")
        raise ValueError(f"{pair} is an int8 pair (values, scales) but {array} is not: pass both "
                         f"as pairs or both as float pages")
    if not is_pair[0]:
        return k_pages, v_pages, None, None
    for name, pages in (("k_pages", k_pages), ("v_pages", v_pages)):
        if len(pages) != 2:
            raise ValueError(f"{name} must be an array or a pair (int8 values, float32 scales), "
                             f"got a {type(pages).__name__} of {len(pages)}")
        values, scales = pages
        if jnp.dtype(values.dtype) != INT8_DTYPE:
            raise ValueError(f"{name} values of a pair must be int8, got {values.dtype}")
        if jnp.dtype(scales.dtype) != SCALES_DTYPE:
            raise ValueError(f"{name} scales must be float32, got {scales.dtype}")
        if values.ndim < 1 or tuple(scales.shape) != tuple(values.shape[:-1]):
            raise ValueError(f"{name} scales shape {tuple(scales.shape)} must be its values' "
                             f"shape {tuple(values.shape)} without the head dim (one per slot "
                             f"and kv head)")
    return k_pages[0], v_pages[0], k_pages[1], v_pages[1]


def dequantize(tile: jax.Array, scales: jax.Array | None, dtype) -> jax.Array:
    """A loaded tile of pages as values: int8 tiles times their rows' ``scales`` (broadcast against
    the tile, e.g. [rows, 1]) in float32, then ``dtype`` (q's, for the products); other tiles as
    ``as_values`` gives them."""
    if scales is None:
        return as_values(tile)
    return (tile.astype(jnp.float32) * scales).astype(dtype)


def check_positive(name: str, value: int | None) -> None:
    if value is not None and (not isinstance(value, int) or value < 1):
        raise ValueError(f"{name} must be a positive int or None, got {value!r}")


def _check_kv(B, N, H, q_dtype, k_BSKH, v_BSKH, lengths_B, *, T, bits_ok=False
              ) -> AttentionDims:
    if k_BSKH.ndim != 4:
        raise ValueError(f"k_BSKH must be [B, S, K, H], got shape {k_BSKH.shape}")
    if v_BSKH.shape != k_BSKH.shape:
        raise ValueError(f"v_BSKH shape {v_BSKH.shape} != k_BSKH shape {k_BSKH.shape}")
    kB, S, K, kH = k_BSKH.shape
    if kB != B:
        raise ValueError(f"batch of k_BSKH ({kB}) != batch of the queries ({B})")
    if kH != H:
        raise ValueError(f"head dim of k_BSKH ({kH}) != head dim of the queries ({H})")
    if K < 1 or N % K:
        raise ValueError(f"query heads N={N} must be a multiple of kv heads K={K}")
    _check_dtypes(q_dtype, k_BSKH.dtype, v_BSKH.dtype, bits_ok=bits_ok)
    if jnp.shape(lengths_B) != (B,) or not jnp.issubdtype(jnp.result_type(lengths_B), jnp.integer):
        raise ValueError(f"lengths_B must be integers of shape ({B},), got shape "
                         f"{jnp.shape(lengths_B)} dtype {jnp.result_type(lengths_B)}")
    if min(B, T, S, N, H) < 1:
        raise ValueError(f"empty attention: B={B}, T={T}, S={S}, N={N}, H={H}")
    return AttentionDims(B=B, T=T, S=S, N=N, K=K, H=H)


def _check_layer(layer) -> None:
    if jnp.ndim(layer) != 0 or not jnp.issubdtype(jnp.result_type(layer), jnp.integer):
        raise ValueError(f"layer must be an integer scalar (the layer of the stacked cache to "
                         f"read), got shape {jnp.shape(layer)} dtype {jnp.result_type(layer)}")


def _check_dtypes(q_dtype, k_dtype, v_dtype, *, bits_ok: bool) -> None:
    for name, dtype in (("q", q_dtype), ("k", k_dtype), ("v", v_dtype)):
        if jnp.dtype(dtype) not in SUPPORTED_DTYPES and not (bits_ok and dtype == BITS_DTYPE
                                                             and name != "q"):
            raise ValueError(f"{name} dtype {dtype} is not one of "
                             f"{[str(d) for d in SUPPORTED_DTYPES]}"
                             + (" (or uint16: bfloat16 bits, for k and v)" if bits_ok else ""))
    if not (jnp.dtype(q_dtype) == values_dtype(k_dtype) == values_dtype(v_dtype)):
        raise ValueError(f"q, k, v dtypes differ: {q_dtype}, {k_dtype}, {v_dtype}"
                         + (" (uint16 caches hold bfloat16 bits)" if bits_ok else ""))


def _check_options(sliding_window, logit_softcap) -> None:
    if sliding_window is not None and (not isinstance(sliding_window, int) or sliding_window < 1):
        raise ValueError(f"sliding_window must be a positive int or None, got {sliding_window!r}")
    if logit_softcap is not None and not logit_softcap > 0:
        raise ValueError(f"logit_softcap must be positive or None, got {logit_softcap!r}")


def as_lengths(lengths_B) -> jax.Array:
    """lengths as int32, the index type of every kernel."""
    return jnp.asarray(lengths_B).astype(jnp.int32)


def as_layer(layer, num_layers: int) -> jax.Array:
    """The layer to read as int32 [1] (0 for an unstacked cache), as ``lax.dynamic_index_in_dim``
    reads it: a negative layer counts from the end, then it is clamped to [0, num_layers)."""
    if layer is None:
        return jnp.zeros((1,), jnp.int32)
    layer = jnp.asarray(layer).astype(jnp.int32)
    layer = jnp.where(layer < 0, layer + num_layers, layer)
    return jnp.clip(layer, 0, num_layers - 1).reshape(1)


def values_dtype(dtype) -> jnp.dtype:
    """The dtype of the values an array of ``dtype`` holds: bfloat16 for bits (uint16)."""
    return jnp.dtype(jnp.bfloat16) if jnp.dtype(dtype) == BITS_DTYPE else jnp.dtype(dtype)


def as_values(tile: jax.Array) -> jax.Array:
    """A loaded tile of a cache as values: bits (uint16) bitcast to bfloat16, in registers."""
    if tile.dtype == BITS_DTYPE:
        return lax.bitcast_convert_type(tile, jnp.bfloat16)
    return tile
