"""The decoder stack: embed → L × (attention + MLP) → final norm → logits.

Layers are stacked (every layer parameter has a leading L axis) and run by ``lax.scan`` over the layer
index, so compile time does not grow with depth. The scan does not slice the params: each layer hands
the whole stacks and its index to the backend (see :mod:`llm_jax.model.layers`), whose kernels may read
the layer's weights in place. Layers whose attention differs (Gemma 2 alternates sliding-window and
global layers; Gemma 3 has five local layers, with their own RoPE, to one global) are scanned in groups of
one period (a last, partial period runs after the scan), keeping each layer's window and RoPE static values.

Every function takes the params (canonical, or a backend's prepared weights) and a ``backend``: a
:class:`llm_jax.backends.Backend`, a name (``"auto"``, ``"xla"``, ``"cpu"``, ``"pallas"``) or None for
``llm_jax.backends.default()``.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen as nn
from jax.sharding import Mesh

from llm_jax import backends
from llm_jax import kv_cache as kvc
from llm_jax.backends import Backend
from llm_jax.config import LongRope, ModelConfig
from llm_jax.kv_cache import KVCache, PagedBatch, PagedKVCache
from llm_jax.lora import LoraBatch
from llm_jax.model.attention import Attention
from llm_jax.model.layers import Embedder, GatedMLP, MoeMLP, RMSNorm, final_norm
from llm_jax.quantization import quantize_params, quantized_shapes

Params = dict[str, Any]
# attend(layer, q_BTNH, k_BTKH, v_BTKH, window, cache) -> (o_BTNH, cache)
AttendFn = Callable[..., tuple[jax.Array, KVCache | None]]
BackendArg = Backend | str | None


def resolve_backend(backend: BackendArg) -> Backend:
    """The :class:`Backend` a model function runs on: ``backend`` itself, the one it names, or (None)
    :func:`llm_jax.backends.default`."""
    if backend is None:
        return backends.default()
    return backends.choose(backend)


class DecoderLayer(nn.Module):
    """Pre-norm residual block, its MLP dense or a mixture of experts (``config.experts``); with
    ``sandwich_norm`` (Gemma 2) each sub-block output is normed too, and without ``pre_norm`` (OLMo 2) only
    the outputs are: x + norm(attn(x)), then x + norm(mlp(x)).

    Its params are every layer's, stacked [L, ...]; a call runs layer ``layer`` (an int32 scalar), a
    sliding-window layer where ``sliding`` (static: it chooses the layer's RoPE, Gemma 3's local base).
    ``seq_lens_BT``: the sequence length that picks each token's LongRoPE factors (:func:`_rope_seq_lens`).
    """

    config: ModelConfig
    backend: Backend = backends.Xla()

    @nn.compact
    def __call__(self, x_BTD, positions_BT, attend: Callable, layer: jax.Array, lora: LoraBatch | None = None,
                 sliding: bool = False, seq_lens_BT: jax.Array | None = None):
        c, L = self.config, self.config.n_layers

        def norm(name: str, x_BTD: jax.Array) -> jax.Array:
            return RMSNorm(eps=c.norm_eps, weight_offset=c.norm_weight_offset, stack=L, name=name)(x_BTD, layer)

        def pre_norm(name: str, x_BTD: jax.Array) -> jax.Array:
            return norm(name, x_BTD) if c.pre_norm else x_BTD

        attn = Attention(c, self.backend, stack=L, name="attn")
        q_BTNH, k_BTKH, v_BTKH = attn.project(pre_norm("attn_norm", x_BTD), positions_BT, layer, lora, sliding,
                                                seq_lens_BT)
        o_BTNH, aux = attend(q_BTNH, k_BTKH, v_BTKH)
        y_BTD = attn.output(o_BTNH, layer, lora)
        if c.sandwich_norm:
            y_BTD = norm("post_attn_norm", y_BTD)
        x_BTD = x_BTD + y_BTD
        if c.experts is None:
            mlp = GatedMLP(d_ff=c.d_ff, activation=c.activation, backend=self.backend, stack=L, name="mlp")
        else:
            mlp = MoeMLP(d_ff=c.d_ff, experts=c.experts, activation=c.activation, backend=self.backend, stack=L,
                         name="moe")
        y_BTD = mlp(pre_norm("mlp_norm", x_BTD), layer, lora)
        if c.sandwich_norm:
            y_BTD = norm("post_mlp_norm", y_BTD)
        return x_BTD + y_BTD, aux


def param_shapes(config: ModelConfig) -> Params:
    """The params pytree as ``jax.ShapeDtypeStruct`` s (traced from the modules, nothing computed)."""
    D = config.d_model
    x = jax.ShapeDtypeStruct((1, 1, D), jnp.float32)
    tokens = jax.ShapeDtypeStruct((1, 1), jnp.int32)
    key = jax.random.key(0)

    def init(module: nn.Module, *arrays, **kwargs) -> Params:
        return jax.eval_shape(lambda k, *a: module.init(k, *a, **kwargs)["params"], key, *arrays)

    shapes: Params = {
        "embedder": init(Embedder(config.vocab_size, D), tokens, out_dtype=jnp.float32, method=Embedder.encode),
        "layers": init(DecoderLayer(config), x, tokens, attend=lambda q, k, v: (q, None), layer=0),
        "final_norm": init(RMSNorm(eps=config.norm_eps), x),
    }
    if config.classifier is not None:  # a classifier's head replaces the LM head
        shapes["score"] = jax.ShapeDtypeStruct((D, config.classifier.num_labels), jnp.float32)
    elif not config.tie_embeddings:
        shapes["lm_head"] = jax.ShapeDtypeStruct((D, config.vocab_size), jnp.float32)
    shapes = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, config.param_jnp_dtype), shapes)
    return quantized_shapes(shapes, config)  # integer weights (config.quantization) as they are stored


def init_params(config: ModelConfig, seed: int = 0) -> Params:
    """Random parameters in ``config.param_dtype``: normal(0, 0.02) matrices, zero biases, and norm
    scales that make each norm the identity; the projections then quantized if ``config.quantization``
    says so.

    Drawn with NumPy on the host: initialising with jax.random would compile dozens of small programs,
    which costs far more than the draws for the model sizes used in tests and benchmarks.
    """
    rng = np.random.default_rng(seed)

    def draw(path, shape):
        name = jax.tree_util.keystr(path[-1:])
        if "scale" in name:
            value = np.full(shape.shape, 1.0 - config.norm_weight_offset, np.float32)
        elif "bias" in name:
            value = np.zeros(shape.shape, np.float32)
        else:
            value = rng.normal(0.0, 0.02, shape.shape).astype(np.float32)
        return jnp.asarray(value, shape.dtype)

    params = jax.tree_util.tree_map_with_path(draw, param_shapes(config.replace(quantization=None)))
    if config.quantization is None:
        return params
    return quantize_params(params, config.replace(quantization=None), config.quantization)[1]


def embed(params: Params, config: ModelConfig, tokens_BT: jax.Array, backend: BackendArg = None) -> jax.Array:
    """The token embeddings [B, T, D] in the compute dtype (Gemma's scaled by √D)."""
    x_BTD = Embedder(config.vocab_size, config.d_model, resolve_backend(backend)).apply(
        {"params": params["embedder"]}, tokens_BT, config.compute_jnp_dtype, method=Embedder.encode)
    if config.embed_scale:
        # Gemma multiplies by sqrt(D) rounded to the activation dtype.
        x_BTD = x_BTD * jnp.asarray(config.d_model ** 0.5, x_BTD.dtype)
    return x_BTD


def unembed(params: Params, config: ModelConfig, x_BTD: jax.Array, backend: BackendArg = None) -> jax.Array:
    """Final norm and LM head: float32 logits [B, T, V]."""
    config.check_language_model()
    backend = resolve_backend(backend)
    x_BTD = final_norm(params, config, x_BTD)
    if config.tie_embeddings:
        logits_BTV = Embedder(config.vocab_size, config.d_model, backend).apply(
            {"params": params["embedder"]}, x_BTD, method=Embedder.decode)
    else:
        logits_BTV = backend.dense("BTD,DV->BTV", x_BTD, params["lm_head"], jnp.float32)
    if config.final_logit_softcap is not None:
        cap = config.final_logit_softcap
        logits_BTV = cap * jnp.tanh(logits_BTV / cap)
    return logits_BTV


def greedy_tokens(params: Params, config: ModelConfig, x_BD: jax.Array, backend: BackendArg = None) -> jax.Array | None:
    """The greedy token [B] of last hidden states ``x_BD`` (before the final norm) — the argmax of
    :func:`unembed`'s logits — where the backend has a way that does not compute every logit (the CPU
    kernels' screen of the LM head); None where it has none."""
    return resolve_backend(backend).greedy_tokens(params, config, final_norm(params, config, x_BD))


def _layer_period(windows: tuple[int | None, ...]) -> int:
    """Smallest p such that layer l's window equals layer (l mod p)'s; the last period may be cut short
    (Gemma 3's 26 layers repeat a period of 6)."""
    L = len(windows)
    return next(p for p in range(1, L + 1) if all(windows[i] == windows[i % p] for i in range(L)))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, kw_only=True)
