"""The CPU kernels backend: ``cpu_kernels`` (C++ XLA FFI calls) for one CPU device.

Products read float32 or bfloat16 weights where they lie in the stacked layers (a layer index, no copy)
and in the execution form of :mod:`llm_jax.backends.cpu.forms` (panels, fused q/k/v and gate/up) or the
canonical layout; attention reads the cache in place and scores only the keys each query sees; a decode
step's key and value are written by the attention kernel itself; greedy steps read the LM head through
its screen (:mod:`llm_jax.backends.cpu.greedy_head`); a mixture of experts' few (token, expert) pairs of a
decode step read their experts where they lie in the stack (float panels, or quantized ones through the
quantized products of :mod:`llm_jax.backends.cpu.quantized`). What the kernels do not cover (other dtypes,
gradients, a mixture of experts' many pairs) is XLA's, as in :class:`llm_jax.backends.Xla`.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Sequence

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

import cpu_kernels
from llm_jax import kv_cache as kvc
from llm_jax.backends import base
from llm_jax.backends.base import Backend, matmul_form
from llm_jax.backends.cpu import forms, greedy_head, quantized
from llm_jax.backends.cpu.forms import Fused, FusedPart, Panels
from llm_jax.bits import as_bits, from_bits
from llm_jax.config import Activation, ModelConfig
from llm_jax.quantization import QuantizedArray

Params = dict[str, Any]

# From this many rows on, the gated MLP's activation on a fused gate/up output is ``cpu_kernels.glu`` (XLA
# computes it one element at a time); fewer rows keep XLA's fusion, which costs less than a kernel call.
GLU_KERNEL_MIN_ROWS = 8
_KERNEL_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))
_KV_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.uint16))


@dataclasses.dataclass(frozen=True)
class CpuKernels(Backend):
    """The C++ kernels of ``cpu_kernels`` on one CPU device. ``greedy_screen``: prepared weights hold the
    LM head's screens for greedy steps (False saves their memory: 0.5 to 1 of the head).

    The instruction paths the kernels may take, each where the CPU and the build have it
    (``cpu_kernels.build``'s probes): ``amx``, AMX's tiles, and ``bf16_dot``, AVX-512's bfloat16 dot
    products, for bfloat16 products of many rows (off: float32 register tiles); ``int8_dot``, AVX-512
    VNNI, for the LM head's int8 screen in quads at many rows (off: the bfloat16 screen or every logit).
    Every kernel call follows them, and so do the screens :meth:`prepare` builds: prepare the weights
    with the backend that runs them."""

    greedy_screen: bool = True
    amx: bool = True
    bf16_dot: bool = True
    int8_dot: bool = True
    name = "cpu"

    @property
    def instructions(self) -> dict[str, bool]:
        """The instruction options as the ``cpu_kernels`` functions take them (keyword arguments)."""
        return dict(amx=self.amx, bf16_dot=self.bf16_dot, int8_dot=self.int8_dot)

    def prepare(self, params: Params, config: ModelConfig) -> Params:
        if config.param_jnp_dtype not in _KERNEL_DTYPES:
            return params  # the kernels read float32 and bfloat16; other dtypes run XLA's products
        if config.quantization is not None:  # int8 panels where they serve; the float head's panels and screen
            weights = quantized.prepare(params, config)
            q = config.quantization
            if (q.embedding if config.tie_embeddings else q.lm_head) is None:
                weights = forms.prepare_head(weights, config)
                head = forms.head_panels(weights, config)
                if self.greedy_screen and head is not None and greedy_head.applies(config):
                    weights[greedy_head.SCREEN] = greedy_head.build(head, **self.instructions)
            return weights
        weights = forms.prepare(params, config)
        head = forms.head_panels(weights, config)
        if self.greedy_screen and head is not None and greedy_head.applies(config):
            weights[greedy_head.SCREEN] = greedy_head.build(head, **self.instructions)
        return weights

    # Matrix products.
    def dense_many(self, equations: Sequence[str], x: jax.Array, ws: Sequence[Any], out_dtype,
                   layer: jax.Array | None = None) -> list[jax.Array]:
        if any(isinstance(w, quantized.QuantizedPanels) for w in ws):
            return _quantized_many(equations, x, ws, out_dtype, layer)
        products = _plan(equations, x, ws, layer)
        if products is None:
            return _xla_many(equations, x, ws, out_dtype, layer)
        ys = _run(x, products, layer, self.instructions)
        out = [None] * len(ws)
        for product, y_RN in zip(products, ys):
            for index, start, width, shape in product.parts:
                out[index] = y_RN[:, start:start + width].reshape(shape).astype(out_dtype)
        return out

    def gate_up(self, x_BTD: jax.Array, gate_DF: Any, up_DF: Any, activation: Activation,
                layer: jax.Array | None = None) -> jax.Array:
        products = _plan(["BTD,DF->BTF"] * 2, x_BTD, [gate_DF, up_DF], layer)
        rows = math.prod(x_BTD.shape[:-1])
        if products is None or len(products) != 1 or rows < GLU_KERNEL_MIN_ROWS:
            return super().gate_up(x_BTD, gate_DF, up_DF, activation, layer)
        (y_RE,) = _run(x_BTD, products, layer, self.instructions)  # [gate | up]: one fused product
        F = y_RE.shape[1] // 2
        return cpu_kernels.glu(y_RE, activation.value).reshape(*x_BTD.shape[:-1], F)

    def sorted_experts(self, x_BTD: jax.Array, weights_BTU: jax.Array, chosen_BTU: jax.Array, gate_EDF: Any,
                       up_EDF: Any, down_EFD: Any, activation: Activation,
                       layer: jax.Array | None = None) -> jax.Array:
        gate_EDF, up_EDF, down_EFD = (_canonical(w, layer, x_BTD.dtype) for w in (gate_EDF, up_EDF, down_EFD))
        return super().sorted_experts(x_BTD, weights_BTU, chosen_BTU, gate_EDF, up_EDF, down_EFD, activation)

    def chosen_experts(self, x_BTD: jax.Array, weights_BTU: jax.Array, chosen_BTU: jax.Array, gate_EDF: Any,
                       up_EDF: Any, down_EFD: Any, activation: Activation,
                       layer: jax.Array | None = None) -> jax.Array:
        ws = (gate_EDF, up_EDF, down_EFD)
        if any(isinstance(w, quantized.QuantizedPanels) for w in ws):
            return _chosen_quantized_experts(x_BTD, weights_BTU, chosen_BTU, ws, activation, layer, self.instructions)
        if not all(isinstance(w, (jax.Array, Panels)) and jnp.dtype(w.dtype) == jnp.dtype(gate_EDF.dtype) for w in ws) \
                or jnp.dtype(gate_EDF.dtype) not in _KERNEL_DTYPES:
            return super().chosen_experts(x_BTD, weights_BTU, chosen_BTU, gate_EDF, up_EDF, down_EFD, activation,
                                          layer)
        return _chosen_experts(x_BTD, weights_BTU, chosen_BTU, ws, activation, layer, self.instructions)

    def embed(self, table_VD: Any, tokens_BT: jax.Array, out_dtype) -> jax.Array:
        if isinstance(table_VD, quantized.QuantizedPanels):
            return quantized.table_rows(table_VD, tokens_BT, out_dtype)
        if isinstance(table_VD, Panels):  # row t of E is column t of the head: panel t // 16, lane t % 16
            bits = as_bits(table_VD.data)
            rows_BTD = bits.at[tokens_BT // cpu_kernels.PANEL, :, tokens_BT % cpu_kernels.PANEL].get(mode="fill")
            return from_bits(rows_BTD, table_VD.dtype).astype(out_dtype)
        return super().embed(table_VD, tokens_BT, out_dtype)

    # Attention.
    def attention(self, q_BTNH, k_BTKH, v_BTKH, lengths_B, *, config: ModelConfig, window: int | None,
                  mesh: Mesh | None = None) -> jax.Array:
        if q_BTNH.shape[1] == 1 or jnp.dtype(k_BTKH.dtype) not in _KV_DTYPES:
            return super().attention(q_BTNH, k_BTKH, v_BTKH, lengths_B, config=config, window=window)
        B, T = q_BTNH.shape[:2]
        positions_BT = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
        return _prefill_attention(q_BTNH, k_BTKH, v_BTKH, positions_BT, lengths_B, config.attn_scale, window,
                                  config.attn_logit_softcap)

    def append_and_attend(self, q_BTNH, k_BTKH, v_BTKH, k_LBSKH, v_LBSKH, layer, slots_BT, positions_BT, *,
                          config: ModelConfig, window: int | None, mesh: Mesh | None = None):
        if isinstance(k_LBSKH, kvc.Int8KV):  # the paged kernel reads int8 in place: one page per row
            return self.append_and_attend_as_pages(q_BTNH, k_BTKH, v_BTKH, k_LBSKH, v_LBSKH, layer, slots_BT,
                                                   positions_BT, config=config, window=window)
        if jnp.dtype(k_LBSKH.dtype) not in _KV_DTYPES:
            return super().append_and_attend(q_BTNH, k_BTKH, v_BTKH, k_LBSKH, v_LBSKH, layer, slots_BT,
                                             positions_BT, config=config, window=window)
        common = dict(scale=config.attn_scale, window=window, softcap=config.attn_logit_softcap)
        kv_lengths_B = positions_BT[:, -1] + 1
        if q_BTNH.shape[1] == 1:  # a decode step: one kernel writes the key and value, then attends
            o_BNH, k_LBSKH, v_LBSKH = cpu_kernels.decode_attention_append(
                q_BTNH[:, 0], kvc.stored(k_LBSKH, k_BTKH[:, 0]), kvc.stored(v_LBSKH, v_BTKH[:, 0]), k_LBSKH,
                v_LBSKH, layer, slots_BT[:, 0], positions_BT[:, 0], kv_lengths_B, **common)
            return o_BNH[:, None].astype(q_BTNH.dtype), k_LBSKH, v_LBSKH
        k_LBSKH = kvc.write_tokens(k_LBSKH, layer, slots_BT, k_BTKH)
        v_LBSKH = kvc.write_tokens(v_LBSKH, layer, slots_BT, v_BTKH)
        o_BTNH = cpu_kernels.prefill_attention(q_BTNH, k_LBSKH, v_LBSKH, layer, positions_BT, kv_lengths_B, **common)
        return o_BTNH.astype(q_BTNH.dtype), k_LBSKH, v_LBSKH

    def paged_attention(self, q_TNH, k_TKH, v_TKH, k_LPZKH, v_LPZKH, layer, batch: kvc.PagedBatch, *,
                        config: ModelConfig, window: int | None, mesh: Mesh | None = None):
        int8 = isinstance(k_LPZKH, kvc.Int8KV)
        if not int8 and jnp.dtype(k_LPZKH.dtype) not in _KV_DTYPES:
            return super().paged_attention(q_TNH, k_TKH, v_TKH, k_LPZKH, v_LPZKH, layer, batch, config=config,
                                           window=window)
        if int8:  # the kernel takes int8 as pairs (values, scales), the new rows quantized as write_slots does
            k_new, v_new = kvc.quantize_kv(k_TKH), kvc.quantize_kv(v_TKH)
            k_pages, v_pages = (k_LPZKH.q_LBSKH, k_LPZKH.s_LBSK), (v_LPZKH.q_LBSKH, v_LPZKH.s_LBSK)
        else:
            k_new, v_new = kvc.stored(k_LPZKH, k_TKH), kvc.stored(v_LPZKH, v_TKH)
            k_pages, v_pages = k_LPZKH, v_LPZKH
        # One kernel writes the step's keys and values into the pages (in place) and attends, reading each
        # sequence's pages where they lie and scoring only the keys each token sees.
        o_TNH, k_pages, v_pages = cpu_kernels.paged_attention_append(
            q_TNH, k_new, v_new, k_pages, v_pages, layer, batch.slots_T, batch.block_tables_BX, batch.query_start_B,
            batch.num_tokens_B, batch.seq_lens_B, scale=config.attn_scale, window=window,
            softcap=config.attn_logit_softcap)
        if int8:
            k_pages, v_pages = kvc.Int8KV(*k_pages), kvc.Int8KV(*v_pages)
        return o_TNH.astype(q_TNH.dtype), k_pages, v_pages

    # Choosing tokens.
    def argmax(self, scores_BV: jax.Array) -> jax.Array:
        if scores_BV.dtype != jnp.float32 or scores_BV.ndim != 2:
            return super().argmax(scores_BV)
        return cpu_kernels.argmax(scores_BV)

    def greedy_tokens(self, weights: Params, config: ModelConfig, x_BD: jax.Array) -> jax.Array | None:
        return greedy_head.greedy_tokens(weights, config, x_BD, **self.instructions)


@dataclasses.dataclass(frozen=True)
class _Product:
    """One kernel product: x [R, K] · ``matrix`` (``layout`` "kn", "nk" or "panels"), whose output columns
    [start, start + width) are weight ``index``'s, of shape ``shape``: ``parts`` lists (index, start,
    width, shape)."""

    matrix: jax.Array
    layout: str
    K: int
    parts: tuple[tuple[int, int, int, tuple[int, ...]], ...]


def _contraction(equation: str, x_shape) -> tuple[tuple[int, ...], int] | None:
    """(the rows' shape, K) of an einsum contracting trailing axes of x; None for any other."""
    x_spec, w_spec = equation.replace(" ", "").split("->")[0].split(",")
    n_c = sum(a in w_spec for a in x_spec)
    if n_c == 0 or any(a not in w_spec for a in x_spec[len(x_spec) - n_c:]):
        return None
    return tuple(x_shape[: len(x_shape) - n_c]), math.prod(x_shape[len(x_shape) - n_c:])


def _plan(equations: Sequence[str], x: jax.Array, ws: Sequence[Any], layer) -> list[_Product] | None:
    """The kernel products that compute ``einsum(eq_i, x, w_i)``, one per matrix (a fused group and its
    parts are one); None where the kernels do not take them (other dtypes or einsums): XLA's then."""
    lead = 0 if layer is None else 1
    products: list[_Product] = []
    i = 0
    while i < len(ws):
        eq, w = equations[i], ws[i]
        if isinstance(w, FusedPart):
            raise ValueError(f"weight {i} is part {w.index} of a fused group whose first part is not before it")
        if isinstance(w, Fused):
            n = len(w.out_shapes)
            if i + n > len(ws) or any(not isinstance(ws[i + j], FusedPart) or ws[i + j].index != j
                                      for j in range(1, n)):
                raise ValueError(f"the fused group of {n} parts at weight {i} is not followed by its parts")
            contraction = _contraction(eq, x.shape)
            if contraction is None:
                return None
            rows, K = contraction
            matrix, N, transposed = w.data, sum(w.widths), False
            starts = [sum(w.widths[:j]) for j in range(n)]
            parts = tuple((i + j, starts[j], w.widths[j], (*rows, *w.out_shapes[j])) for j in range(n))
            i += n
        else:
            form = matmul_form(eq, x.shape, w.shape[lead:])
            if form is None:
                return None
            matrix, N, K, transposed = w, form.N, form.K, form.transposed
            parts = ((i, 0, form.N, form.out_shape),)
            i += 1
        if jnp.dtype(matrix.dtype) not in _KERNEL_DTYPES:
            return None
        if isinstance(matrix, Panels):
            if matrix.transposed != transposed:
                return None
            layout, data = "panels", matrix.data
        else:
            layout = "nk" if transposed else "kn"
            data = matrix.reshape(*matrix.shape[:lead], *((N, K) if transposed else (K, N)))
        products.append(_Product(data, layout, K, parts))
    if len({p.K for p in products}) != 1 or len({p.matrix.dtype for p in products}) != 1:
        return None
    return products


def _run(x: jax.Array, products: list[_Product], layer, instructions: dict[str, bool]) -> list[jax.Array]:
    """The products' outputs [R, N] float32, one kernel call per layout, on the instruction paths
    ``instructions`` allow (:attr:`CpuKernels.instructions`)."""
    K = products[0].K
    x_RK = x.reshape(x.size // K, K)
    ys = [None] * len(products)
    for layout in ("kn", "nk", "panels"):
        which = [i for i, p in enumerate(products) if p.layout == layout]
        if which:
            outs = cpu_kernels.matmuls(x_RK, [products[i].matrix for i in which], transposed=layout == "nk",
                                       panels=layout == "panels", layer=layer, **instructions)
            for i, y in zip(which, outs):
                ys[i] = y
    return ys


def _quantized_many(equations, x, ws, out_dtype, layer) -> list[jax.Array]:
    """The products of weights held as int8 panels (one kernel call for all) and of any others (XLA's)."""
    panels = [i for i, w in enumerate(ws) if isinstance(w, quantized.QuantizedPanels)]
    for i in panels:
        contraction = _contraction(equations[i], x.shape)
        if contraction is None or contraction[1] != math.prod(ws[i].in_shape):
            raise ValueError(f"weight {i} (int8 panels, inputs {ws[i].in_shape}) does not contract {equations[i]!r} "
                             f"on x {x.shape}")
    out = [None] * len(ws)
    for i, y in zip(panels, quantized.products(x, [ws[i] for i in panels], out_dtype, layer)):
        out[i] = y
    others = [i for i in range(len(ws)) if i not in panels]
    for i, y in zip(others, _xla_many([equations[i] for i in others], x, [ws[i] for i in others], out_dtype, layer)):
        out[i] = y
    return out


def _xla_many(equations, x, ws, out_dtype, layer) -> list[jax.Array]:
    """XLA's products of ``ws`` in any form (typed leaves unpacked; a fused group's outputs split)."""
    out = [None] * len(ws)
    for i, (eq, w) in enumerate(zip(equations, ws)):
        if isinstance(w, FusedPart):
            continue
        if not isinstance(w, Fused):
            w = w.unpacked() if isinstance(w, Panels) else w
            out[i] = base._einsum(eq, x, w if layer is None else base.layer_of(w, layer), out_dtype)
            continue
        data = w.data.unpacked() if isinstance(w.data, Panels) else w.data
        data = data if layer is None else base.layer_of(data, layer)
        y = jnp.einsum("...d,de->...e", x.astype(data.dtype), data.reshape(x.shape[-1], -1),
                       preferred_element_type=jnp.float32)
        start = 0
        for j, shape in enumerate(w.out_shapes):
            width = math.prod(shape)
            out[i + j] = y[..., start:start + width].reshape(*x.shape[:-1], *shape).astype(out_dtype)
            start += width
    return out


def _canonical(w: Any, layer, dtype) -> jax.Array | QuantizedArray:
    """A mixture's stack of experts [L, E, ...] (panels or the canonical layout) as layer ``layer``'s experts
    [E, ...] in the canonical layout (panels unpacked: a copy; quantized panels dequantized into ``dtype``);
    [E, ...] itself without a layer."""
    if isinstance(w, quantized.QuantizedPanels):
        return quantized.dequantized(w, layer, dtype)
    if isinstance(w, Panels):
        data = w.data if layer is None else base.layer_of(w.data, layer)
        return Panels(data, w.in_shape, w.out_shape).unpacked()
    return w if layer is None else base.layer_of(w, layer)


def _expert_matrices(w: Any) -> tuple[jax.Array, bool]:
    """(every layer's experts as one stack of matrices [L·E, ...], whether they are panels): expert e of layer
    l is matrix l·E + e, read in place by ``cpu_kernels.matmuls``' ``layer`` (a reshape, no copy)."""
    if isinstance(w, Panels):
        return w.data.reshape(-1, *w.data.shape[-3:]), True
    return w.reshape(-1, *w.shape[-2:]), False


def _chosen_experts(x_BTD, weights_BTU, chosen_BTU, ws, activation: Activation, layer,
                    instructions: dict[str, bool]) -> jax.Array:
    """:func:`base.gathered_experts` by the kernels, each row's expert read where it lies in the stack
    (:func:`_expert_matrices`): per row, one call for its gate and up products and one for its down product,
    in a loop over the rows."""
    B, T, D = x_BTD.shape
    E, U = ws[0].shape[-3], chosen_BTU.shape[-1]
    (gates, gate_panels), (ups, _), (downs, down_panels) = (_expert_matrices(w) for w in ws)
    expert_R = chosen_BTU.reshape(-1)
    matrix_R = expert_R if layer is None else layer * E + expert_R
    x_RD = jnp.repeat(x_BTD.reshape(B * T, D), U, axis=0).astype(gates.dtype)

    def row(_, x_matrix):
        x_D, matrix = x_matrix
        gate_1F, up_1F = cpu_kernels.matmuls(x_D[None], [gates, ups], panels=gate_panels, layer=matrix,
                                             **instructions)
        h_1F = base.gated(gate_1F, up_1F, activation).astype(x_BTD.dtype)
        (y_1D,) = cpu_kernels.matmuls(h_1F.astype(downs.dtype), [downs], panels=down_panels, layer=matrix,
                                      **instructions)
        return None, y_1D[0]

    _, y_RD = jax.lax.scan(row, None, (x_RD, matrix_R))
    y_RD = y_RD * weights_BTU.reshape(-1)[:, None]
    return jnp.sum(y_RD.reshape(B, T, U, D), axis=2).astype(x_BTD.dtype)


def _chosen_quantized_experts(x_BTD, weights_BTU, chosen_BTU, ws, activation: Activation, layer,
                              instructions: dict[str, bool]) -> jax.Array:
    """:func:`_chosen_experts` for stacks of experts of which some are quantized panels: per row, its expert's
    integers and scales read where they lie in the stack by ``quant_matmul`` (or the int8 panel product, per
    channel), gate and up in one call where both are panels; a stack in another form (a quantized leaf whose
    width takes no panels, floats a mix keeps) read as its expert's slice."""
    B, T, D = x_BTD.shape
    E, U = ws[0].shape[-3], chosen_BTU.shape[-1]
    flat = [_one_stack(w) for w in ws]
    expert_R = chosen_BTU.reshape(-1)
    matrix_R = expert_R if layer is None else layer * E + expert_R
    x_RD = jnp.repeat(x_BTD.reshape(B * T, D), U, axis=0)

    def row(_, x_matrix):
        x_D, matrix = x_matrix
        gate_1F, up_1F = _expert_products(x_D[None], flat[:2], matrix, instructions)
        h_1F = base.gated(gate_1F, up_1F, activation).astype(x_BTD.dtype)
        (y_1D,) = _expert_products(h_1F, flat[2:], matrix, instructions)
        return None, y_1D[0]

    _, y_RD = jax.lax.scan(row, None, (x_RD, matrix_R))
    y_RD = y_RD * weights_BTU.reshape(-1)[:, None]
    return jnp.sum(y_RD.reshape(B, T, U, D), axis=2).astype(x_BTD.dtype)


def _one_stack(w: Any) -> Any:
    """A stack of experts [*lead, E, ...] in any form as one stack of matrices [prod(lead)·E, ...] (a reshape)."""
    if isinstance(w, quantized.QuantizedPanels):
        return quantized.one_stack(w)
    if isinstance(w, QuantizedArray):
        def flat(a):
            return a.reshape(-1, *a.shape[-2:])

        return dataclasses.replace(w, values=flat(w.values), scales=flat(w.scales),
                                   offsets=None if w.offsets is None else flat(w.offsets))
    if isinstance(w, Panels):
        return dataclasses.replace(w, data=w.data.reshape(-1, *w.data.shape[-3:]))
    return w.reshape(-1, *w.shape[-2:])


def _expert_products(x_1K: jax.Array, ws: list[Any], matrix: jax.Array,
                     instructions: dict[str, bool]) -> list[jax.Array]:
    """x [1, K] times matrix ``matrix`` of each one-stack ``ws`` (:func:`_one_stack`): [1, N_i] float32 each."""
    if all(isinstance(w, quantized.QuantizedPanels) for w in ws):
        return quantized.products(x_1K, ws, jnp.float32, matrix)
    out = []
    for w in ws:
        if isinstance(w, quantized.QuantizedPanels):
            (y,) = quantized.products(x_1K, [w], jnp.float32, matrix)
        elif isinstance(w, QuantizedArray):
            y = base._einsum("RK,KN->RN", x_1K, w.layer(matrix), jnp.float32)
        elif isinstance(w, Panels):
            (y,) = cpu_kernels.matmuls(x_1K.astype(w.dtype), [w.data], panels=True, layer=matrix, **instructions)
        else:
            (y,) = cpu_kernels.matmuls(x_1K.astype(w.dtype), [w], layer=matrix, **instructions)
        out.append(y)
    return out


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7))
def _prefill_attention(q_BTNH, k_BSKH, v_BSKH, q_positions_BT, kv_lengths_B, scale: float, window: int | None,
                       softcap: float | None) -> jax.Array:
    """:func:`base.xla_attention` computed by ``cpu_kernels.prefill_attention`` (only the keys each query
    sees); gradients are XLA's."""
    o_BTNH = cpu_kernels.prefill_attention(q_BTNH, k_BSKH[None], v_BSKH[None], 0, q_positions_BT, kv_lengths_B,
                                           scale=scale, window=window, softcap=softcap)
    return o_BTNH.astype(q_BTNH.dtype)


def _prefill_attention_fwd(q_BTNH, k_BSKH, v_BSKH, q_positions_BT, kv_lengths_B, scale, window, softcap):
    o_BTNH = _prefill_attention(q_BTNH, k_BSKH, v_BSKH, q_positions_BT, kv_lengths_B, scale, window, softcap)
    return o_BTNH, (q_BTNH, k_BSKH, v_BSKH, q_positions_BT, kv_lengths_B)


def _prefill_attention_bwd(scale, window, softcap, residuals, do_BTNH):
    q_BTNH, k_BSKH, v_BSKH, q_positions_BT, kv_lengths_B = residuals
    _, vjp = jax.vjp(lambda q, k, v: base.xla_attention(q, k, v, q_positions_BT, kv_lengths_B, scale=scale,
                                                        window=window, softcap=softcap), q_BTNH, k_BSKH, v_BSKH)
    return (*vjp(do_BTNH), None, None)


_prefill_attention.defvjp(_prefill_attention_fwd, _prefill_attention_bwd)
