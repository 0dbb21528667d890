"""Matrix products, attention and greedy argmax for LLM inference on CPU: XLA FFI custom calls written
in C++ (``matmul.cc``, ``decode_attention.cc``, ``prefill_attention.cc``, ``paged_attention.cc``,
``argmax.cc``, ``glu.cc``); and ``stream_read.cc`` and ``peak_flops.cc``, the benchmark's probes of memory
bandwidth and arithmetic peak (``build.stream_read()``, ``build.arithmetic_probe()``).

Depends on jax only. ``matmul(x_RK, w)`` computes x [R, K] · W in float32 for W [K, N] or, with
``transposed=True``, W [N, K], or, with ``panels=True``, W held as panels of 16 columns [N / 16, K, 16]
(``to_panels``), in float32 or bfloat16 — the product decode runs for every weight matrix. The panel
layout is the fastest: many rows run the register tiles on it as it lies, one row streams a few panels
at a time. On CPU, with few rows R (decode), it streams the weights at memory bandwidth on every core;
with many (batched decode, prefill) it runs register-tiled products on packed panels of the weights
(a tied LM head [N, K] at up to 32 rows: on its rows as they lie, against x transposed);
either way it reads bfloat16 weights as they are (XLA:CPU has no bfloat16 kernel and converts whole
matrices to float32 first); on other platforms, and when the kernels cannot be built (no C++
compiler), it is XLA's product. Gradients are XLA's.

Instruction paths beyond the float32 vectors are each a keyword option of the calls that can take them,
on by default (used where the CPU and the build have them, :mod:`cpu_kernels.build`'s probes): ``amx``
(AMX's tiles) and ``bf16_dot`` (AVX-512's bfloat16 dot products) for bfloat16 products on panels of many
rows, and ``int8_dot`` (AVX-512 VNNI) for the int8 products in quads of rows. They reach the kernels as
attributes of each call, never from the environment; the greedy heads take the options of the head's
product they stand for.

    available() -> bool          # the kernels are built and registered for this process
    matmul(x_RK, w, *, transposed=False, panels=False, layer=None, amx=True, bf16_dot=True, int8_dot=True)
        -> y_RN (float32; x is rounded to w's dtype first, as in XLA; with ``layer``, w is a stack [L, ...] of
        which that layer is read, in place; int8 panels too, unscaled and x not rounded: the LM head's screen
        of llm_jax/backends/cpu/greedy_head.py)
    matmuls(x_RK, ws, *, ...) -> (y_RN, ...)  # weights sharing x, one call; matmul's options
    to_panels(w_KN) -> p [N / 16, K, 16];  from_panels(p) -> w_KN   # leading axes (layers) kept
    to_pairs(p) -> p in pairs of rows;  from_pairs(p) -> p  # what matmuls(..., pairs=True) reads
    pairs_available() -> bool   # products on pairs can run on the kernels (AVX512_BF16), else XLA's
    to_quads(p) -> int8 p in quads of rows;  from_quads(p) -> p  # what matmuls(..., quads=True) reads
    quads_available() -> bool   # products on quads can run on the kernels (AVX512_VNNI), else XLA's
    quantize_rows(x_RK) -> (n_RK int8, t_R)  # x per row as the products on quads quantize it
    decode_attention(q_BNH, k_LBSKH, v_LBSKH, layer, ...) -> o_BNH  # one query per row, cache read in place
    decode_attention_append(q_BNH, k_new_BKH, v_new_BKH, k_LBSKH, v_LBSKH, layer, slots_B, ...)
        -> (o_BNH, k_LBSKH, v_LBSKH)  # the step's keys and values written first, the caches in place
    prefill_attention(q_BTNH, k_LBSKH, v_LBSKH, layer, ...) -> o_BTNH  # many queries per row: visible keys only
    paged_attention(q_TNH, k_LPZKH, v_LPZKH, layer, block_tables_BX, query_start_B, num_tokens_B, seq_lens_B, ...)
        -> o_TNH  # a serving step's ragged tokens over the pages of a paged cache, read in place (int8
                  # pages as pairs (values, scales [L, P, Z, K]), dequantized as they are read)
    paged_attention_append(q_TNH, k_new_TKH, v_new_TKH, k_LPZKH, v_LPZKH, layer, slots_T, block_tables_BX, ...)
        -> (o_TNH, k_LPZKH, v_LPZKH)  # the step's keys and values written at their slots first, pages in place
    argmax(x_BV) -> i_B   # jnp.argmax over the last axis (float32), vectorized; XLA's off the CPU
    screened_argmax(y_BV, x_BD, panels, scales_V, norms_V, c1, c2, errors_V=None, *, amx=True, bf16_dot=True)
        -> i_B  # argmax of x · W from a screen: the token of matmul's product (with those options), then argmax
    quads_argmax(x_BD, quads, panels, scales_V, errors_V, norms_V, c1, c2, *, amx=True, bf16_dot=True,
        int8_dot=True) -> i_B  # the same through the int8 screen in quads, its product in the same call
    glu(y_RE, activation) -> act(gate) · up [R, E / 2]  # the gated MLP's activation on y = [gate | up]
    gated(gate, up, activation) -> act(gate) · up  # the same through XLA, gate and up apart
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from cpu_kernels import build
from cpu_kernels.decode_attention import decode_attention, decode_attention_append
from cpu_kernels.paged_attention import paged_attention, paged_attention_append
from cpu_kernels.prefill_attention import prefill_attention
from cpu_kernels.quant_matmul import quant_matmul

__all__ = ["GLU_ACTIVATIONS", "PANEL", "argmax", "available", "decode_attention", "decode_attention_append",
           "from_pairs", "from_panels", "from_quads", "gated", "glu", "matmul", "matmuls", "paged_attention",
           "paged_attention_append", "pairs_available", "prefill_attention", "quads_argmax", "quads_available",
           "quant_matmul", "quantize_rows", "screened_argmax", "to_pairs", "to_panels", "to_quads"]


def available() -> bool:
    """True when the default backend is the CPU and the kernels are built and registered."""
    return jax.default_backend() == "cpu" and build.load()


PANEL = 16  # columns per panel of the panel layout
QUADS_MAX_K = 1 << 16  # rows of K the products on quads take, at most this less one (common.h kQuadsMaxK)


def to_panels(w: jax.Array) -> jax.Array:
    """W [..., K, N] → its panel layout [..., N / 16, K, 16]: panel q holds columns 16q ... 16q + 15, row
    after row (N must be a multiple of 16)."""
    *lead, K, N = w.shape
    if N % PANEL:
        raise ValueError(f"the panel layout needs a multiple of {PANEL} columns, got W {w.shape}")
    return jnp.swapaxes(w.reshape(*lead, K, N // PANEL, PANEL), -3, -2)


def from_panels(p: jax.Array) -> jax.Array:
    """The panel layout [..., N / 16, K, 16] → W [..., K, N] (the inverse of :func:`to_panels`)."""
    *lead, P, K, width = p.shape
    if width != PANEL:
        raise ValueError(f"panels are [..., N / {PANEL}, K, {PANEL}], got {p.shape}")
    return jnp.swapaxes(p, -3, -2).reshape(*lead, K, P * PANEL)


def _interleaved(p: jax.Array, g: int) -> jax.Array:
    """Panels [..., N / 16, K, 16] with each g rows interleaved, [..., N / 16, K / g, 16, g], held as
    [..., N / 16, K, 16] (K a multiple of g)."""
    *lead, P, K, _ = p.shape
    return jnp.swapaxes(p.reshape(*lead, P, K // g, g, PANEL), -2, -1).reshape(p.shape)


def _deinterleaved(p: jax.Array, g: int) -> jax.Array:
    """The inverse of :func:`_interleaved`."""
    *lead, P, K, _ = p.shape
    return jnp.swapaxes(p.reshape(*lead, P, K // g, PANEL, g), -2, -1).reshape(p.shape)


def to_pairs(p: jax.Array) -> jax.Array:
    """Panels [..., N / 16, K, 16] → the same panels in pairs of rows, the layout the CPU's bfloat16 dot
    products read (K even): rows 2i and 2i + 1 of a panel interleaved, [..., N / 16, K / 2, 16, 2], held
    as [..., N / 16, K, 16] (same shape and size; only the order within each panel differs)."""
    *lead, P, K, width = p.shape
    if width != PANEL or K % 2:
        raise ValueError(f"pairs of rows need panels [..., N / {PANEL}, K, {PANEL}] with K even, got {p.shape}")
    return _interleaved(p, 2)


def from_pairs(p: jax.Array) -> jax.Array:
    """The inverse of :func:`to_pairs`: panels [..., N / 16, K, 16] in their plain row order."""
    return _deinterleaved(p, 2)


def to_quads(p: jax.Array) -> jax.Array:
    """int8 panels [..., N / 16, K, 16] → the same panels in quads of rows, the layout AVX-512 VNNI's dot
    products read (K a multiple of 4): rows 4i … 4i + 3 of a panel interleaved, [..., N / 16, K / 4, 16, 4],
    held as [..., N / 16, K, 16] (same shape and size; only the order within each 64-byte line differs)."""
    *lead, P, K, width = p.shape
    if width != PANEL or K % 4 or p.dtype != jnp.int8:
        raise ValueError(f"quads of rows need int8 panels [..., N / {PANEL}, K, {PANEL}] with K a multiple of 4, "
                         f"got {p.dtype} {p.shape}")
    return _interleaved(p, 4)


def from_quads(p: jax.Array) -> jax.Array:
    """The inverse of :func:`to_quads`: panels [..., N / 16, K, 16] in their plain row order."""
    return _deinterleaved(p, 4)


def quads_available() -> bool:
    """Whether products on int8 panels in quads (``matmuls(..., quads=True)``) can run on the kernels: they
    are available and built with AVX-512 VNNI's dot products (:func:`cpu_kernels.build.int8_dot`); a call
    uses them where its ``int8_dot`` option allows."""
    return available() and build.int8_dot()


def quantize_rows(x_RK: jax.Array) -> tuple[jax.Array, jax.Array]:
    """x [R, K] (float32) as products on quads quantize it, row by row: t = max |x| / 127 and n = x / t
    rounded to the nearest integer (ties to even) → (n [R, K] int8, t [R] float32), |x − t n| ≤ t / 2
    (1 + 2⁻¹⁶); a row of zeros gives t = 0 and n = 0, a row with a NaN or an infinity t = NaN and n = 0.
    The kernels run ``common.h``'s ``quantize_row``, with correctly rounded divisions; XLA:CPU divides
    approximately (one float32 quotient in twenty differs in its last place), so here t, and rarely an n,
    may differ from theirs: what the products on quads compute where the kernels do not run."""
    x_RK = x_RK.astype(jnp.float32)
    m_R = jnp.max(jnp.abs(x_RK), axis=-1)
    finite_R = m_R <= jnp.finfo(jnp.float32).max
    t_R = jnp.where(finite_R, m_R / jnp.float32(127), jnp.float32(jnp.nan))
    ok_R = t_R > 0
    safe_R = jnp.where(ok_R, t_R, jnp.float32(1))
    n_RK = jnp.where(ok_R[:, None], jnp.clip(jnp.round(x_RK / safe_R[:, None]), -127, 127), 0).astype(jnp.int8)
    return n_RK, t_R


def pairs_available() -> bool:
    """Whether products on panels in pairs (``matmuls(..., pairs=True)``) can run on the kernels: they are
    available and built with the CPU's bfloat16 dot products (:func:`cpu_kernels.build.bf16_dot`); a call
    uses them where its ``bf16_dot`` option allows, and AMX, where it runs and the call's ``amx`` allows,
    takes those of 32 rows or more, K a multiple of 32 (elsewhere such products run as XLA's)."""
    return available() and build.bf16_dot()


def _layer(w: jax.Array, layer: jax.Array | None) -> jax.Array:
    """Layer ``layer`` of a stack of weights [L, ...] (``w`` itself when not stacked)."""
    return w if layer is None else jax.lax.dynamic_index_in_dim(w, layer, keepdims=False)


def _as_kn(w: jax.Array, layout: str) -> jax.Array:
    """One (unstacked) weight as [K, N]."""
    return {"kn": lambda: w, "nk": lambda: w.T, "panels": lambda: from_panels(w),
            "pairs": lambda: from_panels(from_pairs(w)), "quads": lambda: from_panels(from_quads(w))}[layout]()


def _xla(x_RK: jax.Array, ws: tuple[jax.Array, ...], layer: jax.Array | None, layout: str):
    if layout == "quads":  # x quantized per row, integer sums (exact), then the step: as the kernel
        n_RK, t_R = quantize_rows(x_RK)
        return tuple(jnp.einsum("RK,KN->RN", n_RK.astype(jnp.int32), _as_kn(_layer(w, layer), layout).astype(jnp.int32))
                     .astype(jnp.float32) * t_R[:, None] for w in ws)
    if ws[0].dtype == jnp.int8:  # integer weights as float32 values, x as it is (see matmuls)
        return tuple(jnp.einsum("RK,KN->RN", x_RK.astype(jnp.float32), _as_kn(_layer(w, layer), layout).astype(jnp.float32),
                                precision="highest") for w in ws)
    return tuple(jnp.einsum("RK,KN->RN", x_RK.astype(w.dtype), _as_kn(_layer(w, layer), layout),
                            preferred_element_type=jnp.float32) for w in ws)


def _kernel(x_RK: jax.Array, ws: tuple[jax.Array, ...], layer: jax.Array | None, layout: str, amx: bool,
            bf16_dot: bool):
    dtype = {jnp.dtype(jnp.bfloat16): "bf16", jnp.dtype(jnp.int8): "i8"}.get(jnp.dtype(ws[0].dtype), "f32")
    width = {"kn": lambda w: w.shape[-1], "nk": lambda w: w.shape[-2], "panels": lambda w: w.shape[-3] * PANEL,
             "pairs": lambda w: w.shape[-3] * PANEL, "quads": lambda w: w.shape[-3] * PANEL}
    shapes = [jax.ShapeDtypeStruct((x_RK.shape[0], width[layout](w)), jnp.float32) for w in ws]
    call = jax.ffi.ffi_call(f"llm_jax_matmul_{layout}_{dtype}", shapes, vmap_method="sequential")
    # Products on panels (and pairs) choose among the instruction paths: the call's options go with it.
    options = dict(amx=bool(amx), bf16_dot=bool(bf16_dot)) if layout in ("panels", "pairs") else {}
    index = jnp.zeros((), jnp.int32) if layer is None else jnp.asarray(layer, jnp.int32)
    if layout in ("panels", "pairs", "quads") and layer is None:  # the kernel takes stacks [L, N / 16, K, 16]
        ws = tuple(w[None] for w in ws)
    # x rounded to the weights' dtype, as XLA's product (``_xla``) does: both routes compute the same.
    x_RK = x_RK.astype(jnp.float32) if dtype == "i8" else x_RK.astype(ws[0].dtype).astype(jnp.float32)
    return tuple(call(index, x_RK, *ws, **options))


def _on_cpu(x_RK, ws, layer, layout: str, amx: bool, bf16_dot: bool):
    """The kernel's product on CPU, XLA's elsewhere."""
    return jax.lax.platform_dependent(x_RK, ws, layer,
                                      cpu=functools.partial(_kernel, layout=layout, amx=amx, bf16_dot=bf16_dot),
                                      default=functools.partial(_xla, layout=layout))


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _matmuls(x_RK: jax.Array, ws: tuple[jax.Array, ...], layer: jax.Array | None, layout: str, amx: bool,
             bf16_dot: bool):
    return _on_cpu(x_RK, ws, layer, layout, amx, bf16_dot)


def _matmuls_fwd(x_RK, ws, layer, layout, amx, bf16_dot):
    return _matmuls(x_RK, ws, layer, layout, amx, bf16_dot), (x_RK, ws, layer)


def _matmuls_bwd(layout, amx, bf16_dot, residuals, dys):
    x_RK, ws, layer = residuals
    x32 = x_RK.astype(jnp.float32)
    dx_RK = jnp.zeros(x_RK.shape, jnp.float32)
    dws = []
    for w, dy_RN in zip(ws, dys):
        dy_RN, w_KN = dy_RN.astype(jnp.float32), _as_kn(_layer(w, layer), layout).astype(jnp.float32)
        # The forward reads x rounded to w's dtype: its cotangent is rounded the same way (as XLA's is).
        dx_RK += (dy_RN @ w_KN.T).astype(w.dtype).astype(jnp.float32)
        dw_KN = x32.T @ dy_RN
        dw = {"kn": lambda: dw_KN, "nk": lambda: dw_KN.T, "panels": lambda: to_panels(dw_KN)}[layout]().astype(w.dtype)
        dws.append(dw if layer is None else jnp.zeros_like(w).at[layer].set(dw))
    return dx_RK.astype(x_RK.dtype), tuple(dws), None


_matmuls.defvjp(_matmuls_fwd, _matmuls_bwd)


def matmuls(x_RK: jax.Array, ws, *, transposed: bool = False, panels: bool = False, pairs: bool = False,
            quads: bool = False, layer: jax.Array | int | None = None, amx: bool = True, bf16_dot: bool = True,
            int8_dot: bool = True):
    """x [R, K] · W_i → [R, N_i] float32 for each W_i in ``ws`` ([K, N_i]; [N_i, K] when ``transposed``; in
    the panel layout [N_i / 16, K, 16] of :func:`to_panels` when ``panels``; all float32 or all bfloat16,
    or, in panels, all int8: the product with the integers as they are and x not rounded, for a caller
    that applies its own scales, with no gradient). ``pairs`` (with ``panels``): bfloat16 panels in pairs
    of rows (:func:`to_pairs`), read as they lie by the CPU's bfloat16 dot products where
    :func:`pairs_available` (the LM head's screen; no gradient). ``quads`` (with ``panels``): int8 panels
    in quads of rows (:func:`to_quads`) and x quantized per row (:func:`quantize_rows`: n, t), the result
    t · (n · W_i) with exact integer sums, on AVX-512 VNNI where :func:`quads_available` (the LM head's
    screen at many rows; no gradient).
    On CPU one kernel call streams every W_i: one fork-join for all.

    ``amx``, ``bf16_dot``, ``int8_dot``: the instruction paths the call may take where the CPU has them.
    bfloat16 products on panels of 32 rows or more (K a multiple of 32) run on AMX's tiles with ``amx``,
    those of 8 rows or more on AVX-512's bfloat16 dot products with ``bf16_dot`` (pairs need it, else
    XLA's product runs), the rest as float32 ones do (streams below 8 rows, register tiles from 8); products
    on quads need ``int8_dot`` (else XLA's). Each path sums in its own order: the results agree within float32 rounding, not bit for bit.
    Other layouts and dtypes have one path and ignore them.

    With ``layer`` (an int32 scalar, may be traced), every W_i is a stack [L, ...] of such matrices and
    its layer ``layer`` is used: the kernel reads it inside the stack, with no copy.

    Uses the kernels when :func:`available`, XLA's products otherwise.
    """
    ws = tuple(ws)
    if transposed and panels:
        raise ValueError("matmul: the panel layout holds W [K, N] (not transposed)")
    if (pairs or quads) and not panels:
        raise ValueError("matmul: pairs and quads of rows are forms of the panel layout (panels=True)")
    if pairs and quads:
        raise ValueError("matmul: panels are in pairs or in quads of rows, not both")
    layout = "pairs" if pairs else "quads" if quads else "panels" if panels else "nk" if transposed else "kn"
    in_panels = layout in ("panels", "pairs", "quads")
    k_axis = -1 if layout == "nk" else -2
    rank = (2 if layer is None else 3) + in_panels
    for w in ws:
        if (x_RK.ndim != 2 or w.ndim != rank or x_RK.shape[1] != w.shape[k_axis]
                or (in_panels and w.shape[-1] != PANEL)):
            stack = "" if layer is None else "L, "
            form = {"kn": "K, N", "nk": "N, K"}.get(layout, f"N / {PANEL}, K, {PANEL}")
            raise ValueError(f"matmul needs x [R, K] and w [{stack}{form}] with the same K, got x {x_RK.shape} "
                             f"and w {w.shape}")
    if layer is not None:
        layer = jnp.asarray(layer, jnp.int32)
    amx, bf16_dot = bool(amx), bool(bf16_dot)
    dtypes = {w.dtype for w in ws}
    screen = {"pairs": (jnp.bfloat16, 2, bf16_dot and pairs_available()),
              "quads": (jnp.int8, 4, bool(int8_dot) and quads_available())}.get(layout)
    if screen is not None:  # the LM head's screens: bfloat16 in pairs, int8 in quads; no gradient
        dtype, multiple, runs = screen
        if dtypes != {jnp.dtype(dtype)} or x_RK.shape[1] % multiple:
            what = "even" if multiple == 2 else f"a multiple of {multiple}"
            raise ValueError(f"matmul: {layout} of rows hold {jnp.dtype(dtype).name} weights with K {what}, got "
                             f"{sorted(map(str, dtypes))} and K = {x_RK.shape[1]}")
        if not runs:
            return _xla(x_RK, ws, layer, layout)
        return _on_cpu(x_RK, ws, layer, layout, amx, bf16_dot)
    if jnp.dtype(jnp.int8) in dtypes:  # the LM head's screen: panels, no gradient
        if len(dtypes) != 1 or layout != "panels":
            raise ValueError("matmul: int8 weights only in the panel layout, not mixed with others")
        if not available():
            return _xla(x_RK, ws, layer, layout)
        return _on_cpu(x_RK, ws, layer, layout, amx, bf16_dot)
    if len(dtypes) != 1 or dtypes.pop() not in (jnp.float32, jnp.bfloat16) or not available():
        return _xla(x_RK, ws, layer, layout)
    return _matmuls(x_RK, ws, layer, layout, amx, bf16_dot)


def matmul(x_RK: jax.Array, w: jax.Array, *, transposed: bool = False, panels: bool = False, pairs: bool = False,
           quads: bool = False, layer: jax.Array | int | None = None, amx: bool = True, bf16_dot: bool = True,
           int8_dot: bool = True):
    """x [R, K] · W → [R, N] float32, W [K, N] (or [N, K] when ``transposed``, or panels [N / 16, K, 16],
    bfloat16 ones in pairs of rows when ``pairs``, int8 ones in quads when ``quads``; with ``layer``, a
    stack [L, ...] of them), float32 or bfloat16; the instruction paths it may take as in :func:`matmuls`."""
    return matmuls(x_RK, (w,), transposed=transposed, panels=panels, pairs=pairs, quads=quads, layer=layer, amx=amx,
                   bf16_dot=bf16_dot, int8_dot=int8_dot)[0]


def argmax(x_BV: jax.Array) -> jax.Array:
    """``jnp.argmax(x_BV, axis=-1)`` as int32 [B] for float32 x [B, V]: the first index of each row's
    maximum (of its first NaN, if any). On CPU a kernel (XLA:CPU reduces (value, index) pairs one element
    at a time); XLA's elsewhere and when the kernels are not available."""
    if x_BV.ndim != 2 or x_BV.dtype != jnp.float32:
        raise ValueError(f"argmax needs float32 x [B, V], got {x_BV.dtype} {x_BV.shape}")
    xla = lambda x: jnp.argmax(x, axis=-1).astype(jnp.int32)
    if not available():
        return xla(x_BV)
    call = jax.ffi.ffi_call("llm_jax_argmax_f32", jax.ShapeDtypeStruct(x_BV.shape[:1], jnp.int32),
                            vmap_method="sequential")
    return jax.lax.platform_dependent(x_BV, cpu=call, default=xla)


def _full_argmax(x_BD: jax.Array, panels: jax.Array, amx: bool, bf16_dot: bool) -> jax.Array:
    """The unscreened path's tokens [B] (int32) for x [B, D] and W as panels [V / 16, D, 16]: every logit
    through :func:`matmul` with these options (the kernels' product, or XLA's where they do not run), then
    :func:`argmax`."""
    return argmax(matmul(x_BD, panels, panels=True, amx=amx, bf16_dot=bf16_dot))


def screened_argmax(y_BV: jax.Array, x_BD: jax.Array, panels: jax.Array, scales_V: jax.Array | None,
                    norms_V: jax.Array, c1: float, c2: float, errors_V: jax.Array | None = None, *,
                    amx: bool = True, bf16_dot: bool = True) -> jax.Array:
    """The greedy token per row [B] (int32) of the logits x [B, D] · W, W [D, V] (float32 or bfloat16) held
    as panels [V / 16, D, 16]: the unscreened path's token, ``argmax(matmul(x_BD, panels, panels=True,
    amx=amx, bf16_dot=bf16_dot))``, the first largest float32 logit of the head's own product of these B
    rows with these options (which choose its instruction path, and so the order of its sums: the kernel
    computes the candidates' logits on the same path). Given screened logits a =
    ``y_BV`` (times ``scales_V`` [V] when given) that differ from that product's by at most r = c1 · ||x_b||₁
    · scales_V[j] + c2 · ||x_b||₂ · norms_V[j], or, with ``errors_V`` [V] (screened logits of x quantized as
    :func:`quantize_rows` does, δ_b = x_b − t_b n_b; needs ``scales_V``), r = c1 · (||x_b||₂ + ||δ_b||₂) ·
    errors_V[j] + (c1 · ||δ_b||₂ + c2 · ||x_b||₂) · norms_V[j]: the columns whose interval [a − r, a + r]
    reaches the largest lower end have their logits computed with the product's own arithmetic for B rows
    (bit for bit), the largest wins, the first on ties; a row with a NaN or an infinity is computed in full
    (its first NaN wins, as in ``jnp.argmax``). x is rounded to W's dtype, as the product rounds it; ``y_BV``
    must be the screen's logits of x so rounded. The unscreened path itself where the kernels are not
    available."""
    B, V = y_BV.shape
    none = jnp.zeros((0,), jnp.float32)
    scales = none if scales_V is None else scales_V
    errors = none if errors_V is None else errors_V
    floats = {a.dtype for a in (y_BV, x_BD, scales, errors, norms_V)}
    if (x_BD.ndim != 2 or x_BD.shape[0] != B or panels.shape != (V // PANEL, x_BD.shape[1], PANEL)
            or norms_V.shape != (V,) or scales.shape not in ((V,), (0,)) or errors.shape not in ((V,), (0,))
            or (errors_V is not None and scales_V is None) or floats != {jnp.dtype(jnp.float32)}
            or panels.dtype not in (jnp.float32, jnp.bfloat16)):
        raise ValueError(f"screened_argmax needs float32 y [B, V], x [B, D], scales, norms and errors [V] (errors "
                         f"only with scales), and panels [V / {PANEL}, D, {PANEL}] (float32 or bfloat16), got "
                         f"{y_BV.shape}, {x_BD.shape}, {scales.shape}, {norms_V.shape}, {errors.shape}, "
                         f"{panels.dtype} {panels.shape}")

    def xla(y_BV, x_BD, panels, scales, errors, norms_V):
        return _full_argmax(x_BD, panels, amx, bf16_dot)

    if not available():
        return xla(y_BV, x_BD, panels, scales, errors, norms_V)
    return _head_call("llm_jax_screened_argmax", B, c1, c2, amx, bf16_dot, (y_BV, x_BD, panels, scales, errors,
                                                                            norms_V), xla)


def _head_call(target: str, B: int, c1: float, c2: float, amx: bool, bf16_dot: bool,
               operands: tuple[jax.Array, ...], default) -> jax.Array:
    """The greedy head's kernel ``target`` (suffixed by the head's dtype: ``operands[2]``, its panels) on
    ``operands``, attributes c1 and c2 (the bound) and amx and bf16_dot (the head product's options, whose
    path its exact check repeats) → tokens [B] int32, on CPU; ``default(*operands)`` elsewhere."""
    dtype = "bf16" if operands[2].dtype == jnp.bfloat16 else "f32"
    call = jax.ffi.ffi_call(f"{target}_{dtype}", jax.ShapeDtypeStruct((B,), jnp.int32), vmap_method="sequential")
    kernel = lambda *args: call(*args, c1=float(c1), c2=float(c2), amx=bool(amx), bf16_dot=bool(bf16_dot))
    return jax.lax.platform_dependent(*operands, cpu=kernel, default=default)


def quads_argmax(x_BD: jax.Array, quads: jax.Array, panels: jax.Array, scales_V: jax.Array, errors_V: jax.Array,
                 norms_V: jax.Array, c1: float, c2: float, *, amx: bool = True, bf16_dot: bool = True,
                 int8_dot: bool = True) -> jax.Array:
    """The greedy token per row [B] (int32) of the logits x [B, D] · W, W held as ``panels`` [V / 16, D, 16]
    (float32 or bfloat16), through its int8 screen in quads of rows (``quads``, :func:`to_quads`; ``scales_V``,
    ``errors_V``, ``norms_V`` and c1, c2 as :func:`screened_argmax` takes them) in one kernel call: the token
    of ``screened_argmax(matmul(x_BD, quads, panels=True, quads=True), x_BD, panels, scales_V, norms_V, c1,
    c2, errors_V, amx=amx, bf16_dot=bf16_dot)`` — the unscreened path's token, ``argmax(matmul(x_BD, panels,
    panels=True, amx=amx, bf16_dot=bf16_dot))`` — without the screened logits [B, V] going through memory
    (the kernel bounds each unit of columns as the product finishes it). x is rounded to the head's dtype
    first, for the screen's product too. Where the quads do not run (:func:`quads_available`, or
    ``int8_dot`` off), the unscreened path itself."""
    B, D = x_BD.shape
    V = panels.shape[0] * PANEL
    if (quads.shape != panels.shape or quads.dtype != jnp.int8 or panels.shape[1:] != (D, PANEL) or D % 4
            or D >= QUADS_MAX_K or x_BD.dtype != jnp.float32 or panels.dtype not in (jnp.float32, jnp.bfloat16)
            or any(a.shape != (V,) or a.dtype != jnp.float32 for a in (scales_V, errors_V, norms_V))):
        raise ValueError(f"quads_argmax needs float32 x [B, D] (D a multiple of 4 below {QUADS_MAX_K}), int8 quads "
                         f"and float32 or bfloat16 panels [V / {PANEL}, D, {PANEL}], and float32 scales, errors and "
                         f"norms [V], got x {x_BD.dtype} {x_BD.shape}, quads {quads.dtype} {quads.shape}, panels "
                         f"{panels.dtype} {panels.shape}, {scales_V.shape}, {errors_V.shape}, {norms_V.shape}")
    full = lambda x_BD, quads, panels, scales_V, errors_V, norms_V: _full_argmax(x_BD, panels, amx, bf16_dot)
    if not (int8_dot and quads_available()):
        return full(x_BD, quads, panels, scales_V, errors_V, norms_V)
    return _head_call("llm_jax_quads_argmax", B, c1, c2, amx, bf16_dot,
                      (x_BD, quads, panels, scales_V, errors_V, norms_V), full)


GLU_ACTIVATIONS = ("silu", "gelu_tanh")  # what glu computes: SwiGLU's act, GeGLU's (tanh-approximated GELU)


def gated(gate: jax.Array, up: jax.Array, activation: str) -> jax.Array:
    """``act(gate) · up`` through XLA, act ``"silu"`` or ``"gelu_tanh"``: what :func:`glu` computes, from
    gate and up apart (the model's separate layout, few rows, other platforms)."""
    if activation not in GLU_ACTIVATIONS:
        raise ValueError(f"glu: activation must be one of {GLU_ACTIVATIONS}, got {activation!r}")
    act = jax.nn.silu(gate) if activation == "silu" else jax.nn.gelu(gate, approximate=True)
    return act * up


def _glu_xla(y_RE: jax.Array, activation: str) -> jax.Array:
    return gated(*jnp.split(y_RE, 2, axis=-1), activation)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _glu(y_RE: jax.Array, activation: str) -> jax.Array:
    call = jax.ffi.ffi_call(f"llm_jax_glu_{activation}_f32",
                            jax.ShapeDtypeStruct((y_RE.shape[0], y_RE.shape[1] // 2), jnp.float32),
                            vmap_method="sequential")
    return jax.lax.platform_dependent(y_RE, cpu=call, default=functools.partial(_glu_xla, activation=activation))


def _glu_fwd(y_RE, activation):
    return _glu(y_RE, activation), y_RE


def _glu_bwd(activation, y_RE, d_RF):
    return jax.vjp(functools.partial(_glu_xla, activation=activation), y_RE)[1](d_RF)


_glu.defvjp(_glu_fwd, _glu_bwd)


def glu(y_RE: jax.Array, activation: str) -> jax.Array:
    """``act(gate) · up`` [R, E / 2] float32 for y = [gate | up] [R, E] float32 (the fused gate/up
    projection's output), act ``"silu"`` (SwiGLU) or ``"gelu_tanh"`` (GeGLU, tanh-approximated GELU): on
    CPU a kernel, a vector at a time (XLA:CPU computes it one element at a time on one thread), within a
    few float32 units of XLA's; XLA's elsewhere and when the kernels are not available. Gradients are
    XLA's."""
    if activation not in GLU_ACTIVATIONS:
        raise ValueError(f"glu: activation must be one of {GLU_ACTIVATIONS}, got {activation!r}")
    if y_RE.ndim != 2 or y_RE.dtype != jnp.float32 or y_RE.shape[1] % 2:
        raise ValueError(f"glu needs float32 y [R, E] with E even (gate, then up), got {y_RE.dtype} {y_RE.shape}")
    if not available():
        return _glu_xla(y_RE, activation)
    return _glu(y_RE, activation)
