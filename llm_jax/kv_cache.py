"""The KV cache: an immutable pytree of every layer's keys and values plus per-sequence lengths.

Layout: ``k_LBSKH`` / ``v_LBSKH`` — layer, batch, cache slot, kv head, head dim. Slot s holds position s
of its sequence (prompts are right-padded), and ``lengths_B[b]`` slots of row b are valid; slots past it
hold stale values that attention masks out and later writes overwrite. Functions return a new cache;
jitted callers donate the old one so XLA updates the buffers in place.

A bfloat16 cache holds its keys and values as their bits (uint16; ``KVCache.dtype`` is still bfloat16,
and :func:`from_bits` gives the bfloat16 arrays): XLA:CPU has no bfloat16 dynamic-update-slice and
copies a bfloat16 cache whole on every write, and converting between the two forms around each prefill
or decode call would itself copy the cache. Elsewhere the bits cost nothing (a bitcast).

An int8 cache (``init_cache(..., dtype="int8")``) holds each of keys and values as an :class:`Int8KV`:
int8 [L, B, S, K, H] and a float32 scale per token and head [L, B, S, K] (symmetric, ``max |x| / 127``
over H), half a bfloat16 cache's bytes. The functions below write it quantized and read it dequantized
(float32); attention runs XLA's operations on it. The serving engine's paged cache
(``init_paged_cache(..., dtype="int8")``) holds its pages the same way, int8 [L, P, Z, K, H] with scales
[L, P, Z, K]; :func:`write_slots` and :func:`read_pages` quantize and dequantize them (the CPU kernels'
paged attention reads them in place).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from llm_jax import bits
from llm_jax.config import ModelConfig


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Int8KV:
    """Keys or values [L, B, S, K, H] held as int8 ``q_LBSKH`` with a float32 scale per token and head
    ``s_LBSK``: x ≈ q · s. In the paged cache the token axes are pages and rows: [L, P, Z, K, H] and
    [L, P, Z, K]."""

    q_LBSKH: jax.Array
    s_LBSK: jax.Array

    shape = property(lambda self: self.q_LBSKH.shape)
    ndim = property(lambda self: self.q_LBSKH.ndim)
    dtype = property(lambda self: self.q_LBSKH.dtype)
    nbytes = property(lambda self: self.q_LBSKH.nbytes + self.s_LBSK.nbytes)

    def __getitem__(self, index) -> Int8KV:
        """Both arrays indexed alike over their leading axes (``cache[:, rows_B]``)."""
        return Int8KV(self.q_LBSKH[index], self.s_LBSK[index])

    def is_deleted(self) -> bool:
        """Whether its buffers were donated (to a program that failed, or whose result was dropped)."""
        return self.q_LBSKH.is_deleted() or self.s_LBSK.is_deleted()

    @staticmethod
    def zeros(shape: tuple[int, ...], *, sharding: Int8KV | None = None) -> Int8KV:
        """An empty one of ``shape`` [..., H] (scales [...]); ``sharding``: an :class:`Int8KV` of the two
        arrays' shardings."""
        on = sharding or Int8KV(None, None)
        return Int8KV(jnp.zeros(shape, jnp.int8, device=on.q_LBSKH),
                      jnp.zeros(shape[:-1], jnp.float32, device=on.s_LBSK))