class LayerHooks:
    """Research access to the residual stream between layers.

    ``steering_BLD`` is added to every token's residual stream after each layer (activation addition,
    Turner et al. 2023): row b gets ``steering_BLD[b, l]`` after layer l. ``record_layers`` (static) lists
    the layers whose output — the residual stream after the layer (and its steering), before the final
    norm; ``transformers``' ``hidden_states[l + 1]`` except for the last layer, which it returns normed —
    the forward functions return as a third output [B, T, len(record_layers), D].
    """

    steering_BLD: jax.Array | None = None
    record_layers: tuple[int, ...] = dataclasses.field(default=(), metadata=dict(static=True))

    def check(self, config: ModelConfig, batch_size: int) -> None:
        L = config.n_layers
        bad = [l for l in self.record_layers if not 0 <= l < L]
        if bad:
            raise ValueError(f"record_layers {bad} outside the model's layers [0, {L})")
        expected = (batch_size, L, config.d_model)
        if self.steering_BLD is not None and tuple(self.steering_BLD.shape) != expected:
            raise ValueError(f"steering_BLD has shape {tuple(self.steering_BLD.shape)}, expected {expected} "
                             "(batch, layers, d_model)")


def decoder_stack(params: Params, config: ModelConfig, x_BTD: jax.Array, positions_BT: jax.Array,
                  attend: AttendFn, cache: KVCache | None, hooks: LayerHooks | None, backend: Backend,
                  lora: LoraBatch | None = None, seq_lens_BT: jax.Array | None = None):
    """Run every layer over ``x_BTD``; ``attend`` decides what attention sees and how the cache changes;
    ``lora``: each token's LoRA adapter (:mod:`llm_jax.lora`) updates the projections; ``seq_lens_BT``
    (:func:`_rope_seq_lens`): the sequence length that picks each token's LongRoPE factors.

    Returns the final residual stream and the cache, plus the recorded layers [B, T, R, D] (or None)
    when ``hooks`` is given.
    """
    windows = config.layer_windows()
    layer = DecoderLayer(config, backend)
    period = _layer_period(windows)
    groups, tail = divmod(config.n_layers, period)  # tail: the layers of a last, partial period
    steering_GPBD = steering_tail = recorded = slot_L = None
    if hooks is not None:
        hooks.check(config, x_BTD.shape[0])
        if hooks.steering_BLD is not None:
            B, L, D = hooks.steering_BLD.shape
            steering_LBD = hooks.steering_BLD.transpose(1, 0, 2)
            steering_GPBD = steering_LBD[:groups * period].reshape(groups, period, B, D)
            steering_tail = steering_LBD[groups * period:]
        if hooks.record_layers:
            R = len(hooks.record_layers)
            recorded = jnp.zeros((R, *x_BTD.shape), x_BTD.dtype)
            # Layer l writes slot slot_L[l]; layers not recorded write slot R, which is dropped.
            slot_L = jnp.asarray([hooks.record_layers.index(l) if l in hooks.record_layers else R
                                  for l in range(config.n_layers)], jnp.int32)

    def run_group(carry, steering_PBD, count: int):
        x_BTD, cache, group, recorded = carry
        for j in range(count):
            index = group * period + j
            x_BTD, cache = layer.apply(
                {"params": params["layers"]}, x_BTD, positions_BT,
                functools.partial(attend, index, window=windows[j], cache=cache), index, lora,
                sliding=windows[j] is not None, seq_lens_BT=seq_lens_BT)
            if steering_PBD is not None:
                x_BTD = x_BTD + steering_PBD[j][:, None, :].astype(x_BTD.dtype)
            if recorded is not None:
                recorded = recorded.at[slot_L[index]].set(x_BTD, mode="drop")
        return x_BTD, cache, group + 1, recorded

    carry = (x_BTD, cache, jnp.zeros((), jnp.int32), recorded)
    carry, _ = jax.lax.scan(lambda c, s: (run_group(c, s, period), None), carry, steering_GPBD, length=groups)
    if tail:
        carry = run_group(carry, steering_tail, tail)
    x_BTD, cache, _, recorded = carry
    if hooks is None:
        return x_BTD, cache
    return x_BTD, cache, None if recorded is None else recorded.transpose(1, 2, 0, 3)


