"""The backend seam and its reference implementation, XLA's own operations.

A :class:`Backend` answers every "which kernel?" question of the model: matrix products, the gated
MLP's activation, a mixture of experts' MLP, embedding lookups, attention over fresh keys and over the
KV cache, the argmax of greedy steps, and the form of the weights its kernels read
(:meth:`Backend.prepare`). The model calls it and never asks what device it runs on. :class:`Xla` is
the reference every other backend is tested against; the others override what their kernels do better.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Sequence

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from llm_jax import kv_cache as kvc
from llm_jax.bits import as_bits, from_bits
from llm_jax.config import Activation, Experts, ModelConfig
from llm_jax.quantization import QuantizedArray

Params = dict[str, Any]

# Masked scores get a large finite negative value rather than -inf, so a row with no visible key
# (padding) gives zeros instead of NaN.
MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)


@dataclasses.dataclass(frozen=True)
class Backend:
    """How the model's operations run. Frozen and hashable: a static argument of the jitted stages.

    Every method has XLA's implementation here; subclasses override what their kernels compute.
    """

    name = "xla"

    def prepare(self, params: Params, config: ModelConfig) -> Params:
        """The form of canonical ``params`` this backend's kernels read (``params`` itself here)."""
        return params

    # Matrix products.
    def dense(self, equation: str, x: jax.Array, w: Any, out_dtype, layer: jax.Array | None = None) -> jax.Array:
        """``einsum(equation, x, w)`` with float32 accumulation, cast to ``out_dtype``; with ``layer``,
        ``w`` is a stack [L, ...] of every layer's weights and ``w[layer]`` is used."""
        return self.dense_many([equation], x, [w], out_dtype, layer)[0]

    def dense_many(self, equations: Sequence[str], x: jax.Array, ws: Sequence[Any], out_dtype,
                   layer: jax.Array | None = None) -> list[jax.Array]:
        """:meth:`dense` of one input with several weights (q/k/v, gate/up)."""
        return [_einsum(eq, x, _plain(w, self, layer), out_dtype) for eq, w in zip(equations, ws)]

    def gate_up(self, x_BTD: jax.Array, gate_DF: Any, up_DF: Any, activation: Activation,
                layer: jax.Array | None = None) -> jax.Array:
        """``act(x · gate) · (x · up)`` in float32 [B, T, F]: the gated MLP's hidden activations."""
        gate_BTF, up_BTF = self.dense_many(["BTD,DF->BTF"] * 2, x_BTD, [gate_DF, up_DF], jnp.float32, layer)
        return gated(gate_BTF, up_BTF, activation)

    def moe_mlp(self, x_BTD: jax.Array, router_DE: Any, gate_EDF: Any, up_EDF: Any, down_EFD: Any, *,
                experts: Experts, activation: Activation, layer: jax.Array | None = None) -> jax.Array:
        """A sparse mixture-of-experts MLP [B, T, D] in ``x_BTD``'s dtype: each token routed (:func:`route`) to
        its top-k experts, each a gated MLP, their outputs summed by routing weight. Few (token, expert) pairs
        (:func:`gathers_experts`: decode, small batches) run as :meth:`chosen_experts`, which reads only the
        chosen experts' weights; more run sorted by expert through ``ragged_dot`` (:meth:`sorted_experts`)."""
        B, T, _ = x_BTD.shape
        weights_BTU, chosen_BTU = route(_einsum("BTD,DE->BTE", x_BTD, _plain(router_DE, self, layer), jnp.float32),
                                        experts)
        few = gathers_experts(B * T * experts.top_k, experts.num_experts)
        run = self.chosen_experts if few else self.sorted_experts
        return run(x_BTD, weights_BTU, chosen_BTU, gate_EDF, up_EDF, down_EFD, activation, layer)

    def sorted_experts(self, x_BTD: jax.Array, weights_BTU: jax.Array, chosen_BTU: jax.Array, gate_EDF: Any,
                       up_EDF: Any, down_EFD: Any, activation: Activation,
                       layer: jax.Array | None = None) -> jax.Array:
        """The experts' outputs summed by routing weight [B, T, D], the (token, expert) pairs sorted by expert
        and multiplied group by group (:func:`sparse_experts`), of layer ``layer`` of the stacks [L, E, ...]
        where given. Quantized experts are dequantized, the layer's whole stack, into ``x_BTD``'s dtype: a
        prefill's many pairs read every expert anyway."""
        gate_EDF, up_EDF, down_EFD = (_dequantized(_plain(w, self, layer), x_BTD.dtype)
                                      for w in (gate_EDF, up_EDF, down_EFD))
        return sparse_experts(x_BTD, weights_BTU, chosen_BTU, gate_EDF, up_EDF, down_EFD, activation)

    def chosen_experts(self, x_BTD: jax.Array, weights_BTU: jax.Array, chosen_BTU: jax.Array, gate_EDF: Any,
                       up_EDF: Any, down_EFD: Any, activation: Activation,
                       layer: jax.Array | None = None) -> jax.Array:
        """:meth:`sorted_experts`' function, each (token, expert) pair's product on its own: the chosen
        experts' matrices gathered from the weights (from the stack [L, E, ...] with ``layer``) without the
        others. Here XLA's gather and batched products (:func:`gathered_experts`; quantized experts gathered as
        their integers and scales, then dequantized)."""
        gate_EDF, up_EDF, down_EFD = (_plain(w, self) for w in (gate_EDF, up_EDF, down_EFD))
        return gathered_experts(x_BTD, weights_BTU, chosen_BTU, gate_EDF, up_EDF, down_EFD, activation, layer)

    def embed(self, table_VD: Any, tokens_BT: jax.Array, out_dtype) -> jax.Array:
        """Rows ``tokens_BT`` of the embedding table [V, D] (bfloat16 gathered as its bits; a quantized
        table's rows gathered, then dequantized)."""
        if isinstance(table_VD, QuantizedArray):
            return table_VD.rows(tokens_BT).dequantize(out_dtype)
        table_VD = _plain(table_VD, self)
        return from_bits(jnp.take(as_bits(table_VD), tokens_BT, axis=0), table_VD.dtype).astype(out_dtype)

    # Attention.
    def attention(self, q_BTNH, k_BTKH, v_BTKH, lengths_B, *, config: ModelConfig, window: int | None,
                  mesh: Mesh | None = None) -> jax.Array:
        """Causal attention of T queries at positions 0 ... T-1 over their own keys (prefill, a full
        forward); key t is visible to rows whose ``lengths_B`` exceed t."""
        B, T = q_BTNH.shape[:2]
        positions_BT = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
        return xla_attention(q_BTNH, k_BTKH, v_BTKH, positions_BT, lengths_B, scale=config.attn_scale,
                             window=window, softcap=config.attn_logit_softcap)

    def append_and_attend(self, q_BTNH, k_BTKH, v_BTKH, k_LBSKH, v_LBSKH, layer, slots_BT, positions_BT, *,
                          config: ModelConfig, window: int | None, mesh: Mesh | None = None):
        """Write the new keys and values [B, T, K, H] at ``slots_BT`` of layer ``layer`` of the stacked
        caches (a slot past the cache writes nothing: a finished row), then attend from the new queries
        at ``positions_BT``, each row seeing its slots up to its last query: (o_BTNH, k_LBSKH, v_LBSKH)."""
        k_LBSKH = kvc.write_tokens(k_LBSKH, layer, slots_BT, k_BTKH)
        v_LBSKH = kvc.write_tokens(v_LBSKH, layer, slots_BT, v_BTKH)
        o_BTNH = xla_attention(q_BTNH, kvc.read_layer(k_LBSKH, layer), kvc.read_layer(v_LBSKH, layer), positions_BT,
                               positions_BT[:, -1] + 1, scale=config.attn_scale, window=window,
                               softcap=config.attn_logit_softcap)
        return o_BTNH, k_LBSKH, v_LBSKH

    def append_and_attend_as_pages(self, q_BTNH, k_BTKH, v_BTKH, k_LBSKH, v_LBSKH, layer, slots_BT, positions_BT,
                                   *, config: ModelConfig, window: int | None, mesh: Mesh | None = None):
        """:meth:`append_and_attend` through this backend's :meth:`paged_attention`, each row of the cache read
        as one page of S tokens (``kv_cache.rows_as_pages``): for caches a backend's kernels read only as
        pages (int8)."""
        B, T, N, H = q_BTNH.shape
        o_TNH, k_LBSKH, v_LBSKH = self.paged_attention(
            q_BTNH.reshape(B * T, N, H), k_BTKH.reshape(B * T, *k_BTKH.shape[2:]),
            v_BTKH.reshape(B * T, *v_BTKH.shape[2:]), k_LBSKH, v_LBSKH, layer,
            kvc.rows_as_pages(slots_BT, positions_BT, k_LBSKH.shape[2]), config=config, window=window, mesh=mesh)
        return o_TNH.reshape(B, T, N, H), k_LBSKH, v_LBSKH

    def paged_attention(self, q_TNH, k_TKH, v_TKH, k_LPZKH, v_LPZKH, layer, batch: kvc.PagedBatch, *,
                        config: ModelConfig, window: int | None, mesh: Mesh | None = None):
        """A serving step's attention over the paged cache: write the T new keys and values [T, K, H] at
        ``batch.slots_T`` of layer ``layer``, then attend from each token over its sequence's positions up
        to its own (``kv_cache.PagedBatch``): (o_TNH, k_LPZKH, v_LPZKH). Here the reference: each sequence's
        pages gathered, its queries padded to ``batch.max_query_len``."""
        k_LPZKH = kvc.write_slots(k_LPZKH, layer, batch.slots_T, k_TKH)
        v_LPZKH = kvc.write_slots(v_LPZKH, layer, batch.slots_T, v_TKH)
        T = q_TNH.shape[0]
        i_Q = jnp.arange(batch.max_query_len, dtype=jnp.int32)
        rows_BQ = batch.query_start_B[:, None] + i_Q
        valid_BQ = i_Q < batch.num_tokens_B[:, None]
        positions_BQ = batch.seq_lens_B[:, None] - batch.num_tokens_B[:, None] + i_Q
        o_BQNH = xla_attention(q_TNH[jnp.where(valid_BQ, rows_BQ, 0)],
                               kvc.read_pages(k_LPZKH, layer, batch.block_tables_BX),
                               kvc.read_pages(v_LPZKH, layer, batch.block_tables_BX), positions_BQ,
                               batch.seq_lens_B, scale=config.attn_scale, window=window,
                               softcap=config.attn_logit_softcap)
        o_TNH = jnp.zeros_like(q_TNH).at[jnp.where(valid_BQ, rows_BQ, T)].set(o_BQNH, mode="drop")
        return o_TNH, k_LPZKH, v_LPZKH

    # Choosing tokens.
    def argmax(self, scores_BV: jax.Array) -> jax.Array:
        """The first index of each row's largest score (of its first NaN), int32 [B]: ``jnp.argmax``."""
        return jnp.argmax(scores_BV, axis=-1).astype(jnp.int32)

    def greedy_tokens(self, weights: Params, config: ModelConfig, x_BD: jax.Array) -> jax.Array | None:
        """The greedy token [B] of final-normed hidden states ``x_BD`` without computing every logit, where
        this backend has a way to (the argmax of the logits the head's own product would give); None
        otherwise, and the caller computes the logits."""
        return None