def quantize_kv(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """x [..., H] → (int8 q [..., H], float32 s [...]): symmetric, rounding to nearest, s = max |x| / 127."""
    x = x.astype(jnp.float32)
    s = jnp.max(jnp.abs(x), axis=-1) / 127
    q = jnp.round(x / jnp.where(s > 0, s, 1)[..., None])
    return jnp.clip(q, -127, 127).astype(jnp.int8), s


def dequantize_kv(q: jax.Array, s: jax.Array) -> jax.Array:
    """Undoes :func:`quantize_kv` (up to its rounding): q [..., H] · s [...] in float32."""
    return q.astype(jnp.float32) * s[..., None]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
    k_LBSKH: jax.Array
    v_LBSKH: jax.Array
    lengths_B: jax.Array  # int32: valid slots per sequence

    @property
    def batch_size(self) -> int:
        return self.k_LBSKH.shape[1]

    @property
    def max_len(self) -> int:
        return self.k_LBSKH.shape[2]

    @property
    def dtype(self) -> jnp.dtype:
        """The dtype of the keys and values (bfloat16 for a cache that holds their bits)."""
        return _values(self.k_LBSKH)

    @property
    def nbytes(self) -> int:
        return self.k_LBSKH.nbytes + self.v_LBSKH.nbytes + self.lengths_B.nbytes


def init_cache(config: ModelConfig, batch_size: int, max_len: int, dtype=None, *, sharding=None) -> KVCache:
    """An empty cache for ``batch_size`` sequences of up to ``max_len`` tokens (default dtype: compute;
    bfloat16 is held as its bits, see the module's docstring).

    ``sharding``: a :class:`KVCache` of shardings (``llm_jax.sharding.cache_shardings``); each device
    then allocates only its own shard.
    """
    if max_len > config.max_seq_len:
        raise ValueError(f"cache max_len={max_len} exceeds the model's context of {config.max_seq_len} tokens")
    if batch_size <= 0 or max_len <= 0:
        raise ValueError(f"cache needs a positive batch_size and max_len, got {batch_size=} {max_len=}")
    dtype = jnp.dtype(dtype or config.compute_dtype)
    stored = jnp.dtype(jnp.uint16) if dtype == jnp.bfloat16 else dtype
    shape = (config.n_layers, batch_size, max_len, config.n_kv_heads, config.head_dim)
    on = sharding or KVCache(k_LBSKH=None, v_LBSKH=None, lengths_B=None)
    if sharding is not None and isinstance(sharding.k_LBSKH, Int8KV) != (dtype == jnp.int8):
        raise ValueError(f"the shardings of a {dtype} cache must be made for it: "
                         f"cache_shardings(..., dtype={dtype.name!r})")
    if dtype == jnp.int8:
        return KVCache(k_LBSKH=Int8KV.zeros(shape, sharding=on.k_LBSKH),
                       v_LBSKH=Int8KV.zeros(shape, sharding=on.v_LBSKH),
                       lengths_B=jnp.zeros((batch_size,), jnp.int32, device=on.lengths_B))
    return KVCache(k_LBSKH=jnp.zeros(shape, stored, device=on.k_LBSKH),
                   v_LBSKH=jnp.zeros(shape, stored, device=on.v_LBSKH),
                   lengths_B=jnp.zeros((batch_size,), jnp.int32, device=on.lengths_B))


KV_CACHE_DTYPES = ("int8", "bfloat16", "float32")  # what a cache may hold, by name


def cache_dtype(config: ModelConfig, dtype=None) -> jnp.dtype:
    """The dtype a cache of ``dtype`` holds (None: the model's compute dtype); one of
    :data:`KV_CACHE_DTYPES`, else a ValueError naming them."""
    try:
        resolved = jnp.dtype(dtype or config.compute_dtype)
    except TypeError:
        resolved = None
    if resolved is None or resolved.name not in KV_CACHE_DTYPES:
        raise ValueError(f"a KV cache holds one of {', '.join(KV_CACHE_DTYPES)} (or None: the compute dtype), "
                         f"got {dtype!r}")
    return resolved


def cache_bytes_per_token(config: ModelConfig, dtype=None) -> int:
    """Bytes of K and V one token occupies across all layers (int8: and its scales)."""
    itemsize = jnp.dtype(dtype or config.compute_dtype).itemsize
    scales = 4 if jnp.dtype(dtype or config.compute_dtype) == jnp.int8 else 0
    return 2 * config.n_layers * config.n_kv_heads * (config.head_dim * itemsize + scales)


def as_bits(cache: KVCache) -> KVCache:
    """The cache with bfloat16 keys and values held as their bits (uint16), as :func:`init_cache` makes
    them (for a cache built from bfloat16 arrays elsewhere). The functions below take either form;
    :func:`from_bits` undoes it."""
    return dataclasses.replace(cache, k_LBSKH=bits.as_bits(cache.k_LBSKH), v_LBSKH=bits.as_bits(cache.v_LBSKH))


def from_bits(cache: KVCache, dtype) -> KVCache:
    """Undoes :func:`as_bits` for a cache that was of ``dtype``."""
    return dataclasses.replace(cache, k_LBSKH=bits.from_bits(cache.k_LBSKH, dtype),
                               v_LBSKH=bits.from_bits(cache.v_LBSKH, dtype))


def _values(cache_LBSKH: jax.Array) -> jnp.dtype:
    """The dtype of the values ``cache_LBSKH`` holds (uint16: bfloat16 held as bits)."""
    return jnp.dtype(jnp.bfloat16) if cache_LBSKH.dtype == jnp.uint16 else cache_LBSKH.dtype


def stored(cache_LBSKH: jax.Array, new: jax.Array) -> jax.Array:
    """``new`` as ``cache_LBSKH`` stores it (rounded to the cache's values, as bits when it holds bits)."""
    new = new.astype(_values(cache_LBSKH))
    return bits.as_bits(new) if cache_LBSKH.dtype == jnp.uint16 else new


def write_block(cache_LBSKH: jax.Array, layer: jax.Array, new_BTKH: jax.Array) -> jax.Array:
    """Write a block of T tokens at slots [0, T) of every row (prefill)."""
    zero = jnp.zeros((), jnp.int32)
    if isinstance(cache_LBSKH, Int8KV):
        q_BTKH, s_BTK = quantize_kv(new_BTKH)
        return Int8KV(jax.lax.dynamic_update_slice(cache_LBSKH.q_LBSKH, q_BTKH[None], (layer, zero, zero, zero, zero)),
                      jax.lax.dynamic_update_slice(cache_LBSKH.s_LBSK, s_BTK[None], (layer, zero, zero, zero)))
    return jax.lax.dynamic_update_slice(cache_LBSKH, stored(cache_LBSKH, new_BTKH[None]),
                                        (layer, zero, zero, zero, zero))


def write_tokens(cache_LBSKH: jax.Array, layer: jax.Array, slots_BT: jax.Array, new_BTKH: jax.Array) -> jax.Array:
    """Write token (b, t) at slot ``slots_BT[b, t]`` of ``layer``; out-of-range slots are dropped."""
    # Rows are indexed explicitly: a scatter vmapped over B made XLA:CPU lay the cache out batch-major
    # inside the layer loop and copy the whole cache twice per layer and step.
    rows_B1 = jnp.arange(cache_LBSKH.shape[1], dtype=jnp.int32)[:, None]
    if isinstance(cache_LBSKH, Int8KV):
        q_BTKH, s_BTK = quantize_kv(new_BTKH)
        return Int8KV(cache_LBSKH.q_LBSKH.at[layer, rows_B1, slots_BT].set(q_BTKH, mode="drop"),
                      cache_LBSKH.s_LBSK.at[layer, rows_B1, slots_BT].set(s_BTK, mode="drop"))
    return cache_LBSKH.at[layer, rows_B1, slots_BT].set(stored(cache_LBSKH, new_BTKH), mode="drop")


def read_layer(cache_LBSKH: jax.Array, layer: jax.Array) -> jax.Array:
    """The keys or values of layer ``layer``: [B, S, K, H] (bfloat16 for a cache of bits; float32 for int8)."""
    if isinstance(cache_LBSKH, Int8KV):
        q_BSKH = jax.lax.dynamic_index_in_dim(cache_LBSKH.q_LBSKH, layer, keepdims=False)
        s_BSK = jax.lax.dynamic_index_in_dim(cache_LBSKH.s_LBSK, layer, keepdims=False)
        return dequantize_kv(q_BSKH, s_BSK)
    layer_BSKH = jax.lax.dynamic_index_in_dim(bits.as_bits(cache_LBSKH), layer, keepdims=False)
    return bits.from_bits(layer_BSKH, _values(cache_LBSKH))


# The paged KV cache of the serving engine (``llm_jax.serving``): a pool of P pages of Z tokens per layer,
# shared by every sequence through its block table (page b of a sequence holds its positions
# [b·Z, (b + 1)·Z)). Page 0 is never handed out (``llm_jax.serving.NULL_BLOCK``): block tables are padded
# with it, and padding tokens write there.


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PagedKVCache:
    k_LPZKH: jax.Array
    v_LPZKH: jax.Array

    @property
    def num_pages(self) -> int:
        return self.k_LPZKH.shape[1]

    @property
    def page_size(self) -> int:
        return self.k_LPZKH.shape[2]

    @property
    def dtype(self) -> jnp.dtype:
        """The dtype of the keys and values (bfloat16 for a cache that holds their bits)."""
        return _values(self.k_LPZKH)

    @property
    def nbytes(self) -> int:
        return self.k_LPZKH.nbytes + self.v_LPZKH.nbytes


def init_paged_cache(config: ModelConfig, num_pages: int, page_size: int, dtype=None, *,
                     sharding: PagedKVCache | None = None) -> PagedKVCache:
    """An empty pool of ``num_pages`` pages of ``page_size`` tokens (default dtype: compute; bfloat16 held
    as its bits, as :func:`init_cache` does; int8 as :class:`Int8KV`). ``sharding``: a :class:`PagedKVCache`
    of shardings (``llm_jax.sharding.paged_cache_shardings`` for the same dtype)."""
    if num_pages < 2 or page_size < 1:
        raise ValueError(f"a paged cache needs at least 2 pages (page 0 is padding) of at least 1 token, got "
                         f"{num_pages=} {page_size=}")
    dtype = jnp.dtype(dtype or config.compute_dtype)
    stored_dtype = jnp.dtype(jnp.uint16) if dtype == jnp.bfloat16 else dtype
    shape = (config.n_layers, num_pages, page_size, config.n_kv_heads, config.head_dim)
    on = sharding or PagedKVCache(k_LPZKH=None, v_LPZKH=None)
    if sharding is not None and isinstance(sharding.k_LPZKH, Int8KV) != (dtype == jnp.int8):
        raise ValueError(f"the shardings of a {dtype} paged cache must be made for it: "
                         f"paged_cache_shardings(..., dtype={dtype.name!r})")
    if dtype == jnp.int8:
        return PagedKVCache(k_LPZKH=Int8KV.zeros(shape, sharding=on.k_LPZKH),
                            v_LPZKH=Int8KV.zeros(shape, sharding=on.v_LPZKH))
    return PagedKVCache(k_LPZKH=jnp.zeros(shape, stored_dtype, device=on.k_LPZKH),
                        v_LPZKH=jnp.zeros(shape, stored_dtype, device=on.v_LPZKH))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, kw_only=True)
