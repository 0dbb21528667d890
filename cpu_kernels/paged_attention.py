"""Paged attention on CPU for the serving engine: one step's flat, ragged batch of T query tokens from B
sequences (decode tokens and prefill chunks together) against one layer of a KV cache held in pages,
read where the pages lie (``paged_attention.cc``). Forward only: the engine never differentiates.

    paged_attention(q_TNH, k_LPZKH, v_LPZKH, layer, block_tables_BX, query_start_B, num_tokens_B, seq_lens_B,
                    *, scale, window, softcap) -> o_TNH float32
    paged_attention_append(q_TNH, k_new_TKH, v_new_TKH, k_LPZKH, v_LPZKH, layer, slots_T, block_tables_BX,
                           query_start_B, num_tokens_B, seq_lens_B, *, scale, window, softcap)
        -> (o_TNH, k_LPZKH, v_LPZKH)

Pages are [L, P, Z, K, H]: L layers of P pages of Z tokens, float32, bfloat16, or bfloat16 held as its bits
(uint16), or int8 as a pair (int8 q [L, P, Z, K, H], float32 scales s [L, P, Z, K]: x = q · s, a scale per
slot and kv head; then k_new and v_new are pairs too, [T, K, H] and [T, K]); ``layer`` (int32, may be
traced) selects the layer. Sequence b owns q rows ``query_start_B[b]`` ... ``query_start_B[b] +
num_tokens_B[b] - 1``, the last ``num_tokens_B[b]`` of its ``seq_lens_B[b]`` tokens: its query i sits at
position p = seq_lens_B[b] − num_tokens_B[b] + i, and its key position s at row s % Z of page
``block_tables_BX[b, s // Z]``. A query at p sees keys s ≤ p (and p − s < window with a window); scores
· scale, soft-capped (softcap · tanh(score / softcap)) with a softcap, softmax in float32. A query with no
visible key, a padding sequence's (num_tokens 0) and every q row no sequence owns give 0. Sequences own
disjoint rows; a page index outside [0, P) is clamped. Query head n reads kv head n // (N / K).

The ``_append`` form first writes row t of the step's keys and values [T, K, H] (the pages' dtype) at slot
``slots_T[t]`` = page · Z + row of layer ``layer`` (nothing for a slot outside [0, P · Z): padding), then
attends, and returns the pages too, updated in place: donate them, or carry them in a loop.

On CPU, with the kernels built, the kernels run; elsewhere :func:`paged_attention_xla` and
:func:`paged_attention_append_xla`, the same in plain jnp (each token's sequence gathered from the pages:
[T, X · Z, K, H], for tests and small steps), the kernels' oracle.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from cpu_kernels import build
from cpu_kernels.attention_call import _attributes, _target


def _as_int32(name: str, x) -> jax.Array:
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.integer):
        raise ValueError(f"paged_attention: {name} must be integers, got {x.dtype} {x.shape}")
    return x.astype(jnp.int32)


def _int8(pages) -> bool:
    """Whether ``pages`` (or new rows) are int8 with their scales, a pair (q, s)."""
    return isinstance(pages, tuple)


def _check_int8(name: str, what: str, x, rank: int) -> jax.Array:
    """The int8 values of a pair (q [..., H] int8, s [...] float32) of ``rank`` dimensions; the array
    itself for any other."""
    if not _int8(x):
        return x
    if len(x) != 2 or x[0].dtype != jnp.int8 or x[0].ndim != rank or x[1].dtype != jnp.float32 or (
            x[1].shape != x[0].shape[:-1]):
        shapes = [(getattr(a, "shape", None), getattr(a, "dtype", None)) for a in x]
        raise ValueError(f"{name}: int8 {what} must be a pair (int8 q [{rank} dims], float32 scales q.shape[:-1]), "
                         f"got {shapes}")
    return x[0]


def _check(name: str, q_TNH, k_LPZKH, v_LPZKH, layer, block_tables_BX, query_start_B, num_tokens_B, seq_lens_B,
           window, softcap) -> None:
    if _int8(k_LPZKH) != _int8(v_LPZKH):
        raise ValueError(f"{name} needs pages k and v alike, got one int8 pair and one array")
    k_LPZKH, v_LPZKH = (_check_int8(name, "pages", x, 5) for x in (k_LPZKH, v_LPZKH))
    if k_LPZKH.ndim != 5 or v_LPZKH.shape != k_LPZKH.shape or v_LPZKH.dtype != k_LPZKH.dtype:
        raise ValueError(f"{name} needs pages k and v [L, P, Z, K, H] alike, got k {k_LPZKH.shape} {k_LPZKH.dtype}, "
                         f"v {v_LPZKH.shape} {v_LPZKH.dtype}")
    L, P, Z, K, H = k_LPZKH.shape
    if min(L, P, Z, K, H) < 1:
        raise ValueError(f"{name}: pages [L, P, Z, K, H] must have every dimension >= 1, got {k_LPZKH.shape}")
    if k_LPZKH.dtype != jnp.int8:
        _target("paged", k_LPZKH)  # names the dtype when it is not supported
    if q_TNH.ndim != 3 or q_TNH.shape[2] != H or q_TNH.shape[1] % K:
        raise ValueError(f"{name} needs q [T, N, H] with N a multiple of K = {K} and H = {H} (pages "
                         f"{k_LPZKH.shape}), got q {q_TNH.shape}")
    if not jnp.issubdtype(q_TNH.dtype, jnp.floating):
        raise ValueError(f"{name}: q must be floating point, got {q_TNH.dtype}")
    if block_tables_BX.ndim != 2:
        raise ValueError(f"{name}: block_tables must be [B, X], got {block_tables_BX.shape}")
    B = block_tables_BX.shape[0]
    for what, a in (("query_start", query_start_B), ("num_tokens", num_tokens_B), ("seq_lens", seq_lens_B)):
        if a.shape != (B,):
            raise ValueError(f"{name}: {what} must be [B] = ({B},) like block_tables {block_tables_BX.shape}, "
                             f"got {a.shape}")
    if jnp.ndim(layer) != 0:
        raise ValueError(f"{name}: layer must be a scalar, got shape {jnp.shape(layer)}")
    if window is not None and window < 1:
        raise ValueError(f"{name}: window must be None or >= 1, got {window}")
    if softcap is not None and not softcap > 0:
        raise ValueError(f"{name}: softcap must be None or > 0, got {softcap}")


def _values(pages) -> jax.Array:
    """Pages as float32 (bfloat16 bits read as bfloat16; int8 pairs dequantized, q · s)."""
    if _int8(pages):
        q, s = pages
        return q.astype(jnp.float32) * s[..., None]
    if pages.dtype == jnp.uint16:
        pages = jax.lax.bitcast_convert_type(pages, jnp.bfloat16)
    return pages.astype(jnp.float32)


def paged_attention_xla(q_TNH, k_LPZKH, v_LPZKH, layer, block_tables_BX, query_start_B, num_tokens_B, seq_lens_B,
                        *, scale: float, window: int | None, softcap: float | None) -> jax.Array:
    """:func:`paged_attention` in plain jnp: each q row's sequence (the first that owns it) gathered from
    the pages, position by position, [T, X · Z, K, H]; masked; softmax in float32: o [T, N, H] float32."""
    block_tables_BX, query_start_B, num_tokens_B, seq_lens_B = (
        jnp.asarray(a, jnp.int32) for a in (block_tables_BX, query_start_B, num_tokens_B, seq_lens_B))
    T, N, H = q_TNH.shape
    _, P, Z, K, _ = _check_int8("paged_attention", "pages", k_LPZKH, 5).shape
    X = block_tables_BX.shape[1]
    t_T = jnp.arange(T, dtype=jnp.int32)
    owns_TB = (t_T[:, None] >= query_start_B) & (t_T[:, None] < query_start_B + num_tokens_B)
    b_T = jnp.argmax(owns_TB, axis=1)
    owned_T = jnp.any(owns_TB, axis=1)
    p_T = seq_lens_B[b_T] - num_tokens_B[b_T] + t_T - query_start_B[b_T]
    s_S = jnp.arange(X * Z, dtype=jnp.int32)
    visible_TS = owned_T[:, None] & (s_S <= p_T[:, None])
    if window is not None:
        visible_TS &= p_T[:, None] - s_S < window
    pages_TX = jnp.clip(block_tables_BX[b_T], 0, P - 1)

    def gather(pages_LPZKH):  # [T, X · Z, K, H] float32, zero where not visible (unwritten slots may hold NaN)
        rows_TXZKH = jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, layer, keepdims=False)[pages_TX],
                                  pages_LPZKH)
        x_TSKH = _values(rows_TXZKH).reshape(T, X * Z, K, H)
        return jnp.where(visible_TS[:, :, None, None], x_TSKH, 0.0)

    k_TSKH, v_TSKH = gather(k_LPZKH), gather(v_LPZKH)
    q_TKGH = q_TNH.astype(jnp.float32).reshape(T, K, N // K, H)
    scores_TKGS = jnp.einsum("TKGH,TSKH->TKGS", q_TKGH, k_TSKH, precision="highest") * scale
    if softcap is not None:
        scores_TKGS = softcap * jnp.tanh(scores_TKGS / softcap)
    visible_T11S = visible_TS[:, None, None, :]
    scores_TKGS = jnp.where(visible_T11S, scores_TKGS, -jnp.inf)
    top_TKG1 = jnp.max(scores_TKGS, axis=-1, keepdims=True)
    e_TKGS = jnp.where(visible_T11S, jnp.exp(scores_TKGS - jnp.where(jnp.isfinite(top_TKG1), top_TKG1, 0.0)), 0.0)
    p_TKGS = e_TKGS / jnp.maximum(jnp.sum(e_TKGS, axis=-1, keepdims=True), jnp.finfo(jnp.float32).tiny)
    o_TKGH = jnp.einsum("TKGS,TSKH->TKGH", p_TKGS, v_TSKH, precision="highest")
    return o_TKGH.reshape(T, N, H)


def write_slots_xla(pages_LPZKH, layer, slots_T: jax.Array, new_TKH):
    """Row t of ``new_TKH`` at slot ``slots_T[t]`` (page · Z + row) of layer ``layer``; slots outside
    [0, P · Z) write nothing. Int8 pages take int8 rows with their scales (pairs), both written."""
    P, Z = _check_int8("write_slots", "pages", pages_LPZKH, 5).shape[1:3]
    slots_T = jnp.asarray(slots_T, jnp.int32)
    inside_T = (slots_T >= 0) & (slots_T < P * Z)
    page_T = jnp.where(inside_T, slots_T // Z, P)  # past the pool: dropped
    return jax.tree.map(lambda pages, new: pages.at[layer, page_T, slots_T % Z].set(new, mode="drop"), pages_LPZKH,
                        new_TKH)


def paged_attention_append_xla(q_TNH, k_new_TKH, v_new_TKH, k_LPZKH, v_LPZKH, layer, slots_T, block_tables_BX,
                               query_start_B, num_tokens_B, seq_lens_B, *, scale: float, window: int | None,
                               softcap: float | None) -> tuple[jax.Array, jax.Array, jax.Array]:
    """:func:`paged_attention_append` in plain jnp: the writes as a scatter, then :func:`paged_attention_xla`."""
    k_LPZKH = write_slots_xla(k_LPZKH, layer, slots_T, k_new_TKH)
    v_LPZKH = write_slots_xla(v_LPZKH, layer, slots_T, v_new_TKH)
    o_TNH = paged_attention_xla(q_TNH, k_LPZKH, v_LPZKH, layer, block_tables_BX, query_start_B, num_tokens_B,
                                seq_lens_B, scale=scale, window=window, softcap=softcap)
    return o_TNH, k_LPZKH, v_LPZKH


def _operands(k, v) -> tuple:
    """Keys and values as the kernels take them: (k, v); int8 pairs as (k_q, v_q, k_s, v_s)."""
    return (k[0], v[0], k[1], v[1]) if _int8(k) else (k, v)


def _kernel_target(k_LPZKH) -> str:
    return "llm_jax_paged_attention_i8" if _int8(k_LPZKH) else _target("paged", k_LPZKH)


def _kernel(q_TNH, k_LPZKH, v_LPZKH, layer, block_tables_BX, query_start_B, num_tokens_B, seq_lens_B, *,
            scale, window, softcap):
    call = jax.ffi.ffi_call(_kernel_target(k_LPZKH), jax.ShapeDtypeStruct(q_TNH.shape, jnp.float32),
                            vmap_method="sequential")
    return call(layer, q_TNH, *_operands(k_LPZKH, v_LPZKH), block_tables_BX, query_start_B, num_tokens_B,
                seq_lens_B, **_attributes(window, scale, softcap))


def _append_kernel(q_TNH, k_new_TKH, v_new_TKH, k_LPZKH, v_LPZKH, layer, slots_T, block_tables_BX, query_start_B,
                   num_tokens_B, seq_lens_B, *, scale, window, softcap):
    new, pages = _operands(k_new_TKH, v_new_TKH), _operands(k_LPZKH, v_LPZKH)
    target = _kernel_target(k_LPZKH).replace("_attention_", "_attention_append_")
    results = (jax.ShapeDtypeStruct(q_TNH.shape, jnp.float32), *(jax.ShapeDtypeStruct(a.shape, a.dtype) for a in pages))
    aliases = {2 + len(new) + i: 1 + i for i in range(len(pages))}  # after layer, q and the new rows
    call = jax.ffi.ffi_call(target, results, vmap_method="sequential", input_output_aliases=aliases)
    o_TNH, *pages = call(layer, q_TNH, *new, *pages, slots_T, block_tables_BX, query_start_B, num_tokens_B, seq_lens_B,
                         **_attributes(window, scale, softcap))
    if _int8(k_LPZKH):
        return o_TNH, (pages[0], pages[2]), (pages[1], pages[3])
    return o_TNH, pages[0], pages[1]


def _on_cpu(kernel, xla, *operands, scale, window, softcap):
    """The kernel on CPU where it is built, ``xla`` elsewhere."""
    options = {"scale": scale, "window": window, "softcap": softcap}
    if not build.load():
        return xla(*operands, **options)
    return jax.lax.platform_dependent(*operands, cpu=functools.partial(kernel, **options),
                                      default=functools.partial(xla, **options))


def paged_attention(q_TNH: jax.Array, k_LPZKH: jax.Array, v_LPZKH: jax.Array, layer, block_tables_BX,
                    query_start_B, num_tokens_B, seq_lens_B, *, scale: float, window: int | None,
                    softcap: float | None) -> jax.Array:
    """Attention of the step's T query tokens q [T, N, H] over layer ``layer`` of the pages [L, P, Z, K, H]
    (or int8 pairs), each sequence's keys read through its block table: o [T, N, H] float32 (see the
    module's docstring)."""
    block_tables_BX, query_start_B, num_tokens_B, seq_lens_B = (
        _as_int32(name, a) for name, a in (("block_tables", block_tables_BX), ("query_start", query_start_B),
                                           ("num_tokens", num_tokens_B), ("seq_lens", seq_lens_B)))
    _check("paged_attention", q_TNH, k_LPZKH, v_LPZKH, layer, block_tables_BX, query_start_B, num_tokens_B,
           seq_lens_B, window, softcap)
    return _on_cpu(_kernel, paged_attention_xla, q_TNH.astype(jnp.float32), k_LPZKH, v_LPZKH,
                   _as_int32("layer", layer), block_tables_BX, query_start_B, num_tokens_B, seq_lens_B, scale=scale,
                   window=window, softcap=softcap)