@dataclasses.dataclass(frozen=True)
class Xla(Backend):
    """XLA's own operations everywhere: the reference, and what runs sharded over a mesh."""


def _plain(w: Any, backend: Backend, layer: jax.Array | None = None) -> jax.Array | QuantizedArray:
    """``w`` (``w[layer]`` with a layer) as a plain array or a quantized one (which :func:`_einsum`
    dequantizes); a typed leaf of another backend's form is an error."""
    if not isinstance(w, (jax.Array, QuantizedArray)) and not hasattr(w, "__array__"):
        raise TypeError(f"the {backend.name} backend got a weight of type {type(w).__name__}: weights prepared "
                        "for another backend (pass model.params, or that backend with model.weights)")
    return w if layer is None else layer_of(w, layer)


def _dequantized(w: jax.Array | QuantizedArray, dtype) -> jax.Array:
    """``w`` as a plain array: a quantized one dequantized into ``dtype``."""
    return w.dequantize(dtype) if isinstance(w, QuantizedArray) else w


def layer_of(w_L: jax.Array, layer: jax.Array) -> jax.Array:
    """``w_L[layer]`` for a stack [L, ...] and a traced index (bfloat16 sliced as its bits)."""
    if isinstance(w_L, QuantizedArray):
        return w_L.layer(layer)
    return from_bits(jax.lax.dynamic_index_in_dim(as_bits(w_L), layer, keepdims=False), w_L.dtype)