class PagedBatch:
    """Where a serving step's flat, ragged batch of T tokens lives on the pages, for B sequences.

    Sequence b owns tokens ``query_start_B[b]`` ... ``query_start_B[b] + num_tokens_B[b] - 1``: the last
    ``num_tokens_B[b]`` of its ``seq_lens_B[b]`` tokens, so its token i sits at position
    ``seq_lens_B[b] - num_tokens_B[b] + i``. Its position s is row s % Z of page ``block_tables_BX[b, s // Z]``.
    Token t's key and value go to slot ``slots_T[t]`` (page · Z + row). Padding sequences have no tokens;
    padding tokens write to page 0. ``max_query_len`` (static) bounds ``num_tokens_B``.
    """

    slots_T: jax.Array  # int32
    block_tables_BX: jax.Array  # int32
    query_start_B: jax.Array  # int32
    num_tokens_B: jax.Array  # int32
    seq_lens_B: jax.Array  # int32
    max_query_len: int = dataclasses.field(metadata=dict(static=True))


def rows_as_pages(slots_BT: jax.Array, positions_BT: jax.Array, max_len: int) -> PagedBatch:
    """A step of :func:`llm_jax.model.transformer.forward_extend` over a :class:`KVCache` of ``max_len``
    slots, as a :class:`PagedBatch` over the same arrays read as pages: row b of [L, B, S, K, H] is page b
    of S tokens ([L, P = B, Z = S, K, H]), so paged attention kernels serve the contiguous cache in place.
    Row b's T tokens (consecutive positions ``positions_BT[b]``) are tokens b·T … b·T + T − 1 of the flat
    step. Only tokens with a slot in the cache are the row's: a finished row (its slots past the cache,
    writing nothing) has none, and tokens past the cache's end (speculative verification there, whose
    outputs no emitted token depends on) are no sequence's, so attention gives them 0."""
    B, T = slots_BT.shape
    rows_B = jnp.arange(B, dtype=jnp.int32)
    in_cache_BT = (slots_BT >= 0) & (slots_BT < max_len)
    num_tokens_B = jnp.sum(in_cache_BT, axis=1, dtype=jnp.int32)
    return PagedBatch(slots_T=jnp.where(in_cache_BT, rows_B[:, None] * max_len + slots_BT, -1).reshape(B * T),
                      block_tables_BX=rows_B[:, None], query_start_B=rows_B * T, num_tokens_B=num_tokens_B,
                      seq_lens_B=jnp.where(num_tokens_B > 0, positions_BT[:, 0] + num_tokens_B, 0).astype(jnp.int32),
                      max_query_len=T)