def _rope_seq_lens(config: ModelConfig, seq_lens_BT: jax.Array) -> jax.Array | None:
    """``seq_lens_BT`` where the RoPE reads it (LongRoPE chooses each token's factors by the length of its
    sequence: ``rope.rotary_cos_sin``); None for every other RoPE.

    Each forward function says what that length is. A prompt, run whole (``forward``, ``forward_prefill``),
    counts its row's length, as transformers' forward does; a token appended to a cache (``forward_extend``:
    decoding, speculative verification) its own position + 1, as transformers' one-token decode step does,
    so that verifying k proposals in one call rotates each as plain decoding would; a serving step
    (``forward_paged``) its sequence's length after the step."""
    return seq_lens_BT.astype(jnp.int32) if isinstance(config.rope_scaling, LongRope) else None


def _attend_fresh(config: ModelConfig, lengths_B: jax.Array, write_cache: bool, backend: Backend,
                  mesh: Mesh | None = None):
    """Attention over this call's own keys (queries at positions 0..T-1); optionally store them."""

    def attend(layer, q_BTNH, k_BTKH, v_BTKH, *, window, cache):
        o_BTNH = backend.attention(q_BTNH, k_BTKH, v_BTKH, lengths_B, config=config, window=window, mesh=mesh)
        if write_cache:
            cache = KVCache(k_LBSKH=kvc.write_block(cache.k_LBSKH, layer, k_BTKH),
                            v_LBSKH=kvc.write_block(cache.v_LBSKH, layer, v_BTKH), lengths_B=cache.lengths_B)
        return o_BTNH, cache

    return attend