def _einsum(equation: str, x: jax.Array, w: jax.Array | QuantizedArray, out_dtype) -> jax.Array:
    # A quantized weight is dequantized into the activations' dtype, then multiplied: on GPU and TPU XLA
    # fuses the dequantization into the product's operand; on CPU the kernels read the integers instead.
    if isinstance(w, QuantizedArray):
        w = w.dequantize(x.dtype)
    # Contracted axes that lie together in both operands are merged first: given "BTNH,NHD->BTD" as it
    # stands, XLA:CPU transposes the whole weight on every call; on [B, T, N·H] · [N·H, D] it does not.
    form = matmul_form(equation, x.shape, w.shape)
    if form is not None and form.contracted > 1:
        x2 = x.reshape(*x.shape[: x.ndim - form.contracted], form.K)
        w2 = w.reshape(form.N, form.K) if form.transposed else w.reshape(form.K, form.N)
        y = jnp.einsum("...k,nk->...n" if form.transposed else "...k,kn->...n", x2.astype(w.dtype), w2,
                       preferred_element_type=jnp.float32)
        return y.reshape(form.out_shape).astype(out_dtype)
    return jnp.einsum(equation, x.astype(w.dtype), w, preferred_element_type=jnp.float32).astype(out_dtype)


@dataclasses.dataclass(frozen=True)
class MatmulForm:
    """An einsum that is x [rows..., k...] · W [k..., out...] (or W [out..., k...], ``transposed``)."""

    R: int
    K: int
    N: int
    transposed: bool
    contracted: int  # how many axes are contracted
    out_shape: tuple[int, ...]