def paged_attention_append(q_TNH: jax.Array, k_new_TKH: jax.Array, v_new_TKH: jax.Array, k_LPZKH: jax.Array,
                           v_LPZKH: jax.Array, layer, slots_T, block_tables_BX, query_start_B, num_tokens_B,
                           seq_lens_B, *, scale: float, window: int | None,
                           softcap: float | None) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Write row t of k_new and v_new [T, K, H] (the pages' dtype; int8 pages: pairs of int8 rows and their
    scales [T, K]) at slot ``slots_T[t]`` of layer ``layer`` (nothing outside [0, P · Z)), then
    :func:`paged_attention`: (o [T, N, H] float32, k pages, v pages), the pages updated in place."""
    slots_T, block_tables_BX, query_start_B, num_tokens_B, seq_lens_B = (
        _as_int32(name, a) for name, a in (("slots", slots_T), ("block_tables", block_tables_BX),
                                           ("query_start", query_start_B), ("num_tokens", num_tokens_B),
                                           ("seq_lens", seq_lens_B)))
    _check("paged_attention_append", q_TNH, k_LPZKH, v_LPZKH, layer, block_tables_BX, query_start_B, num_tokens_B,
           seq_lens_B, window, softcap)
    T, _, H = q_TNH.shape
    pages = _check_int8("paged_attention_append", "pages", k_LPZKH, 5)
    K = pages.shape[3]
    for name, new in (("k_new", k_new_TKH), ("v_new", v_new_TKH)):
        if _int8(new) != _int8(k_LPZKH):
            raise ValueError(f"paged_attention_append: {name} must be an int8 pair exactly when the pages are")
        new = _check_int8("paged_attention_append", name, new, 3)
        if new.shape != (T, K, H) or new.dtype != pages.dtype:
            raise ValueError(f"paged_attention_append: {name} must be [T, K, H] = {(T, K, H)} of the pages' dtype "
                             f"{pages.dtype}, got {new.shape} {new.dtype}")
    if slots_T.shape != (T,):
        raise ValueError(f"paged_attention_append: slots must be [T] = ({T},), got {slots_T.shape}")
    return _on_cpu(_append_kernel, paged_attention_append_xla, q_TNH.astype(jnp.float32), k_new_TKH, v_new_TKH,
                   k_LPZKH, v_LPZKH, _as_int32("layer", layer), slots_T, block_tables_BX, query_start_B, num_tokens_B,
                   seq_lens_B, scale=scale, window=window, softcap=softcap)