def forward_hidden(params: Params, config: ModelConfig, tokens_BT: jax.Array, lengths_B: jax.Array | None = None,
                   *, hooks: LayerHooks | None = None, backend: BackendArg = None, lora: LoraBatch | None = None):
    """Full-sequence causal pass without a cache: the final residual stream [B, T, D] (before the final
    norm), plus the recorded layers when ``hooks`` is given. ``lengths_B`` marks right padding; ``lora``
    chooses each token's LoRA adapter."""
    backend = resolve_backend(backend)
    B, T = tokens_BT.shape
    lengths_B = jnp.full((B,), T, jnp.int32) if lengths_B is None else lengths_B
    positions_BT = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    out = decoder_stack(params, config, embed(params, config, tokens_BT, backend), positions_BT,
                        _attend_fresh(config, lengths_B, False, backend), None, hooks, backend, lora,
                        _rope_seq_lens(config, jnp.broadcast_to(lengths_B[:, None], (B, T))))
    return out[0] if hooks is None else (out[0], out[2])


def forward(params: Params, config: ModelConfig, tokens_BT: jax.Array, lengths_B: jax.Array | None = None,
            *, hooks: LayerHooks | None = None, backend: BackendArg = None, lora: LoraBatch | None = None):
    """Full-sequence causal forward pass without a cache: logits [B, T, V] (float32), plus the recorded
    layers when ``hooks`` is given. Differentiable in ``params`` (canonical) on every backend.

    ``lengths_B`` marks right padding (default: every token is real); logits at padded positions are
    meaningless. ``lora``: each token's LoRA adapter (:class:`llm_jax.lora.LoraBatch`).
    """
    backend = resolve_backend(backend)
    if hooks is None:
        x_BTD = forward_hidden(params, config, tokens_BT, lengths_B, backend=backend, lora=lora)
        return unembed(params, config, x_BTD, backend)
    x_BTD, recorded = forward_hidden(params, config, tokens_BT, lengths_B, hooks=hooks, backend=backend, lora=lora)
    return unembed(params, config, x_BTD, backend), recorded