def matmul_form(equation: str, x_shape, w_shape) -> MatmulForm | None:
    """The :class:`MatmulForm` of ``equation`` on these shapes, or None for any other einsum."""
    inputs, out = equation.replace(" ", "").split("->")
    x_spec, w_spec = inputs.split(",")
    contracted = "".join(a for a in x_spec if a in w_spec)
    n_c = len(contracted)
    if not contracted or x_spec[len(x_spec) - n_c:] != contracted:
        return None
    rows_spec = x_spec[: len(x_spec) - n_c]
    if w_spec[:n_c] == contracted:
        transposed, out_spec = False, w_spec[n_c:]
    elif w_spec[len(w_spec) - n_c:] == contracted:
        transposed, out_spec = True, w_spec[: len(w_spec) - n_c]
    else:
        return None
    if out != rows_spec + out_spec or len(w_shape) != len(w_spec):
        return None
    out_dims = tuple(w_shape[: len(out_spec)] if transposed else w_shape[n_c:])
    return MatmulForm(R=math.prod(x_shape[: len(rows_spec)]), K=math.prod(x_shape[len(rows_spec):]),
                      N=math.prod(out_dims), transposed=transposed, contracted=n_c,
                      out_shape=(*x_shape[: len(rows_spec)], *out_dims))