def write_slots(pages_LPZKH: jax.Array, layer: jax.Array, slots_T: jax.Array, new_TKH: jax.Array) -> jax.Array:
    """Write token t at slot ``slots_T[t]`` (page · Z + row) of layer ``layer``; slots past the pool are
    dropped. Int8 pages take each token's keys or values quantized per head (:func:`quantize_kv`)."""
    P, Z = pages_LPZKH.shape[1:3]
    slots_T = jnp.where((slots_T >= 0) & (slots_T < P * Z), slots_T, P * Z)
    at = (layer, slots_T // Z, slots_T % Z)
    if isinstance(pages_LPZKH, Int8KV):
        q_TKH, s_TK = quantize_kv(new_TKH)
        return Int8KV(pages_LPZKH.q_LBSKH.at[at].set(q_TKH, mode="drop"),
                      pages_LPZKH.s_LBSK.at[at].set(s_TK, mode="drop"))
    return pages_LPZKH.at[at].set(stored(pages_LPZKH, new_TKH), mode="drop")


def read_pages(pages_LPZKH: jax.Array, layer: jax.Array, block_tables_BX: jax.Array) -> jax.Array:
    """The keys or values of every sequence, position by position: [B, X·Z, K, H] (bfloat16 for bits;
    float32, dequantized, for int8)."""
    if isinstance(pages_LPZKH, Int8KV):
        return dequantize_kv(read_pages(pages_LPZKH.q_LBSKH, layer, block_tables_BX),
                             read_pages(pages_LPZKH.s_LBSK, layer, block_tables_BX))
    layer_PZKH = jax.lax.dynamic_index_in_dim(bits.as_bits(pages_LPZKH), layer, keepdims=False)
    B, X = block_tables_BX.shape
    seq_BSKH = layer_PZKH[block_tables_BX].reshape(B, X * layer_PZKH.shape[1], *layer_PZKH.shape[2:])
    return bits.from_bits(seq_BSKH, _values(pages_LPZKH))