def forward_prefill(params: Params, config: ModelConfig, tokens_BT: jax.Array, lengths_B: jax.Array,
                    cache: KVCache, mesh: Mesh | None = None, *, hooks: LayerHooks | None = None,
                    backend: BackendArg = None, lora: LoraBatch | None = None):
    """Run right-padded prompts from an empty cache: final hidden states [B, T, D] and the filled cache
    (plus the recorded layers when ``hooks`` is given).

    ``mesh``: the mesh params and cache are laid out on (``llm_jax.sharding``), for attention kernels.
    """
    backend = resolve_backend(backend)
    B, T = tokens_BT.shape
    if T > cache.max_len:
        raise ValueError(f"prompt block of {T} tokens does not fit a cache of {cache.max_len} slots")
    positions_BT = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    dtype = cache.k_LBSKH.dtype
    x_BTD, cache, *recorded = decoder_stack(params, config, embed(params, config, tokens_BT, backend), positions_BT,
                                            _attend_fresh(config, lengths_B, True, backend, mesh),
                                            kvc.as_bits(cache), hooks, backend, lora,
                                            _rope_seq_lens(config, jnp.broadcast_to(lengths_B[:, None], (B, T))))
    return (x_BTD, dataclasses.replace(kvc.from_bits(cache, dtype), lengths_B=lengths_B.astype(jnp.int32)), *recorded)


def forward_extend(params: Params, config: ModelConfig, tokens_BT: jax.Array, cache: KVCache,
                   active_B: jax.Array, mesh: Mesh | None = None, *, hooks: LayerHooks | None = None,
                   backend: BackendArg = None, lora: LoraBatch | None = None):
    """Append T tokens per active row after its ``cache.lengths_B`` tokens (decode): hidden [B, T, D]
    and the cache (plus the recorded layers when ``hooks`` is given).

    Inactive rows (finished sequences) write nothing and keep their length. ``mesh`` as for
    :func:`forward_prefill`.
    """
    backend = resolve_backend(backend)
    B, T = tokens_BT.shape
    positions_BT = cache.lengths_B[:, None] + jnp.arange(T, dtype=jnp.int32)
    # Slots of inactive rows are pushed out of range, so their writes are dropped.
    slots_BT = jnp.where(active_B[:, None], positions_BT, cache.max_len)
    new_lengths_B = cache.lengths_B + jnp.where(active_B, T, 0).astype(jnp.int32)

    def attend(layer, q_BTNH, k_BTKH, v_BTKH, *, window, cache):
        o_BTNH, k_LBSKH, v_LBSKH = backend.append_and_attend(q_BTNH, k_BTKH, v_BTKH, cache.k_LBSKH, cache.v_LBSKH,
                                                             layer, slots_BT, positions_BT, config=config,
                                                             window=window, mesh=mesh)
        return o_BTNH, KVCache(k_LBSKH=k_LBSKH, v_LBSKH=v_LBSKH, lengths_B=cache.lengths_B)

    x_BTD, cache, *recorded = decoder_stack(params, config, embed(params, config, tokens_BT, backend), positions_BT,
                                            attend, cache, hooks, backend, lora,
                                            _rope_seq_lens(config, positions_BT + 1))
    return (x_BTD, dataclasses.replace(cache, lengths_B=new_lengths_B), *recorded)


def forward_paged(params: Params, config: ModelConfig, tokens_T: jax.Array, positions_T: jax.Array,
                  cache: PagedKVCache, batch: PagedBatch, mesh: Mesh | None = None, *, backend: BackendArg = None,
                  lora: LoraBatch | None = None):
    """A serving step: T tokens of many sequences, flat and ragged (``kv_cache.PagedBatch`` says whose each
    is), at ``positions_T``, over the paged cache: hidden states [T, D] (before the final norm) and the
    cache holding the tokens' keys and values. ``lora``: each token's adapter ([1, T, A] selection)."""
    backend = resolve_backend(backend)

    def attend(layer, q_BTNH, k_BTKH, v_BTKH, *, window, cache):
        o_TNH, k_LPZKH, v_LPZKH = backend.paged_attention(q_BTNH[0], k_BTKH[0], v_BTKH[0], cache.k_LPZKH,
                                                          cache.v_LPZKH, layer, batch, config=config, window=window,
                                                          mesh=mesh)
        return o_TNH[None], PagedKVCache(k_LPZKH=k_LPZKH, v_LPZKH=v_LPZKH)

    t_T1 = jnp.arange(tokens_T.shape[0], dtype=jnp.int32)[:, None]  # token t's sequence: whose query range holds t
    owns_TB = (t_T1 >= batch.query_start_B) & (t_T1 < batch.query_start_B + batch.num_tokens_B)
    seq_lens_T = jnp.sum(jnp.where(owns_TB, batch.seq_lens_B, 0), axis=1, dtype=jnp.int32)
    x_1TD, cache = decoder_stack(params, config, embed(params, config, tokens_T[None], backend), positions_T[None],
                                 attend, cache, None, backend, lora, _rope_seq_lens(config, seq_lens_T[None]))
    return x_1TD[0], cache