def gated(gate: jax.Array, up: jax.Array, activation: Activation) -> jax.Array:
    """``act(gate) · up``: SwiGLU's SiLU or GeGLU's tanh-approximated GELU."""
    match activation:
        case Activation.SILU:
            return jax.nn.silu(gate) * up
        case Activation.GELU_TANH:
            return jax.nn.gelu(gate, approximate=True) * up


def route(logits_BTE: jax.Array, experts: Experts) -> tuple[jax.Array, jax.Array]:
    """(weights [B, T, U] float32, experts [B, T, U] int32) of each token's top-k experts: the softmax over all
    E router logits in float32, its k largest (ties to the lower index, as ``torch.topk``), renormalised to sum
    to 1 where ``experts.normalize_top_k``."""
    probs_BTE = jax.nn.softmax(logits_BTE.astype(jnp.float32), axis=-1)
    weights_BTU, chosen_BTU = jax.lax.top_k(probs_BTE, experts.top_k)
    if experts.normalize_top_k:
        weights_BTU = weights_BTU / jnp.sum(weights_BTU, axis=-1, keepdims=True)
    return weights_BTU, chosen_BTU.astype(jnp.int32)


def sparse_experts(x_BTD: jax.Array, weights_BTU: jax.Array, chosen_BTU: jax.Array, gate_EDF: jax.Array,
                   up_EDF: jax.Array, down_EFD: jax.Array, activation: Activation) -> jax.Array:
    """Σ_u weights_BTU · expert_{chosen_BTU}(x) [B, T, D], in ``x_BTD``'s dtype, each expert the gated MLP
    ``down(act(x · gate) · (x · up))``. The B·T·U rows (a token for each of its experts) are sorted by expert
    and multiplied group by group (``lax.ragged_dot``), so each expert reads only its own tokens; R below is
    those rows, in that order."""
    B, T, D = x_BTD.shape
    E, U = gate_EDF.shape[0], chosen_BTU.shape[-1]
    expert_R = chosen_BTU.reshape(-1)
    order_R = jnp.argsort(expert_R, stable=True)  # row r is token order_R[r] // U's expert expert_R[order_R[r]]
    sizes_E = jnp.bincount(expert_R, length=E).astype(jnp.int32)
    x_RD = x_BTD.reshape(B * T, D)[order_R // U]

    def product(x_R, w_E):
        return jax.lax.ragged_dot(x_R.astype(w_E.dtype), w_E, sizes_E, preferred_element_type=jnp.float32)

    h_RF = gated(product(x_RD, gate_EDF), product(x_RD, up_EDF), activation).astype(x_BTD.dtype)
    y_RD = product(h_RF, down_EFD) * weights_BTU.reshape(-1)[order_R][:, None]
    # Back to token order (the inverse permutation), then each token's U rows summed.
    y_BTUD = jnp.zeros_like(y_RD).at[order_R].set(y_RD, unique_indices=True).reshape(B, T, U, D)
    return jnp.sum(y_BTUD, axis=2).astype(x_BTD.dtype)


def gathers_experts(pairs: int, num_experts: int) -> bool:
    """Whether a mixture's ``pairs`` (token, chosen expert) pairs, known when tracing, run each on its own
    (:meth:`Backend.chosen_experts`) rather than sorted by expert through ``ragged_dot``: while they are no more
    than the experts. Gathered, each pair reads its expert's matrices, so up to E pairs read at most what all
    E experts hold (decode reads k of E); and XLA:CPU's ``ragged_dot`` multiplies every row with every expert
    (docs/benchmarks.md, ``scripts/benchmarking/bench_moe.py``)."""
    return pairs <= num_experts


def gathered_experts(x_BTD: jax.Array, weights_BTU: jax.Array, chosen_BTU: jax.Array, gate_EDF: jax.Array,
                     up_EDF: jax.Array, down_EFD: jax.Array, activation: Activation,
                     layer: jax.Array | None = None) -> jax.Array:
    """:func:`sparse_experts` as R = B·T·U products of one row each: row r (token r // U and its (r % U)-th
    expert) multiplied with that expert's matrices, gathered [R, ...] (from the stack [L, E, ...] at ``layer``
    where given: only those matrices are read; bfloat16 gathered as its bits; a quantized stack's integers and
    scales gathered, then dequantized into ``x_BTD``'s dtype, as :func:`_einsum` does a layer's). The same
    roundings: float32 products, the hidden activations in ``x_BTD``'s dtype, a token's U outputs weighted and
    summed in float32."""
    B, T, D = x_BTD.shape
    U = chosen_BTU.shape[-1]
    expert_R = chosen_BTU.reshape(-1)

    def chosen(w):  # [R, in, out]
        if isinstance(w, QuantizedArray):
            return w.chosen(expert_R, layer).dequantize(x_BTD.dtype)
        bits = as_bits(w)
        return from_bits(bits[expert_R] if layer is None else bits[layer, expert_R], w.dtype)

    gate_RDF, up_RDF, down_RFD = chosen(gate_EDF), chosen(up_EDF), chosen(down_EFD)
    x_RD = jnp.repeat(x_BTD.reshape(B * T, D), U, axis=0)
    gate_RF, up_RF = (jnp.einsum("RD,RDF->RF", x_RD.astype(w.dtype), w, preferred_element_type=jnp.float32)
                      for w in (gate_RDF, up_RDF))
    h_RF = gated(gate_RF, up_RF, activation).astype(x_BTD.dtype)
    y_RD = jnp.einsum("RF,RFD->RD", h_RF.astype(down_RFD.dtype), down_RFD, preferred_element_type=jnp.float32)
    y_RD = y_RD * weights_BTU.reshape(-1)[:, None]
    return jnp.sum(y_RD.reshape(B, T, U, D), axis=2).astype(x_BTD.dtype)


def xla_attention(q_BTNH, k_BSKH, v_BSKH, q_positions_BT, kv_lengths_B, *, scale: float,
                  window: int | None, softcap: float | None) -> jax.Array:
    """Masked attention in plain jnp. Key slot s is position s; it is visible to a query at position p
    iff s <= p, s < kv_lengths_B[b] and (no window or p - s < window). Rows with no visible key are 0.
    Query heads are grouped [K, G] so G of them share a K/V head without repeating it."""
    B, T, N, H = q_BTNH.shape
    K = k_BSKH.shape[2]
    q_BTKGH = q_BTNH.reshape(B, T, K, N // K, H)
    scores_BKGTS = jnp.einsum("BTKGH,BSKH->BKGTS", q_BTKGH, k_BSKH,
                              preferred_element_type=jnp.float32) * scale
    if softcap is not None:
        scores_BKGTS = softcap * jnp.tanh(scores_BKGTS / softcap)
    s_S = jnp.arange(k_BSKH.shape[1])
    p_BT1 = q_positions_BT[:, :, None]
    visible_BTS = (s_S <= p_BT1) & (s_S < kv_lengths_B[:, None, None])
    if window is not None:
        visible_BTS &= p_BT1 - s_S < window
    visible_B11TS = visible_BTS[:, None, None]
    scores_BKGTS = jnp.where(visible_B11TS, scores_BKGTS, MASK_VALUE)
    probs_BKGTS = jnp.exp(scores_BKGTS - jnp.max(scores_BKGTS, axis=-1, keepdims=True))
    probs_BKGTS = jnp.where(visible_B11TS, probs_BKGTS, 0.0)
    denom_BKGT1 = jnp.maximum(jnp.sum(probs_BKGTS, axis=-1, keepdims=True), jnp.finfo(jnp.float32).tiny)
    probs_BKGTS = (probs_BKGTS / denom_BKGT1).astype(v_BSKH.dtype)
    o_BTKGH = jnp.einsum("BKGTS,BSKH->BTKGH", probs_BKGTS, v_BSKH, preferred_element_type=jnp.float32)
    return o_BTKGH.reshape(B, T, N, H).astype(q_BTNH.dtype)
